"""The CI subset of the crash-loop harness (tests/chaos/crash_loop.py): random
restarts ending in close, exit without close(), raise, SIGKILL at a random instant
and SIGKILL while staging the first save, on 1 and 2 gloo ranks, each restore
checked against the model of what was committed. The long run is
`python tests/chaos/crash_loop.py --lives 60` or CAIRN_SLOW=1 here."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLOW = os.environ.get("CAIRN_SLOW") == "1"


ALL = ("close", "exit", "raise", "kill", "kill1st")
# CI: the kills on one rank, exit without close() and raise on two (each life ends
# between its restore and its next commit often; test_restore_contract.py runs the
# issue's exit/raise/close sequence on one rank); every life list ends with a clean
# close. The long run draws every ending on both.
CASES = ([(1, 60, ALL), (2, 30, ALL)] if SLOW
         else [(1, 3, ("kill1st", "kill", "close")), (2, 2, ("exit", "raise"))])


@pytest.mark.parametrize("ranks,lives,endings", CASES)
def test_crash_loop_restores_the_newest_committed_step(tmp_path, ranks, lives, endings):
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tests", "chaos", "crash_loop.py"),
                        "--lives", str(lives), "--ranks", str(ranks),
                        "--endings", ",".join(endings),
                        "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=3000)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["failed"] == 0, summary["failures"]
    # Each ending asked for was hit (round-robin), plus the final clean close.
    for ending in endings:
        assert summary["endings"].get(ending, 0) >= 1, summary
