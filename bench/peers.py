#!/usr/bin/env python3
"""cairn's CheckpointManager against the checkpointing libraries a team would pick
instead (bench/peers/: DLRover Flash Checkpoint, plain and under dlrover-run,
torchsnapshot, NVIDIA Resiliency Ext's async queue and its LocalCheckpointManager),
same state, same disk, the machine's floors beside them.

Run from the repository root, in the peers' environment (scripts/bench_peers_setup.sh)::

    .venv-peers/bin/python bench/peers.py --size-mb 100 --ranks 1,2       # 100 MB state
    .venv-peers/bin/python bench/peers.py --size-mb 1500 --ranks 1        # reference state
    .venv-peers/bin/python bench/peers.py --size-mb 3 --ranks 2 --reps 20 # fixed cost

For every (ranks, peer), one session per peer in fresh processes (bench/peers/worker.py;
torchrun for 2 ranks, every rank holding the same state as under DDP):

1. save phase: reps + 1 saves, the first reported apart; per save the blocking
   stall (``save`` returns), the time until durable on local disk (``wait`` returns;
   for peers that do not fsync, the adapter's fsync is included) and the peak extra
   memory (RssAnon of the session's process tree + the peer's shared-memory files
   over the baseline after opening it); max over ranks. Then every rank SIGKILLs
   itself after the last save was durable.
2. what the killed session left: processes still running (found by an environment
   marker the session's children inherit), new /dev/shm and /tmp entries.
3. the orphaned processes are killed (a restarted node has none), then the
   restore phase (the restart): a fresh session restores from the peer's fastest
   tier, then from disk with the page cache dropped; both checked bit for bit.
4. what is left after the restarted session closed; the harness then removes it
   (kills the processes by pid, removes the entries it attributed to the run, and the
   named semaphores of killed sessions that no process has open).

A peer in SUPERVISED (``dlrover-run``: DLRover under its own launcher, the one way it
restores from memory after a SIGKILL) runs as one job instead: DLRover's local master,
then ``dlrover-run --max_restarts 1`` of the worker, which saves and SIGKILLs itself;
the launcher restarts it and the restarted worker restores (``run_supervised``).
NVRx's ``LocalCheckpointManager`` is two more adapters: ``nvrx-local`` (its directory in
/dev/shm) and ``nvrx-local-disk`` (on the local disk).

Floors, measured in this process on the same state size: the copy floor (the faster
of a single-threaded memcpy and Tensor.copy_, cairn._measure) and the disk's
direct-I/O write and parallel direct-I/O read (src/io/floors.cc).

Writes bench/results/peers-<size>mb.json and a PNG chart next to it: bars per peer
for each figure with its floor as a line, and a timeline of cairn's saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))

from bench import _shm  # noqa: E402
from bench._procs import stop_group  # noqa: E402

DEFAULT_PEERS = ["cairn", "dlrover-run", "torchsnapshot", "nvrx", "nvrx-local"]

# Peers whose fastest restore needs their own launcher: the session is one job under
# it, whose worker saves and SIGKILLs itself and is restarted by the launcher to
# restore (worker.py --phase supervised). dlrover-run's agent keeps DLRover's shared
# memory across the worker's death; it needs DLRover's master (its --standalone mode
# fails on torch 2.13), which the harness starts first and stops after.
SUPERVISED = {"dlrover-run"}


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries CAIRN_PEERS_RUN=marker."""
    out = []
    needle = f"CAIRN_PEERS_RUN={marker}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(d))
        except OSError:
            pass
    return out


def listing() -> dict[str, set[str]]:
    return {"/dev/shm": set(os.listdir("/dev/shm")), "/tmp": set(os.listdir("/tmp"))}


# Names in /dev/shm and /tmp that a peer's session creates. Other users of the machine
# create entries there at the same time, so only these are counted (and removed):
# the sessions run with TMPDIR in their own scratch directory, so what lands in /tmp
# itself is a hard-coded path (DLRover's /tmp/ckpt_sock); the private TMPDIR's
# leftovers are counted apart.
def attributable(name: str, shm_dirs: list[str]) -> bool:
    return ("ckpt_shm_" in name or name.startswith(("ckpt_sock", "ckpt_lock"))
            or any(os.path.basename(d) == name for d in shm_dirs))


def new_entries(before: dict[str, set[str]], shm_dirs: list[str], tmpdir: Path
                ) -> dict[str, list[str]]:
    now = listing()
    out = {k: sorted(n for n in now[k] - before[k] if attributable(n, shm_dirs))
           for k in now}
    out["TMPDIR"] = sorted(os.listdir(tmpdir)) if tmpdir.exists() else []
    return out


def run_phase(peer: str, phase: str, ranks: int, size_mb: float, reps: int, root: Path,
              out: Path, marker: str, kill: bool, timeout: float, tmpdir: Path
              ) -> list[dict]:
    py = sys.executable
    worker = ["-m", "bench.peers.worker", "--peer", peer, "--phase", phase,
              "--size-mb", str(size_mb), "--reps", str(reps), "--root", str(root),
              "--out", str(out)] + (["--kill"] if kill else [])
    if ranks == 1:
        cmd = [py] + worker
    else:
        port = 29500 + (os.getpid() + int(time.time())) % 2000
        cmd = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(port)] + worker
    env = dict(os.environ, CAIRN_PEERS_RUN=marker,
               PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'python'}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TMPDIR=str(tmpdir))
    for r in range(ranks):
        Path(f"{out}.rank{r}.json").unlink(missing_ok=True)
    # The log goes to a file, not a pipe: a helper process the peer leaves running
    # (DLRover's saver) inherits it and would keep a pipe open.
    log_path = Path(f"{out}.{phase}.log")
    with open(log_path, "wb") as logf:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    log = log_path.read_bytes()
    results = []
    for r in range(ranks):
        f = Path(f"{out}.rank{r}.json")
        if not f.exists():
            tail = log.decode(errors="replace")[-3000:]
            raise RuntimeError(f"{peer} {phase} ({ranks} ranks): no result from rank {r}:\n{tail}")
        results.append(json.loads(f.read_text()))
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"DLRover's master exited ({proc.returncode}):\n"
                               + log.read_bytes().decode(errors="replace")[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"DLRover's master did not listen on {port} within {timeout:.0f} s")


def run_supervised(peer: str, ranks: int, size_mb: float, reps: int, root: Path, out: Path,
                   marker: str, timeout: float, tmpdir: Path) -> dict:
    """One job of `peer` under its launcher (SUPERVISED): DLRover's master, then
    ``dlrover-run --max-restarts 1`` of worker.py --phase supervised. Returns the
    save and restore results and what was left (a) when the job had ended, with the
    master still up (the master itself not counted), (b) after the master was stopped.
    Stops the master's and the job's process groups whatever happens."""
    py = sys.executable
    env = dict(os.environ, CAIRN_PEERS_RUN=marker,
               PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'python'}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", TMPDIR=str(tmpdir))
    port = _free_port()
    master_log = Path(f"{out}.master.log")
    job_log = Path(f"{out}.supervised.log")
    for r in range(ranks):
        Path(f"{out}.rank{r}.json").unlink(missing_ok=True)
        Path(f"{out}.restore.rank{r}.json").unlink(missing_ok=True)
    before = listing()
    master = job = None
    with open(master_log, "wb") as mlog, open(job_log, "wb") as jlog:
        try:
            master = subprocess.Popen(
                [py, "-m", "dlrover.python.master.main", "--port", str(port), "--node_num",
                 "1", "--job_name", f"cairn-peers-{marker[:8]}", "--platform", "local"],
                cwd=REPO, env=env, stdout=mlog, stderr=subprocess.STDOUT,
                start_new_session=True)
            _wait_port(port, master, 120, master_log)
            cmd = [py, "-m", "dlrover.trainer.torch.main", "--nnodes", "1",
                   "--nproc_per_node", str(ranks), "--max_restarts", "1",
                   "-m", "bench.peers.worker", "--peer", peer, "--phase", "supervised",
                   "--size-mb", str(size_mb), "--reps", str(reps), "--root", str(root),
                   "--out", str(out)]
            job = subprocess.Popen(cmd, cwd=REPO, env=dict(env, DLROVER_MASTER_ADDR=
                                                            f"127.0.0.1:{port}"),
                                   stdout=jlog, stderr=subprocess.STDOUT,
                                   start_new_session=True)
            try:
                job.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            job_rc = job.poll()
            time.sleep(0.5)
            left_job = {"processes": len([p for p in marked_pids(marker) if p != master.pid]),
                        **new_entries(before, [], tmpdir)}
            stop_group(master, term_first=True)
            stop_group(job, term_first=True)
            time.sleep(0.5)
            left_master = {"processes": len(marked_pids(marker)),
                           **new_entries(before, [], tmpdir)}
        finally:
            for proc in (job, master):
                if proc is not None and proc.poll() is None:
                    stop_group(proc, grace=2, term_first=True)
    results = {}
    for phase, suffix in (("save", ""), ("restore", ".restore")):
        results[phase] = []
        for r in range(ranks):
            f = Path(f"{out}{suffix}.rank{r}.json")
            if not f.exists():
                tail = job_log.read_bytes().decode(errors="replace")[-3000:]
                raise RuntimeError(f"{peer} ({ranks} ranks, job exit {job_rc}): no {phase} "
                                   f"result from rank {r}:\n{tail}")
            results[phase].append(json.loads(f.read_text()))
    return {**results, "left_after_job": left_job, "left_after_master_stop": left_master,
            "before": before, "job_rc": job_rc}


def median(xs):
    return statistics.median(xs) if xs else None


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_peer(peer: str, ranks: int, size_mb: float, reps: int, scratch: Path,
             timeout: float) -> dict:
    marker = uuid.uuid4().hex
    root = scratch / f"{peer}-{ranks}r-{marker[:6]}"
    root.mkdir(parents=True)
    tmpdir = scratch / f"tmp-{marker[:6]}"
    tmpdir.mkdir()
    out = scratch / f"{peer}-{ranks}r"
    before = listing()
    sems_before = _shm.sem_names()
    shm_dirs: list[str] = []
    supervised = None
    try:
        if peer in SUPERVISED:
            supervised = run_supervised(peer, ranks, size_mb, reps, root, out, marker,
                                        timeout, tmpdir)
            saved, restored = supervised["save"], supervised["restore"]
            shm_dirs = saved[0].get("shm_dirs", [])
            # The launcher restarts the worker at once (its agent, saver and shared
            # memory stay by design): there is no moment "after the SIGKILL" to look at.
            after_kill = None
            after_close = supervised["left_after_job"]
        else:
            saved = run_phase(peer, "save", ranks, size_mb, reps, root, out, marker, True,
                              timeout, tmpdir)
            shm_dirs = saved[0].get("shm_dirs", [])
            time.sleep(0.5)
            orphans = marked_pids(marker)
            after_kill = {"processes": len(orphans), **new_entries(before, shm_dirs, tmpdir)}
            # The restart comes after the node's orphans are gone, as when a node or
            # container is restarted (DLRover's saver outlives its SIGKILLed trainer
            # under plain python, and a restarted DdpCheckpointer then waits 60 s for its
            # sockets and fails).
            _kill(orphans)
            restored = run_phase(peer, "restore", ranks, size_mb, reps, root, out, marker,
                                 False, timeout, tmpdir)
            time.sleep(0.5)
            after_close = {"processes": len(marked_pids(marker)),
                           **new_entries(before, shm_dirs, tmpdir)}
    finally:
        # Clean up what the sessions left (ours only).
        _kill(marked_pids(marker))
        for top, names in new_entries(before, shm_dirs, tmpdir).items():
            if top == "TMPDIR":
                continue
            for n in names:
                path = os.path.join(top, n)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    Path(path).unlink(missing_ok=True)
        # Named semaphores of the killed sessions' spawn/forkserver queues: their
        # resource tracker, which would unlink them, was killed with the orphans.
        sems_removed = len(_shm.remove_leaked_sems(sems_before))
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)
    s0 = saved[0]
    steady = s0["saves"][1:]
    extra = {}
    if supervised is not None:
        extra = {"launcher": "dlrover-run (--max-restarts 1) + DLRover's local master",
                 "left_after_master_stop": supervised["left_after_master_stop"],
                 "restart_count": restored[0].get("restart_count")}
    return {
        **extra, "peer": peer, "version": s0["version"], "patch": s0["patch"],
        "fastest_tier": s0["fastest_tier"], "ranks": ranks, "bytes": s0["bytes"],
        "first_save": s0["saves"][0],
        "stall_s": median([s["stall_s"] for s in steady]),
        "durable_s": median([s["durable_s"] for s in steady]),
        "extra_bytes": median([s["extra_bytes"] for s in steady]),
        "saves": s0["saves"],
        "restore_tier": restored[0]["tier"],
        "restore_fast_s": restored[0]["restore_fast_s"],
        "restore_disk_s": restored[0]["restore_disk_s"],
        "restore_ok": all(r["restore_fast_ok"] and r["restore_disk_ok"] for r in restored),
        "restore_cold": restored[0]["cold"],
        "restore_evidence": restored[0].get("evidence"),
        "left_after_kill": after_kill, "left_after_close": after_close,
        "named_semaphores_removed": sems_removed,
    }


def floors(size_mb: float, scratch: Path, reps: int) -> dict:
    """Copy floor and direct-I/O floors for one rank's state (cairn._measure)."""
    import types

    import torch

    from bench.peers.worker import build_state, nbytes
    from cairn import _measure

    torch.set_num_threads(1)  # as in the sessions; OpenMP workers spin on a busy machine
    state = build_state(size_mb)
    ctx = types.SimpleNamespace(state=state, nbytes=nbytes(state), scratch=scratch,
                                drop_caches=True, dropped=False)
    rows = {"memcpy": [], "Tensor.copy_": [], "direct-I/O write": [], "direct-I/O read": []}
    for _ in range(reps):
        rows["memcpy"].append(_measure.floor_memcpy(ctx)[0])
        rows["Tensor.copy_"].append(_measure.floor_tensor_copy(ctx)[0])
        (w, _), (r, _) = _measure.floor_direct_io(ctx)
        rows["direct-I/O write"].append(w)
        rows["direct-I/O read"].append(r)
    med = {k: median(v) for k, v in rows.items()}
    med["copy"] = min(med["memcpy"], med["Tensor.copy_"])
    med["bytes"] = ctx.nbytes
    del state, torch
    return med


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fl = result["floors"]
    figures = [("stall_s", "blocking stall (s)", fl["copy"], "copy floor"),
               ("durable_s", "time until durable (s)", fl["direct-I/O write"],
                "direct-I/O write"),
               ("restore_fast_s", "restore, fastest tier (s)", fl["copy"], "copy floor"),
               ("restore_disk_s", "restore from disk, cold (s)", fl["direct-I/O read"],
                "direct-I/O read"),
               ("extra_bytes", "peak extra memory (GB)", fl["bytes"] / 1e9, "state size")]
    configs = sorted({r["ranks"] for r in result["rows"] if "failed" not in r})
    fig, axes = plt.subplots(len(configs), len(figures) + 1,
                             figsize=(4 * (len(figures) + 1), 3.4 * len(configs)),
                             squeeze=False)
    for ci, ranks in enumerate(configs):
        rows = [r for r in result["rows"] if r["ranks"] == ranks and "failed" not in r]
        for fi, (key, title, floor, fname) in enumerate(figures):
            ax = axes[ci][fi]
            vals = [(r[key] or 0) / (1e9 if key == "extra_bytes" else 1) for r in rows]
            names = [r["peer"] + ("*" if r["patch"] else "") for r in rows]
            ax.bar(names, vals, color=["#d62728" if r["peer"] == "cairn" else "#1f77b4"
                                       for r in rows])
            ax.axhline(floor, color="k", linestyle="--", linewidth=1, label=fname)
            ax.set_title(f"{title}, {ranks} rank(s)", fontsize=9)
            ax.tick_params(axis="x", labelsize=8, rotation=20)
            ax.legend(fontsize=7)
        # Timeline of cairn's saves in this config.
        ax = axes[ci][-1]
        cairn_rows = [r for r in rows if r["peer"] == "cairn"]
        if cairn_rows:
            r = cairn_rows[0]
            base = r["saves"][0]["t0"]
            for i, s in enumerate(r["saves"]):
                ax.barh(i, s["t1"] - s["t0"], left=s["t0"] - base, color="#d62728",
                        label="stall (memory tier staged)" if i == 0 else None)
                ax.barh(i, s["t2"] - s["t1"], left=s["t1"] - base, color="#ff9896",
                        label="persist to durable tier" if i == 0 else None)
            n = len(r["saves"])
            ax.barh(n, r["restore_fast_s"], color="#2ca02c",
                    label=f"restore ({r['restore_tier']}), after SIGKILL")
            ax.barh(n + 1, r["restore_disk_s"], color="#98df8a", label="restore (disk, cold)")
            ax.set_yticks(range(n + 2), [f"save {s['step']}" for s in r["saves"]]
                          + ["restore", "restore disk"], fontsize=7)
            ax.set_xlabel("s (restores: own time axis, from 0)", fontsize=7)
            ax.set_title(f"cairn timeline, {ranks} rank(s)", fontsize=9)
            ax.legend(fontsize=6)
    runs = f"{result['runs']} runs of " if result.get("runs") else ""
    fig.suptitle(f"{result['bytes'] / 1e6:.0f} MB state, {result['ntensors']} tensors; "
                 f"* = patched to run on CPU; medians of {runs}"
                 f"{result['reps']} saves", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


FIGURES = ("stall_s", "durable_s", "restore_fast_s", "restore_disk_s", "extra_bytes")


def combine(results: list[dict]) -> dict:
    """Several runs of one configuration as one result: each peer's figure is the
    median of the runs' (each run's the median of its saves), the runs' own values
    kept in the row's ``runs``; floors likewise. A peer that failed in some runs is
    the median of the others (``ok_runs`` says how many)."""
    base = results[0]
    rows = []
    for r0 in base["rows"]:
        same = [r for res in results for r in res["rows"]
                if r["peer"] == r0["peer"] and r["ranks"] == r0["ranks"] and "failed" not in r]
        if not same:
            rows.append(r0)
            continue
        row = dict(same[0])
        row["runs"] = {k: [r[k] for r in same] for k in FIGURES}
        for k in FIGURES:
            vals = [v for v in row["runs"][k] if v is not None]
            row[k] = median(vals) if vals else None
        row["restore_ok"] = all(r["restore_ok"] for r in same)
        row["ok_runs"] = len(same)
        rows.append(row)
    floors = {k: median([res["floors"][k] for res in results]) for k in base["floors"]}
    return {**base, "floors": floors, "rows": rows, "runs": len(results),
            "loadavg": [max(res["loadavg"][0] for res in results)] + list(base["loadavg"][1:]),
            "time": ", ".join(res["time"] for res in results)}


def markdown(result: dict) -> str:
    """The result as bench/README.md's tables (one per rank count)."""
    fl = result["floors"]
    runs = result.get("runs")
    what = (f"medians of {runs} runs, each the median of {result['reps']} saves (a first "
            "save apart), the runs' values in brackets; highest load average "
            if runs else f"medians of {result['reps']} saves (a first save apart); load average ")
    lines = [f"State {result['bytes'] / 1e6:.0f} MB in {result['ntensors']} tensors per rank; "
             f"{what}{result['loadavg'][0]:.1f} on {result['cpus']} CPUs; {result['time']}.",
             "",
             f"Floors: copy {fl['copy'] * 1e3:.1f} ms (memcpy {fl['memcpy'] * 1e3:.1f}, "
             f"Tensor.copy_ {fl['Tensor.copy_'] * 1e3:.1f}), direct-I/O write "
             f"{fl['direct-I/O write']:.3f} s, parallel direct-I/O read "
             f"{fl['direct-I/O read']:.3f} s.", ""]
    for ranks in sorted({r["ranks"] for r in result["rows"]}):
        lines += [f"{ranks} rank(s):", "",
                  "| peer | stall ms | durable s | restore after SIGKILL (tier) s | restore "
                  "from disk, cold s | peak extra MB | first save: stall ms / durable s "
                  "| left after SIGKILL | left after restart + close |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in [r for r in result["rows"] if r["ranks"] == ranks]:
            if "failed" in r:
                lines.append(f"| {r['peer']} | failed: {r['failed'][-200:]!r} |||||||")
                continue

            def left(d):
                if d is None:
                    return "(restarted at once by its launcher)"
                parts = [f"{d['processes']} processes"] if d["processes"] else []
                parts += [f"{k}/{n}" for k in ("/dev/shm", "/tmp") for n in d[k]]
                return ", ".join(parts) or "nothing"

            def fig(key, scale, spec):
                v = r[key]
                if v is None:
                    return "–"
                out = format(v * scale, spec)
                if "runs" in r and len(r["runs"][key]) > 1:
                    out += " (" + ", ".join("–" if x is None else format(x * scale, spec)
                                            for x in r["runs"][key]) + ")"
                return out
            runs_ok = (f" [{r['ok_runs']} of {runs} runs]"
                       if runs and r.get("ok_runs", runs) < runs else "")
            lines.append(
                f"| {r['peer']} {r['version']}{' (patched)' if r['patch'] else ''}{runs_ok} | "
                f"{fig('stall_s', 1e3, '.1f')} | {fig('durable_s', 1, '.3f')} | "
                f"{fig('restore_fast_s', 1, '.3f')} ({r['restore_tier']}) | "
                f"{fig('restore_disk_s', 1, '.3f')} | "
                f"{r['extra_bytes'] / 1e6:.0f} | {r['first_save']['stall_s'] * 1e3:.1f} / "
                f"{r['first_save']['durable_s']:.2f} | {left(r['left_after_kill'])} | "
                f"{left(r['left_after_close'])}"
                + (f"; after its master stopped: {left(r['left_after_master_stop'])}"
                   if "left_after_master_stop" in r else "") + " |")
        lines.append("")
        for r in [r for r in result["rows"] if r["ranks"] == ranks and r.get("note")]:
            lines += [f"{r['peer']}, {ranks} rank(s): {r['note']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=100)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="print an earlier run's tables (markdown) and redraw its chart")
    ap.add_argument("--median", type=Path, nargs="+", metavar="JSON",
                    help="several earlier runs of one configuration: print the medians' "
                    "tables (each run's value in brackets); with --out, write the combined "
                    "JSON and its chart")
    args = ap.parse_args(argv)
    if args.median:
        result = combine([json.loads(p.read_text()) for p in args.median])
        print(markdown(result))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
            chart(result, args.out.with_suffix(".png"))
        return 0
    if args.render:
        result = json.loads(args.render.read_text())
        print(markdown(result))
        chart(result, args.render.with_suffix(".png"))
        return 0
    from bench import peers as registry
    from bench.peers.worker import build_state, leaves

    names = args.peers.split(",")
    unknown = set(names) - set(registry.ADAPTERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {sorted(registry.ADAPTERS)}")
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    out = args.out or results_dir / f"peers-{args.size_mb:g}mb.json"
    scratch = Path(tempfile.mkdtemp(prefix="cairn-peers-", dir=results_dir))
    try:
        st = build_state(args.size_mb)
        ntensors = len(leaves(st))
        del st
        fl = floors(args.size_mb, scratch, args.reps)
        rows = []
        for ranks in [int(x) for x in args.ranks.split(",")]:
            for peer in names:
                t0 = time.time()
                row, failures = None, []
                for attempt in range(2):  # a session that failed is retried once
                    try:
                        row = one_peer(peer, ranks, args.size_mb, args.reps, scratch,
                                       args.timeout)
                        break
                    except RuntimeError as e:
                        print(f"{peer:14s} {ranks}r FAILED: {str(e)[-2000:]}", flush=True)
                        failures.append(str(e)[-4000:])
                if row is None:  # reported as a failed row, the others go on
                    rows.append({"peer": peer, "ranks": ranks, "failed": failures[-1]})
                    continue
                row["failed_attempts"] = failures
                rows.append(row)
                print(f"{peer:14s} {ranks}r stall {row['stall_s'] * 1e3:9.2f} ms  durable "
                      f"{row['durable_s']:7.3f} s  restore {row['restore_tier']} "
                      f"{row['restore_fast_s']:7.3f} s disk {row['restore_disk_s'] or 0:7.3f} s  "
                      f"extra {row['extra_bytes'] / 1e6:8.1f} MB  ok={row['restore_ok']}  "
                      f"left(kill) {row['left_after_kill']}  left(close) "
                      f"{row['left_after_close']}"
                      + (f"  left(master stopped) {row['left_after_master_stop']}"
                         if "left_after_master_stop" in row else "")
                      + (f"  evidence: {row['restore_evidence']}" if row["restore_evidence"]
                         else "") + f"  [{time.time() - t0:.0f} s]", flush=True)
        result = {"size_mb": args.size_mb, "bytes": fl["bytes"], "ntensors": ntensors,
                  "reps": args.reps, "floors": fl, "rows": rows,
                  "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        out.write_text(json.dumps(result, indent=1))
        print(f"floors: copy {fl['copy'] * 1e3:.2f} ms, direct-I/O write "
              f"{fl['direct-I/O write']:.3f} s, read {fl['direct-I/O read']:.3f} s")
        if args.no_chart:
            print(f"wrote {out}")
            return 0
        try:
            chart(result, out.with_suffix(".png"))
            print(f"wrote {out} and {out.with_suffix('.png')}")
        except ImportError:
            print(f"wrote {out} (no matplotlib: run in .venv-peers for the chart)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
