#!/usr/bin/env bash
# Build the wheels a bare CUDA machine lacks, for its Python (default 3.12, x86-64), into .whl/.
#
# The GPU machine we measure on has Python, NumPy, CuPy, PyTorch, pytest and matplotlib but no
# dask, distributed, bokeh or Chainer, and no network. This fetches pure-Python wheels of the
# versions pinned below (those our CI resolves) and builds Chainer 7.8.1's wheel from its sdist,
# so `scripts/gpu/remote.sh` can install them there with `pip --no-index`. About 17 MB.
# nvidia-cudnn-frontend (the `cudnn` module, 1.8 MB, no dependencies) is the `[cudnn]` extra:
# cuDNN itself (nvidia-cudnn-cu13) comes with the machine's PyTorch.
#
#   bash scripts/gpu/prepare.sh [python-version]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV="${1:-3.12}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p .whl
rm -f .whl/*.whl
# Everything the test suite imports at collection that the CUDA image does not ship.
PKGS=(dask==2026.8.0 distributed==2026.8.0 bokeh==3.9.2 tornado==6.6.1 zict==3.0.0 tblib==3.2.2
      partd==1.4.2 locket==1.0.0 pooch==1.9.0 platformdirs==4.14.7 xyzservices==2026.9.1
      nvidia-cudnn-frontend==1.14.1)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "${PKGS[@]}"
# Chainer 7.8.1 is an sdist only; its build imports pkg_resources (setuptools<81).
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl chainer==7.8.1
du -sh .whl
ls .whl
