#!/usr/bin/env python
"""Crash-loop chaos harness for the restore contract (docs/memory.md, "The restore
contract"): random sequences of process lives over one checkpoint root, each life
restoring, saving a few steps and then ending in one of the ways a real run ends,
checked against a model of what was committed.

    python tests/chaos/crash_loop.py --lives 60 --ranks 1     # a long run
    python tests/chaos/crash_loop.py --lives 8 --ranks 2      # on 2 gloo ranks

Every life (one process per rank; two ranks run under torchrun) creates a
``CheckpointManager(root, memory=True)`` with the default configuration, restores
into a state of every kind of value (a tensor per rank, top-level int and str, a
nested dict with a list, a Stateful), records what it restored, saves 0 to 3 newer
steps (memory-only, durable, or mixed, chosen per life), logging each step once
``wait()`` returned for it, and then ends in one of these ways (round-robin, so each
is hit):

  close     the ``with`` block ends normally (close() runs)
  exit      sys.exit() without close()
  raise     user code raises inside ``with CheckpointManager(...)``
  kill      SIGKILL at a random instant of the life (the engine's chaos timer)
  kill1st   SIGKILL half-way through staging the life's first save

The model: the newest step rank 0 logged as committed before a life started is a
lower bound of what that life must restore (a step can commit without the log line
when the kill falls in between; it can never be newer than the newest step started).
Each life checks that its restored step is >= that bound and <= the newest step any
life started, the same on every rank, and that every restored value equals the
deterministic value of that step and rank. A last life closes cleanly and the run
must leave no shared memory behind. Exits non-zero if any check fails; prints and
(--json) writes the counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
ENDINGS = ["close", "exit", "raise", "kill", "kill1st"]
MODES = ["memory", "durable", "mixed"]


# ---- the worker: one rank of one life ---------------------------------------------


class Counter:
    """A Stateful (DCP): restored through load_state_dict."""

    def __init__(self) -> None:
        self.n = -1

    def state_dict(self):
        import torch
        return {"n": torch.tensor([self.n], dtype=torch.int64)}

    def load_state_dict(self, sd) -> None:
        self.n = int(sd["n"][0])


def values_of(step: int, rank: int) -> dict:
    """What a save of `step` holds on `rank`, as plain Python for comparison: "w" is
    replicated (the same on every rank: DCP saves one copy), "mine" is the rank's."""
    return {"w": [float(step) + i / 1024 for i in range(4)],
            "mine": [float(step) + rank / 8 + i for i in range(4)], "epoch": step,
            "tag": f"step-{step}", "nested": {"step": step, "seen": [step, step * 2]},
            "counter": step}


def state_of(step: int, rank: int) -> dict:
    import torch
    v = values_of(step, rank)
    c = Counter()
    c.n = v["counter"]
    w = float(step) + torch.arange(4096, dtype=torch.float32) / 1024
    mine = float(step) + rank / 8 + torch.arange(4, dtype=torch.float64)
    return {"w": w, f"mine{rank}": mine, "epoch": v["epoch"], "tag": v["tag"],
            "nested": {"step": v["nested"]["step"], "seen": list(v["nested"]["seen"])},
            "counter": c}


def observed(state: dict, rank: int) -> dict:
    return {"w": [float(x) for x in state["w"][:4]],
            "mine": [float(x) for x in state[f"mine{rank}"]], "epoch": state["epoch"],
            "tag": state["tag"], "nested": state["nested"], "counter": state["counter"].n}


def zygote() -> dict:
    """Preloads torch and cairn, then forks the ranks of each life the driver asks
    for (a JSON line on stdin), waits for them and answers their exit codes (a JSON
    line). Returns only in a forked rank, with its plan: the rank then runs at the
    module's top level and exits as a real run does (atexit, interpreter teardown)."""
    import torch  # noqa: F401 - preloaded for the forked ranks
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import cairn  # noqa: F401

    print("ready", flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            os._exit(0)
        plan = json.loads(line)
        pids = []
        for rank in range(plan["ranks"]):
            pid = os.fork()
            if pid == 0:
                return dict(plan, rank=rank)
            pids.append(pid)
        rcs = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps(rcs), flush=True)


def rank_main(plan: dict) -> None:
    """One rank of one life, in a process forked by the zygote."""
    rank = plan["rank"]
    fd = os.open(plan["log"] + f".r{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(0)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan["ranks"]))
    os.environ.pop("CAIRN_CHAOS", None)
    if plan["chaos"]:
        os.environ["CAIRN_CHAOS"] = plan["chaos"]
    worker(plan)


def worker(plan: dict) -> None:
    import atexit

    import torch
    import torch.distributed as dist

    import cairn

    rank = plan["rank"]
    if plan["ranks"] > 1:
        dist.init_process_group("gloo", init_method="file://" + plan["store"], rank=rank,
                                world_size=plan["ranks"])
        atexit.register(dist.destroy_process_group)  # gloo's own teardown first
    commits = open(os.path.join(plan["workdir"], f"commits.r{rank}"), "a")

    def log_commit(step: int) -> None:
        commits.write(f"{step}\n")
        commits.flush()

    mgr = cairn.CheckpointManager(plan["root"], memory=True, keep=2, timeout=120)
    blank = {"w": torch.zeros(4096), f"mine{rank}": torch.zeros(4, dtype=torch.float64),
             "epoch": -1, "tag": "", "nested": {"step": -1,
             "seen": [0, 0]}, "counter": Counter()}
    restored = mgr.restore(blank)
    out = {"restored": restored, "tier": mgr.restored and mgr.restored[1],
           "values": observed(blank, rank) if restored is not None else None}
    path = os.path.join(plan["workdir"], f"life{plan['life']}.r{rank}.json")
    with open(path + ".tmp", "w") as f:  # whole or absent, whenever the kill falls
        json.dump(out, f)
    os.rename(path + ".tmp", path)
    start = (restored or 0) + 1
    steps = range(start, start + plan["saves"])
    if plan["ending"] in ("close", "raise"):
        with mgr:
            for i, step in enumerate(steps):
                mgr.save(step, state_of(step, rank), durable=plan["durable"][i])
                mgr.wait()
                log_commit(step)
            if plan["ending"] == "raise":
                raise RuntimeError("user code fails after restore")
    else:
        for i, step in enumerate(steps):
            mgr.save(step, state_of(step, rank), durable=plan["durable"][i])
            mgr.wait()
            log_commit(step)
        if plan["ending"] == "kill":  # the timer had not fired yet: now
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(0)  # without close()


# ---- the driver ----------------------------------------------------------------


def newest_commit(workdir: str) -> int | None:
    path = os.path.join(workdir, "commits.r0")
    if not os.path.exists(path):
        return None
    steps = [int(x) for x in open(path).read().split()]
    return max(steps) if steps else None


def run_life(a, rng: random.Random, life: int, ending: str, started: list[int]) -> dict:
    """Runs one life; returns its record (outcome, restored step, failures)."""
    base = newest_commit(a.workdir)  # the model: committed before this life
    highest = max(started) if started else None
    mode = rng.choice(MODES)
    saves = rng.randint(1 if ending == "kill1st" else 0, 3)
    durable = [mode == "durable" or (mode == "mixed" and rng.random() < 0.5)
               for _ in range(saves)]
    chaos = ""
    if ending == "kill":
        # Every rank, or one (its peers then fail their next collective).
        victims = rng.choice(["all"] + [str(r) for r in range(a.ranks)] if a.ranks > 1
                             else ["all"])
        chaos = f"timer:{rng.randint(0, 6000)}:{victims}"
    elif ending == "kill1st":
        chaos = "stage:1:all"
    logf = os.path.join(a.workdir, f"life{life}.log")
    plan = {"life": life, "ranks": a.ranks, "ending": ending, "saves": saves,
            "durable": durable, "chaos": chaos, "root": a.root, "workdir": a.workdir,
            "log": logf, "store": os.path.join(a.workdir, f"store{life}")}
    t = time.time()
    rcs = a.zygote.run(plan, a.timeout)
    rc = None if rcs is None else next((x for x in rcs if x != 0), 0)
    text = "".join(open(logf + f".r{r}", errors="replace").read()
                   for r in range(a.ranks) if os.path.exists(logf + f".r{r}"))
    rec = {"life": life, "ending": ending, "mode": mode, "saves": saves, "rc": rc,
           "base": base, "seconds": round(time.time() - t, 1), "failures": []}
    fail = rec["failures"].append
    if rc is None:
        fail("timed out")
    # The steps this life may have started (for the next lives' upper bound).
    outs = []
    for r in range(a.ranks):
        p = os.path.join(a.workdir, f"life{life}.r{r}.json")
        outs.append(json.load(open(p)) if os.path.exists(p) else None)
    if all(o is not None for o in outs):
        restored = outs[0]["restored"]
        rec["restored"], rec["tier"] = restored, outs[0]["tier"]
        if any(o["restored"] != restored for o in outs):
            fail(f"ranks restored different steps: {[o['restored'] for o in outs]}")
        if base is not None and (restored is None or restored < base):
            fail(f"restored step {restored}, older than step {base} committed before")
        if restored is not None and (highest is None or restored > highest):
            fail(f"restored step {restored}, never started (newest started {highest})")
        for r, o in enumerate(outs):
            if restored is not None and o["values"] != json.loads(json.dumps(
                    values_of(restored, r))):
                fail(f"rank {r}: values of step {restored} differ: {o['values']}")
        first = (restored or 0) + 1
        started.extend(range(first, first + saves))
    elif ending not in ("kill",):
        fail("a rank did not record its restore")
    # How the life ended.
    if "terminate called" in text or "Fatal Python error" in text:
        fail("aborted at exit: " + text[-800:])
    if ending == "close" and rc != 0:
        fail(f"clean life exited {rc}")
    if ending == "exit" and rc != 0:
        fail(f"exit without close() exited {rc}")
    if ending == "raise" and (rc in (0, None) or "user code fails after restore" not in text):
        fail(f"raise inside the with block: exit {rc}, traceback missing")
    if ending == "raise" and rc not in (0, None) and rc != 1 and a.ranks == 1:
        fail(f"raise inside the with block ended with {rc}, not the traceback's 1")
    if ending in ("kill", "kill1st") and rc == 0:
        fail("the kill never happened")
    if rec["failures"]:
        rec["log_tail"] = text[-3000:]
    return rec


class Zygote:
    """The driver's side of the zygote (a `--zygote` process of this file)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), OMP_NUM_THREADS="1")
        env.pop("CAIRN_CHAOS", None)
        self.proc = subprocess.Popen([sys.executable, HERE, "--zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the zygote did not start")

    def run(self, plan: dict, timeout: float) -> list[int] | None:
        """The ranks' exit codes, or None (and every process gone) on a timeout."""
        import threading
        self.proc.stdin.write(json.dumps(plan) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        return json.loads(line) if line else None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()  # any rank left behind goes with its group


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lives", type=int, default=40)
    p.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--workdir", default="/tmp/cairn-crash-loop")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--endings", default=",".join(ENDINGS),
                   help="the endings to draw from, round-robin (default: all)")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else int(time.time())
    rng = random.Random(seed)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    a.root = os.path.join(a.workdir, "ckpt")
    sys.path.insert(0, os.path.join(REPO, "python"))
    from cairn.manager import memory_tier_name
    shm = os.path.join("/dev/shm", memory_tier_name(os.path.abspath(a.root)))
    print(f"[crash-loop] seed {seed}; {a.lives} lives on {a.ranks} rank(s)", flush=True)
    pool = a.endings.split(",")
    if set(pool) - set(ENDINGS):
        p.error(f"unknown endings {sorted(set(pool) - set(ENDINGS))}; choose from {ENDINGS}")
    endings = [pool[i % len(pool)] for i in range(a.lives)]
    rng.shuffle(endings)
    endings.append("close")  # the last life ends cleanly: then nothing may be left
    started: list[int] = []
    records = []
    a.zygote = Zygote()
    try:
        for life, ending in enumerate(endings):
            rec = run_life(a, rng, life, ending, started)
            records.append(rec)
            status = "FAIL " + "; ".join(rec["failures"]) if rec["failures"] else "ok"
            print(f"[crash-loop] life {life:3d} {ending:8s} {rec['mode']:7s} saves "
                  f"{rec['saves']} committed-before {rec['base']} restored "
                  f"{rec.get('restored')} ({rec.get('tier')}) rc {rec['rc']} "
                  f"{rec['seconds']}s: {status}", flush=True)
        leftover = os.path.exists(shm)
    finally:
        a.zygote.close()
        shutil.rmtree(shm, ignore_errors=True)
    failed = [r for r in records if r["failures"]]
    if leftover:
        failed.append({"life": "end", "failures": [f"{shm} left after the last close"]})
    summary = {
        "seed": seed, "ranks": a.ranks, "lives": len(records), "failed": len(failed),
        "endings": dict(collections.Counter(r["ending"] for r in records)),
        "modes": dict(collections.Counter(r["mode"] for r in records)),
        "restored_tier": dict(collections.Counter(str(r.get("tier")) for r in records)),
        # restored == the newest step logged as committed before the life, or newer
        # (committed, the kill fell before its log line)
        "restored_newest_logged": sum(1 for r in records if r.get("restored") is not None
                                      and r["restored"] == r["base"]),
        "restored_newer_than_logged": sum(1 for r in records if r.get("restored") is not None
                                          and r["base"] is not None
                                          and r["restored"] > r["base"]),
        "failures": [{k: r.get(k) for k in ("life", "ending", "failures", "log_tail")}
                     for r in failed],
    }
    print(f"[crash-loop] {len(records)} lives, {len(failed)} failed; endings "
          f"{summary['endings']}; restored from {summary['restored_tier']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if not failed:
        shutil.rmtree(a.workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        rank_main(zygote())  # a forked rank: ends as the interpreter ends
    else:
        sys.exit(main())
