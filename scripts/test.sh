#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs every test: the format check,
# the C++ suite (CTest) and the Python suite (pytest, two test files at a time, then
# the tests marked serial alone), then checks that the run
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

# Two at a time (pytest-xdist, a test file per worker: most tests wait on processes,
# servers and I/O, not on a core), then the few that act on the whole node's
# /dev/shm alone (marked serial). CAIRN_TEST_WORKERS=0 runs everything in one process.
workers=${CAIRN_TEST_WORKERS:-2}
pytest_phase() {  # exit status 5 (no test selected by the arguments) is not a failure
  python -m pytest -q -x --durations=25 "$@" || { local r=$?; [ $r -eq 5 ] || rc=$r; }
}
if [ $rc -eq 0 ]; then
  echo "== Python tests ($workers at a time)"
  if [ "$workers" -gt 0 ]; then
    pytest_phase -n "$workers" --dist loadfile -m "not serial" tests/python "$@"
  else
    pytest_phase -m "not serial" tests/python "$@"
  fi
fi
if [ $rc -eq 0 ]; then
  echo "== Python tests that act on the whole node (one at a time)"
  pytest_phase -m serial tests/python "$@"
fi

echo "== leftovers (orphaned processes, /dev/shm residue)"
sleep 2  # helpers of the last test's killed processes exit within seconds
scripts/check_leftovers.sh --since "$stamp" || rc=${rc/#0/1}
exit $rc
