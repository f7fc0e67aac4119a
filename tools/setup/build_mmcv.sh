#!/usr/bin/env bash
# Build and install mmcv==2.1.0 with CPU ops into the given Python's environment.
#
# Why this script: torch >= 2.10 headers require C++20, but mmcv 2.1.0's setup.py hard-codes
# -std=c++14/17, so a plain `pip install mmcv==2.1.0` fails to compile. We fetch the sdist, raise the
# language standard to C++20 (nothing else changes) and build the wheel once; the wheel is cached in
# $MMCV_WHEEL_CACHE so later environments on the same machine install it in seconds.
set -euo pipefail
PY=${1:?usage: build_mmcv.sh PYTHON}
VERSION=2.1.0
CACHE=${MMCV_WHEEL_CACHE:-$HOME/.cache/mmseg-mesa/wheels}
TORCH=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
WHEEL_DIR="$CACHE/torch-$TORCH"
mkdir -p "$WHEEL_DIR"
if ! ls "$WHEEL_DIR"/mmcv-$VERSION-*.whl >/dev/null 2>&1; then
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  "$PY" -m pip download --no-deps --no-build-isolation --no-binary :all: "mmcv==$VERSION" -d "$WORK"
  tar -xzf "$WORK/mmcv-$VERSION.tar.gz" -C "$WORK"
  sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$WORK/mmcv-$VERSION/setup.py"
  echo "Building mmcv $VERSION with CPU ops (about 10-15 minutes on 2 cores, once per machine)..."
  MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} \
    "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEEL_DIR" "$WORK/mmcv-$VERSION"
fi
"$PY" -m pip install --no-deps "$WHEEL_DIR"/mmcv-$VERSION-*.whl
