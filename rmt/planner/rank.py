"""Every byte of one rank of a run, phase by phase: what ``rmt-plan memory --config`` answers.

:mod:`rmt.planner.memory` counts the bytes that grow with the memory tables' slots; this module
adds everything else a rank holds, for the run a config describes at a world size, so that "does
this run fit, on how many GPUs" is answered before the run (``tools/bench_rank_memory.py``
measures the same phases against it). Terms per rank (``b`` = bytes of ``train.precision``, ``t``
tensor-parallel ranks, ``P_r`` the dense parameters the rank holds):

``params``, ``grads``, ``main_params``, ``optimizer_states``
    the dense parameters (everything but the memory value tables) as megatron-core holds them,
    :func:`rmt.planner.dense.dense_bytes_per_param` per element of ``P_r``: ``b`` each, an fp32
    gradient buffer, fp32 main copies under bf16 and Adam's two fp32 moments (the last two
    ``1/DP`` of it with ``train.distributed_optimizer``). ``P_r`` (:func:`stage_params`):
    column/row-parallel weights and vocab-parallel tables split by ``t``; norms, row-parallel
    biases, position tables and the memory layers (keys, query networks, projections: replicated
    over tensor-parallel ranks) whole; the embedding on the first pipeline stage, the final norm
    and output layer on the last, each layer on the stage of its model chunk; MoE experts split by
    expert x expert-tensor parallelism.
``activations``
    what the backward keeps, per micro-batch and model chunk (:func:`chunk_activations`: the
    model of :mod:`rmt.planner.flops` (the transformer's layer for the mixer, twice per token for
    the recurrent transformer's overlapping windows) split into the parts a tensor-parallel rank holds whole
    (norm inputs, the hidden states between sublayers: ``1/t`` of them under sequence parallelism)
    and the parts it holds ``1/t`` of (attention heads, FFN columns, vocab-parallel logits)), times
    the micro-batches in flight at the schedule's peak (:func:`in_flight`): one without pipeline
    parallelism; ``min(PP - s, m)`` on stage ``s`` of 1F1B; the warm-up of megatron's interleaved
    schedule plus one on a virtual pipeline. Recomputation keeps only each span's input
    (``full``) or drops the core attention's state (``selective``), and adds the one span rebuilt
    at a time in the backward.
``transient`` (``step``)
    the largest of the loss workspace below, the one recomputed span rebuilt in the backward, and
    on a GPU the optimizer step's temporary (torch's foreach AdamW, megatron-core's choice without
    Transformer Engine or apex, takes the second moments' square root out of place: 4 bytes per
    element stepped; none with their fused Adam, nor on a CPU, where rmt uses torch's fused form).
``loss_workspace``
    on the last stage, what the loss (:func:`rmt.training.loss.lm_loss` over megatron-core's
    vocab-parallel cross entropy) holds at its forward's peak beside what it keeps for the
    backward (:func:`loss_bytes_per_logit`, per element of the ``T x Vp/t`` logits; the kept part
    is among the last chunk's ``activations``).
``tables``
    the memory tables, their gradients, optimizer states and checkpoint buffers of the rank's
    memory layers, :func:`rmt.planner.memory.phases` without the keys (counted above). With
    ``memory.table_location: host`` the device keeps only the staged rows of the micro-batches
    in flight; the shards, slot flags, states and gradients are the stage's ``host_tables``
    (:func:`rmt.planner.memory.host_phases`), outside a GPU's phases (a CPU rank's ``tables``
    count both: one memory).
``heap_retained``
    on a CPU, the freed tensors (each under 32 MiB) of the step that ``train.host_heap_retain_mib``
    keeps in the heap for the next one, measured to stay resident: in ``step`` ``min(retain, A)``
    with ``A`` = activations + transient (the next step's tensors do not all fit the freed
    blocks, the optimizer's moments having been drawn from them), in ``save``
    ``min(retain, 2 A)``, the step's whole peak.
``process``
    a fixed overhead per process: on a CPU the interpreter, torch, megatron-core and gloo's
    threads as measured once (:data:`CPU_PROCESS_BYTES`, the resident set before the model is
    built); on a GPU the CUDA context, NCCL's communicators and the caching allocator's reserve
    (:data:`GPU_PROCESS_BYTES`, stated, not measured). Collectives run in place on the DDP
    buckets and the parameter buffer: no further buffer.

Phases: ``init`` (the model built in fp32 and cast, wrapped in DDP, the optimizer built: the
larger of the fp32 build and the wrapped state), ``step`` (the state, its Adam moments, the
activations in flight and the loss or recompute transient), ``save`` (the state plus the
checkpoint's copies: the fp32 main copies' pieces under bf16, and on data-parallel rank 0, which
writes the replicated parameters, a copy of them when they are views into the distributed
optimizer's parameter buffer), ``load`` (a fresh process: the state with the moments built for the load, plus one read
buffer per tensor, the largest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

from rmt.config import TABLE_TYPES
from rmt.memory.byte_sizes import DTYPE_BYTES
from rmt.models.vocab import padded_vocab_size
from rmt.planner.dense import dense_bytes_per_param
from rmt.planner.flops import fc1_width, ffn_kept_elements, linear_biases, qkv_width
from rmt.planner.flops import norm_params as width_norm_params
from rmt.planner.kernel_paths import attention_path, dropout_mask_bytes, drops_embedding, materializes_scores
from rmt.planner.memory import GIB

CPU_PROCESS_BYTES = 385 << 20
"""Resident set of one CPU rank before its model is built (interpreter, torch, megatron-core,
gloo's process groups): measured by ``tools/bench_rank_memory.py`` (its ``start_mib``)."""
CPU_EXTENSION_BYTES = 5 << 20
"""The C++ extensions' code a CPU rank with UltraMem / PKM tables maps (their kernels build and
load with the model): measured, the difference of ``configs/ultramem_tiny.yaml``'s init from
``configs/tiny.yaml``'s beyond the planned bytes."""
CPU_FRAMEWORK_BYTES = {"init": 30 << 20, "step": 43 << 20, "save": 45 << 20, "load": 32 << 20}
"""What a CPU rank adds above :data:`CPU_PROCESS_BYTES` in each phase whatever the model (code
paths loaded on first use, the data loader, allocator arenas, the checkpoint writer's threads):
``tools/bench_rank_memory.py --only tiny``, a one-layer model of 64 hidden units."""
GPU_PROCESS_BYTES = 2 << 30
"""Per GPU rank: CUDA context (~0.5 GiB), NCCL communicator buffers and the caching allocator's
fragmentation reserve; stated, not measured."""
CPU_BF16_SHORTFALL = {"init": 0.26, "step": 0.05, "save": 0.24, "load": 0.36}
"""Where the plan is known to fall short: the most a phase of a shipped bf16 config measured above
it on a CPU, at the config's own settings (``tools/bench_rank_memory.py --only transformer_49m
transformer_49m_distopt rmt_46m``, 2 gloo ranks; ``configs/transformer_49m.yaml`` with and without
the distributed optimizer, ``configs/rmt_46m.yaml``): init +10%, +26% and +15%, step +1%, +1% and
+5%, save +14%, +24% and +21%, load +19%, +36% and +20%; outside the step, 50-290 MiB that no term
itemizes, in phases far below the step's, the peak a fit is decided on."""
CPU_BF16_OVERSTATEMENT = {"save": 0.23}
"""Where a shipped bf16 config measured more than 10% below the plan on a CPU (the same runs as
:data:`CPU_BF16_SHORTFALL`): rank 0's save of ``configs/rmt_46m.yaml``, -23%, while its other
rank's was +21%."""
PHASES = ("init", "step", "save", "load")


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over its ranks (from ``parallel.*`` and ``train.*`` at a world size)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    microbatches: int = 1
    """Micro-batches per step on a data-parallel rank."""
    device: str = "cpu"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


def layout_of(config, world_size: int, device: str = "cpu") -> Layout:
    """The :class:`Layout` of ``config`` on ``world_size`` ranks."""
    p, t = config.parallel, config.train
    model_ranks = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size % model_ranks:
        raise ValueError(
            f"the world size ({world_size}) must be a multiple of tensor x pipeline parallel "
            f"({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size})."
        )
    dp = world_size // model_ranks
    micro = max(1, (t.global_batch_size or t.micro_batch_size * dp) // (t.micro_batch_size * dp))
    return Layout(
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_model_parallel_size or 1,
        dp=dp,
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        distributed_optimizer=t.distributed_optimizer,
        recompute=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        microbatches=micro,
        device=device,
    )


def with_vocabulary(config):
    """``config`` with ``model.vocab_size`` set where only the data knows it (the byte tokenizer's,
    a dataset's recorded one); one sentence when it cannot be known without building data."""
    if config.model.vocab_size is None:
        from rmt.data.metadata import known_vocab_size

        config.model.vocab_size = known_vocab_size(config)
    if config.model.vocab_size is None:
        raise ValueError(
            "model.vocab_size must be set to plan the run (only the byte tokenizer's vocabulary and "
            "a dataset's recorded one are known without building data)."
        )
    return config


# -- parameters -----------------------------------------------------------------------------------
def norm_params(config) -> int:
    """Parameters of one norm of the hidden state (:func:`rmt.planner.flops.norm_params`)."""
    return width_norm_params(config.model.normalization, config.model.hidden_size)


def _layer_params(config, layout: Layout) -> int:
    """Dense parameters of one transformer / RMT layer on a tensor-parallel rank."""
    m, t = config.model, layout.tp
    Dff = m.ffn_hidden_size or 4 * (m.rank * m.dv if m.arch == "rmt" else m.hidden_size)
    if m.arch == "rmt":
        Dk, Dv, R = m.dk, m.dv, m.rank
        return (3 * R * Dk + R * Dk + 2 * R * Dv * Dff) // t + 2 * Dk * Dv + 2 * R * Dk
    D, A, H = m.hidden_size, m.hidden_size, m.num_attention_heads  # heads x head dim = hidden size
    qkv, f1 = qkv_width(H, m.num_query_groups or H, D // H), fc1_width(Dff, m.gated_linear_unit)
    biases = linear_biases(D, qkv, f1, m.add_bias_linear)
    whole = 2 * D if m.add_bias_linear else 0  # the row-parallel linears' biases, on every rank
    return (D * qkv + A * D + D * f1 + Dff * D + biases - whole) // t + 2 * norm_params(config) + whole


def _embedding_params(config, layout: Layout, first: bool, last: bool) -> int:
    """The embedding (first stage) and the final norm and output layer (last stage) of a rank."""
    m, t, Vp = config.model, layout.tp, padded_vocab_size(config)
    learned = m.position == "learned"
    n = 0
    if m.arch == "rmt":
        Dk, Dv, R, N = m.dk, m.dv, m.rank, m.seq_length
        if first:
            n += Vp * Dv * R // t + Dk * R + ((N * Dv * R + Dk * R) if learned else 0)
        if last:
            n += Dk * Dv + R * Dk + Vp * Dv * R // t
        return n
    D = m.hidden_size
    if first:
        n += Vp * D // t + (m.seq_length * D if learned else 0)
    if last:
        n += norm_params(config) + Vp * D // t
    return n


def _memory_layers_on(config, first: int, last: int) -> List[Dict]:
    """Counts of the memory layers of ``config`` that a model chunk of layers ``first..last`` holds."""
    if config.memory.type == "none":
        return []
    from rmt.memory.shapes import memory_placement, parse_moe_layers
    from rmt.planner.memory_layers import memory_plan

    plan = memory_plan(config)
    mem = config.memory
    if mem.type == "moe" and mem.moe_placement == "mlp":
        where = [(i, i) for i in parse_moe_layers(mem.placement, config.model.num_layers)]
    elif mem.type == "moe":
        from rmt.memory.shapes import parse_placement

        where = parse_placement(mem.placement, config.model.num_layers)
    else:
        where = memory_placement(config)
    return [c for (i, j), c in zip(where, plan["layers"]) if first <= i <= last]


def _value_elements(config) -> int:
    """Elements of one memory layer's value tables (counted by :mod:`rmt.planner.memory`)."""
    mem = config.memory
    if mem.type not in TABLE_TYPES:
        return 0
    from rmt.memory.shapes import value_dim

    return mem.num_keys**2 * (value_dim(config) + (mem.pre_value_dim if mem.type == "ultramem_v2" else 0))


def _memory_dense_params(config, layout: Layout, layers: List[Dict]) -> int:
    """Dense parameters of the memory layers a rank holds: replicated over tensor-parallel ranks,
    MoE experts split over expert x expert-tensor parallel ranks."""
    mem = config.memory
    if mem.type != "moe":
        return sum(c["params"] for c in layers) - len(layers) * _value_elements(config)
    from rmt.memory.shapes import expert_hidden_size, memory_width

    expert = 2 * memory_width(config) * expert_hidden_size(config)
    total = 0
    for c in layers:
        experts = mem.num_experts * expert
        total += c["params"] - experts + experts // (layout.ep * layout.etp)
        if mem.moe_placement == "mlp":  # the dense MLP it replaces is not built
            m = config.model
            Dff = m.ffn_hidden_size or 4 * m.hidden_size
            total -= (2 * m.hidden_size * Dff + Dff) // layout.tp + m.hidden_size
    return total


def chunks_of(config, layout: Layout, stage: int):
    """``(first, last)`` global layers of each model chunk of pipeline stage ``stage``."""
    from rmt.memory.shapes import stage_layers

    if layout.vpp == 1:
        return [stage_layers(config, stage)]
    return [stage_layers(config, stage, v) for v in range(layout.vpp)]


def stage_params(config, layout: Layout, stage: int) -> int:
    """Dense parameter elements one rank of pipeline stage ``stage`` holds (module docstring)."""
    m = config.model
    if m.arch not in ("transformer", "rmt"):
        from rmt.planner.flops import plan_model

        doc = plan_model(config)
        return doc["params"] - sum(1 for _ in _memory_layers_on(config, 1, m.num_layers)) * _value_elements(config)
    n = _embedding_params(config, layout, stage == 0, stage == layout.pp - 1)
    for first, last in chunks_of(config, layout, stage):
        n += (last - first + 1) * _layer_params(config, layout)
        n += _memory_dense_params(config, layout, _memory_layers_on(config, first, last))
    return n


# -- activations ----------------------------------------------------------------------------------
def _layer_activation_elements(config, layout: Layout):
    """``(whole, split, core_bytes)`` per token of one layer: elements a tensor-parallel rank
    keeps whole (``1/t`` under sequence parallelism, the two hidden dropouts' masks among them),
    elements it keeps ``1/t`` of, and the bytes the core attention keeps (split by heads): the
    fused kernel's fp32 log-sum-exp, or where the scores are materialized (megatron's kernels;
    torch's on a CPU under dropout, which takes its unfused path) the softmax probabilities and
    under dropout its mask and the dropped probabilities; :mod:`rmt.planner.flops`' layer model."""
    m = config.model
    b = DTYPE_BYTES[config.train.precision]
    if m.arch == "rmt":
        Dk, Dv, R = m.dk, m.dv, m.rank
        Dff = m.ffn_hidden_size or 4 * R * Dv
        return 2 * Dk * Dv + R * Dv, 4 * R * Dv + 2 * Dff, 4 * R
    D, H = m.hidden_size, m.num_attention_heads
    Dff = m.ffn_hidden_size or 4 * D
    mask = dropout_mask_bytes(config, layout.device)
    whole = 4 * D + 2 * D * mask // b
    if not materializes_scores(attention_path(config, layout.device)):
        core = 4 * H
    else:
        keys = 2 * m.block_width if m.arch == "recurrent" else m.seq_length  # a query's keys
        core = H * keys * (b + (b + mask if mask else 0))
    return whole, 4 * D + ffn_kept_elements(Dff, m.gated_linear_unit), core


def _memory_activation_bytes(config, layers: List[Dict], device: str) -> int:
    """Bytes per token the memory layers of a chunk keep for the backward (what the retrieval's
    path keeps on ``device``, :func:`rmt.planner.memory.retrieval_saved_bytes`; the selected
    indices and scores, pooled rows; MoE: the routed copies and expert activations)."""
    if not layers:
        return 0
    mem = config.memory
    b = DTYPE_BYTES[config.train.precision]
    from rmt.memory.shapes import memory_width

    W = memory_width(config)
    if mem.type == "moe":
        from rmt.memory.shapes import expert_hidden_size

        per = mem.moe_topk * (W + 2 * expert_hidden_size(config)) * b + 2 * mem.num_experts * 4
        if mem.moe_placement == "skip":
            per += 2 * W * b
        return len(layers) * per
    from rmt.memory.layer import MemorySpec
    from rmt.planner.memory import TablePlan, retrieval_saved_bytes

    total = 0
    for k in range(len(layers)):
        s = MemorySpec.from_config(config, k)
        r = 1 if s.retrieval != "tucker" else s.tucker_rank
        one_token = TablePlan(
            slots=s.num_keys**2,
            dim=1,
            tokens=1,
            heads=s.num_heads,
            topk=s.topk,
            key_dim=r,
            tucker_rank=r,
            ive_blocks=s.ive_blocks,
            precision=config.train.precision,
            device="gpu" if device == "gpu" else "cpu",
            retrieval_kernel=mem.retrieval_kernel,
        )
        scores = retrieval_saved_bytes(one_token)
        picked = s.num_heads * s.topk * (8 + 4 * s.num_cores)
        total += 3 * W * b + scores + picked + s.ive_blocks * s.value_dim * b
    return total


def chunk_activations(config, layout: Layout, stage: int, chunk: int) -> Dict[str, int]:
    """Bytes one micro-batch of model chunk ``chunk`` of stage ``stage`` keeps for its backward:
    ``kept`` (after recomputation) and ``span`` (the most one recomputed span rebuilds)."""
    m, t = config.model, layout.tp
    b = DTYPE_BYTES[config.train.precision]
    T = config.train.micro_batch_size * m.seq_length
    sp = layout.sequence_parallel
    whole, split, core = _layer_activation_elements(config, layout)
    core //= t
    layer = (whole // (t if sp else 1) + split // t) * b + core
    if m.arch == "recurrent":  # each layer runs on windows: 2k tokens per block of k (rmt.planner.flops)
        layer = layer * 2 * m.block_width * -(-m.seq_length // m.block_width) // m.seq_length
    width = m.dk * m.dv if m.arch == "rmt" else m.hidden_size
    hidden = width * b // (t if sp else 1)
    first, last = chunks_of(config, layout, stage)[chunk]
    n = last - first + 1
    memory = _memory_activation_bytes(config, _memory_layers_on(config, first, last), layout.device)
    kept, span = n * layer + memory, 0
    if layout.recompute == "selective":
        kept -= n * core
    elif layout.recompute == "full":
        k = layout.recompute_num_layers
        recomputed, spans = (n, n // k) if layout.recompute_method == "uniform" else (min(k, n), min(k, n))
        kept -= recomputed * layer - spans * hidden
        span = (k if layout.recompute_method == "uniform" else 1) * layer
    extra = 0
    Vp = padded_vocab_size(config)
    if stage == 0 and chunk == 0 and m.arch == "rmt":
        extra += m.rank * m.dv * b + 4 * m.rank * m.seq_length // t // config.train.micro_batch_size
    elif stage == 0 and chunk == 0 and drops_embedding(config):  # the embedding's dropout mask
        extra += width * dropout_mask_bytes(config, layout.device) // (t if sp else 1)
    if stage == layout.pp - 1 and chunk == layout.vpp - 1:
        extra += (width + (2 * m.rank * m.dv if m.arch == "rmt" else width)) * b // (t if sp else 1)
        extra += loss_bytes_per_logit(config)["kept"] * Vp // t
    return {"kept": T * (kept + extra), "span": T * span, "layers": n}


def in_flight(layout: Layout, stage: int) -> int:
    """Micro-batch chunks whose activations one rank of ``stage`` holds at the schedule's peak:
    megatron-core's 1F1B warm-up ``PP - s - 1`` plus the one in steady state (all of a step's
    ``m`` at most); interleaved: ``2 (PP - s - 1) + (VPP - 1) PP`` plus one, of ``m VPP``."""
    m = layout.microbatches
    if layout.pp == 1:
        return 1
    if layout.vpp == 1:
        return min(layout.pp - stage, m)
    return min(2 * (layout.pp - stage - 1) + (layout.vpp - 1) * layout.pp + 1, m * layout.vpp)


def stage_activations(config, layout: Layout, stage: int) -> Dict[str, int]:
    """Activation bytes at the step's peak on a rank of ``stage`` (module docstring)."""
    chunks = [chunk_activations(config, layout, stage, c) for c in range(layout.vpp)]
    live = in_flight(layout, stage)
    # the in-flight chunks cycle through the model chunks in order (interleaved schedule)
    kept = sum(chunks[i % layout.vpp]["kept"] for i in range(live))
    return {"kept": kept, "in_flight": live, "recompute_span": max(c["span"] for c in chunks)}


def loss_bytes_per_logit(config) -> Dict[str, int]:
    """Bytes per element of the last stage's vocab-parallel logits ``[T, Vp/t]`` around the loss
    (:func:`rmt.training.loss.lm_loss` over megatron-core's vocab-parallel cross entropy):
    ``kept`` from the loss's forward to its backward (among the ``activations``), ``workspace``
    beside them at the forward's peak (the ``transient``).

    The cross entropy takes fp32 logits, overwrites them in place with their softmax and keeps it
    (4 bytes); under bf16 those fp32 logits are a copy, beside the model's bf16 logits (``b``),
    which the caller holds until the loss returns. With ``train.z_loss`` the cross entropy gets a
    copy (it would overwrite what the z-loss reads), so the logits in the model dtype stay beside
    it in fp32 too, with their fp32 copy under bf16 (4); the z-loss's ``log sum exp`` makes the
    max-shifted logits (4, freed after their exponential) and their exponential (4, kept). The
    backward holds less: its first gradient (4) replaces the temporaries. Before the loss, the
    transformer's and the RMT's output layers write ``[s, b]``-ordered logits that are copied into
    ``[b, s]`` order (``2 b`` at once), which is the peak in fp32 without the z-loss. Measured in
    the whole step (``tools/bench_rank_memory.py``'s ``tiny`` layout with a 50,257-token
    vocabulary, 8 x 512 tokens): ``kept + workspace`` is 6.0 and 18.0 bytes in bf16 without and
    with the z-loss, 8.2 and 16.1 in fp32 (the model's own activations included), as counted."""
    b = DTYPE_BYTES[config.train.precision]
    copy = 4 if b != 4 else 0
    if config.train.z_loss > 0:
        kept, loss = 4 + 4, b + copy + 4
    else:
        kept, loss = 4, b if copy else 0
    transposed = 2 * b if config.model.arch in ("transformer", "rmt") else 0
    return {"kept": kept, "workspace": max(loss, transposed - kept)}


def loss_workspace(config, layout: Layout, stage: int) -> int:
    """The loss's transient on the last stage (:func:`loss_bytes_per_logit`'s ``workspace``)."""
    if stage != layout.pp - 1:
        return 0
    T = config.train.micro_batch_size * config.model.seq_length
    return T * (padded_vocab_size(config) // layout.tp) * loss_bytes_per_logit(config)["workspace"]


# -- tables ---------------------------------------------------------------------------------------
def stage_table_plan(config, layout: Layout, stage: int):
    """The :class:`rmt.planner.memory.TablePlan` of the memory tables on a rank of ``stage`` (None
    when it holds none): its layers, group, tensor-parallel split, replicas and, for tables in host
    memory, the layers whose staged rows the micro-batches in flight hold (:func:`in_flight`, the
    in-flight chunks cycling through the model chunks)."""
    if config.memory.type not in TABLE_TYPES:
        return None
    from rmt.planner.memory import plan_from_config

    mem = config.memory
    per_chunk = [len(_memory_layers_on(config, f, l)) for f, l in chunks_of(config, layout, stage)]
    if not sum(per_chunk):
        return None
    local = mem.partition == "local"
    group = 1 if local else (mem.group_size or layout.dp * layout.tp)
    replicas = layout.dp if local else layout.dp * layout.tp // group
    staged = sum(per_chunk[i % layout.vpp] for i in range(in_flight(layout, stage)))
    plan = plan_from_config(config, group, sum(per_chunk), layout.microbatches, layout.tp, max(1, replicas), staged)
    return replace(plan, device="gpu" if layout.device == "gpu" else "cpu")


def stage_tables(config, layout: Layout, stage: int) -> Dict[str, int]:
    """Bytes of the memory tables on a rank of ``stage`` by phase (keys left out), on the device."""
    from rmt.planner.memory import phases

    plan = stage_table_plan(config, layout, stage)
    if plan is None:
        return {p: 0 for p in PHASES}
    out = phases(plan, keys=False)
    return {p: out[p] for p in PHASES}


def stage_host_tables(config, layout: Layout, stage: int) -> Dict[str, int]:
    """Bytes of the memory tables a rank of ``stage`` holds in host memory by phase
    (``memory.table_location: host``; all zero otherwise)."""
    from rmt.planner.memory import host_phases

    plan = stage_table_plan(config, layout, stage)
    if plan is None:
        return {p: 0 for p in PHASES}
    out = host_phases(plan)
    return {p: out[p] for p in PHASES}


# -- the rank -------------------------------------------------------------------------------------
def rank_components(config, layout: Layout, stage: int) -> Dict[str, int]:
    """The terms of the module docstring, in bytes, for one rank of pipeline stage ``stage``."""
    elements = stage_params(config, layout, stage)
    per = dense_bytes_per_param(config.train.precision, layout.distributed_optimizer, layout.dp)
    act = stage_activations(config, layout, stage)
    return {
        "dense_params": elements,
        "params": int(elements * per["param"]),
        "grads": int(elements * per["grad"]),
        "main_params": int(elements * per["main_param"]),
        "optimizer_states": int(elements * (per["exp_avg"] + per["exp_avg_sq"])),
        "activations": act["kept"],
        "in_flight_microbatches": act["in_flight"],
        "recompute_span": act["recompute_span"],
        "loss_workspace": loss_workspace(config, layout, stage),
        "process": CPU_PROCESS_BYTES if layout.device == "cpu" else GPU_PROCESS_BYTES,
    }


def rank_phases(config, layout: Layout, stage: int, writer: bool = True) -> Dict[str, Dict[str, int]]:
    """Per phase, the bytes one rank of ``stage`` holds at that phase's peak, by term; ``writer``:
    the rank is data-parallel rank 0, which writes the replicated parameters of a checkpoint."""
    c = rank_components(config, layout, stage)
    tables = stage_tables(config, layout, stage)
    state = {k: c[k] for k in ("params", "grads", "main_params")}
    fp32_build = c["dense_params"] * 4  # every parameter is drawn in fp32, then cast
    init = dict(state, build_transient=max(0, fp32_build - sum(state.values())))
    trained = dict(state, optimizer_states=c["optimizer_states"])
    # torch's foreach AdamW (megatron-core's optimizer on a GPU without Transformer Engine or apex)
    # takes the square root of the second moments out of place: 4 bytes per element it steps
    optimizer_temp = c["optimizer_states"] // 2 if layout.device == "gpu" else 0
    step = dict(
        trained, activations=c["activations"], transient=max(c["loss_workspace"], c["recompute_span"], optimizer_temp)
    )
    copies = c["main_params"]  # the bf16 main copies' pieces are written as fresh tensors
    if layout.distributed_optimizer and writer:
        copies += c["params"]  # views into the parameter buffer: the writer of their replica copies them
    save = dict(trained, checkpoint_copies=copies)
    if layout.device == "cpu":  # the freed tensors that train.host_heap_retain_mib keeps resident
        retain = config.train.host_heap_retain_mib << 20
        freed = c["activations"] + step["transient"]
        step["heap_retained"] = min(retain, freed)
        save["heap_retained"] = min(retain, freed + step["heap_retained"])
    load = dict(trained, read_buffer=0)
    out = {"init": init, "step": step, "save": save, "load": load}
    if layout.device == "cpu":  # tables in host memory are in the same memory as the rest
        on_host = stage_host_tables(config, layout, stage)
        tables = {p: tables[p] + on_host[p] for p in PHASES}
    for phase, terms in out.items():
        terms["tables"] = tables[phase]
        terms["framework"] = (
            0
            if layout.device != "cpu"
            else CPU_FRAMEWORK_BYTES[phase] + (CPU_EXTENSION_BYTES if config.memory.type in TABLE_TYPES else 0)
        )
        terms["process"] = c["process"]
    return out


def distinct_stages(layout: Layout) -> List[int]:
    """The pipeline stages whose ranks differ: the first, the middle ones, the last."""
    return sorted({0, layout.pp - 1} | ({1} if layout.pp > 2 else set()))


def plan_rank(
    config, world_size: int, device: str = "cpu", gib: Optional[float] = None, host_gib: Optional[float] = None
) -> Dict:
    """The ``rmt-plan memory --config`` JSON document: for each distinct pipeline stage its terms
    and phases, the peak per rank and, with ``gib``, whether it fits. With tables in host memory
    (``memory.table_location: host``) each stage's ``host_tables`` by phase and ``host_peak``, the
    bytes of the tables in a rank's host memory; with ``host_gib`` whether they fit it
    (``host_fits``; ``fits`` is then both)."""
    layout = layout_of(config, world_size, device)
    host = config.memory.table_location == "host" and config.memory.type in TABLE_TYPES
    if host_gib is not None and not host:
        raise ValueError("--host-gib is the host memory of tables in host memory: it needs memory.table_location host.")
    stages = {}
    for s in range(layout.pp) if layout.pp <= 3 else _all_distinct(config, layout):
        ph = rank_phases(config, layout, s)
        totals = {p: sum(v.values()) for p, v in ph.items()}
        stages[str(s)] = {
            "components": rank_components(config, layout, s),
            "phases": ph,
            "totals": totals,
            "peak": max(totals.values()),
        }
        if host:
            stages[str(s)]["host_tables"] = stage_host_tables(config, layout, s)
    peak = max(v["peak"] for v in stages.values())
    doc = {
        "layout": asdict(layout),
        "world_size": world_size,
        "stages": stages,
        "peak": peak,
        "checkpoint_bytes": checkpoint_bytes(config),
    }
    if host:
        doc["host_peak"] = max(max(v["host_tables"].values()) for v in stages.values())
    if layout.device == "cpu" and config.train.precision == "bf16":
        doc.update(known_shortfall=CPU_BF16_SHORTFALL, known_overstatement=CPU_BF16_OVERSTATEMENT)
    if gib is not None:
        doc.update(gib=gib, fits=peak <= gib * GIB)
    if host_gib is not None:
        doc.update(host_gib=host_gib, host_fits=doc["host_peak"] <= host_gib * GIB)
        doc["fits"] = doc.get("fits", True) and doc["host_fits"]
    return doc


def _all_distinct(config, layout: Layout) -> List[int]:
    """Every stage whose terms differ from the stage before it (the middle stages of an even
    split are alike), with the first and the last."""
    keep, seen = [], None
    for s in range(layout.pp):
        key = (
            stage_params(config, layout, s),
            tuple(sorted(stage_tables(config, layout, s).items())),
            in_flight(layout, s),
        )
        if s in (0, layout.pp - 1) or key != seen:
            keep.append(s)
        seen = key
    return keep


def checkpoint_bytes(config) -> int:
    """Bytes on disk of a checkpoint: dense parameters in the model dtype with Adam's two fp32
    moments (and the fp32 main copies under bf16), the tables and their optimizer states."""
    from rmt.planner.flops import plan_model

    doc = plan_model(config)
    values = _value_elements(config) * len(_memory_layers_on(config, 1, config.model.num_layers))
    dense = doc["params"] - values
    per = dense_bytes_per_param(config.train.precision, False, 1)
    total = int(dense * (per["param"] + per["main_param"] + per["exp_avg"] + per["exp_avg_sq"]))
    if values:
        from rmt.planner.memory import checkpoint_bytes as table_bytes
        from rmt.planner.memory import plan_from_config

        n = len(_memory_layers_on(config, 1, config.model.num_layers))
        total += table_bytes(plan_from_config(config, 1, n, 1))
    return total


def human(n: float) -> str:
    for unit, size in (("TiB", GIB << 10), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


__all__ = [
    "Layout",
    "layout_of",
    "stage_params",
    "chunk_activations",
    "in_flight",
    "rank_phases",
    "plan_rank",
    "checkpoint_bytes",
    "CPU_PROCESS_BYTES",
    "GPU_PROCESS_BYTES",
]
