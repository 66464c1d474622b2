#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one call on a GPU machine (docs/testing.md): build the
# C++/CUDA extensions, the async memory stream in a real training step
# (tools/bench_memory_stream.py at the UltraMem-151M-x12 shape, with the fused value optimizer,
# profiled: device busy time and the host's waits;
# $STREAM_ARGS replaces its arguments), the GPU tests (tests/test_ops_gpu.py, the memory layers
# and the sparse optimizers on the device, the memory layers' host waits under torch's
# detector), activation recomputation on the device (tests/test_recompute.py: CUDA RNG states,
# the async stream's side stream under recomputed spans), a one-GPU torchrun (NCCL) training run
# saved and resumed, every architecture for a few bf16 steps, the dense model's megatron switches
# (bf16, distributed optimizer and full recomputation together on the tiny configs, saved and
# resumed; tools/bench_dense_switches.py at the UltraMem-151M-x12 shape, each switch on and off),
# and the lookup-reduce benchmark. Logs and JSON go to $OUT (default ./gpu_checks); python is
# $PYTHON (default python3). $CHECKS picks the checks by name (default: all of stream tests
# recompute torchrun architectures dense rank_memory host_table step_time lookup retrieval); host_table: value tables in
# host memory (memory.table_location: host) against the device table at the UltraMem-151M-x12
# shape (step time ratio, hidden share, link bytes and bandwidth; with a device cache of a quarter
# of the rows, memory.host_cache_rows, refreshed every 5 steps), a table 4x the device memory
# the run may use, and the host-table tests on the GPU; rank_memory: the whole-rank
# planner against torch.cuda.max_memory_allocated per phase for one-GPU layouts of the
# UltraMem-151M-x12 shape (tools/bench_rank_memory.py --device gpu); step_time: rmt-plan
# calibrate on the GPU, then the step-time model against measured one-GPU steps of the
# UltraMem-151M-x12 shape and its dense twin (tools/bench_step_time.py --gpu, goal within 15%),
# and the shipped H100 profile against docs/benchmarks.md's H100 steps; the extensions are built
# whenever any check runs, since the rest use them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a machine without a package index: the wheels carried in .whl (docs/testing.md), installed aside
if ! $PY -c 'import megatron.core, omegaconf' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/rmt-site .whl/*.whl || exit 2
    export PYTHONPATH=$PYTHONPATH:/tmp/rmt-site
fi
# the card's own architecture only: a quarter of the CUDA build's time
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}
CHECKS=${CHECKS:-stream tests recompute torchrun architectures dense rank_memory host_table step_time lookup retrieval}
wanted() { [[ " $CHECKS " == *" $1 "* ]]; }
step() { echo "== $(date +%T) $*"; }
step "environment"; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
step "build the extensions"; $PY -m rmt.ops.extensions 2>&1 | tee "$OUT/build.log"
if wanted stream; then
step "async memory stream in a training step"
$PY tools/bench_memory_stream.py ${STREAM_ARGS:---fused --variants dense,sync_fused,async_fused --steps 16 --warmup 6 --profile 1} --json "$OUT/bench_memory_stream.json" 2>&1 | tee "$OUT/bench_memory_stream.log"
fi
if wanted tests; then
step "GPU tests"
$PY -m pytest -q -p no:cacheprovider tests/test_ops_gpu.py tests/test_memory_integration.py \
    tests/test_ops_sparse_optim.py tests/test_host_syncs.py 2>&1 | tee "$OUT/test_ops_gpu.log"
fi
if wanted recompute; then
step "activation recomputation on the GPU"
$PY -m pytest -q -p no:cacheprovider tests/test_recompute.py 2>&1 | tee "$OUT/test_recompute.log"
fi
if wanted torchrun; then
step "one-GPU torchrun (NCCL): UltraMem on the async stream with the fused value optimizer, saved, then resumed"
CKPT=$(mktemp -d)
for steps in 20 30; do
    $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m rmt.training.cli \
        --config configs/ultramem_tiny.yaml train.steps=$steps train.save="$CKPT" \
        train.log_interval=10 train.eval_interval=10 memory.async_stream=true \
        memory.value_optimizer=sparse_adam memory.fused_value_optimizer=true 2>&1 | tee -a "$OUT/torchrun.log"
done
rm -rf "$CKPT"
fi
if wanted architectures; then
step "every architecture trains on the GPU in bf16 (a few steps each)"
for config in tiny rmt_tiny recurrent_tiny mixer_tiny moe_tiny pkm_tiny ultramem_tiny ultramem_v2_tiny; do
    echo "-- $config"
    $PY -m rmt.training.cli --config configs/$config.yaml train.steps=10 train.precision=bf16 \
        train.eval_interval=10 train.progress=false 2>&1 | tee -a "$OUT/architectures.log" | grep -E "final|rror"
done
echo "-- tiny with Llama's layer (grouped-query attention, SwiGLU, RoPE, RMSNorm)"
$PY -m rmt.training.cli --config configs/tiny.yaml train.steps=10 train.precision=bf16 train.eval_interval=10 \
    train.progress=false model.position=rope model.normalization=RMSNorm model.num_query_groups=2 \
    model.gated_linear_unit=true model.activation=silu model.add_bias_linear=false 2>&1 | tee -a "$OUT/architectures.log" | grep -E "final|rror"
fi
if wanted dense; then
step "dense switches together on the GPU: bf16, distributed optimizer, full recomputation; saved, then resumed"
for config in tiny rmt_tiny recurrent_tiny mixer_tiny ultramem_tiny ultramem_v2_tiny; do
    CKPT=$(mktemp -d)
    for steps in 10 20; do
        echo "-- $config to step $steps"
        $PY -m rmt.training.cli --config configs/$config.yaml train.steps=$steps train.save="$CKPT" \
            train.precision=bf16 train.distributed_optimizer=true train.recompute_granularity=full \
            train.recompute_method=uniform train.recompute_num_layers=1 train.eval_interval=10 \
            train.progress=false 2>&1 | tee -a "$OUT/dense.log" | grep -E "resumed|final|rror"
    done
    rm -rf "$CKPT"
done
step "dense switches at the UltraMem-151M-x12 shape: step time and max_memory_allocated"
$PY tools/bench_dense_switches.py ${DENSE_ARGS:---steps 8 --warmup 3} --json "$OUT/bench_dense_switches.json" 2>&1 | tee "$OUT/bench_dense_switches.log"
fi
if wanted rank_memory; then
step "whole-rank memory per phase against the planner (UltraMem-151M-x12, one GPU)"
$PY tools/bench_rank_memory.py --device gpu --config configs/ultramem_151m_x12.yaml \
    train.global_batch_size=null --only dp1 dp1_bf16_distopt dp1_recompute_full \
    --json "$OUT/bench_rank_memory.json" 2>&1 | tee "$OUT/bench_rank_memory.log"
fi
if wanted host_table; then
step "value tables in host memory against the device table (UltraMem-151M-x12)"
$PY tools/bench_memory_stream.py --host --variants dense,async_sparse,sync_host,async_host,async_host_cache \
    --steps 16 --warmup 6 memory.host_cache_refresh=5 \
    --json "$OUT/bench_host_table.json" 2>&1 | tee "$OUT/bench_host_table.log"
step "a host table 4x the device memory the run may use (12 GiB cap, 47 GB of table and moments)"
$PY tools/bench_memory_stream.py --device-mem-gib 12 --variants async_host --steps 12 --warmup 4 \
    memory.num_keys=1600 --json "$OUT/bench_host_table_large.json" 2>&1 | tee "$OUT/bench_host_table_large.log"
$PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_memory_host_table.py 2>&1 | tee "$OUT/test_memory_host_table.log"
fi
if wanted step_time; then
step "step-time model: calibrate the GPU, then measured one-GPU steps against the prediction"
$PY tools/bench_step_time.py --gpu --steps 10 --warmup 4 --calibrate once --json "$OUT/bench_step_time.json" 2>&1 | tee "$OUT/bench_step_time.log"
$PY -m pytest -q -p no:cacheprovider tests/test_planner_time.py -k h100 2>&1 | tee -a "$OUT/bench_step_time.log"
fi
if wanted lookup; then
step "lookup-reduce benchmark"
$PY tools/bench_lookup_reduce.py --quick --json "$OUT/bench_lookup_reduce.json" 2>&1 | tee "$OUT/bench_lookup_reduce.log"
fi
if wanted retrieval; then
step "fused retrieval on the GPU: CUDA and Triton against the unfused path"
$PY -m pytest -q -p no:cacheprovider tests/test_retrieval_gpu.py 2>&1 | tee "$OUT/test_retrieval_gpu.log"
for backend in cuda triton; do
    for dtype in fp32 bf16; do
        step "fused retrieval benchmark: $backend $dtype"
        $PY tools/bench_retrieval.py --device gpu --backend $backend --dtype $dtype ${RETRIEVAL_ARGS:---reps 3} \
            --json "$OUT/bench_retrieval_${backend}_${dtype}.json" 2>&1 | tee "$OUT/bench_retrieval_${backend}_${dtype}.log"
    done
done
fi
step "done"
