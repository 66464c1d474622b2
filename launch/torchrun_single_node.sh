#!/usr/bin/env bash
# One machine, NPROC processes (GPUs, or CPU processes over gloo).
#   NPROC=4 bash launch/torchrun_single_node.sh --config configs/tiny.yaml parallel.tensor_model_parallel_size=2
# Variables: NPROC (default: number of GPUs, else 2), MASTER_PORT (default 29500),
#            OMP_NUM_THREADS (default 1 per process on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
NPROC=${NPROC:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
  --master_port="${MASTER_PORT:-29500}" -m rmt.training.cli "$@"
