#!/usr/bin/env python3
"""S3 checkpoint benchmark: cairn over s3:// vs DCP over fsspec/s3fs, s3torchconnector
and a raw boto3 floor, all against one local S3 server (moto) in the same run.

Run from the repository root::

    .venv/bin/python bench/s3.py                  # >= 1 GB state, 3 reps
    .venv/bin/python bench/s3.py --size-gb 0.1    # smoke run

What one run measures, side by side, on the same state and the same server
(tests/s3/moto_server.py: moto in server mode on 127.0.0.1, its own process
group, stopped at the end):

* floor: ``boto3``'s transfer manager (``upload_fileobj`` / ``download_fileobj``)
  moving one object of the state's size, as a multipart upload and parallel ranged
  downloads with cairn's part size and concurrency (``TransferConfig``:
  ``multipart_chunksize`` = ``CAIRN_S3_PART_SIZE``, ``max_concurrency`` =
  ``CAIRN_S3_CONCURRENCY``), from and into pre-faulted memory;
* cairn: ``dcp.save`` with ``cairn.Writer("s3://...")`` (returns committed) and
  ``dcp.load`` with ``cairn.Reader`` into preallocated tensors (checksums verified);
* dcp+fsspec: ``dcp.save`` / ``dcp.load`` with DCP's ``FsspecWriter`` /
  ``FsspecReader`` over s3fs (``thread_count`` = ``--peer-threads``, DCP's default 1;
  ``sync_files=False``: an S3 object is durable when its upload completes);
* s3torchconnector: its DCP ``S3StorageWriter`` / ``S3StorageReader`` (AWS CRT
  client, pointed at the local endpoint with path-style addressing).

Each figure is the median of ``--reps`` repetitions (repetitions are the outer loop,
so background load hits every peer alike); the first load of each peer is checked
bit-for-bit. Every checkpoint is deleted after it was loaded, so moto (which keeps
objects in memory) holds at most one at a time. The server is moto with two paths
fixed for large objects (tests/s3/moto_ranged.py: ranged GETs read only the range,
and values are stored without copies, so a 1 GB CompleteMultipartUpload costs its
checksum instead of ~6 GB of copying); it is the same server for every peer, so
the ratios stay fair, and absolute MB/s are reported too. Next to each time the
table shows the CPU seconds the server's process group and this process spent
on it (moto runs under one GIL: server CPU ~ wall time means moto was the
bottleneck). cairn / floor ratios are given twice: ratio of the medians, and
the median of the per-repetition ratios ("paired": the two run back to back, so
this cancels most of the load of a shared machine).

``--staged`` (on by default) adds the slow-mount figures of ``cairn.Writer(path,
staging_dir=...)`` against a directory throttled to ``--throttle-mbps`` (its
storage wrapped by a FaultInjector with a bandwidth cap): the time of a synchronous direct save,
and, for ``dcp.async_save`` with ``staging_dir``, the time it blocks and the time
until the checkpoint is published, against the time the bandwidth allows; once
with DCP's default stager (a fresh CPU copy per save) and once with
``async_stager=cairn.SharedMemoryStager()`` (slots reused across saves).

Results: a table and ratios on stdout, JSON in ``--json`` (default
bench/results/s3.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
# CAIRN_TREE: another checkout's python/ to time (e.g. before a change), default this one.
sys.path.insert(0, str(Path(os.environ.get("CAIRN_TREE", REPO)) / "python"))
sys.path.insert(0, str(REPO / "tests" / "s3"))
import cairn  # noqa: E402
from moto_server import MotoServer  # noqa: E402

_spec = importlib.util.spec_from_file_location("cairn_bench_checkpoint",
                                               REPO / "bench" / "checkpoint.py")
_ck = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _ck  # its dataclasses look themselves up there
_spec.loader.exec_module(_ck)
build_state, tensors, like, same = _ck.build_state, _ck.tensors, _ck.like, _ck.same

MB = 1e6
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class MemFile(io.RawIOBase):
    """A seekable file over a pre-faulted bytearray: boto3 reads from / writes into
    memory, as cairn does, with no disk in the way."""

    def __init__(self, buf: bytearray):
        super().__init__()
        self.view = memoryview(buf)
        self.pos = 0

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.view)}[whence]
        self.pos = base + off
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def write(self, b):
        n = len(b)
        self.view[self.pos:self.pos + n] = b
        self.pos += n
        return n


class Bench:
    def __init__(self, srv: MotoServer, state: dict, nbytes: int, part: int, conc: int,
                 peer_threads: int):
        self.srv = srv
        self.state = state
        self.nbytes = nbytes
        self.part = part
        self.conc = conc
        self.peer_threads = peer_threads
        self.client = srv.boto3_client()
        self.run = uuid.uuid4().hex[:8]
        self.n = 0
        self.cpu: dict = {}

    def mark(self) -> tuple[float, float, float]:
        """(wall, server CPU, this process's CPU) seconds, for cpu_since()."""
        return time.perf_counter(), self.srv.cpu_seconds(), time.process_time()

    def cpu_since(self, op: str, m: tuple[float, float, float]) -> float:
        """Records the server's and this process's CPU seconds since mark `m` for
        `op` ("save" / "load") of the current peer; returns the wall seconds."""
        wall, srv, me = self.mark()
        self.cpu[op] = {"server_cpu_s": srv - m[1], "client_cpu_s": me - m[2]}
        return wall - m[0]

    def prefix(self, name: str) -> str:
        self.n += 1
        return f"bench-{self.run}/{name}-{self.n}"

    def delete_prefix(self, prefix: str) -> None:
        keys = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.srv.bucket, Prefix=prefix)
        for page in pages:
            keys += [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.srv.bucket,
                                       Delete={"Objects": keys[i:i + 1000], "Quiet": True})

    # ---- peers: each returns (save seconds, load seconds, loaded ok) ----

    def boto3_floor(self, check: bool):
        from boto3.s3.transfer import TransferConfig
        cfg = TransferConfig(multipart_threshold=self.part, multipart_chunksize=self.part,
                             max_concurrency=self.conc, use_threads=True)
        if not hasattr(self, "_src"):
            self._src = bytearray(os.urandom(1 << 20)) * (self.nbytes >> 20)
            self._src += bytearray(self.nbytes - len(self._src))
            self._dst = bytearray(len(self._src))  # zero-filled: pre-faulted
        prefix = self.prefix("boto3")
        key = prefix + "/blob"
        m = self.mark()
        self.client.upload_fileobj(MemFile(self._src), self.srv.bucket, key, Config=cfg)
        save = self.cpu_since("save", m)
        m = self.mark()
        self.client.download_fileobj(self.srv.bucket, key, MemFile(self._dst), Config=cfg)
        load = self.cpu_since("load", m)
        ok = (self._dst == self._src) if check else None
        self.delete_prefix(prefix)
        return save, load, ok

    def _dcp_roundtrip(self, name, writer_fn, reader_fn, check):
        prefix = self.prefix(name)
        uri = f"s3://{self.srv.bucket}/{prefix}"
        dest = like(self.state)
        m = self.mark()
        dcp.save(self.state, storage_writer=writer_fn(uri))
        save = self.cpu_since("save", m)
        m = self.mark()
        dcp.load(dest, storage_reader=reader_fn(uri))
        load = self.cpu_since("load", m)
        ok = same(dest, self.state) if check else None
        del dest
        self.delete_prefix(prefix)
        return save, load, ok

    def cairn(self, check: bool):
        return self._dcp_roundtrip("cairn", cairn.Writer, cairn.Reader, check)

    def fsspec(self, check: bool):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        opts = {"endpoint_url": self.srv.endpoint, "key": self.srv.key_id,
                "secret": self.srv.secret}
        return self._dcp_roundtrip(
            "fsspec",
            lambda uri: FsspecWriter(uri, sync_files=False, thread_count=self.peer_threads,
                                     **opts),
            lambda uri: FsspecReader(uri, **opts), check)

    def s3torchconnector(self, check: bool):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter
        region = os.environ["AWS_REGION"]
        cfg = S3ClientConfig(force_path_style=True, part_size=self.part)

        def client():
            return S3Client(region, endpoint=self.srv.endpoint, s3client_config=cfg)

        # Its DCP classes build their client without an endpoint: swap in one
        # that points at the local server.
        def writer(uri):
            w = S3StorageWriter(region, uri, s3client_config=cfg, thread_count=self.peer_threads)
            w.fs = S3FileSystem(region, s3_client=client())
            return w

        def reader(uri):
            r = S3StorageReader(region, uri, s3client_config=cfg)
            r.fs = S3FileSystem(region, s3_client=client(),
                                reader_constructor=r._reader_constructor)
            return r

        return self._dcp_roundtrip("s3torchconnector", writer, reader, check)


PEERS = {
    "boto3 (floor)": Bench.boto3_floor,
    "cairn": Bench.cairn,
    "dcp+fsspec": Bench.fsspec,
    "s3torchconnector": Bench.s3torchconnector,
}


def med(xs):
    return statistics.median(xs)


def staged_figures(args, scratch: Path) -> dict:
    """Slow-mount figures: a directory throttled to --throttle-mbps."""
    bw = args.throttle_mbps * MB
    g = torch.Generator().manual_seed(1)
    n = int(args.staged_mb * MB) // 4
    state = {f"t{i}": torch.randn(n // 8, generator=g) for i in range(8)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    target = scratch / "slow-target"
    target.mkdir()
    staging = scratch / "staging"
    inj = cairn._ext.FaultInjector()  # the target, seen through a pipe of `bw`
    inj.set_bandwidth(int(bw))

    def slow(name):
        return inj.wrap(cairn._ext.open_storage(str(target / name)))
    direct, stall, published, sm_stall, sm_published = [], [], [], [], []
    stager = cairn.SharedMemoryStager()

    def staged_save(name, rep, stalls, publishes, **kw):
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=cairn.Writer(slow(f"{name}-{rep}"),
                                                                staging_dir=staging), **kw)
        stalls.append(time.perf_counter() - t0)
        fut.result()
        publishes.append(time.perf_counter() - t0)
        assert cairn.latest_valid(str(target)) is not None
        if rep == 0:
            dest = like(state)
            dcp.load(dest, storage_reader=cairn.Reader(str(target / f"{name}-{rep}")))
            assert same(dest, state), "staged checkpoint differs from the state"
        leftovers = [p for p in staging.rglob("*") if p.is_file()] if staging.exists() else []
        assert not leftovers, f"staged files left behind: {leftovers[:3]}"
        shutil.rmtree(target / f"{name}-{rep}")

    try:
        for rep in range(args.reps):
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=cairn.Writer(slow(f"direct-{rep}")))
            direct.append(time.perf_counter() - t0)
            shutil.rmtree(target / f"direct-{rep}")
            # DCP's default stager (a fresh CPU copy per save), then cairn's
            # (slots reused across saves: no allocation after the first).
            staged_save("staged", rep, stall, published)
            staged_save("staged-shm", rep, sm_stall, sm_published, async_stager=stager)
    finally:
        stager.close()
    bound = nbytes / bw
    return {
        "bytes": nbytes, "throttle_MBps": args.throttle_mbps, "bandwidth_bound_s": bound,
        "direct_sync_save_s": {"median_s": med(direct), "seconds": direct},
        "staged_async_stall_s": {"median_s": med(stall), "seconds": stall},
        "staged_async_published_s": {"median_s": med(published), "seconds": published},
        "staged_async_shm_stager_stall_s": {"median_s": med(sm_stall), "seconds": sm_stall},
        "staged_async_shm_stager_published_s": {"median_s": med(sm_published),
                                                "seconds": sm_published},
    }


def ratios(peers: dict, staged: dict | None) -> dict:
    out = {}

    def put(name, value, target, met):
        out[name] = {"value": value, "target": target, "met": met}

    c, f = peers.get("cairn"), peers.get("boto3 (floor)")
    if c and f:
        for op in ("save", "load"):
            v = f[op]["median_s"] / c[op]["median_s"]
            put(f"cairn_{op}_throughput / boto3_floor", v, ">= 0.9", v >= 0.9)
            # The two run back to back in each repetition: the median of the
            # per-repetition ratios cancels most of the background load.
            v = med(a / b for a, b in zip(f[op]["seconds"], c[op]["seconds"]))
            put(f"cairn_{op}_throughput / boto3_floor, paired", v, ">= 0.9", v >= 0.9)
    for peer, tag in (("dcp+fsspec", "fsspec_dcp"), ("s3torchconnector", "s3torchconnector")):
        p = peers.get(peer)
        if c and p:
            target = "<= 0.5" if peer == "dcp+fsspec" else "(info)"
            for op in ("save", "load"):
                v = c[op]["median_s"] / p[op]["median_s"]
                put(f"cairn_{op}_time / {tag}_{op}_time", v, target,
                    v <= 0.5 if peer == "dcp+fsspec" else None)
    if staged:
        v = staged["staged_async_stall_s"]["median_s"] / staged["direct_sync_save_s"]["median_s"]
        put("staged_async_stall / direct_sync_save", v, "<= 0.2", v <= 0.2)
        v = staged["staged_async_published_s"]["median_s"] / staged["bandwidth_bound_s"]
        put("staged_async_published / bandwidth_bound", v, "<= 1.1", v <= 1.1)
        v = (staged["staged_async_published_s"]["median_s"]
             - staged["staged_async_stall_s"]["median_s"]) / staged["bandwidth_bound_s"]
        put("staged_async (published - stall) / bandwidth_bound", v, "(info)", None)
        d = staged["direct_sync_save_s"]["median_s"]
        v = staged["staged_async_shm_stager_stall_s"]["median_s"] / d
        put("staged_async+SharedMemoryStager stall / direct_sync_save", v, "<= 0.2", v <= 0.2)
        v = staged["staged_async_shm_stager_published_s"]["median_s"] / staged["bandwidth_bound_s"]
        put("staged_async+SharedMemoryStager published / bandwidth_bound", v, "<= 1.1",
            v <= 1.1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="state size (default 1.0)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated, from {list(PEERS)}")
    ap.add_argument("--peer-threads", type=int, default=1,
                    help="thread_count of the DCP peers' writers (DCP's default: 1)")
    ap.add_argument("--staged-mb", type=float, default=200,
                    help="state size of the slow-mount figures (default 200 MB)")
    ap.add_argument("--throttle-mbps", type=float, default=50)
    ap.add_argument("--no-staged", dest="staged", action="store_false")
    ap.add_argument("--stock-moto", action="store_true",
                    help="stock moto, which reads the whole object for each ranged GET and "
                    "copies a multipart object ~6 times on complete (fails at 1 GB here; "
                    "default: tests/s3/moto_ranged.py)")
    ap.add_argument("--dir", default=str(REPO / "bench" / "results"),
                    help="parent of the scratch directory (staging dir, throttled target)")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "s3.json"))
    args = ap.parse_args(argv)
    names = [p for p in args.peers.split(",") if p]
    unknown = set(names) - set(PEERS)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {list(PEERS)}")

    part = int(float(os.environ.get("CAIRN_S3_PART_SIZE", 8 << 20)))
    conc = int(float(os.environ.get("CAIRN_S3_CONCURRENCY", 16)))
    state = build_state(args.size_gb) if names else {}
    ts = tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "loadavg_before": os.getloadavg(), "state_bytes": nbytes, "state_tensors": len(ts),
        "reps": args.reps, "part_size": part, "concurrency": conc,
        "peer_threads": args.peer_threads,
        "server": ("moto (stock)" if args.stock_moto else
                   "moto, ranged GETs read only the range, values stored without copies "
                   "(tests/s3/moto_ranged.py)")
        + ", 127.0.0.1, SigV4 not checked",
    }
    print(f"state {nbytes / 1e9:.2f} GB in {len(ts)} tensors; part {part >> 20} MiB, "
          f"concurrency {conc}; {args.reps} reps")
    parent = Path(args.dir)
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cairn-s3bench-", dir=parent))
    samples = {n: {"save": [], "load": [], "ok": None, "cpu": {"save": [], "load": []}}
               for n in names}
    staged = None
    try:
        with MotoServer(ranged_gets=not args.stock_moto) as srv:
            os.environ.update(srv.env())
            os.environ.pop("AWS_ENDPOINT_URL_S3", None)
            bench = Bench(srv, state, nbytes, part, conc, args.peer_threads)
            for rep in range(args.reps):
                for n in names:
                    s, ld, ok = PEERS[n](bench, check=rep == 0)
                    samples[n]["save"].append(s)
                    samples[n]["load"].append(ld)
                    for op in ("save", "load"):
                        samples[n]["cpu"][op].append(bench.cpu[op])
                    if rep == 0:
                        samples[n]["ok"] = ok
                        if ok is False:
                            raise SystemExit(f"{n}: loaded data differs from the state")
                    c = bench.cpu
                    print(f"  rep {rep + 1} {n:<18} save {s:7.2f} s  load {ld:7.2f} s   "
                          f"server CPU {c['save']['server_cpu_s']:6.2f} / "
                          f"{c['load']['server_cpu_s']:6.2f} s  client CPU "
                          f"{c['save']['client_cpu_s']:6.2f} / {c['load']['client_cpu_s']:6.2f} s",
                          flush=True)
        if args.staged:
            staged = staged_figures(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    peers = {}
    for n, smp in samples.items():
        peers[n] = {}
        for op in ("save", "load"):
            m = med(smp[op])
            srv_cpu = med(c["server_cpu_s"] for c in smp["cpu"][op])
            peers[n][op] = {"median_s": m, "seconds": smp[op], "MBps": nbytes / m / MB,
                            "server_cpu_s": srv_cpu,
                            "client_cpu_s": med(c["client_cpu_s"] for c in smp["cpu"][op]),
                            "server_busy": srv_cpu / m}
        peers[n]["checked"] = smp["ok"]
    rat = ratios(peers, staged)
    meta["loadavg_after"] = os.getloadavg()

    print()
    print(f"{'peer':<20}{'save s':>9}{'MB/s':>8}{'load s':>9}{'MB/s':>8}"
          f"{'server CPU s (save/load)':>27}{'client CPU s':>16}")
    for n, p in peers.items():
        print(f"{n:<20}{p['save']['median_s']:>9.2f}{p['save']['MBps']:>8.0f}"
              f"{p['load']['median_s']:>9.2f}{p['load']['MBps']:>8.0f}"
              f"{p['save']['server_cpu_s']:>16.2f} /{p['load']['server_cpu_s']:>7.2f}"
              f"{p['save']['client_cpu_s']:>9.2f} /{p['load']['client_cpu_s']:>5.2f}")
    if staged:
        print()
        print(f"slow mount: {staged['bytes'] / MB:.0f} MB to a {args.throttle_mbps:g} MB/s "
              f"directory (bandwidth bound {staged['bandwidth_bound_s']:.2f} s)")
        print(f"  direct sync save          {staged['direct_sync_save_s']['median_s']:7.2f} s")
        print(f"  staged async_save blocks  {staged['staged_async_stall_s']['median_s']:7.3f} s")
        print(f"  staged async_save publish {staged['staged_async_published_s']['median_s']:7.2f} s")
        print(f"  same, async_stager=cairn.SharedMemoryStager(): blocks "
              f"{staged['staged_async_shm_stager_stall_s']['median_s']:.3f} s, publish "
              f"{staged['staged_async_shm_stager_published_s']['median_s']:.2f} s")
    print()
    for name, r in rat.items():
        met = "" if r["met"] is None else ("  met" if r["met"] else "  NOT met")
        print(f"{name:<48}{r['value']:>7.2f}   target {r['target']}{met}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "peers": peers, "staged": staged, "ratios": rat},
                              indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
