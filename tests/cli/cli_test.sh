#!/usr/bin/env bash
# End-to-end test of the `cairn` CLI (run by ctest):
#   cli_test.sh CAIRN_BINARY EXAMPLE_SAVE_LOAD_BINARY
set -euo pipefail
cairn=$1
example=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

"$example" "$dir/root" >/dev/null                  # writes root/step_1234
mkdir -p "$dir/root/step_9999/data"                # a partial checkpoint

out=$("$cairn" ls "$dir/root")
echo "$out" | grep -q "step_1234 .*1234 .*complete" || fail "ls: $out"
echo "$out" | grep -q "step_9999 .*partial" || fail "ls partial: $out"

out=$("$cairn" inspect "$dir/root/step_1234")
echo "$out" | grep -q "model.weight .*float32 .*\[1024, 300\]" || fail "inspect: $out"
"$cairn" inspect --json "$dir/root/step_1234" | grep -q '"format_version": 1' || fail "inspect --json"

"$cairn" verify "$dir/root/step_1234" >/dev/null 2>&1 || fail "verify of an intact checkpoint"

"$cairn" cp "$dir/root/step_1234" "$dir/copy" >/dev/null 2>&1 || fail "cp"
"$cairn" verify "$dir/copy" >/dev/null 2>&1 || fail "verify of the copy"

# Corruption: exit 1 and name the file and the tensor.
printf '\xff' | dd of="$dir/root/step_1234/data/r0.bin" bs=1 seek=100 conv=notrunc 2>/dev/null
set +e
err=$("$cairn" verify "$dir/root/step_1234" 2>&1 >/dev/null)
rc=$?
set -e
[ $rc -eq 1 ] || fail "verify of a corrupt checkpoint exited $rc"
echo "$err" | grep -q "data/r0.bin: checksum mismatch in block 0 of tensor 'model.weight'" ||
  fail "verify message: $err"
# The progress line ("\rverifying  42.0% ...") is ended before the error is printed.
echo "$err" | grep -q "verifying" || fail "verify printed no progress: $err"
echo "$err" | grep "cairn: " | grep -qv "^cairn: " && fail "error on the progress line: $err"

# A corrupt source is not copied (and the destination stays uncommitted).
set +e
"$cairn" cp "$dir/root/step_1234" "$dir/copy2" >/dev/null 2>&1
rc=$?
set -e
[ $rc -eq 1 ] || fail "cp of a corrupt checkpoint exited $rc"
[ ! -e "$dir/copy2/cairn.manifest" ] || fail "cp committed a corrupt copy"

set +e
"$cairn" verify "$dir/missing" >/dev/null 2>&1
rc=$?
set -e
[ $rc -eq 2 ] || fail "verify of a missing checkpoint exited $rc"
# prune: keep the newest committed step; the partial leftover older than it goes.
mkdir -p "$dir/pr"
"$example" "$dir/pr" >/dev/null                      # pr/step_1234
"$cairn" cp "$dir/pr/step_1234" "$dir/pr/step_2000" >/dev/null 2>&1 || fail "cp for prune"
mkdir -p "$dir/pr/step_1500/data"                    # a crashed save's leftover
out=$("$cairn" prune --dry-run -k 1 "$dir/pr")
echo "$out" | grep -q "would remove step_1234" || fail "prune --dry-run: $out"
[ -e "$dir/pr/step_1234/cairn.manifest" ] || fail "prune --dry-run removed something"
out=$("$cairn" prune -k 1 "$dir/pr")
echo "$out" | grep -q "removed step_1234" && echo "$out" | grep -q "removed step_1500" ||
  fail "prune: $out"
[ "$(ls "$dir/pr")" = "step_2000" ] || fail "prune left: $(ls "$dir/pr")"
"$cairn" verify "$dir/pr/step_2000" >/dev/null 2>&1 || fail "prune damaged the newest"

# Hostile and unlucky input (issue 8). Every call runs under `timeout`, so a
# call that blocks fails the test instead of hanging it.
t() { timeout 30 "$@"; }
expect_rc() {  # expect_rc RC WHAT cmd...
  local want=$1 what=$2
  shift 2
  set +e
  out=$(t "$@" 2>&1)
  local rc=$?
  set -e
  [ $rc -eq "$want" ] || fail "$what: exited $rc (want $want): $out"
}
mkdir -p "$dir/h"
"$example" "$dir/h" >/dev/null                        # h/step_1234
ck="$dir/h/step_1234"
sum=$(cat "$ck/cairn.manifest" "$ck/data/r0.bin" | md5sum)
intact() {
  [ "$(cat "$ck/cairn.manifest" "$ck/data/r0.bin" | md5sum)" = "$sum" ] || fail "$1: source changed"
  t "$cairn" verify "$ck" >/dev/null 2>&1 || fail "$1: source no longer verifies"
}
# 1. Copies onto, into or around the source are refused before a byte changes.
expect_rc 1 "cp ck ck" "$cairn" cp "$ck" "$ck"
echo "$out" | grep -q "onto itself" || fail "cp ck ck message: $out"
intact "cp ck ck"
ln -s "$ck" "$dir/h/l"
expect_rc 1 "cp ck l" "$cairn" cp "$ck" "$dir/h/l"
intact "cp ck l (symlink)"
expect_rc 1 "cp l ck" "$cairn" cp "file://$dir/h/l" "$ck"
intact "cp l ck"
expect_rc 1 "cp ck ck/sub" "$cairn" cp "$ck" "$ck/sub/deeper"
echo "$out" | grep -q "inside the source" || fail "cp into the source: $out"
[ ! -e "$ck/sub" ] || fail "cp into the source created $ck/sub"
intact "cp ck ck/sub"
expect_rc 1 "cp ck parent" "$cairn" cp "$ck" "$dir/h"
echo "$out" | grep -q "inside the destination" || fail "cp around the source: $out"
intact "cp ck parent"
expect_rc 0 "cp ck l2" "$cairn" cp "$dir/h/l" "$dir/h/step_1235"
t "$cairn" verify "$dir/h/step_1235" >/dev/null 2>&1 || fail "verify of a copy made through a link"
rm "$dir/h/l"
# 2. A FIFO where the manifest or a data file belongs: clear errors, no hang,
#    and discovery moves on to the older checkpoint.
rm "$dir/h/step_1235/cairn.manifest"
mkfifo "$dir/h/step_1235/cairn.manifest"
expect_rc 0 "ls with a FIFO manifest" "$cairn" ls "$dir/h"
echo "$out" | grep -q "step_1234 .*complete" || fail "ls lost the good checkpoint: $out"
echo "$out" | grep -q "step_1235 .*partial.*FIFO" || fail "ls FIFO: $out"
expect_rc 1 "verify of a FIFO manifest" "$cairn" verify "$dir/h/step_1235"
echo "$out" | grep -q "FIFO" || fail "verify FIFO message: $out"
expect_rc 1 "inspect of a FIFO manifest" "$cairn" inspect "$dir/h/step_1235"
expect_rc 1 "cp of a FIFO manifest" "$cairn" cp "$dir/h/step_1235" "$dir/h/x"
rm "$dir/h/step_1235/cairn.manifest"
"$cairn" cp "$ck" "$dir/h/step_1236" >/dev/null 2>&1 || fail "cp for the FIFO data test"
rm "$dir/h/step_1236/data/r0.bin"
mkfifo "$dir/h/step_1236/data/r0.bin"
expect_rc 1 "verify of a FIFO data file" "$cairn" verify "$dir/h/step_1236"
echo "$out" | grep -q "data/r0.bin.*FIFO" || fail "verify FIFO data message: $out"
expect_rc 1 "cp of a FIFO data file" "$cairn" cp "$dir/h/step_1236" "$dir/h/y"
[ ! -e "$dir/h/y/cairn.manifest" ] || fail "cp committed a copy of a FIFO"
expect_rc 0 "ls with a FIFO data file" "$cairn" ls "$dir/h"
# (Crafted chunk maps and extra sections are tested in tests/cpp/format_test.cc
# and tests/python/test_hostile_input.py.)

# floors: the three figures on a local directory, nothing left behind; a URI
# without a local directory is a usage error.
mkdir -p "$dir/fl"
expect_rc 0 "floors" "$cairn" floors "$dir/fl" --size-mb 20 --reps 2 --no-drop-caches
for f in memcpy "direct write" "parallel direct read"; do
  echo "$out" | grep -Eq "^$f +[0-9.]+ +[0-9.]+$" || fail "floors $f: $out"
done
expect_rc 0 "floors --json" "$cairn" floors "file://$dir/fl" --size-mb 1 --reps 1 --json \
  --no-drop-caches
echo "$out" | grep -q '"bytes": 16777216' || fail "floors --json rounds to 16 MiB: $out"
[ -z "$(ls -A "$dir/fl")" ] || fail "floors left files behind: $(ls -A "$dir/fl")"
expect_rc 2 "floors of an s3 URI" "$cairn" floors s3://bucket/prefix
expect_rc 2 "floors of a missing directory" "$cairn" floors "$dir/absent"

echo "cli ok"
