#!/usr/bin/env bash
# The main job: set up the environment, then fine-tune the embedded tiny model on the bundled corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python examples/finetune_tiny.py "$@"
