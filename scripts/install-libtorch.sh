#!/usr/bin/env bash
# Installs libtorch 2.13.0 (CPU use) for tch 0.26 into .libtorch/ of the
# repository (or $REGENT_LIBTORCH_DIR), from PyPI: the torch wheel and the
# two small CUDA runtime wheels its CPU libraries load. About 540 MB to
# download, 1.2 GB on disk. tch finds it through LIBTORCH (set in
# .cargo/config.toml); binaries find its libraries through the rpath that
# the tensor crates' build scripts add.
#
# Idempotent: an install of the right version is kept.
#
# A GPU machine needs the full CUDA stack instead: run with
# REGENT_LIBTORCH_CUDA=1 (pip installs torch with its CUDA dependencies,
# about 2.7 GB) and build with LIBTORCH_USE_PYTORCH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2.13.0
dir=${REGENT_LIBTORCH_DIR:-$PWD/.libtorch}
stamp="$dir/.regent-libtorch-$version"
if [[ -f $stamp && -f $dir/torch/lib/libtorch_cpu.so ]]; then
  echo "libtorch $version already in $dir"
  exit 0
fi
rm -rf "$dir"
mkdir -p "$dir"
if [[ ${REGENT_LIBTORCH_CUDA:-0} == 1 ]]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$dir" "torch==$version"
else
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" \
    "torch==$version" nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
fi
# Only the libraries and headers are needed; the Python package's tests and
# caches are not.
touch "$stamp"
echo "libtorch $version installed in $dir ($(du -sh "$dir" | cut -f1))"
