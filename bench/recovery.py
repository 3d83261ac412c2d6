"""Live recovery of a killed trainer: torchft's heal from a live peer vs cairn under
torchrun --max-restarts (issue 23).

    .venv-peers/bin/python bench/recovery.py                 # 3 runs of each system
    .venv-peers/bin/python bench/recovery.py --systems cairn --reps 1
    .venv-peers/bin/python bench/recovery.py --render bench/results/recovery.json

One scenario, the same model and data for both (bench/peers/recovery_worker.py: an
MLP with 8.4 M parameters, AdamW: ~100 MB of state; synthetic batches seeded by step):

- torchft: one `torchft_lighthouse` (the README's flags: --min_replicas 1
  --quorum_tick_ms 100 --join_timeout_ms 10000) and two replica groups of one
  process each. Once both have committed --warmup steps together, the driver
  SIGKILLs replica group 1 and starts it again at once (the role of a supervisor);
  the new process joins the quorum, heals from replica group 0 (PGTransport) and
  trains on.
- cairn: `torchrun --standalone --nproc-per-node 2 --max-restarts 3`, DDP over gloo,
  CheckpointManager(memory=True) saving every step. Once both ranks have run
  --warmup steps, the driver SIGKILLs rank 1; torchrun stops rank 0 and restarts the
  whole job; both ranks restore from the memory tier and train on.

Timed from the kill (the driver's clock) to the first training step after recovery
(torchft: the restarted group's first committed step with 2 participants; cairn: the
later of the two ranks' first step), split by the timestamps the workers write:
process start (kill -> the script's first statement), import, process-group set-up
(torchft: TCPStore, ProcessGroupGloo, Manager; cairn: cairn.init_distributed), model +
DDP + optimizer, checkpoint manager (cairn's CheckpointManager; torchft: none apart),
restore/heal (cairn: mgr.restore; torchft: quorum, PG reconfiguration and the heal until
its load_state_dict returned), first step. cairn's milestones are the
later rank's. Every process is started in its own session and stopped by process group
(lighthouse included); what is left in /dev/shm and /tmp is counted, then removed.
Results: bench/results/recovery.json and recovery.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench._procs import stop_group  # noqa: E402

WORKER = REPO / "bench" / "peers" / "recovery_worker.py"
RESULTS = REPO / "bench" / "results"
COMPONENTS = ["process start", "import", "process group", "model + DDP + optimizer",
              "checkpoint manager", "restore / heal", "first step"]
MILESTONES = ["start", "imported", "pg", "model", "ready", "restored", "first_step"]
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--quorum_tick_ms", "100",
                    "--join_timeout_ms", "10000"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill
    return out


def wait_for(pred, timeout: float, what: str, procs=()):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        for p in procs:
            if p.poll() is not None and p.returncode not in (0, None):
                raise RuntimeError(f"{what}: a process exited with {p.returncode}")
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries this run's marker (ours only)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if f"CAIRN_RECOVERY_RUN={marker}".encode() in Path(f"/proc/{d}/environ").read_bytes():
                out.append(int(d))
        except OSError:
            pass
    return out


def shm_of(events: Path) -> list[str]:
    """The /dev/shm paths the workers reported owning (cairn's slot directory)."""
    return sorted({e["path"] for e in read_events(events) if e["ev"] == "shm"})


def env_for(tmp: Path) -> dict:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)
    env["PYTHONPATH"] = str(REPO / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    env["OMP_NUM_THREADS"] = "1"
    env["CAIRN_RECOVERY_RUN"] = tmp.name
    return env


def components(ms: dict[str, float], t_kill: float) -> dict[str, float]:
    times = [t_kill] + [ms[m] for m in MILESTONES]
    return {c: times[i + 1] - times[i] for i, c in enumerate(COMPONENTS)}


def run_torchft(scratch: Path, args, with_cairn: bool = False) -> dict:
    events = scratch / "events.jsonl"
    stop = scratch / "stop"
    env = env_for(scratch)
    port = free_port()
    lighthouse_bin = Path(sys.executable).parent / "torchft_lighthouse"
    hb = ["--heartbeat_timeout_ms", str(args.heartbeat_ms)] if args.heartbeat_ms else []
    lh = subprocess.Popen([str(lighthouse_bin), *LIGHTHOUSE_FLAGS, *hb,
                           "--bind", f"127.0.0.1:{port}"],
                          env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=open(scratch / "lighthouse.log", "w"))
    addr = f"http://127.0.0.1:{port}"
    procs: dict[int, subprocess.Popen] = {}
    logs = []

    def start(replica: int) -> subprocess.Popen:
        log = open(scratch / f"rg{replica}-{len(logs)}.log", "w")
        logs.append(log)
        extra = [str(scratch / "ckpt" / f"rg{replica}")] if with_cairn else []
        return subprocess.Popen([sys.executable, str(WORKER), "torchft", str(events),
                                 str(replica), addr, str(stop), *extra],
                                env=env, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)

    try:
        procs[0], procs[1] = start(0), start(1)

        def both_warm():
            evs = read_events(events)
            n = [sum(1 for e in evs if e["ev"] == "step" and e["who"] == str(r)
                     and e["committed"] and e["participants"] == 2) for r in (0, 1)]
            return min(n) >= args.warmup
        wait_for(both_warm, args.timeout, "torchft warm-up", procs.values())
        t_kill = time.time()
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        old_pid = procs[1].pid
        procs[1] = start(1)
        new_pid = procs[1].pid

        def recovered():
            evs = [e for e in read_events(events) if e["pid"] == new_pid]
            return next((e for e in evs if e["ev"] == "step" and e["committed"]
                         and e["participants"] == 2), None)
        first = wait_for(recovered, args.timeout, "torchft recovery", procs.values())
        # a few steps more, then a clean stop
        wait_for(lambda: sum(1 for e in read_events(events) if e["pid"] == new_pid
                             and e["ev"] == "step") >= first_index(events, new_pid) + 3,
                 args.timeout, "torchft steps after recovery", procs.values())
        stop.touch()
        for p in procs.values():
            stop_group(p, grace=20)
    finally:
        stop.touch()
        for p in procs.values():
            if p.poll() is None:
                stop_group(p, grace=5)
        lh.send_signal(signal.SIGTERM)
        stop_group(lh, grace=5)
        for log in logs:
            log.close()
    evs = read_events(events)
    new = {e["ev"]: e for e in reversed([e for e in evs if e["pid"] == new_pid])}
    ms = {m: new[m]["t"] for m in MILESTONES[:-1] if m in new}
    healed = "restored" in ms
    if not healed:
        if not with_cairn:
            raise RuntimeError("torchft: the restarted replica never healed (no load_state_dict)")
        # cairn restored this group's own newest step, which was already the quorum's
        # step: nothing to heal.
        ms["restored"] = ms["ready"]
    ms["first_step"] = first["t"]
    before = [e for e in evs if e["pid"] == old_pid and e["ev"] == "step" and e["committed"]]
    surv = [e["t"] for e in evs if e["who"] == "0" and e["ev"] == "step" and e["committed"]]
    gap = max((b - a for a, b in zip(surv, surv[1:]) if b > t_kill), default=None)
    cr = new.get("cairn_restored")
    return {"t_kill": t_kill, "milestones": ms, "components": components(ms, t_kill),
            "total": ms["first_step"] - t_kill,
            "healed_from_peer": healed,
            "cairn_restore": None if cr is None else {k: cr[k] for k in ("tier", "step",
                                                                         "seconds")},
            "step_before_kill": before[-1]["step"] if before else None,
            "step_after_heal": first["step"],
            "survivor_longest_gap_s": gap,
            "survivor_steps_alone": sum(1 for e in evs if e["who"] == "0" and e["ev"] == "step"
                                        and e["committed"] and e["participants"] == 1
                                        and e["t"] > t_kill)}


def first_index(events: Path, pid: int) -> int:
    evs = [e for e in read_events(events) if e["pid"] == pid and e["ev"] == "step"]
    for i, e in enumerate(evs):
        if e["committed"] and e["participants"] == 2:
            return i + 1
    return 1 << 30


def run_cairn(scratch: Path, args, init_sync: bool = True) -> dict:
    events = scratch / "events.jsonl"
    stop = scratch / "stop"
    root = scratch / "ckpt"
    env = env_for(scratch)
    env["RECOVERY_DDP_INIT_SYNC"] = "1" if init_sync else "0"
    log = open(scratch / "torchrun.log", "w")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", "--max-restarts", "3",
                            "--monitor-interval", str(args.monitor_interval),
                            str(WORKER), "cairn", str(events), str(root), str(stop)],
                           env=env, start_new_session=True, stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        def warm():
            evs = [e for e in read_events(events) if e["ev"] == "step" and e["attempt"] == 0]
            n = [sum(1 for e in evs if e["who"] == f"rank{r}") for r in (0, 1)]
            return min(n) >= args.warmup
        wait_for(warm, args.timeout, "cairn warm-up", [job])
        victim = next(e["pid"] for e in read_events(events)
                      if e["who"] == "rank1" and e["attempt"] == 0)
        before = [e["step"] for e in read_events(events) if e["ev"] == "step"
                  and e["attempt"] == 0]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def recovered():
            evs = [e for e in read_events(events) if e["attempt"] == 1 and e["ev"] == "step"]
            return len({e["who"] for e in evs}) == 2 and evs
        wait_for(recovered, args.timeout, "cairn recovery", [job])
        wait_for(lambda: sum(1 for e in read_events(events) if e["attempt"] == 1
                             and e["ev"] == "step") >= 8, args.timeout,
                 "cairn steps after recovery", [job])
        stop.touch()
        stop_group(job, grace=30)
    finally:
        stop.touch()
        if job.poll() is None:
            stop_group(job, grace=5)
        log.close()
    evs = [e for e in read_events(events) if e["attempt"] == 1]
    ms = {}
    for m in MILESTONES[:-1]:
        ms[m] = max(next(e["t"] for e in evs if e["who"] == w and e["ev"] == m)
                    for w in ("rank0", "rank1"))
    ms["first_step"] = max(next(e["t"] for e in evs if e["who"] == w and e["ev"] == "step")
                           for w in ("rank0", "rank1"))
    restored = [e for e in evs if e["ev"] == "restored"]
    # torchrun's own share of "process start": from rank 0's death (it is stopped by
    # torchrun after rank 1's) to the new processes' first statement is respawn.
    return {"t_kill": t_kill, "milestones": ms, "components": components(ms, t_kill),
            "total": ms["first_step"] - t_kill,
            "step_before_kill": max(before), "step_after_restore": min(e["step"] for e in restored),
            # a restart that found no checkpoint trains from step 0: not a recovery
            "restored_nothing": any(e["step"] < 0 for e in restored),
            "tiers": sorted({str(e.get("tier")) for e in restored})}


SYSTEMS = {"torchft": run_torchft, "cairn": run_cairn,
           "torchft+cairn": lambda scratch, args: run_torchft(scratch, args, with_cairn=True),
           "cairn-no-init-sync": lambda scratch, args: run_cairn(scratch, args,
                                                                         init_sync=False)}


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    import importlib.metadata as md
    for pkg in ("torch", "torchft"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cairn"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True).stdout.strip()
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r and not r.get("restored_nothing")
              and r.get("step_after_restore", 0) >= 0]
        if not ok:
            continue
        out[name] = {"runs": len(ok),
                     "total_median_s": statistics.median(r["total"] for r in ok),
                     "components_median_s": {c: statistics.median(r["components"][c] for r in ok)
                                             for c in COMPONENTS},
                     "failed_runs": sum(1 for r in rs if "error" in r),
                     "restored_nothing_runs": sum(1 for r in rs if "error" not in r and (
                         r.get("restored_nothing") or r.get("step_after_restore", 0) < 0))}
        for k in ("survivor_longest_gap_s", "survivor_steps_alone"):
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                out[name][k + "_median"] = statistics.median(vals)
        lost = [r["step_before_kill"] - r["step_after_restore"] for r in ok
                if "step_after_restore" in r]
        if lost:
            out[name]["steps_redone_median"] = statistics.median(lost)
    return out


def render(doc: dict, png: Path) -> None:
    summ = doc["summary"] = summarize(doc["runs"])
    print("| system | runs | kill -> first step s | " + " | ".join(COMPONENTS) + " |")
    print("|---|---:|---:|" + "---:|" * len(COMPONENTS))
    for name, s in summ.items():
        print(f"| {name} | {s['runs']} | {s['total_median_s']:.2f} | "
              + " | ".join(f"{s['components_median_s'][c]:.2f}" for c in COMPONENTS) + " |")
    for name, s in summ.items():
        extra = {k: v for k, v in s.items() if k not in ("runs", "total_median_s",
                                                         "components_median_s")}
        print(f"{name}: {extra}; totals "
              + ", ".join(f"{r['total']:.2f}" for r in doc["runs"][name] if "total" in r))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = list(summ)
    left = [0.0] * len(names)
    for c in COMPONENTS:
        vals = [summ[n]["components_median_s"][c] for n in names]
        ax.barh(names, vals, left=left, label=c)
        left = [a + b for a, b in zip(left, vals)]
    for i, n in enumerate(names):
        ax.text(left[i], i, f" {summ[n]['total_median_s']:.2f} s", va="center")
    ax.set_xlabel("seconds from SIGKILL to the first training step after recovery (medians)")
    ax.set_xlim(0, max(left) * 1.2)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title(f"recovery after SIGKILL, 100 MB state, 2 replicas, gloo\n"
                 f"(component medians of >= {min(s['runs'] for s in summ.values())} runs; "
                 f"label: median total)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"chart: {png}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="torchft,cairn",
                    help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10, help="steps before the kill")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--monitor-interval", type=float, default=0.1,
                    help="torchrun's --monitor-interval (its default, 0.1 s)")
    ap.add_argument("--heartbeat-ms", type=int, default=None,
                    help="the lighthouse's --heartbeat_timeout_ms (default: its own, 5000)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep logs and events")
    ap.add_argument("--out", default=str(RESULTS / "recovery.json"))
    ap.add_argument("--render", help="print the tables and draw the chart of a JSON")
    args = ap.parse_args()
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        render(doc, Path(args.render).with_suffix(".png"))
        Path(args.render).write_text(json.dumps(doc, indent=1))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    names = args.systems.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    leftovers: dict[str, list] = {n: [] for n in names}
    load0 = os.getloadavg()[0]
    for rep in range(args.reps):
        for name in names:
            tag = "".join(c if c.isalnum() else "-" for c in name)
            scratch = Path(tempfile.mkdtemp(prefix=f"recovery-{tag}-", dir=RESULTS))
            try:
                r = SYSTEMS[name](scratch, args)
            except Exception as e:  # noqa: BLE001 - recorded, the other runs go on
                r = {"error": f"{type(e).__name__}: {e}"}
                for log in scratch.glob("*.log"):
                    r.setdefault("log_tail", {})[log.name] = log.read_text()[-3000:]
            # What this run left: only things it can be sure are its own (the machine
            # is shared): processes carrying its marker, the /dev/shm paths its
            # workers reported, the files in its private TMPDIR (the scratch).
            pids = marked_pids(scratch.name)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shm = [p for p in shm_of(scratch / "events.jsonl") if os.path.exists(p)]
            for p in shm:
                shutil.rmtree(p, ignore_errors=True)
            tmp_left = sorted(x.name for x in scratch.iterdir()
                              if x.name not in ("events.jsonl", "stop", "ckpt")
                              and not x.name.endswith(".log"))
            leftovers[name].append({"processes": len(pids), "shm": shm, "tmpdir": tmp_left})
            if not args.keep_scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            r["rep"] = rep
            runs[name].append(r)
            print(f"[recovery] {name} rep {rep}: "
                  + (f"{r['total']:.2f} s " + json.dumps({k: round(v, 3) for k, v in
                                                          r['components'].items()})
                     if "error" not in r else r["error"]), flush=True)
    doc = {"versions": versions(), "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
           "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "args": vars(args), "lighthouse_flags": LIGHTHOUSE_FLAGS, "runs": runs,
           "left_behind_then_removed": leftovers, "summary": summarize(runs)}
    out = Path(args.out)
    render(doc, out.with_suffix(".png"))
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0 if all("error" not in r for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
