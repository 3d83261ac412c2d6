"""No process outlives its trainer: a trainer with cairn.data.DataLoader workers is
SIGKILLed and every process it started (workers, forkserver, resource tracker) must
be gone within seconds, with both start methods. Processes are tracked by a marker
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
        # A threaded trainer, like one with torch.distributed or a CheckpointManager.
        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
        ds = cd.ShardDataset(list(range(4)), read_shard)
        kw = {} if ctx == "default" else {"multiprocessing_context": ctx}
        dl = cd.DataLoader(ds, batch_size=2, num_workers=2, **kw)
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


def run_and_kill(tmp_path, ctx, where="main"):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    mark = uuid.uuid4().hex
    env = dict(os.environ, CAIRN_HYGIENE_MARK=mark, PYTHONPATH=os.path.join(REPO, "python"))
    proc = subprocess.Popen([sys.executable, str(script), ctx, where], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        method = proc.stdout.readline().strip()
        ready = proc.stdout.readline().strip()
        assert ready == "READY", (method, ready)
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
    method, before, left = run_and_kill(tmp_path, "default")
    assert method == "forkserver"
    assert any("forkserver" in cmd for _, cmd in before), before
    assert any("resource_tracker" in cmd for _, cmd in before), before
    assert left == [], left


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
