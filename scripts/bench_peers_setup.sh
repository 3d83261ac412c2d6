#!/usr/bin/env bash
# Installs the peers bench/peers/ compares cairn with into a SEPARATE virtual
# environment, .venv-peers, that borrows torch and numpy from the project's venv.
#
# Why a separate venv: the peers pin and pull dependencies of their own (grpcio,
# kubernetes, pynvml, ...). Installing them into .venv would change the project's
# resolution; worse, a peer asking for another torch would replace the one the
# project is built and tested against. Here:
#   * .venv-peers is created from the same base interpreter as .venv;
#   * a .pth file in its site-packages appends .venv's site-packages to sys.path,
#     so `import torch` / `import numpy` resolve to .venv's copies (nothing is
#     copied, nothing in .venv is written);
#   * every pip call runs with a constraints file pinning torch and numpy to the
#     versions .venv has, so the resolver treats them as already satisfied and
#     fails rather than install another torch;
#   * a peer whose metadata would still drag in a different torch is installed
#     with --no-deps plus the dependencies it actually imports.
# Idempotent: rerunning re-checks the pins and leaves a complete env unchanged.
# Not part of scripts/test.sh (CI does not install the peers; the smoke test of
# bench/peers skips when .venv-peers is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT_PY=${PROJECT_PY:-$ROOT/.venv/bin/python}
PEERS=${PEERS_VENV:-$ROOT/.venv-peers}

[[ -x $PROJECT_PY ]] || { echo "no project venv at $PROJECT_PY (run scripts/setup.sh first)" >&2; exit 1; }
PROJECT_SITE=$("$PROJECT_PY" -c 'import os, sysconfig; print(os.path.realpath(sysconfig.get_paths()["purelib"]))')
BASE_PY=$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')
TORCH_V=$("$PROJECT_PY" -c 'import torch; print(torch.__version__.split("+")[0])')
NUMPY_V=$("$PROJECT_PY" -c 'import numpy; print(numpy.__version__)')

if [[ ! -x $PEERS/bin/python ]]; then
  "$BASE_PY" -m venv "$PEERS"
fi
PEERS_SITE=$("$PEERS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Appended after .venv-peers' own site-packages: a peer's own dependency wins over
# .venv's copy only if it was installed here, and the constraints keep torch/numpy out.
echo "$PROJECT_SITE" > "$PEERS_SITE/zz_cairn_project_venv.pth"

CONSTRAINTS=$PEERS/constraints.txt
cat > "$CONSTRAINTS" <<CONS
torch==$TORCH_V
numpy==$NUMPY_V
python-dateutil<3
xxhash<4
paramiko<4
CONS

pip_peers() {
  "$PEERS/bin/python" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@"
}

# Peers whose dependency metadata resolves against .venv's torch as is.
pip_peers \
  torchsnapshot==0.1.0 psutil aiofiles nest-asyncio importlib_metadata pyyaml \
  torchdata==0.11.0 matplotlib
# MosaicML Streaming 0.13.0 asks for numpy<2.2 (the project has a newer one) and for
# every cloud SDK it can read from; it runs on the project's numpy for local and
# local+remote-directory datasets, which is all bench/data.py uses. Installed without
# its dependencies, plus the ones its local path imports.
pip_peers --no-deps mosaicml-streaming==0.13.0
pip_peers xxhash zstd python-snappy brotli tqdm catalogue boto3 paramiko
# `import streaming` imports its vision datasets, hence torchvision; its metadata pins
# torch exactly, so the resolver picks the one matching the project's torch.
pip_peers torchvision
# DLRover: the package itself has few hard requirements; its flash checkpoint
# imports psutil and grpcio, and its local master imports kubernetes.
pip_peers dlrover==0.6.1 psutil grpcio protobuf "kubernetes<35"
# NVIDIA Resiliency Ext (its deps: nvidia-ml-py, pynvml, psutil, defusedxml, torch>=2.3)
# and torchft (opentelemetry, torch>=2.7; its wheel carries the lighthouse binary):
# their torch requirement is met by the project's torch under the constraints.
pip_peers nvidia-resiliency-ext==0.4.1
pip_peers torchft==0.2.0

"$PEERS/bin/python" - <<PY
import torch, numpy
assert torch.__version__.split("+")[0] == "$TORCH_V", torch.__version__
assert torch.__file__.startswith("$PROJECT_SITE"), torch.__file__
print("peers env: torch", torch.__version__, "from", torch.__file__)
PY
"$PROJECT_PY" -c 'import torch; print("project env: torch", torch.__version__)'
