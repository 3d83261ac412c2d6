"""The shared file cache across real processes: byte limit, crashes mid-copy,
pins, no double fetch. Uses the engine (cairn._ext.FileCache) directly."""

import hashlib
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

from cairn import _ext

FORK = multiprocessing.get_context("fork")


def make_source(root, n, size):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        with open(os.path.join(root, f"f{i:03d}"), "wb") as f:
            f.write(rng.bytes(size))
    return root


def engine(src, cache, limit, **kw):
    keys, sizes = _ext.list_source(src)
    return _ext.FileCache(src, cache, limit, keys, sizes, **kw), keys


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_bytes(root):
    total = 0
    for d, _, files in os.walk(os.path.join(root, "files")):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                pass
    return total


def _reader(src_dir, src, cache, limit, seed, result_q):
    eng, keys = engine(src, cache, limit, threads=3, prefetch_files=4)
    order = np.random.default_rng(seed).permutation(len(keys)).astype(np.int64)
    eng.set_plan(order, order, np.arange(len(keys), dtype=np.int64))
    bad = 0
    for i in range(len(keys)):
        path = eng.acquire(i)
        fid = eng.plan_file(i)
        if digest(path) != digest(os.path.join(src_dir, keys[fid])):
            bad += 1
        eng.release(fid)
    result_q.put(bad)


def test_cache_limit_respected_under_concurrent_processes(tmp_path):
    size, n = 20_000, 24
    src_dir = make_source(f"{tmp_path}/src", n, size)
    src = f"slow://{src_dir}?latency=0.003"
    cache = f"{tmp_path}/cache"
    limit = 6 * size
    probe, _ = engine(src, cache, limit)
    q = FORK.Queue()
    procs = [FORK.Process(target=_reader, args=(src_dir, src, cache, limit, s, q)) for s in range(4)]
    peak = [0]
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            peak[0] = max(peak[0], cache_bytes(probe.root))
            time.sleep(0.001)

    t = threading.Thread(target=monitor)
    t.start()
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    stop.set()
    t.join()
    assert all(p.exitcode == 0 for p in procs)
    assert [q.get() for _ in procs] == [0, 0, 0, 0]  # every byte served was right
    assert 0 < peak[0] <= limit
    st = probe.stats()
    assert st["used_bytes"] <= limit
    assert st["shared_evictions"] > 0


def _slow_fetch(src, cache, limit):
    eng, _ = engine(src, cache, limit)
    eng.acquire_file(0)


def test_crash_mid_copy_is_never_served_and_is_refetched(tmp_path):
    size = 3 << 20
    src_dir = make_source(f"{tmp_path}/src", 1, size)
    share = f"test-{os.getpid()}-{time.monotonic_ns()}"
    src = f"slow://{src_dir}?bandwidth=2e6&share={share}"  # 1.5 s for the file
    cache = f"{tmp_path}/cache"
    try:
        root = engine(src_dir, cache, 1 << 30)[0].root  # same fingerprint: throttle is transparent
        p = FORK.Process(target=_slow_fetch, args=(src, cache, 1 << 30))
        p.start()
        time.sleep(0.7)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        left = os.listdir(os.path.join(root, "files"))
        assert len(left) == 1 and ".cairn-tmp-" in left[0]  # killed mid-copy, nothing published
        engine(src_dir, cache, 1 << 30)
        assert os.listdir(os.path.join(root, "files")) == []  # opening the cache cleaned it
        eng, keys = engine(src, cache, 1 << 30)
        path = eng.acquire_file(0)
        assert digest(path) == digest(os.path.join(src_dir, keys[0]))
        assert os.listdir(os.path.join(root, "files")) == [keys[0]]
        assert eng.stats()["shared_fetched_files"] == 1
    finally:
        if os.path.exists(f"/dev/shm/cairn-throttle-{share}"):
            os.unlink(f"/dev/shm/cairn-throttle-{share}")


def test_dead_copy_found_by_a_waiting_process_is_taken_over(tmp_path):
    size = 3 << 20
    src_dir = make_source(f"{tmp_path}/src", 1, size)
    share = f"test-{os.getpid()}-{time.monotonic_ns()}"
    src = f"slow://{src_dir}?bandwidth=4e6&share={share}"
    cache = f"{tmp_path}/cache"
    try:
        waiter, keys = engine(src, cache, 1 << 30, timeout=30.0)  # opened before the crash
        p = FORK.Process(target=_slow_fetch, args=(src, cache, 1 << 30))
        p.start()
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        path = waiter.acquire_file(0)
        assert digest(path) == digest(os.path.join(src_dir, keys[0]))
        assert not [f for f in os.listdir(os.path.dirname(path)) if "cairn-tmp" in f]
    finally:
        if os.path.exists(f"/dev/shm/cairn-throttle-{share}"):
            os.unlink(f"/dev/shm/cairn-throttle-{share}")


def _read_all_but_first(src, cache, limit, q):
    eng, keys = engine(src, cache, limit, threads=2, prefetch_files=2)
    order = np.arange(len(keys), dtype=np.int64)
    eng.set_plan(order, order, order[1:])
    for i in range(len(keys) - 1):
        eng.acquire(i)
        eng.release(eng.plan_file(i))
    q.put(eng.stats()["evictions"])


def test_eviction_never_removes_a_file_being_read(tmp_path):
    size, n = 10_000, 10
    src_dir = make_source(f"{tmp_path}/src", n, size)
    cache = f"{tmp_path}/cache"
    limit = 3 * size
    eng, keys = engine(src_dir, cache, limit)
    pinned = eng.acquire_file(0)  # held by this process, never released here
    want = digest(os.path.join(src_dir, keys[0]))
    q = FORK.Queue()
    p = FORK.Process(target=_read_all_but_first, args=(src_dir, cache, limit, q))
    p.start()
    while p.is_alive():
        assert os.path.exists(pinned)
        time.sleep(0.001)
    p.join()
    assert p.exitcode == 0
    assert q.get() > 0  # the other files were evicted around it
    assert digest(pinned) == want
    # Once released, it is an eviction candidate like any other.
    eng.release(0)
    p = FORK.Process(target=_read_all_but_first, args=(src_dir, cache, limit, q))
    p.start()
    p.join()
    assert not os.path.exists(pinned) or eng.stats()["used_bytes"] <= limit


def _acquire_first(src, cache, q):
    eng, _ = engine(src, cache, 1 << 30)
    q.put(digest(eng.acquire_file(0)))


def test_concurrent_requests_fetch_once(tmp_path):
    src_dir = make_source(f"{tmp_path}/src", 1, 1 << 20)
    src = f"slow://{src_dir}?latency=0.3"
    cache = f"{tmp_path}/cache"
    q = FORK.Queue()
    procs = [FORK.Process(target=_acquire_first, args=(src, cache, q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = {q.get() for _ in procs}
    assert got == {digest(os.path.join(src_dir, "f000"))}
    assert engine(src, cache, 1 << 30)[0].stats()["shared_fetched_files"] == 1


def test_stale_temp_files_are_removed_at_open(tmp_path):
    src_dir = make_source(f"{tmp_path}/src", 2, 100)
    cache = f"{tmp_path}/cache"
    root = engine(src_dir, cache, 1 << 20)[0].root
    stale = os.path.join(root, "files", "f000.cairn-tmp-999999-7")
    with open(stale, "wb") as f:
        f.write(b"half a file")
    engine(src_dir, cache, 1 << 20)
    assert not os.path.exists(stale)


def test_bad_source_options_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown option"):
        _ext.list_source(f"slow://{tmp_path}?speed=3")
    with pytest.raises(ValueError, match="non-negative"):
        _ext.list_source(f"slow://{tmp_path}?latency=-1")
    with pytest.raises(FileNotFoundError):
        _ext.list_source(f"{tmp_path}/does-not-exist")
