#!/usr/bin/env bash
# Sets up everything cairn needs on a fresh Debian machine, idempotently:
# apt packages, a virtual environment in .venv with torch==2.13.0 (CPU), and a
# build of the C++ core, CLI, tests and Python extension in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

APT_PACKAGES=(g++ cmake ninja-build pkg-config libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev nlohmann-json3-dev libcli11-dev liburing-dev clang-format
  libcurl4-openssl-dev libssl-dev libpugixml-dev zlib1g-dev libdeflate-dev cloc)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing apt packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating virtual environment .venv"
  "$PY" -m venv .venv
fi
VPY=$ROOT/.venv/bin/python
if ! "$VPY" -c "import torch, nanobind, pytest, xdist, numpy, moto, boto3, crc32c, ray.train, s3fs, s3torchconnector, pytorch_lightning, transformers, accelerate, safetensors; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "== installing Python packages"
  "$VPY" -m pip install -q --upgrade pip
  # ray[train]: cairn.ray and its tests (Train V2 API, the default since Ray 2.5x).
  # crc32c: tests/s3/moto_md5.py checks x-amz-checksum-crc32c as S3 does.
  # pytest-xdist: scripts/test.sh runs the Python tests two at a time.
  "$VPY" -m pip install -q "torch==2.13.0" numpy pytest pytest-xdist "nanobind>=2.0" "scikit-build-core>=0.10" ninja \
    "moto[server]" boto3 crc32c "ray[train]>=2.60" \
    "s3fs>=2024.6" "s3torchconnector[dcp]" "pytorch-lightning>=2.5" "transformers>=4.56" "accelerate>=1.1.0" "safetensors>=0.4"
fi

echo "== building (build/)"
# -g1 (line tables: backtraces and profiles keep file:line) instead of -g, whose full
# variable info takes ~40% of this build's compile time; set CAIRN_CXX_DEBUG=-g for it.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 ${CAIRN_CXX_DEBUG:--g1} -DNDEBUG" \
  -DCAIRN_BUILD_TESTS=ON -DCAIRN_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$VPY" >/dev/null
cmake --build build -j"$(nproc)"

# Development install: the package is imported from python/ (the extension is
# built into python/cairn/), and the CLI is on the venv's PATH.
site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/python" > "$site/cairn-dev.pth"
ln -sf "$ROOT/build/cairn" "$ROOT/.venv/bin/cairn"
echo "== setup done"
