#!/usr/bin/env bash
# Fails (exit 1, printing what it found) if a test run left something behind:
#   * an orphaned process of this checkout: re-parented to init (ppid 1) and
#     running this checkout's virtual environment (multiprocessing's forkserver
#     and resource tracker, DataLoader workers, moto, ray, ...);
#   * cairn's own residue in node shared memory: /dev/shm/cairn-* (memory
#     tiers, staging directories), and named multiprocessing semaphores
#     (/dev/shm/sem.mp-*) that no live process maps: left when a trainer's
#     resource tracker was killed with it (kill its trainer, not its group).
#
#   scripts/check_leftovers.sh [--since FILE] [--venv DIR]
#
# --since FILE: only shared-memory entries modified after FILE count (so a real
# training run on the same node is not blamed on the tests). --venv DIR: the
# environment whose processes count (default: <checkout>/.venv; $VENV too).
set -uo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-$PWD/.venv}"
since=""
shm_root="${CAIRN_SHM_ROOT_FOR_CHECK:-/dev/shm}"
while [ $# -gt 0 ]; do
  case "$1" in
    --since) since="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    *) echo "usage: $0 [--since FILE] [--venv DIR]" >&2; exit 2 ;;
  esac
done
venv="${venv%/}"
found=0

# Orphaned processes of this checkout's environment.
for stat in /proc/[0-9]*/stat; do
  pid="${stat#/proc/}"; pid="${pid%/stat}"
  [ "$pid" = "$$" ] && continue
  # Field 4 is the parent pid; the command name (field 2) may contain spaces.
  ppid=$(sed -e 's/^.*) //' "$stat" 2>/dev/null | cut -d' ' -f2) || continue
  [ "$ppid" = "1" ] || continue
  cmd=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || continue
  case "$cmd" in
    "$venv"/*|*" $venv"/*)
      if [ $found -eq 0 ]; then echo "leftovers of this checkout's test run:"; fi
      echo "  orphaned process $pid: ${cmd:0:200}"
      found=1 ;;
  esac
done

# cairn's residue in node shared memory.
for entry in "$shm_root"/cairn-*; do
  [ -e "$entry" ] || continue
  if [ -n "$since" ] && [ ! "$entry" -nt "$since" ]; then continue; fi
  if [ $found -eq 0 ]; then echo "leftovers of this checkout's test run:"; fi
  echo "  shared memory: $entry ($(du -sh "$entry" 2>/dev/null | cut -f1))"
  found=1
done

for entry in "$shm_root"/sem.mp-*; do
  [ -e "$entry" ] || continue
  if [ -n "$since" ] && [ ! "$entry" -nt "$since" ]; then continue; fi
  grep -qsF "$entry" /proc/[0-9]*/maps && continue  # a live process uses it
  if [ $found -eq 0 ]; then echo "leftovers of this checkout's test run:"; fi
  echo "  shared memory: $entry (a semaphore no process uses)"
  found=1
done

if [ $found -ne 0 ]; then
  echo "check_leftovers: FAILED (stop these processes and delete these files; 'cairn gc' reclaims orphaned memory tiers)"
  exit 1
fi
echo "check_leftovers: no orphaned process, no shared-memory residue"
