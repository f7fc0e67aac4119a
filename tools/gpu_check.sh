#!/usr/bin/env bash
# The GPU run in one command: tools/gpu_check.py (its docstring says what runs) and the
# gpu_check/ package beside it.
#
# On the lent GPU machine (the device tool's `run`, carry [".gpu-wheels"], timeout_s 600):
#     bash tools/gpu_check.sh                      # results under $OUT
# Here, on CPU (tests/test_gpu_check.py runs this):
#     bash tools/gpu_check.sh --dry-run --out DIR [--work DIR]
# PYTHON picks the interpreter: python3 on the GPU machine (the one with torch), .venv's here.
set -uo pipefail
cd "$(dirname "$0")/.."
case " $* " in
  *" --dry-run "*) PY=${PYTHON:-.venv/bin/python} ;;
  *) PY=${PYTHON:-python3} ;;
esac
export PYTHONUNBUFFERED=1
exec "$PY" tools/gpu_check.py --python "$PY" "$@"
