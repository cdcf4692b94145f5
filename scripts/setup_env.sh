#!/usr/bin/env bash
# Create ./.venv and install hf_slideformer into it (editable), with the extra named by the first
# argument, if any: `bash scripts/setup_env.sh` for what training needs, `bash scripts/setup_env.sh test`
# for the test suite's tools too. On a machine without an NVIDIA GPU the CPU build of torch is installed.
#
# Idempotent and quick to re-run: a finished install leaves a stamp in .venv keyed on setup.py's hash
# and the extra, and a later run with the same key only checks that the package still imports.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=${1:-}
PY=${PYTHON:-python3}
HASH=$(sha256sum setup.py | cut -c1-16)
STAMP_DIR=.venv/.hf_slideformer-setup
T0=$SECONDS

say() { echo "[setup] $*"; }
run_quiet() {  # run a command; print its output only when it fails, its time when it succeeds
  local log t=$SECONDS
  log=$(mktemp)
  if "$@" >"$log" 2>&1; then
    rm -f "$log"; say "  ... done ($((SECONDS - t)) s)"
  else
    cat "$log" >&2; rm -f "$log"; return 1
  fi
}
stamped() {  # is the install for extra $1 done? (every extra includes the base install)
  [ -f "$STAMP_DIR/${1:-base}-$HASH" ] || { [ -z "$1" ] && compgen -G "$STAMP_DIR/*-$HASH" >/dev/null; }
}

if [ -x .venv/bin/python ] && stamped "$EXTRA" \
    && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('hf_slideformer') is None)"; then
  exit 0
fi

say "preparing .venv${EXTRA:+ with the '$EXTRA' extra} (a first run, or setup.py changed; a few minutes on a fresh machine)"
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
  say "upgrading pip"
  run_quiet .venv/bin/python -m pip install --upgrade pip || say "  ... skipped (pip upgrade failed; continuing)"
fi
. .venv/bin/activate
if python -c "import torch" >/dev/null 2>&1; then
  say "torch $(python -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  say "installing torch (CUDA build; the longest step)"
  run_quiet python -m pip install torch
else
  say "installing torch (CPU build, no NVIDIA GPU found; the longest step)"
  # A pinned release (served locally on some machines), else the CPU wheel index, else PyPI.
  run_quiet bash -c "python -m pip install torch==2.13.0 \
    || python -m pip install torch --index-url https://download.pytorch.org/whl/cpu || python -m pip install torch"
fi
say "installing hf_slideformer${EXTRA:+[$EXTRA]} and its dependencies (transformers, accelerate, ...)"
run_quiet python -m pip install -e ".${EXTRA:+[$EXTRA]}"
mkdir -p "$STAMP_DIR"
for old in "$STAMP_DIR"/*; do   # stamps of an older setup.py
  case "$old" in *"-$HASH") ;; *) rm -f "$old" ;; esac
done
touch "$STAMP_DIR/${EXTRA:-base}-$HASH"
say "done in $((SECONDS - T0)) s; later runs skip this set-up until setup.py changes"
