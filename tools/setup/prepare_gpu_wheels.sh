#!/usr/bin/env bash
# Fill .gpu-wheels/ with what the GPU machine lacks for tools/gpu_check.sh, here, once.
#
# That machine has Python 3.12, torch 2.11.0+cu130, numpy, opencv-python-headless, matplotlib,
# scipy, pyyaml, rich, regex, packaging, pillow and pytest, but
# no network and no mmcv, mmengine or mmseg. It gets, as files carried with the working tree
# (`carry: [".gpu-wheels"]`, 64 MiB per call in all):
#   - pure-Python wheels: mmengine, mmsegmentation and the imports they need that the image lacks
#     (addict, yapf, platformdirs, termcolor, ftfy, wcwidth, prettytable);
#   - setuptools < 81 (mmcv 2.1.0's setup.py imports pkg_resources, gone from setuptools 81);
#   - mmcv 2.1.0's sdist, built there with CPU ops (tools/gpu_check.py; Mesa needs no mmcv op);
#   - optionally a prebuilt mmcv wheel: MMCV_PY=/path/to/python3.12 with torch 2.11.0 (the
#     device's exact build, from PyPI) builds it here through tools/setup/build_mmcv.sh, and the
#     device run then skips its build (it still checks that the wheel loads there).
# The folder is ignored (.git/info/exclude and .gitignore). Usage:
#     bash tools/setup/prepare_gpu_wheels.sh            # or: make gpu-wheels
#     MMCV_PY=/tmp/py312/bin/python bash tools/setup/prepare_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${GPU_WHEELS:-.gpu-wheels}
PIP=${PIP:-.venv/bin/python -m pip}
LIMIT_MIB=50
PURE=(mmengine==0.10.7 mmsegmentation==1.2.2 addict==2.4.0 yapf==0.43.0 platformdirs==4.3.8
      termcolor==3.3.0 ftfy==6.3.1 wcwidth==0.2.13 prettytable==3.16.0 setuptools==80.9.0)

mkdir -p "$DEST"
# Wheels for CPython 3.12 on x86-64 Linux, whatever Python runs this.
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DEST" "${PURE[@]}"
# The sdist's metadata step imports setuptools and torch: use an environment that has both.
if ! ls "$DEST"/mmcv-2.1.0.tar.gz >/dev/null 2>&1; then
  $PIP download --quiet --no-deps --no-build-isolation --no-binary=:all: -d "$DEST" mmcv==2.1.0
fi
if [[ -n "${MMCV_PY:-}" ]]; then
  TORCH=$("$MMCV_PY" -c 'import torch; print(torch.__version__)')
  [[ "$TORCH" == 2.11.0+cu130 ]] || echo "warning: $MMCV_PY has torch $TORCH, the device 2.11.0+cu130"
  CACHE=$(mktemp -d)
  MMCV_WHEEL_CACHE="$CACHE" bash tools/setup/build_mmcv.sh "$MMCV_PY"
  cp "$CACHE"/torch-*/mmcv-2.1.0-*.whl "$DEST"/
  rm -rf "$CACHE"
fi
# One version of each: two of the same name make the device's `pip install *.whl` fail.
dupes=$(ls "$DEST" | sed -n 's/^\([A-Za-z0-9_]*\)-[0-9].*\.whl$/\1/p' | sort | uniq -d)
[[ -z "$dupes" ]] || { echo "error: several versions of: $dupes in $DEST" >&2; exit 1; }
size=$(du -sm "$DEST" | cut -f1)
ls -l "$DEST"
echo "$DEST: ${size} MiB (limit ${LIMIT_MIB} MiB of the 64 MiB a call carries)"
[[ "$size" -le "$LIMIT_MIB" ]] || { echo "error: $DEST is over ${LIMIT_MIB} MiB" >&2; exit 1; }
