#!/usr/bin/env bash
# The main job: set up the environment (once; only what training needs), then fine-tune the embedded
# tiny model on the bundled corpus (examples/finetune_tiny.py; its options: bash scripts/train.sh --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
exec python examples/finetune_tiny.py "$@"
