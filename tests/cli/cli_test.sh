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

echo "cli ok"
