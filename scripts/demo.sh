#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the demo: the reference trainer on
# 2 CPU ranks, killed mid-run and resumed by torchrun, compared bit for bit with an
# uninterrupted run (examples/resume_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
python examples/resume_demo.py "$@"
