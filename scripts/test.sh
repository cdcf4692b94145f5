#!/usr/bin/env bash
# Set up the environment, then run the test suite (CPU tests; GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec python -m pytest -q -x "$@" tests
