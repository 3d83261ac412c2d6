"""No process outlives its trainer: a trainer with cairn.data.DataLoader workers is
SIGKILLed and every process it started (workers, forkserver, resource tracker) must
be gone within seconds, with both start methods and with the default's choice of
fork for a single-threaded trainer. Processes are tracked by a marker
environment variable that every descendant inherits."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import cairn.data as cd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAINER = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    import cairn.data as cd

    def read_shard(s):
        for i in range(10**9):
            yield torch.tensor([s, i])

    def main():
        ctx, where = sys.argv[1], sys.argv[2]
        if where != "single-threaded":
            # A threaded trainer, like one with torch.distributed or a CheckpointManager.
            threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
        ds = cd.ShardDataset(list(range(4)), read_shard)
        kw = {} if ctx == "default" else {"multiprocessing_context": ctx}
        dl = cd.DataLoader(ds, batch_size=2, num_workers=2, **kw)
        from multiprocessing import forkserver
        # Started by the constructor, before the first iter() (None: not started).
        print(forkserver._forkserver._forkserver_pid, flush=True)
        box = []
        if where == "thread":  # the workers are created by a thread that then exits
            t = threading.Thread(target=lambda: box.append(iter(dl)))
            t.start()
            t.join()
            it = box[0]
        else:
            it = iter(dl)
        print(dl.multiprocessing_context.get_start_method(), flush=True)
        for n, _ in enumerate(it):
            if n == 20:
                print("READY", flush=True)
            time.sleep(0.005)

    if __name__ == "__main__":
        main()
    """
)


def marked(mark):
    """(pid, command line) of every process whose environment holds the marker."""
    out = []
    needle = f"CAIRN_HYGIENE_MARK={mark}".encode()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if needle in env:
            out.append((int(p), cmd))
    return out


def run_and_kill(tmp_path, ctx, where="main", extra_env=None, info=None):
    """Runs TRAINER until it has trained 20 batches, SIGKILLs it, returns (start
    method, processes before the kill, processes left 3 s after). ``info`` (a
    dict) gets the forkserver's pid as the constructor left it ("None": not
    started) and whether that process had torch loaded before the kill."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    mark = uuid.uuid4().hex
    env = dict(os.environ, CAIRN_HYGIENE_MARK=mark, PYTHONPATH=os.path.join(REPO, "python"),
               **(extra_env or {}))
    proc = subprocess.Popen([sys.executable, str(script), ctx, where], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        server = proc.stdout.readline().strip()
        method = proc.stdout.readline().strip()
        ready = proc.stdout.readline().strip()
        assert ready == "READY", (server, method, ready)
        if info is not None:
            info["forkserver_at_construction"] = server
            if server != "None":
                with open(f"/proc/{server}/maps") as f:
                    info["forkserver_has_torch"] = "libtorch" in f.read()
        before = marked(mark)
        proc.kill()  # the trainer only, not its process group
        proc.wait()
        deadline = time.monotonic() + 3
        left = marked(mark)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = marked(mark)
        return method, before, left
    finally:
        for pid, _ in marked(mark):  # whatever a failure left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()


@pytest.mark.parametrize("ctx", ["fork", "forkserver"])
def test_workers_and_helpers_exit_within_seconds_of_a_sigkilled_trainer(tmp_path, ctx):
    method, before, left = run_and_kill(tmp_path, ctx)
    assert method == ctx
    # trainer + 2 workers (+ forkserver and resource tracker for forkserver)
    assert len(before) >= (5 if ctx == "forkserver" else 3), before
    assert left == [], f"still running 3 s after the trainer's SIGKILL: {left}"


def test_workers_created_by_a_short_lived_thread_live_on_and_still_die_with_the_trainer(
        tmp_path):
    # The READY line is only printed if the workers survived the exit of the thread
    # that created them (a parent-death signal tied to that thread would kill them).
    method, before, left = run_and_kill(tmp_path, "fork", where="thread")
    assert method == "fork" and len(before) >= 3
    assert left == [], left


def test_default_start_method_is_forkserver_and_its_helpers_exit_too(tmp_path):
    info = {}
    method, before, left = run_and_kill(tmp_path, "default", info=info)
    assert method == "forkserver"
    assert any("forkserver" in cmd for _, cmd in before), before
    assert any("resource_tracker" in cmd for _, cmd in before), before
    assert left == [], left
    # Started by the constructor (so that its start overlaps the trainer's own
    # work), and it imported torch itself: the workers it forks inherit it instead
    # of each importing torch after the fork (Python <= 3.12 never preloads the
    # trainer's __main__).
    assert info["forkserver_at_construction"] != "None", info
    assert info["forkserver_has_torch"], info


def test_default_forks_a_single_threaded_trainer_and_its_workers_still_exit(tmp_path):
    # OMP_NUM_THREADS=1: no OpenBLAS/OpenMP pool, so the trainer has one thread when
    # it creates its workers, and forking them cannot catch another thread's lock.
    info = {}
    method, before, left = run_and_kill(tmp_path, "default", where="single-threaded",
                                        extra_env={"OMP_NUM_THREADS": "1"}, info=info)
    assert method == "fork"
    assert info["forkserver_at_construction"] == "None", info  # none was started
    assert len(before) == 3 and not any("forkserver" in c for _, c in before), before
    assert left == [], f"still running 3 s after the trainer's SIGKILL: {left}"


def test_single_threaded_counts_native_threads(tmp_path):
    # numpy's OpenBLAS pool is a native thread threading.enumerate() does not show.
    code = ("import os, threading\n"
            "from cairn.data import _workers\n"
            "import numpy, torch\n"
            "torch.randn(512, 512) @ torch.randn(512, 512)\n"
            "n = len(os.listdir('/proc/self/task'))\n"
            "print(threading.active_count(), n, _workers.single_threaded())\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OPENBLAS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    py_threads, os_threads, single = int(out[0]), int(out[1]), out[2] == "True"
    assert py_threads == 1
    assert single == (os_threads == 1), out
    if (os.cpu_count() or 1) > 1:
        assert os_threads > 1 and not single, out


def _read(shard):
    return iter([shard])


def test_unpicklable_read_shard_is_refused_when_the_loader_is_created():
    ds = cd.ShardDataset([1, 2], lambda s: iter([s]))
    with pytest.raises(ValueError, match=r"read_shard cannot be pickled.*'forkserver'"):
        cd.DataLoader(ds, batch_size=1, num_workers=1)
    with pytest.raises(ValueError, match="'spawn' start method"):
        cd.DataLoader(ds, batch_size=1, num_workers=1, multiprocessing_context="spawn")


def test_lambda_read_shard_works_in_process_and_with_fork():
    ds = cd.ShardDataset([1, 2, 3], lambda s: iter([s * 10]))
    assert [int(b) for b in cd.DataLoader(ds, batch_size=1, num_workers=0)] == [10, 20, 30]
    dl = cd.DataLoader(ds, batch_size=1, num_workers=1, multiprocessing_context="fork")
    assert sorted(int(b) for b in dl) == [10, 20, 30]
    del dl


def test_module_level_read_shard_works_with_the_default_forkserver():
    ds = cd.ShardDataset([1, 2, 3], _read)
    dl = cd.DataLoader(ds, batch_size=1, num_workers=2)
    assert dl.multiprocessing_context.get_start_method() == "forkserver"
    assert sorted(int(b) for b in dl) == [1, 2, 3]
    del dl
