"""Every ```python block of README.md runs as written.

Each block is written to a script of its own and run by a fresh interpreter in an
empty temporary directory (the snippets use relative paths there), with a timeout.
A block that cannot run that way carries an annotation on the line before it,
``<!-- readme-test: KIND (why) -->``; KIND is one of:

* ``s3``: runs against the moto server of conftest.py, with the AWS_* environment
  a user would export and the bucket the snippet names created first;
* ``slow``: runs only with CAIRN_SLOW=1 (the skip says why, from the annotation);
* ``excerpt FILE``: lines quoted from FILE (an example that trains a model, run by its
  own tests): every line of the block must be a line of FILE, in order, so the README
  never shows code the example does not have.

Any other annotation fails the test: nothing is skipped silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KINDS = ("s3", "slow", "excerpt")
_ANNOTATION = re.compile(r"<!--\s*readme-test:\s*(\w+)\s*(?:\((.*)\)|(\S+))?\s*-->")


def _blocks() -> list[tuple[int, str, str | None, str]]:
    """(line, code, kind, why) of every ```python block of the README."""
    lines = README.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = _ANNOTATION.search(prev)
            kind, why = (m.group(1), m.group(2) or m.group(3) or "") if m else (None, "")
            out.append((start + 1, "\n".join(lines[start:j]) + "\n", kind, why))
            i = j
        i += 1
    return out


BLOCKS = _blocks()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT / "python"), os.environ.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


def _run(code: str, cwd: Path, env: dict[str, str], timeout: float = 180) -> None:
    script = cwd / "snippet.py"
    script.write_text(code)
    # Its own session, so that a snippet that hangs is killed with its workers.
    proc = subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the snippet ran past {timeout} s:\n{code}\n---\n{out}")
    assert proc.returncode == 0, f"the snippet exited {proc.returncode}:\n{code}\n---\n{out}"
    # Nothing of the snippet's stays in shared memory (its stager's directory, or
    # the memory tier of a manager rooted in cwd: close() frees both).
    left = [p.name for p in Path("/dev/shm").glob(f"cairn-stager-{proc.pid}-*")]
    from cairn.manager import memory_tier_name

    for root in ("ckpt", "checkpoints"):
        if Path("/dev/shm", memory_tier_name(str(cwd / root))).exists():
            left.append(memory_tier_name(str(cwd / root)))
    assert not left, f"the snippet left {left} in /dev/shm:\n{code}"


def test_readme_has_runnable_blocks_and_known_annotations():
    assert len(BLOCKS) >= 6, "README.md lost its python snippets"
    for line, _, kind, why in BLOCKS:
        assert kind is None or kind in KINDS, f"README.md:{line}: unknown readme-test {kind!r}"
        assert kind is None or why, f"README.md:{line}: a readme-test annotation says why"


def test_readme_data_loop_resumes_and_guards_its_workers():
    # An excerpt's loop is its framework's (Lightning restores the loader itself).
    data = [code for _, code, kind, _ in BLOCKS if "DataLoader(" in code and kind != "excerpt"]
    assert data, "README.md has no data-pipeline snippet"
    for code in data:
        assert "range(loader.epoch," in code, "a restored loader must not restart at epoch 0"
        assert 'if __name__ == "__main__":' in code, "workers need the __main__ guard"
    for _, code, _, _ in BLOCKS:
        assert not re.search(r"for epoch in range\(epochs\)", code), code


def test_readme_excerpts_are_the_examples_own_lines():
    excerpts = [b for b in BLOCKS if b[2] == "excerpt"]
    for line, code, _, source in excerpts:
        path = ROOT / source
        assert path.is_file(), f"README.md:{line}: excerpt of a missing file {source}"
        have = [x.rstrip() for x in path.read_text().splitlines()]
        at = 0
        for want in (x.rstrip() for x in code.splitlines() if x.strip()):
            assert want in have[at:], f"README.md:{line}: {want.strip()!r} is not in {source}"
            at = have.index(want, at) + 1


RUNNABLE = [b for b in BLOCKS if b[2] not in ("s3", "excerpt")]


@pytest.mark.parametrize("line,code,kind,why", RUNNABLE,
                         ids=[f"line{b[0]}" for b in RUNNABLE])
def test_readme_block_runs(line, code, kind, why, tmp_path):
    if kind == "slow" and os.environ.get("CAIRN_SLOW") != "1":
        pytest.skip(f"README.md:{line} runs with CAIRN_SLOW=1 only: {why}")
    _run(code, tmp_path, _env(), timeout=600 if kind == "slow" else 180)


@pytest.mark.parametrize("line,code,kind,why",
                         [b for b in BLOCKS if b[2] == "s3"],
                         ids=[f"line{b[0]}" for b in BLOCKS if b[2] == "s3"])
def test_readme_s3_block_runs_against_a_local_server(line, code, kind, why, tmp_path, moto):
    client = moto.boto3_client()
    for bucket in sorted(set(re.findall(r"s3://([a-z0-9.-]+)/", code))):
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    env = _env(moto.env())
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        env.pop(k, None)
    _run(code, tmp_path, env)
