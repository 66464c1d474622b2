"""How long a training step takes: ``rmt-plan time``, the layout search's ranking and the
trainer's predicted step.

The work of every kernel a rank runs (:mod:`rmt.planner.step_work`) is priced with a hardware
profile (:mod:`rmt.planner.hardware`: GEMM efficiency by size, fused attention, memory bandwidth,
the lookup-reduce kernel's rates, the host's issue cost per operation, each collective's alpha and
bus bandwidth inside and across nodes), then composed as megatron-core's schedule runs it:

**One micro-batch on a stage** (each distinct pipeline stage; its model chunks in turn): the
dense layers' forward and backward, recomputation (``full``: the recomputed layers' forward again
in the backward; ``selective``: the core attention's), the embedding or the output layer and the
loss, the tensor-parallel collectives (:mod:`rmt.planner.step_collectives`: those megatron-core
and rmt issue per layer, the embedding's, the output layer's and the loss's, the recomputed
layers' again; the backward's asynchronous ones hidden on a GPU behind the GEMMs megatron runs
while they are in flight), and the memory layers (:func:`memory_layer_time`).

**Memory layers**: their kernels (scoring, top-m, lookup-reduce forward and backward, the fused
row-wise optimizer) run on the rank's device in series with the dense layers (on one device they
share its cores: ``docs/notes/memory-stream-gpu.md`` measured the async stream hiding 5-10% of
their time on one GPU). Their tables' collectives (:func:`rmt.memory.comm_volume.comm_volume`, the
bytes ``rmt-plan comm`` counts, each collective at its kind's alpha-beta over the
memory-parallel group) and, for tables in host memory, their host-link transfers
(:func:`rmt.planner.host.layer_link_bytes`) are waits, not work: with ``memory.async_stream`` a
layer placed ``i:j`` hides them behind the forward of the dense layers ``i+1..j`` (their backward
for the backward's; UltraMemV2's behind its block's FFN), and what exceeds that window is
exposed; without the stream all of it is. An MoE layer's token all-to-alls over its
expert-parallel group (dispatch and combine, forward and backward) are in series with it.

**The pipeline** (megatron-core's 1F1B, interleaved with ``VPP`` model chunks): ``m`` micro-batches
take ``m t_max + (sum_s t_s - t_max) / VPP`` for stage times ``t_s`` per micro-batch (the bubble
``(PP - 1) / m`` of the ideal for equal stages, divided by ``VPP`` when interleaved), plus the
activation and gradient sends ``2 (m VPP + PP - 1)`` times (each on the critical path: megatron
waits for its batched send/receive).

**Data parallelism**: the fp32 gradient all-reduce (or with the distributed optimizer a
reduce-scatter) of the stage's dense parameters in megatron's buckets (``max(40 M, 1 M x DP)``
elements under ``train.overlap_grad_reduce``), overlapped with the last micro-batch's backward
(megatron reduces during the last one only), of which the part beyond it, and at least the last
bucket, is exposed; the distributed optimizer's parameter all-gather, exposed unless
``train.overlap_param_gather`` hides it behind the first micro-batch's forward (at least its
first bucket stays). Local value tables with a dense gradient are reduced with them.

**The optimizer step**: memory-bound (:func:`rmt.planner.step_work.dense_optimizer_work`, the
tables' optimizers), the host tables' step on the host beside it, and the step's small sums (the
reported losses, the gradient norm, the sequence-parallel parameters' gradients: each a
collective's latency).

**Totals**: step seconds on the busiest stage, tokens per second, model FLOPs per GPU (three
times ``rmt-plan model``'s forward FLOPs per token over the step's tokens and GPUs, recomputation
not counted) per second and MFU (over the profile's peak of ``train.precision``), and hardware
FLOPs per GPU (recomputation counted).
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Dict

from rmt.config import TABLE_TYPES
from rmt.memory import comm_volume
from rmt.memory.byte_sizes import DTYPE_BYTES, lookup_bytes
from rmt.planner import host
from rmt.planner.hardware import Profile, collective_seconds, sent_seconds
from rmt.planner.rank import (
    Layout,
    chunks_of,
    distinct_stages,
    layout_of,
    stage_params,
    stage_table_plan,
)
from rmt.planner.step_collectives import (
    edge_collectives,
    exposed_seconds,
    layer_collectives,
    memory_layer_collectives,
    step_sums,
)
from rmt.planner.step_work import (
    FORWARD_SHARE,
    GRAD_ACCUMULATE_BYTES,
    STEP_OPS,
    Kernels,
    core_attention,
    dense_optimizer_work,
    embedding_work,
    layer_forward,
    layer_ops,
    layer_param_elements,
    layer_tokens,
    memory_layer_work,
    microbatch_ops,
    table_optimizer_work,
)

WORK_KINDS = ("gemm", "attention", "memory", "issue")
"""The parts of the dense layers' time (:meth:`rmt.planner.step_work.Kernels.seconds`) a stage
reports in ``work``: device seconds of GEMMs, fused attention and memory-bound operations, and the
host's seconds issuing their operations (on a GPU each phase takes the longer of its device time
and its issue, so a stage whose issue exceeds its device time is host-bound)."""

BUCKET_ELEMENTS = 40_000_000
"""megatron-core's default gradient bucket: ``max(40 M, 1 M x DP)`` elements."""


def _width(config) -> int:
    m = config.model
    return m.dk * m.dv if m.arch == "rmt" else m.hidden_size


def tensor_parallel_seconds(
    config, layout: Layout, profile: Profile, layers: int, first: bool, last: bool, recomputed: int
) -> Dict[str, float]:
    """Exposed seconds of the tensor-parallel collectives of a chunk of ``layers`` layers on one
    micro-batch, forward and backward (:mod:`rmt.planner.step_collectives`): with ``first`` the
    embedding's, with ``last`` the output layer's and the loss's, and the forward's of
    ``recomputed`` layers again in the backward."""
    tp, sp, dtype = layout.tp, layout.sequence_parallel, config.train.precision
    layer = layer_collectives(config, tp, sp, layer_tokens(config))
    edge = edge_collectives(config, tp, sp, first, last)
    return {
        "forward": layers * exposed_seconds(profile, layer["forward"], dtype)
        + exposed_seconds(profile, edge["forward"], dtype),
        "backward": layers * exposed_seconds(profile, layer["backward"], dtype)
        + recomputed * exposed_seconds(profile, layer["forward"], dtype)
        + exposed_seconds(profile, edge["backward"], dtype),
    }


def _memory_comm(config, layout: Layout, profile: Profile, plan) -> Dict[str, float]:
    """Seconds of one memory layer's table collectives per micro-batch, forward and backward."""
    mem = config.memory
    if mem.type not in TABLE_TYPES or mem.partition == "local" or plan is None or plan.group_size <= 1:
        return {"forward": 0.0, "backward": 0.0}
    vol = comm_volume.comm_volume(
        plan.partition,
        plan.tokens,
        plan.topm,
        plan.dim,
        plan.group_size,
        ive=plan.ive_blocks if mem.type == "ultramem" else 1,
        cores=plan.cores,
        value_bytes=DTYPE_BYTES[mem.value_dtype],
        activation_bytes=lookup_bytes(config.train.precision, mem.value_dtype),
        tensor_parallel=plan.tensor_parallel,
    )
    out = {}
    for phase in ("forward", "backward"):
        seconds = 0.0
        for name, sent in vol[phase].items():
            ranks = plan.tensor_parallel if name.startswith("tp_") else plan.group_size
            kind = next(k for k in ("all_to_all", "all_gather", "reduce_scatter") if k in name)
            seconds += sent_seconds(profile, kind, sent, ranks)
            if kind == "all_to_all" and plan.partition == "number":  # ragged: split sizes first
                seconds += sent_seconds(profile, "all_to_all", 8 * ranks, ranks)
        out[phase] = seconds
    return out


def _expert_all_to_all(config, layout: Layout, profile: Profile) -> float:
    """Seconds of an MoE layer's token all-to-alls over the expert-parallel group per micro-batch:
    each of the ``T k`` routed copies sent to its expert's rank and back, forward and backward
    (megatron's all-to-all dispatcher; in series with the layer)."""
    mem = config.memory
    if mem.type != "moe" or layout.ep <= 1:
        return 0.0
    from rmt.memory.shapes import memory_width

    T = config.train.micro_batch_size * config.model.seq_length
    sent = T * mem.moe_topk * memory_width(config) * DTYPE_BYTES[config.train.precision] * (layout.ep - 1) / layout.ep
    return 4 * sent_seconds(profile, "all_to_all", sent, layout.ep, layout.tp)


def _host_link(plan, profile: Profile) -> Dict[str, float]:
    """Seconds of one host table lookup's transfers over the host link, forward and backward."""
    if plan is None or plan.location != "host":
        return {"forward": 0.0, "backward": 0.0}
    per = host.layer_link_bytes(plan)
    return {p: sum(per[p].values()) / profile.host_link for p in ("forward", "backward")}


def memory_layer_time(
    config, layout: Layout, profile: Profile, index: int, placement, plan, layer_fwd_s: float, layer_bwd_s: float
) -> Dict[str, float]:
    """One memory layer's seconds per micro-batch on a rank: its kernels (forward, backward with
    the fused optimizer), its collectives and host transfers, and what of those the async
    stream's window (the dense layers it runs beside) leaves exposed (module docstring)."""
    mem = config.memory
    T = config.train.micro_batch_size * config.model.seq_length
    sharded = plan is not None and mem.partition != "local"
    tokens = -(-T // layout.tp) if sharded and layout.tp > 1 else T
    fwd, bwd = memory_layer_work(config, index, tokens)
    inside = Kernels("fp32")
    if plan is not None:
        inside, _ = table_optimizer_work(config, plan, layout.microbatches, profile.device)
    compute_f = fwd.seconds(profile)["total"]
    compute_b = bwd.seconds(profile)["total"] + inside.seconds(profile)["total"]
    waits = _memory_comm(config, layout, profile, plan)
    link = _host_link(plan, profile)
    moe = _expert_all_to_all(config, layout, profile)
    i, j = placement
    span = max(j - i, 1) if j > i else 0.5  # UltraMemV2 beside its block's FFN: about half the layer
    window_f = span * layer_fwd_s if mem.async_stream else 0.0
    window_b = span * layer_bwd_s if mem.async_stream else 0.0
    wait_f = waits["forward"] + link["forward"]
    wait_b = waits["backward"] + link["backward"]
    return {
        "forward_s": compute_f,
        "backward_s": compute_b,
        "collectives_s": waits["forward"] + waits["backward"] + moe,
        "waits_s": {"forward": wait_f, "backward": wait_b},
        "host_link_s": link["forward"] + link["backward"],
        "exposed_s": max(0.0, wait_f - window_f) + max(0.0, wait_b - window_b) + moe,
        "flops": fwd.flops() + bwd.flops(),
    }


def _recomputed_layers(layout: Layout, layers: int) -> int:
    """Layers of a chunk of ``layers`` whose forward full recomputation runs again."""
    if layout.recompute != "full":
        return 0
    return layers if layout.recompute_method == "uniform" else min(layout.recompute_num_layers, layers)


def _recompute(config, layout: Layout, forward_layer: Kernels, layers: int) -> Kernels:
    """What the backward of a chunk of ``layers`` layers runs again."""
    if layout.recompute == "full":
        return forward_layer.scaled(_recomputed_layers(layout, layers))
    if layout.recompute == "selective":
        return core_attention(config, layout.tp, layout.device).scaled(layers)
    return Kernels(config.train.precision)


def stage_time(config, layout: Layout, profile: Profile, stage: int) -> Dict:
    """One micro-batch on a rank of pipeline ``stage``: seconds by part (module docstring)."""
    from rmt.memory.shapes import memory_placement

    tp, sp = layout.tp, layout.sequence_parallel
    fwd_layer = layer_forward(config, tp, sp, layout.device)
    ops = layer_ops(config, layout.device)
    fwd_layer.ops = FORWARD_SHARE * ops
    bwd_layer = fwd_layer.backward()
    bwd_layer.ops = (1 - FORWARD_SHARE) * ops
    bwd_layer.mem(GRAD_ACCUMULATE_BYTES * layer_param_elements(config, tp))
    layer_f = fwd_layer.seconds(profile)["total"]
    layer_b = bwd_layer.seconds(profile)["total"]
    plan = stage_table_plan(config, layout, stage)
    mlp_moe = config.memory.type == "moe" and config.memory.moe_placement == "mlp"
    placements = memory_placement(config) if config.memory.type != "none" and not mlp_moe else []
    out = {
        "forward_s": 0.0,
        "backward_s": 0.0,
        "recompute_s": 0.0,
        "tensor_parallel_s": 0.0,
        "memory": [],
        "work": dict.fromkeys(WORK_KINDS, 0.0),
    }
    flops = 0.0
    chunks = chunks_of(config, layout, stage)
    for c, (first, last) in enumerate(chunks):
        n = last - first + 1
        forward, backward = fwd_layer.scaled(n), bwd_layer.scaled(n)
        edge_f, edge_b = embedding_work(
            config, tp, sp, stage == 0 and c == 0, stage == layout.pp - 1 and c == len(chunks) - 1, layout.device
        )
        if c == 0:  # the schedule's, the batch's, the embedding's and the loss's operations
            batch_ops = microbatch_ops(config)
            edge_f.ops += FORWARD_SHARE * batch_ops
            edge_b.ops += (1 - FORWARD_SHARE) * batch_ops
        forward.add(edge_f)
        backward.add(edge_b)
        recompute = _recompute(config, layout, fwd_layer, n)
        phases = [("forward_s", forward), ("backward_s", backward)]
        if recompute.gemms or recompute.attention_flops:
            phases.append(("recompute_s", recompute))
        for key, work in phases:
            parts = work.seconds(profile)
            out[key] += parts["total"]
            for kind in WORK_KINDS:
                out["work"][kind] += parts[kind]
        flops += forward.flops() + backward.flops() + recompute.flops()
        tps = tensor_parallel_seconds(
            config,
            layout,
            profile,
            n,
            stage == 0 and c == 0,
            stage == layout.pp - 1 and c == len(chunks) - 1,
            _recomputed_layers(layout, n),
        )
        out["tensor_parallel_s"] += tps["forward"] + tps["backward"]
        on_chunk = [(k, p) for k, p in enumerate(placements) if first <= p[0] <= last]
        if mlp_moe:
            on_chunk = [(k, (i, i)) for k, (i, _) in enumerate(_moe_layers(config)) if first <= i <= last]
        own = memory_layer_collectives(config, tp, sp and not mlp_moe)
        for k, p in on_chunk:
            out["tensor_parallel_s"] += exposed_seconds(
                profile, own["forward"] + own["backward"], config.train.precision
            )
            r = memory_layer_time(config, layout, profile, k, p, plan, layer_f, layer_b)
            out["memory"].append(dict(r, placement=f"{p[0]}:{p[1]}"))
            flops += r["flops"]
            if layout.recompute == "full" and config.memory.type == "moe" and config.memory.moe_placement == "mlp":
                out["recompute_s"] += r["forward_s"]  # an MoE MLP is part of its layer, recomputed with it
    memory = sum(r["forward_s"] + r["backward_s"] + r["exposed_s"] for r in out["memory"])
    out["memory_s"] = memory
    out["microbatch_s"] = out["forward_s"] + out["backward_s"] + out["recompute_s"] + out["tensor_parallel_s"] + memory
    out["flops_per_microbatch"] = flops
    out["last_backward_s"] = out["backward_s"] + out["recompute_s"]
    out["first_forward_s"] = out["forward_s"]
    return out


def _moe_layers(config):
    from rmt.memory.shapes import parse_moe_layers

    return [(i, i) for i in parse_moe_layers(config.memory.placement, config.model.num_layers)]


def _local_table_elements(config, layout: Layout, stage: int) -> int:
    """Elements of the dense-gradient local value tables a rank of ``stage`` holds (reduced over
    the data-parallel group with the dense gradients)."""
    mem = config.memory
    if mem.type not in TABLE_TYPES or mem.partition != "local" or mem.value_optimizer != "adamw":
        return 0
    plan = stage_table_plan(config, layout, stage)
    if plan is None:
        return 0
    rows, cols = plan.shard_shape
    return plan.layers * rows * cols


def data_parallel_seconds(config, layout: Layout, profile: Profile, stage: int, times: Dict) -> Dict[str, float]:
    """The gradient reduction and the distributed optimizer's parameter gathering of ``stage``:
    their whole seconds and the part exposed (module docstring)."""
    t = config.train
    dp = layout.dp
    params = stage_params(config, layout, stage) + _local_table_elements(config, layout, stage)
    out = {"reduce_s": 0.0, "gather_s": 0.0, "exposed_reduce_s": 0.0, "exposed_gather_s": 0.0}
    if dp <= 1:
        return out
    bucket = max(BUCKET_ELEMENTS, 1_000_000 * dp) if t.overlap_grad_reduce else params
    buckets = max(1, -(-params // bucket))
    kind = "reduce_scatter" if layout.distributed_optimizer else "all_reduce"
    each = collective_seconds(profile, kind, 4 * params / buckets, dp, layout.tp)
    out["reduce_s"] = buckets * each
    if t.overlap_grad_reduce:
        out["exposed_reduce_s"] = max(out["reduce_s"] - times["last_backward_s"], each)
    else:
        out["exposed_reduce_s"] = out["reduce_s"]
    if layout.distributed_optimizer:
        b = DTYPE_BYTES[t.precision]
        gather = collective_seconds(profile, "all_gather", b * params / buckets, dp, layout.tp)
        out["gather_s"] = buckets * gather
        hidden = t.overlap_param_gather
        out["exposed_gather_s"] = max(out["gather_s"] - times["first_forward_s"], gather) if hidden else out["gather_s"]
    return out


def optimizer_seconds(config, layout: Layout, profile: Profile, stage: int) -> Dict[str, float]:
    """The optimizer step of a rank of ``stage``: the dense parameters', the device tables' and
    the host tables' (on the host, beside the rest) seconds, and the step's host operations."""
    params = stage_params(config, layout, stage)
    stepped = -(-params // layout.dp) if layout.distributed_optimizer else params
    dense = dense_optimizer_work(config, params, stepped, layout.dp, profile.device)
    out = {"dense_s": dense.seconds(profile)["total"], "tables_s": 0.0, "host_s": 0.0}
    plan = stage_table_plan(config, layout, stage)
    if plan is not None:
        _, step = table_optimizer_work(config, plan, layout.microbatches, profile.device)
        step_s = step.scaled(plan.layers).seconds(profile)["total"]
        if plan.location == "host":
            work = host.optimizer_work(plan)
            link = sum(host.step_link_bytes(plan)["step"].values()) / profile.host_link
            out["host_s"] = max(0.0, work["bytes"] / profile.host_memory_bandwidth - out["dense_s"]) + link
        else:
            out["tables_s"] = step_s
        if config.memory.partition == "local" and config.memory.value_optimizer != "adamw" and layout.dp > 1:
            rows = plan.shard_shape[1] * DTYPE_BYTES[config.memory.value_dtype] + 8
            sent = plan.layers * min(plan.shard_shape[0], plan.tokens * plan.topm * layout.microbatches) * rows
            out["tables_s"] += 2 * sent_seconds(profile, "all_gather", sent * (layout.dp - 1), layout.dp, layout.tp)
    out["issue_s"] = STEP_OPS[config.model.arch] * profile.op_overhead_s
    out["sums_s"] = exposed_seconds(profile, step_sums(config, layout, stage), config.train.precision)
    out["total_s"] = out["dense_s"] + out["tables_s"] + out["host_s"] + out["issue_s"] + out["sums_s"]
    return out


def pipeline_send_seconds(config, layout: Layout, profile: Profile) -> float:
    """One activation (or gradient) send between adjacent pipeline stages."""
    if layout.pp == 1:
        return 0.0
    T = config.train.micro_batch_size * config.model.seq_length
    nbytes = T * _width(config) * DTYPE_BYTES[config.train.precision]
    if layout.sequence_parallel:
        nbytes //= layout.tp
    return sent_seconds(profile, "p2p", nbytes, 2, layout.tp * layout.dp)


def plan_time(config, world_size: int, profile: Profile) -> Dict:
    """The ``rmt-plan time`` document of a validated ``config`` (its vocabulary known) on
    ``world_size`` ranks of ``profile`` (module docstring)."""
    layout = layout_of(config, world_size, profile.device)
    m, t = config.model, config.train
    stages = list(range(layout.pp)) if layout.pp <= 3 else distinct_stages(layout)
    times = {s: stage_time(config, layout, profile, s) for s in range(layout.pp)}
    per = [times[s]["microbatch_s"] for s in range(layout.pp)]
    mb, vpp = layout.microbatches, layout.vpp
    slowest = max(range(layout.pp), key=lambda s: per[s])
    ideal = mb * per[slowest]
    bubble = (sum(per) - per[slowest]) / vpp if layout.pp > 1 else 0.0
    sends = 2 * (mb * vpp + layout.pp - 1) * pipeline_send_seconds(config, layout, profile) if layout.pp > 1 else 0.0
    dp = {s: data_parallel_seconds(config, layout, profile, s, times[s]) for s in range(layout.pp)}
    opt = {s: optimizer_seconds(config, layout, profile, s) for s in range(layout.pp)}
    after = {s: dp[s]["exposed_reduce_s"] + dp[s]["exposed_gather_s"] + opt[s]["total_s"] for s in range(layout.pp)}
    tail = max(after.values())
    step = ideal + bubble + sends + tail
    tokens = (t.global_batch_size or t.micro_batch_size * layout.dp) * m.seq_length
    model_flops = 3 * _model_flops_per_token(config) * tokens
    hardware_flops = mb * sum(times[s]["flops_per_microbatch"] for s in range(layout.pp)) / layout.pp * world_size
    peak = profile.peak_flops[t.precision]
    per_gpu = model_flops / world_size / step
    return {
        "hardware": profile.name,
        "device": profile.device,
        "world_size": world_size,
        "layout": asdict(layout),
        "stages": {
            str(s): dict(
                {k: v for k, v in times[s].items() if k not in ("last_backward_s", "first_forward_s")},
                data_parallel=dp[s],
                optimizer=opt[s],
            )
            for s in stages
        },
        "slowest_stage": slowest,
        "pipeline_s": ideal,
        "bubble_s": bubble,
        "pipeline_sends_s": sends,
        "after_backward_s": tail,
        "step_s": step,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "model_flops_per_step": model_flops,
        "tflops_per_gpu": per_gpu / 1e12,
        "mfu": per_gpu / peak,
        "hardware_tflops_per_gpu": hardware_flops / world_size / step / 1e12,
        "peak_tflops": peak / 1e12,
    }


def _model_flops_per_token(config) -> float:
    from rmt.planner.flops import plan_model

    return float(plan_model(copy.deepcopy(config))["flops_per_token"])
