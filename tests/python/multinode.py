"""Simulated nodes on one machine: each node is a pair of Linux namespaces (UTS: its
own hostname; mount: its own tmpfs on /dev/shm) held open by one process; its ranks
run inside it (nsenter) and talk over loopback. Losing a node kills every process of
it, the holder included, and its tmpfs goes with its mount namespace.

Needs root, unshare and nsenter (CI runs as root)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")


def available() -> bool:
    return os.geteuid() == 0 and all(shutil.which(t) for t in ("unshare", "nsenter"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One simulated node. Not thread-safe."""

    def __init__(self, name: str, shm_size: str = "512m"):
        self.name = name
        self.holder = subprocess.Popen(
            ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
             f"hostname {name} && mount -t tmpfs -o size={shm_size} tmpfs /dev/shm "
             "&& echo ready && exec sleep 100000"],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            self.lose()
            raise RuntimeError(f"node {name} did not start")
        self.procs: list[subprocess.Popen] = []

    def popen(self, argv: list[str], env: dict, log) -> subprocess.Popen:
        p = subprocess.Popen(["nsenter", "-t", str(self.holder.pid), "--uts", "--mount", "--",
                              *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, argv: list[str], timeout: float = 60) -> str:
        return subprocess.run(["nsenter", "-t", str(self.holder.pid), "--uts", "--mount", "--",
                               *argv], capture_output=True, text=True, timeout=timeout,
                              check=True).stdout

    def kill_processes(self) -> None:
        """Kills every process started on the node (a job restart); the node lives."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        self.procs = []

    def lose(self) -> None:
        """The node is gone: its processes, and its shared memory with its namespace."""
        self.kill_processes()
        if self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
        self.holder.wait()


class Job:
    """A run of examples/train.py over nodes, ranks placed node by node."""

    def __init__(self, nodes: list[Node], ranks_per_node: int, args: list[str], workdir: str):
        self.nodes = nodes
        self.per = ranks_per_node
        self.args = args
        self.workdir = workdir
        self.attempt = 0

    def start(self, extra_env: dict | None = None,
              per_rank_env: dict[int, dict] | None = None) -> list[subprocess.Popen]:
        """Starts every rank (attempt n+1: TORCHELASTIC_RESTART_COUNT n); `per_rank_env`
        adds variables to some ranks only."""
        world = len(self.nodes) * self.per
        port = free_port()
        self.attempt += 1
        procs = []
        for n, node in enumerate(self.nodes):
            for j in range(self.per):
                rank = n * self.per + j
                env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"),
                           OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(j), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           TORCHELASTIC_RESTART_COUNT=str(self.attempt - 1))
                env.pop("CAIRN_NODE_ID", None)
                env.update(extra_env or {})
                env.update((per_rank_env or {}).get(rank, {}))
                log = open(os.path.join(self.workdir, f"a{self.attempt}.r{rank}.log"), "w")
                procs.append(node.popen([sys.executable, TRAIN, *self.args], env, log))
                log.close()
        self.procs = procs
        return procs

    def lose_nodes(self, lose) -> None:
        """Node loss before a restart: the nodes at the indexes in `lose` are gone (a
        fresh node of the same name takes each one's place in ``self.nodes``, the list
        the job was made with), the others only lose their processes."""
        for i, node in enumerate(self.nodes):
            if i in lose:
                node.lose()
                self.nodes[i] = Node(node.name)
            else:
                node.kill_processes()

    def log(self, rank: int) -> str:
        with open(os.path.join(self.workdir, f"a{self.attempt}.r{rank}.log")) as f:
            return f.read()

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        out = []
        for p in self.procs:
            try:
                out.append(p.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                out.append(None)
        return out

    def wait_for(self, text: str, timeout: float) -> bool:
        """Until every rank's log of this attempt contains `text` (a log line the
        trainer prints: the only synchronisation with a running job)."""
        world = len(self.procs)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(text in self.log(r) for r in range(world)):
                return True
            if any(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.1)
        return False
