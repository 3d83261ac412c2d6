"""The CI subset of the kill -9 chaos harness (tests/chaos/chaos.py): one trial per
phase plus the 2->1 resume. The full run (50 trials) is `python tests/chaos/chaos.py`
or CAIRN_SLOW=1 here."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_chaos_trials_are_exact(tmp_path):
    trials = "50" if os.environ.get("CAIRN_SLOW") == "1" else "6"
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tests", "chaos", "chaos.py"),
                        "--trials", trials, "--workdir", str(tmp_path / "work"),
                        "--json", str(out)], capture_output=True, text=True, timeout=3000)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["failed"] == 0
    # Every deterministic phase was actually hit by a kill.
    for phase in ("train", "stage", "persist", "commit", "prune"):
        assert summary["kills_per_phase"].get(phase, 0) >= 1, summary
