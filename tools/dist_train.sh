#!/usr/bin/env bash
# Multi-GPU training: torch.distributed.run launches tools/train.py once per GPU (--launcher pytorch).
#   tools/dist_train.sh CONFIG NUM_GPUS [train.py args...]
# Needs CUDA: mmengine's init_dist('pytorch') calls torch.cuda.set_device. On CPU, run tools/train.py.
set -euo pipefail
CONFIG=$1
GPUS=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
"$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --master_addr="$MASTER_ADDR" --nproc_per_node="$GPUS" --master_port="$PORT" \
  "$ROOT/tools/train.py" "$CONFIG" --launcher pytorch "${@:3}"
