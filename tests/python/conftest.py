"""Fixtures shared by the test modules of this folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def moto():
    """One local S3 server per module (tests/s3/moto_server.py, auth on: every
    request's SigV4 signature is verified); each test works below its own prefix."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s3"))
    from moto_server import MotoServer

    with MotoServer(auth=True) as srv:
        yield srv


# The longest test files first (minutes each: kill -9 trials, a Ray cluster, whole
# training runs under torchrun), so that with the files spread over workers
# (scripts/test.sh: pytest-xdist --dist loadfile) none of them starts last and
# runs alone at the end. The rest keep their order.
LONGEST_FIRST = ["test_chaos.py", "test_ray.py", "test_bench_and_demo.py", "test_lightning.py",
                 "test_replication.py", "test_reshard.py", "test_drill.py", "test_hf.py",
                 "test_data_loader.py", "test_crash_loop.py", "test_data_shards.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
