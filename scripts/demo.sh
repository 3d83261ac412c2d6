#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
exec python examples/demo.py "$@"
