#!/usr/bin/env bash
# Several machines: run this on every node with the same MASTER_ADDR/MASTER_PORT.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash launch/torchrun_multi_node.sh --config X ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 NPROC=8 bash launch/torchrun_multi_node.sh --config X ...
# Variables: NNODES, NODE_RANK (0..NNODES-1), MASTER_ADDR (reachable address of node 0),
#            MASTER_PORT (default 29500), NPROC (processes per node, default: GPUs per node).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
NPROC=${NPROC:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --nproc_per_node="$NPROC" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}" \
  -m rmt.training.cli "$@"
