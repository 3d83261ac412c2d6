"""Seeded fuzzing of the manifest validator and loader (see manifest_fuzz.py).

A few thousand mutations of a valid manifest body, each in a valid envelope;
most go through the decode + conversion path of cairn.Reader, every tenth
through a full dcp.load. Runs in a subprocess with a capped address space and
a timeout, so a crash, a hang or a huge allocation fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("seed", [8, 2024])
def test_mutated_manifests_are_refused_cleanly_or_load_the_original(tmp_path, seed):
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "..", "python"))
    try:
        p = subprocess.run(
            [sys.executable, os.path.join(HERE, "manifest_fuzz.py"), str(seed), "2000", "10",
             str(tmp_path)],
            capture_output=True, text=True, timeout=240, env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fuzzing hung: {e.stdout} {e.stderr}")
    assert p.returncode in (0, 1), f"crashed (rc {p.returncode}): {p.stdout} {p.stderr[-3000:]}"
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["n_failures"] == 0, json.dumps(summary, indent=1)
    c = summary["counts"]
    # The fuzzer reaches both sides: most mutations are refused, some still load.
    assert c["refused"] > 500 and c["decoded"] > 20 and c["loaded_equal"] > 5, c
