#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs every test: the format check,
# the C++ suite (CTest) and the Python suite (pytest), then checks that the run
# left no orphaned process and no shared-memory residue (scripts/check_leftovers.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate

echo "== format check (clang-format)"
files=$(git ls-files '*.cc' '*.h' 2>/dev/null || true)
if [ -n "$files" ]; then
  clang-format --dry-run --Werror $files
fi

stamp=$(mktemp)
trap 'rm -f "$stamp"' EXIT
rc=0
echo "== C++ tests"
ctest --test-dir build --output-on-failure -j2 --timeout 300 || rc=$?

if [ $rc -eq 0 ]; then
  echo "== Python tests"
  python -m pytest -q -x --durations=25 tests/python "$@" || rc=$?
fi

echo "== leftovers (orphaned processes, /dev/shm residue)"
sleep 2  # helpers of the last test's killed processes exit within seconds
scripts/check_leftovers.sh --since "$stamp" || rc=${rc/#0/1}
exit $rc
