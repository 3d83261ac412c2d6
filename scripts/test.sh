#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs every test: the format check,
# the C++ suite (CTest) and the Python suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate

echo "== format check (clang-format)"
files=$(git ls-files '*.cc' '*.h' 2>/dev/null || true)
if [ -n "$files" ]; then
  clang-format --dry-run --Werror $files
fi

echo "== C++ tests"
ctest --test-dir build --output-on-failure -j2 --timeout 300

echo "== Python tests"
python -m pytest -q -x tests/python "$@"
