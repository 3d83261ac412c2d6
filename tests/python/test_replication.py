"""Replication of the memory tier to peer nodes, with simulated nodes (own hostname,
own tmpfs on /dev/shm: tests/python/multinode.py) over loopback: losing one node
restores from the peer replica, losing both from the durable tier, a corrupt replica
is never trusted; each run ends bit-identical to an uninterrupted one and consumed the
same samples.

CI runs (about 7 job runs: a reference and a trial of two attempts each for 2 nodes x
1 rank and 2 nodes x 2 ranks, and the corrupt-replica run): a node lost at a random
training step restores its ranks from the peer replica (one node-loss chaos trial per
layout, tests/chaos/node_chaos.py), and a corrupt replica is never trusted.
CAIRN_SLOW=1 adds: losing one node while it holds (with the ``cairn ls --memory``
check), losing both nodes, and 2 nodes x 2 ranks losing one node while it holds.
The long node-loss chaos run is ``python tests/chaos/node_chaos.py --trials N``."""

import os
import random
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multinode  # noqa: E402

sys.path.insert(0, os.path.join(multinode.REPO, "tests", "chaos"))
import node_chaos  # noqa: E402

slow = pytest.mark.skipif(os.environ.get("CAIRN_SLOW") != "1", reason="CAIRN_SLOW=1")

pytestmark = pytest.mark.skipif(not multinode.available(),
                                reason="needs root, unshare and nsenter (CI runs as root)")

HOLD = 8  # saves every 2 steps; durable: steps 6 and 12 (node_chaos.train_args)


def args(tmp, name):
    return node_chaos.train_args(str(tmp), name)


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


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    """The uninterrupted 2 nodes x 2 ranks run: (workdir, final state, samples, dir)."""
    tmp = tmp_path_factory.mktemp("ref2")
    ref = node_chaos.reference(str(tmp), 2)
    return (tmp, torch.load(os.path.join(ref, "final.pt")),
            samples(os.path.join(ref, "samples")), ref)


def run_with_loss(reference, name, lose, corrupt=False, per=1):
    """Runs to HOLD, loses the nodes in `lose` (the others' processes are killed: the
    job restarts), optionally corrupts node a's replica of node b, restarts on
    replacement nodes and returns (job, final state, samples)."""
    tmp, _, _ = reference
    (tmp / name).mkdir()
    nodes = [multinode.Node("node-a"), multinode.Node("node-b")]
    try:
        a = args(tmp, name) + ["--hold-at-step", str(HOLD)]
        job = multinode.Job(nodes, per, a, str(tmp / name))
        job.start()
        assert job.wait_for(f"holding at step {HOLD}", 240), job.log(0) + job.log(per)
        listing = nodes[0].run([os.path.join(multinode.REPO, "build", "cairn"), "ls",
                                "--memory"]) if os.path.exists(
            os.path.join(multinode.REPO, "build", "cairn")) else ""
        job.lose_nodes(lose)
        if corrupt:
            nodes[0].run([sys.executable, "-c", FLIP])
        job.start()
        rcs = job.wait_all(240)
        assert rcs == [0] * 2 * per, job.log(0) + job.log(per)
        return job, torch.load(tmp / name / "final.pt"), samples(tmp / name / "samples"), listing
    finally:
        for n in nodes:
            n.lose()


FLIP = """
import glob
fs = glob.glob('/dev/shm/cairn-*-replicas/node-b/slot*/data/r1.bin')
assert len(fs) == 2, fs  # both replica slots (steps 6 and 8)
for f in fs:
    with open(f, 'r+b') as fh:
        fh.seek(4096); b = fh.read(1); fh.seek(4096); fh.write(bytes([b[0] ^ 0xFF]))
"""


def check_exact(reference, final, seen):
    _, ref_final, ref_samples = reference
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in final)
    assert seen == ref_samples


def test_a_node_lost_at_a_random_training_step_restores_from_the_peer(reference):
    """The CI node-loss chaos trial: node b's rank is SIGKILLed after a random
    optimizer step past the first replicated save (step 4's replication is complete
    once save 6 began), node b is lost, node a's processes are killed, the job
    restarts: rank 1 restores from node a's replica, rank 0 from its own memory."""
    tmp, _, _ = reference
    n = random.Random().randrange(7, 12)
    r = node_chaos.trial(str(tmp), str(tmp / "ref"), "chaos", 1, f"train:{n}:all", (1,))
    assert r["killed"] and not r["errors"], r
    [(s0, t0), (s1, t1)] = r["restored"]
    assert s0 == s1 and s0 in range(4, n, 2) and (t0, t1) == ("memory", "peer"), r


@slow
def test_losing_one_node_restores_it_from_the_peer_replica(reference):
    job, final, seen, listing = run_with_loss(reference, "one", lose={1})
    assert restored(job, 0) == f"({HOLD}, 'memory')"
    assert restored(job, 1) == f"({HOLD}, 'peer')"
    check_exact(reference, final, seen)
    if listing:
        assert "replica" in listing, listing


@slow
def test_losing_every_node_falls_back_to_the_durable_tier(reference):
    job, final, seen, _ = run_with_loss(reference, "both", lose={0, 1})
    assert restored(job, 0) == restored(job, 1) == "(6, 'durable')"
    check_exact(reference, final, seen)


def test_a_corrupt_replica_is_never_trusted(reference):
    job, final, seen, _ = run_with_loss(reference, "corrupt", lose={1}, corrupt=True)
    assert restored(job, 0) == restored(job, 1) == "(6, 'durable')"
    check_exact(reference, final, seen)


def test_two_ranks_per_node_a_node_lost_at_a_random_training_step(reference2):
    """The CI 2 nodes x 2 ranks chaos trial: node b's first rank is SIGKILLed after a
    random optimizer step past the first replicated save, node b is lost, node a's
    processes are killed, the job restarts: ranks 2 and 3 restore from node a's
    replicas, ranks 0 and 1 from their own memory, and the run ends bit-identical to
    the uninterrupted one (the trial checks parameters and samples)."""
    tmp, _, _, ref = reference2
    n = random.Random().randrange(7, 12)
    r = node_chaos.trial(str(tmp), ref, "chaos2", 2, f"train:{n}:all", (1,))
    assert r["killed"] and not r["errors"], r
    steps = {s for s, _ in r["restored"]}
    assert len(steps) == 1 and steps.pop() in range(4, n, 2), r
    assert [t for _, t in r["restored"]] == ["memory"] * 2 + ["peer"] * 2, r


@slow
def test_two_ranks_per_node_losing_one_node_restores_its_ranks_from_the_peer(reference2):
    """2 nodes x 2 ranks: node b (ranks 2, 3) is lost while it holds; its ranks
    restore from node a's replicas, node a's from its own memory; same samples and
    bit-identical parameters."""
    job, final, seen, _ = run_with_loss(reference2[:3], "one2", lose={1}, per=2)
    assert [restored(job, r) for r in range(4)] == [f"({HOLD}, 'memory')"] * 2 + [
        f"({HOLD}, 'peer')"] * 2
    check_exact(reference2[:3], final, seen)
