#!/usr/bin/env bash
# DeepSpeed's launcher, for clusters without SLURM. It starts `rmt-train` once per slot with
# RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, which rmt reads as from torchrun.
#
# One node:
#   NPROC=8 bash launch/deepspeed.sh --config configs/tiny.yaml [overrides]
# Several nodes, started once on the first host: the hostfile lists "hostname slots=N" lines, and
# DeepSpeed reaches the other hosts over passwordless ssh with pdsh (DS_LAUNCHER=openmpi, mpich,
# impi or mvapich start them through that MPI instead); every host needs this checkout and its
# .venv at the same path. Variables every rank needs (NCCL_*, ...) go in .deepspeed_env as
# KEY=VALUE lines (NCCL_*, PYTHON* and a few others are forwarded anyway):
#   HOSTFILE=hostfile bash launch/deepspeed.sh --config X [overrides]
# Several nodes without ssh, started on every node like torchrun (NODE_RANK 0..nodes-1):
#   HOSTFILE=hostfile NODE_RANK=i MASTER_ADDR=node0 bash launch/deepspeed.sh --config X
#
# Variables: NPROC (processes per node; default: GPUs, else 2 on one node, else the hostfile's
# slots), HOSTFILE, DS_LAUNCHER (pdsh), NODE_RANK (no-ssh mode), MASTER_ADDR (default: the first
# host's `hostname -I`, asked over ssh), MASTER_PORT (29500), OMP_NUM_THREADS (1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
fail() { echo "launch/deepspeed.sh: $*" >&2; exit 2; }
args=(--master_port "${MASTER_PORT:-29500}" --module --no_local_rank)
[ -n "${MASTER_ADDR:-}" ] && args+=(--master_addr "$MASTER_ADDR")
if [ -n "${HOSTFILE:-}" ]; then
  [ -f "$HOSTFILE" ] || fail "HOSTFILE '$HOSTFILE' does not exist (lines of 'hostname slots=N')"
  args+=(--hostfile "$HOSTFILE" --launcher "${DS_LAUNCHER:-pdsh}" --venv_script "$PWD/.venv/bin/activate")
  if [ -n "${NODE_RANK:-}" ]; then
    [ -n "${MASTER_ADDR:-}" ] || fail "NODE_RANK (no-ssh mode) needs MASTER_ADDR, the address of the first host"
    args+=(--no_ssh --node_rank "$NODE_RANK")
  fi
  [ -n "${NPROC:-}" ] && args+=(--num_gpus "$NPROC")
else
  [ -z "${NODE_RANK:-}" ] || fail "NODE_RANK needs HOSTFILE (the hosts of every node)"
  # No hostfile: this machine alone. DeepSpeed would read /job/hostfile if present.
  args+=(--hostfile /dev/null)
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  args+=(--num_gpus "${NPROC:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m deepspeed.launcher.runner "${args[@]}" rmt.training.cli "$@"
