"""Replication of the memory tier to peer nodes, with simulated nodes (own hostname,
own tmpfs on /dev/shm: tests/python/multinode.py) over loopback: losing one node
restores from the peer replica, losing both from the durable tier, a corrupt replica
is never trusted; each run ends bit-identical to an uninterrupted one and consumed the
same samples."""

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multinode  # noqa: E402

pytestmark = pytest.mark.skipif(not multinode.available(),
                                reason="needs root, unshare and nsenter (CI runs as root)")

STEPS, EVERY, DURABLE_EVERY, HOLD = 12, 2, 3, 8  # durable: steps 6 and 12


def args(tmp, name):
    return ["--steps", str(STEPS), "--ckpt-every", str(EVERY), "--durable-every",
            str(DURABLE_EVERY), "--replicas", "1", "--keep", "2", "--d-model", "32",
            "--layers", "1", "--seq-len", "32", "--num-workers", "0",
            "--data-dir", str(tmp / "corpus"), "--ckpt-dir", str(tmp / name / "ckpt"),
            "--out", str(tmp / name / "final.pt"), "--sample-log", str(tmp / name / "samples")]


def samples(path):
    seen = {}
    with open(path) as f:
        for line in f:
            rank, step, *ids = line.split()
            key = (int(rank), int(step))
            assert seen.get(key, ids) == ids, f"replayed step {key} consumed other samples"
            seen[key] = ids
    return seen


def restored(job, rank):
    m = re.search(r"rank \d+ restored (.*)", job.log(rank))
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    nodes = [multinode.Node("node-a"), multinode.Node("node-b")]
    try:
        (tmp / "ref").mkdir()
        job = multinode.Job(nodes, 1, args(tmp, "ref"), str(tmp / "ref"))
        job.start()
        assert job.wait_all(240) == [0, 0], job.log(0) + job.log(1)
        return tmp, torch.load(tmp / "ref" / "final.pt"), samples(tmp / "ref" / "samples")
    finally:
        for n in nodes:
            n.lose()


def run_with_loss(reference, name, lose, corrupt=False):
    """Runs to HOLD, loses the nodes in `lose` (the others' processes are killed: the
    job restarts), optionally corrupts node a's replica of node b, restarts on
    replacement nodes and returns (job, final state, samples)."""
    tmp, _, _ = reference
    (tmp / name).mkdir()
    nodes = [multinode.Node("node-a"), multinode.Node("node-b")]
    try:
        a = args(tmp, name) + ["--hold-at-step", str(HOLD)]
        job = multinode.Job(nodes, 1, a, str(tmp / name))
        job.start()
        assert job.wait_for(f"holding at step {HOLD}", 240), job.log(0) + job.log(1)
        listing = nodes[0].run([os.path.join(multinode.REPO, "build", "cairn"), "ls",
                                "--memory"]) if os.path.exists(
            os.path.join(multinode.REPO, "build", "cairn")) else ""
        for i, node in enumerate(nodes):
            if i in lose:
                node.lose()
                nodes[i] = multinode.Node(node.name)
            else:
                node.kill_processes()
        if corrupt:
            nodes[0].run([sys.executable, "-c", FLIP])
        job.nodes = nodes
        job.start()
        rcs = job.wait_all(240)
        assert rcs == [0, 0], job.log(0) + job.log(1)
        return job, torch.load(tmp / name / "final.pt"), samples(tmp / name / "samples"), listing
    finally:
        for n in nodes:
            n.lose()


FLIP = """
import glob
[f] = glob.glob('/dev/shm/cairn-*-replicas/node-b/slot0/data/r1.bin')
with open(f, 'r+b') as fh:
    fh.seek(4096); b = fh.read(1); fh.seek(4096); fh.write(bytes([b[0] ^ 0xFF]))
"""


def check_exact(reference, final, seen):
    _, ref_final, ref_samples = reference
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in final)
    assert seen == ref_samples


def test_losing_one_node_restores_it_from_the_peer_replica(reference):
    job, final, seen, listing = run_with_loss(reference, "one", lose={1})
    assert restored(job, 0) == f"({HOLD}, 'memory')"
    assert restored(job, 1) == f"({HOLD}, 'peer')"
    check_exact(reference, final, seen)
    if listing:
        assert "replica" in listing, listing


def test_losing_every_node_falls_back_to_the_durable_tier(reference):
    job, final, seen, _ = run_with_loss(reference, "both", lose={0, 1})
    assert restored(job, 0) == restored(job, 1) == "(6, 'durable')"
    check_exact(reference, final, seen)


def test_a_corrupt_replica_is_never_trusted(reference):
    job, final, seen, _ = run_with_loss(reference, "corrupt", lose={1}, corrupt=True)
    assert restored(job, 0) == restored(job, 1) == "(6, 'durable')"
    check_exact(reference, final, seen)
