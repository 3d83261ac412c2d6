"""cairn.hf.Trainer in a real Hugging Face Trainer run (tests/python/hf_fit.py: a
2-layer GPT-2 built locally, with dropout, on CPU): SIGKILL mid-epoch, resume with
resume_from_checkpoint=True, bit-identical final weights and the same sample order
as an uninterrupted run; save_total_limit is the retention; a corrupted step falls
back to the previous one with a warning; the export loads with from_pretrained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import cairn  # noqa: E402
from cairn.manager import memory_tier_name  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "hf_fit.py"
REPO = HERE.parents[1]


def _run(out_dir: Path, *extra, check=True):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.run([sys.executable, str(SCRIPT), "--out-dir", str(out_dir / "out"),
                        "--out", str(out_dir / "w.pt"), "--log", str(out_dir / "log"), *extra],
                       env=env, capture_output=True, text=True, timeout=300,
                       start_new_session=True)
    if check and p.returncode != 0:
        raise AssertionError(f"run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def _steps(log: Path) -> dict[int, str]:
    out = {}
    for line in log.read_text().splitlines():
        step, ids = line.split(" ", 1)
        out[int(step)] = ids
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("hf_ref")
    _run(run)
    return run


def test_sigkill_mid_epoch_resumes_bit_identical(reference, tmp_path):
    # 8 steps per epoch, a save every 3 steps, save_total_limit=2: killed at the
    # start of step 11 (epoch 1), resumed from checkpoint-9.
    p = _run(tmp_path, "--kill-at", "11", check=False)
    assert p.returncode != 0
    (tmp_path / "log").rename(tmp_path / "log.killed")
    _run(tmp_path)
    a, b = torch.load(reference / "w.pt"), torch.load(tmp_path / "w.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    want, first, resumed = (_steps(reference / "log"), _steps(tmp_path / "log.killed"),
                            _steps(tmp_path / "log"))
    assert max(first) == 10 and min(resumed) == 9
    assert {**first, **resumed} == want
    # save_total_limit=2: the Trainer keeps two checkpoint dirs, cairn their two steps
    out = tmp_path / "out"
    dirs = sorted(int(d.name.split("-")[1]) for d in out.glob("checkpoint-*"))
    steps = sorted(int(d.name.split("_")[1]) for d in (out / "cairn").glob("step_*"))
    assert dirs == steps == [15, 16], (dirs, steps)
    for s in steps:
        cairn.verify(str(out / "cairn" / f"step_{s:010d}"))
    assert not os.path.exists(os.path.join("/dev/shm", memory_tier_name(str(out / "cairn"))))


def test_corrupted_step_falls_back_with_a_warning(reference, tmp_path):
    import shutil

    sys.path.insert(0, str(HERE))
    import hf_fit
    import transformers

    out = tmp_path / "out"
    shutil.copytree(reference / "out", out)
    data_file = out / "cairn" / "step_0000000016" / "data" / "r0.bin"
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0x04
    data_file.write_bytes(bytes(raw))
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=16, report_to=[],
                                          use_cpu=True, save_steps=3, disable_tqdm=True,
                                          remove_unused_columns=False, logging_strategy="no")
    tr = hf_fit.CairnRun(model=hf_fit.tiny_gpt2(), args=args, train_dataset=hf_fit.Tokens(),
                         cairn_options={"memory": False})
    with pytest.warns(RuntimeWarning, match="step 16.*resuming from step 15"):
        folder = tr._cairn_resolve(True)
    assert folder.endswith("checkpoint-15")
    assert tr._cairn_loaded["trainer_state"] and '"global_step": 15' in tr._cairn_loaded["trainer_state"]
    tr.cairn_manager.close()


def test_export_loads_with_safetensors_and_from_pretrained(reference, tmp_path):
    import safetensors.torch
    import transformers

    import cairn.export

    sys.path.insert(0, str(HERE))
    import hf_fit

    ckpt = reference / "out" / "cairn" / "step_0000000016"
    out = tmp_path / "model"
    written = cairn.export.to_safetensors(str(ckpt), str(out), max_shard_size=20_000)
    assert (out / "model.safetensors.index.json").exists() and len(written) > 1
    model = hf_fit.tiny_gpt2()
    model.config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    final = torch.load(reference / "w.pt")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, final[k]), k
    one = tmp_path / "one"
    cairn.export.to_safetensors(str(ckpt), str(one))
    tensors = safetensors.torch.load_file(str(one / "model.safetensors"))
    assert all(torch.equal(tensors[k], final[k]) for k in tensors)
    # the CLI runs the same code
    cli = REPO / "build" / "cairn"
    if cli.exists():
        env = dict(os.environ, CAIRN_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.run([str(cli), "export", str(ckpt), "--safetensors", str(tmp_path / "cli")],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "cli" / "model.safetensors").exists()
