#!/usr/bin/env bash
# Create ./.venv and install hf_slideformer with its test extras. Idempotent; safe to re-run.
# On a machine without an NVIDIA GPU the CPU build of torch is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    # CPU build: a pinned release (served locally on some machines), else the CPU wheel index, else PyPI.
    python -m pip install -q torch==2.13.0 \
      || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu \
      || python -m pip install -q torch
  fi
fi
python -m pip install -q -e ".[test]"
