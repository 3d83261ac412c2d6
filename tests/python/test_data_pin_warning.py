"""A stock torch DataLoader over a CachedFileDataset whose cache cannot hold its
workers' pins warns up front (docs/data.md), naming the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cairn.data import CachedFileDataset

ROOT = Path(__file__).resolve().parents[2]


def make_source(root: Path, n: int, size: int) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"f{i:03d}.bin").write_bytes(bytes([i % 251]) * size)
    return root


def test_small_cache_warns_before_the_first_file(tmp_path):
    src = make_source(tmp_path / "src", 8, 1000)
    ds = CachedFileDataset(str(src), cache_dir=str(tmp_path / "cache"), cache_limit=4000)
    with pytest.warns(RuntimeWarning, match="pin window is shrunk to 3"):
        it = iter(ds)
    assert len(list(it)) == 8


def test_roomy_cache_does_not_warn(tmp_path):
    src = make_source(tmp_path / "src", 8, 1000)
    ds = CachedFileDataset(str(src), cache_dir=str(tmp_path / "cache"), cache_limit=10 ** 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(ds)) == 8


SCRIPT = r"""
import sys, torch.utils.data as tud
from cairn.data import CachedFileDataset
ds = CachedFileDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
loader = tud.DataLoader(ds, batch_size=2, num_workers=2)
print(sum(len(b) for b in loader))
"""


def test_stock_dataloader_workers_warn_naming_the_workers(tmp_path):
    src = make_source(tmp_path / "src", 8, 1000)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "cache"), "6000"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "8"
    assert "2 concurrent reader(s)" in r.stderr and "stock torch DataLoader" in r.stderr
