#!/usr/bin/env bash
# Several machines: run this on every node with the same MASTER_ADDR/MASTER_PORT.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash launch/torchrun_multi_node.sh --config X train.save=ckpt/x ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 NPROC=8 bash launch/torchrun_multi_node.sh --config X train.save=ckpt/x ...
# Variables: NNODES, NODE_RANK (0..NNODES-1), MASTER_ADDR (reachable address of node 0),
#            MASTER_PORT (default 29500), NPROC (processes per node, default: GPUs per node),
#            JOIN_TIMEOUT (seconds all nodes may take to join, default 600; when it expires the
#            message names the missing node ranks), MAX_RESTARTS (default 3), RDZV_ID (default
#            rmt: the same on every node), PY (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
NPROC=${NPROC:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m rmt.parallel.launcher --nnodes="$NNODES" --node-rank="$NODE_RANK" \
  --nproc-per-node="$NPROC" --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv-id="${RDZV_ID:-rmt}" --max-restarts="${MAX_RESTARTS:-3}" --join-timeout="${JOIN_TIMEOUT:-600}" \
  -m rmt.training.cli "$@"
