"""`import cairn` (and cairn.data) never imports the optional frameworks: Lightning,
transformers, accelerate and safetensors load only with cairn.lightning, cairn.hf
and cairn.export."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_cairn_imports_no_framework():
    code = ("import sys, cairn, cairn.data, cairn.manager\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', "
            "'pytorch_lightning', 'lightning_fabric', 'transformers', 'accelerate', "
            "'safetensors'))\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
