#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the demo:
#  1. the reference trainer on 2 CPU ranks, killed mid-run and resumed by torchrun,
#     compared bit for bit with an uninterrupted run (examples/resume_demo.py);
#  2. a checkpoint saved on 2 ranks, loaded on 3, verified (examples/reshard_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
python examples/resume_demo.py "$@"
echo
python examples/reshard_demo.py
