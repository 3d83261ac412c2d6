"""Smoke test of bench/data.py at tiny sizes: it runs and reports every figure
(no timing assertions; the figures themselves are the benchmark's business)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_data_runs_and_reports(tmp_path):
    out = tmp_path / "data.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "data.py"), "--tiny", "--runs", "1",
         "--out", str(out), "--dir", str(tmp_path / "work")],
        env=env, check=True, timeout=120, capture_output=True,
    )
    res = json.loads(out.read_text())
    for name in ("latency", "bandwidth"):
        sc = res["scenarios"][name]
        for kind in ("stock", "cairn"):
            for epoch in ("cold", "warm"):
                r = sc[kind][epoch]
                assert r["samples"] == sc["config"]["n"]
                assert r["samples_per_s"] > 0 and 0 <= r["wait_fraction"] <= 1
        # Correctness, not speed: the cache fetched the dataset exactly once.
        assert sc["summary"]["fetched_over_dataset"] == 1.0
        assert sc["cairn"]["warm"]["fetched_bytes"] == 0
    assert "cold_bytes_per_s_over_cap" in res["scenarios"]["bandwidth"]["summary"]
    # Resume after a SIGKILL mid-epoch: the saved prefix + the resumed samples are the
    # uninterrupted order (a real kill of a real process; in tiny mode without workers).
    r = res["resume"]["cairn"]
    assert r["runs"] == 1 and r["exact_runs"] == 1, r
    t = r["trials"][0]
    assert 0 < t["killed_after_samples"] < r["uninterrupted_samples"]
    assert t["repeated"] == 0 and t["skipped"] == 0
    # Peers the project venv lacks are skipped with a reason, not silently.
    for peer in ("torchdata", "streaming"):
        assert peer in res["kinds"] or res["skipped"][peer]
