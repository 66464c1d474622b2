#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one call on a GPU machine (docs/testing.md): build the
# C++/CUDA extensions, the async memory stream in a real training step
# (tools/bench_memory_stream.py at the UltraMem-151M-x12 shape, with the fused value optimizer),
# the GPU tests (tests/test_ops_gpu.py) and the lookup-reduce benchmark. Logs and JSON go to
# $OUT (default ./gpu_checks); python is $PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the card's own architecture only: a quarter of the CUDA build's time
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
step() { echo "== $(date +%T) $*"; }
step "environment"; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
step "build the extensions"; $PY -m rmt.ops.extensions 2>&1 | tee "$OUT/build.log"
step "async memory stream in a training step"
$PY tools/bench_memory_stream.py --fused --json "$OUT/bench_memory_stream.json" 2>&1 | tee "$OUT/bench_memory_stream.log"
step "GPU tests"; $PY -m pytest -q -p no:cacheprovider tests/test_ops_gpu.py 2>&1 | tee "$OUT/test_ops_gpu.log"
step "lookup-reduce benchmark"
$PY tools/bench_lookup_reduce.py --quick --json "$OUT/bench_lookup_reduce.json" 2>&1 | tee "$OUT/bench_lookup_reduce.log"
step "done"
