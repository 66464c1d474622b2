#!/usr/bin/env bash
# One machine, NPROC processes (GPUs, or CPU processes over gloo), restarted when one fails.
#   NPROC=4 bash launch/torchrun_single_node.sh --config configs/tiny.yaml train.save=ckpt/tiny parallel.tensor_model_parallel_size=2
# Variables: NPROC (default: number of GPUs, else 2), MAX_RESTARTS (default 3: failed workers are
#            restarted and continue from the newest complete checkpoint under train.save),
#            OMP_NUM_THREADS (default 1 per process), PY (default .venv/bin/python).
# The config is checked before any worker starts (a mistake: one sentence, exit status 2);
# SIGTERM/SIGUSR1 make the workers save at the next step boundary and exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
NPROC=${NPROC:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m rmt.parallel.launcher --standalone --nproc-per-node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-3}" -m rmt.training.cli "$@"
