"""Config checks of the ``memory.*`` keys, called from :func:`rmt.config.validate`."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from rmt.errors import ConfigError

MEMORY_TYPES = ("none", "ultramem", "ultramem_v2", "pkm", "moe")
PRE_VALUE_ACTIVATIONS = ("none", "gelu")
MOE_PLACEMENTS = ("skip", "mlp")
MOE_DISPATCHERS = ("alltoall", "allgather")
TABLE_PARTITIONS = ("local", "number", "dimension", "auto")
VALUE_OPTIMIZERS = ("adamw", "sparse_adam", "rowwise_adagrad")
VALUE_DTYPES = ("fp32", "bf16")


def memory_width(config) -> int:
    """Width of the hidden state memory layers read and write: ``model.hidden_size``, or for the
    Residual Matrix Transformer (``model.arch: rmt``) its residual matrix flattened, ``dk * dv``."""
    m = config.model
    return m.dk * m.dv if m.arch == "rmt" else m.hidden_size


def parse_placement(text: str, num_layers: int) -> List[Tuple[int, int]]:
    """``"3:5/6:8"`` -> ``[(3, 5), (6, 8)]``: memory input taken after layer i, its output
    added after layer j (1-based global layer numbers, UltraMem Appendix E notation)."""
    if text.isdigit():
        raise ConfigError(
            f"memory.placement '{text}' has no 'i:j' entry: YAML reads an unquoted single i:j as a "
            f"base-60 number, so quote it (memory.placement='3:5')")
    pairs = []
    for item in text.split("/"):
        parts = item.strip().split(":")
        try:
            start, end = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"memory.placement entry '{item}' must have the form 'i:j' with integer layers")
        if start > end:
            raise ConfigError(f"memory.placement entry '{item}' ends (layer {end}) before it starts (layer {start})")
        if start < 1 or end > num_layers:
            raise ConfigError(
                f"memory.placement entry '{item}' must lie within layers 1..model.num_layers ({num_layers})")
        pairs.append((start, end))
    return pairs


def memory_placement(config) -> List[Tuple[int, int]]:
    """The placements ``(i, j)`` of ``config``'s UltraMem / UltraMemV2 / PKM / skip-MoE layers:
    :func:`parse_placement` of ``memory.placement``; for ``ultramem_v2`` ``(i, i)`` for each
    layer i with a memory beside its FFN (:func:`parse_moe_layers`' list; empty: every layer)."""
    mem, L = config.memory, config.model.num_layers
    if mem.type == "ultramem_v2":
        return [(i, i) for i in (parse_moe_layers(mem.placement, L) if mem.placement else range(1, L + 1))]
    return parse_placement(mem.placement, L)


def value_dim(config) -> int:
    """Width of the value rows of an UltraMem / UltraMemV2 / PKM layer of ``config``."""
    mem, width = config.memory, memory_width(config)
    if mem.type == "ultramem_v2":
        return mem.value_dim or width // 2
    return width // 2 if mem.type == "ultramem" and mem.half_value_dim else width


def parse_moe_layers(text: str, num_layers: int) -> List[int]:
    """``"1-4/7"`` -> ``[1, 2, 3, 4, 7]``: the layers whose MLP an MoE replaces
    (``memory.moe_placement: mlp``; 1-based, ranges inclusive)."""
    layers = set()
    for item in text.split("/"):
        parts = item.strip().split("-")
        try:
            first, last = int(parts[0]), int(parts[-1])
        except ValueError:
            raise ConfigError(f"memory.placement entry '{item}' must be a layer 'i' or a range 'i-j' "
                              f"(memory.moe_placement 'mlp' and memory.type 'ultramem_v2' list layers)")
        if len(parts) > 2 or first > last:
            raise ConfigError(f"memory.placement entry '{item}' must be a layer 'i' or a range 'i-j' with i <= j")
        if first < 1 or last > num_layers:
            raise ConfigError(
                f"memory.placement entry '{item}' must lie within layers 1..model.num_layers ({num_layers})")
        layers.update(range(first, last + 1))
    return sorted(layers)


def expert_hidden_size(config) -> int:
    """Inner width of one expert: ``memory.expert_hidden_size``, else the dense MLP's divided by
    the top-k (granularity k: the activated experts together are as wide as the MLP)."""
    mem, m = config.memory, config.model
    if mem.expert_hidden_size:
        return mem.expert_hidden_size
    width = memory_width(config)
    dense = m.ffn_hidden_size or (4 * m.rank * m.dv if m.arch == "rmt" else 4 * width)
    return max(1, dense // mem.moe_topk)


def validate_moe(config, world_size: int) -> None:
    """``memory.type: moe`` keys and expert parallelism (megatron-core's MoELayer and groups)."""
    mem, m, p = config.memory, config.model, config.parallel
    if mem.value_optimizer != "adamw":
        raise ConfigError("memory.value_optimizer applies to the value tables of memory.type 'ultramem' "
                          "or 'pkm'; MoE experts are dense, leave it 'adamw'")
    for key in ("num_experts", "moe_topk"):
        if getattr(mem, key) <= 0:
            raise ConfigError(f"memory.{key} must be positive, got {getattr(mem, key)}")
    if mem.moe_topk > mem.num_experts:
        raise ConfigError(f"memory.moe_topk ({mem.moe_topk}) exceeds memory.num_experts ({mem.num_experts})")
    if mem.expert_hidden_size is not None and mem.expert_hidden_size <= 0:
        raise ConfigError(f"memory.expert_hidden_size must be positive, got {mem.expert_hidden_size}")
    if mem.moe_placement not in MOE_PLACEMENTS:
        raise ConfigError(f"memory.moe_placement must be one of {', '.join(MOE_PLACEMENTS)}, got '{mem.moe_placement}'")
    if mem.moe_token_dispatcher_type not in MOE_DISPATCHERS:
        raise ConfigError(f"memory.moe_token_dispatcher_type must be one of {', '.join(MOE_DISPATCHERS)}, "
                          f"got '{mem.moe_token_dispatcher_type}'")
    if mem.moe_expert_capacity_factor is not None and mem.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"memory.moe_expert_capacity_factor must be positive (or null for no token dropping), "
                          f"got {mem.moe_expert_capacity_factor}")
    if mem.moe_placement == "mlp":
        if m.arch != "transformer":
            raise ConfigError(f"memory.moe_placement 'mlp' replaces the MLP of megatron's transformer layers and "
                              f"needs model.arch 'transformer', got '{m.arch}' (use moe_placement 'skip')")
        parse_moe_layers(mem.placement, m.num_layers)
    else:
        validate_memory_pipeline(config, parse_placement(mem.placement, m.num_layers))
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp
    if mem.num_experts % ep:
        raise ConfigError(f"memory.num_experts ({mem.num_experts}) must be divisible by "
                          f"parallel.expert_model_parallel_size ({ep})")
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by expert tensor x expert model x pipeline parallel "
            f"size {etp} x {ep} x {pp} = {etp * ep * pp}")
    if expert_hidden_size(config) % etp:
        raise ConfigError(f"the expert hidden size ({expert_hidden_size(config)}) must be divisible by the expert "
                          f"tensor-parallel size ({etp})")
    if tp > 1 and m.seq_length % tp:
        raise ConfigError(f"model.seq_length ({m.seq_length}) must be divisible by "
                          f"parallel.tensor_model_parallel_size ({tp}): each tensor-parallel rank routes its "
                          f"share of the sequence through the MoE")


def num_model_chunks(config) -> int:
    """Pipeline stages x virtual stages: the model chunks the layers are split evenly over."""
    p = config.parallel
    return p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1)


def stage_layers(config, stage: int, vp_stage: Optional[int] = None) -> Tuple[int, int]:
    """First and last global layer (1-based) of the model chunk of pipeline stage ``stage`` and
    virtual stage ``vp_stage`` (None: no virtual pipeline): ``num_layers / chunks`` layers per
    chunk, chunk ``vp_stage * pipeline_size + stage`` in megatron-core's interleaved order."""
    per = config.model.num_layers // num_model_chunks(config)
    index = (vp_stage or 0) * config.parallel.pipeline_model_parallel_size + stage
    return index * per + 1, (index + 1) * per


def validate_memory_pipeline(config, placement: List[Tuple[int, int]]) -> None:
    """With pipeline parallelism every placement ``i:j`` must lie inside one model chunk (a
    stage, or a virtual stage of the interleaved schedule): its memory layer is built there."""
    chunks = num_model_chunks(config)
    if chunks == 1:
        return
    per = config.model.num_layers // chunks
    for start, end in placement:
        if (start - 1) // per != (end - 1) // per:
            ranges = [f"{s * per + 1}-{(s + 1) * per}" if per > 1 else str(s + 1) for s in range(chunks)]
            ranges = ", ".join(ranges[:-1]) + " or " + ranges[-1]
            boundary = ((start - 1) // per + 1) * per
            what = "stages" if chunks == config.parallel.pipeline_model_parallel_size else "model chunks (virtual stages)"
            raise ConfigError(
                f"memory.placement '{start}:{end}' crosses the pipeline stage boundary after layer "
                f"{boundary}; with {chunks} {what} of {per} layers each placement must lie within layers {ranges}")


def validate_memory_parallel(config, world_size: int) -> None:
    """``memory.partition`` / ``group_size`` / ``owner_reduce`` (UltraMem Appendix C/D): the
    group must divide the data x tensor parallel ranks of a stage and the split axis must
    divide evenly over it."""
    mem, p = config.memory, config.parallel
    if mem.partition not in TABLE_PARTITIONS:
        raise ConfigError(f"memory.partition must be one of {', '.join(TABLE_PARTITIONS)}, got '{mem.partition}'")
    if mem.partition == "local":
        if mem.owner_reduce:
            raise ConfigError("memory.owner_reduce needs memory.partition 'number' or 'auto'")
        return
    if mem.type == "moe":
        raise ConfigError("memory.partition must be 'local' for memory.type 'moe' (only UltraMem/PKM tables shard)")
    if mem.owner_reduce and mem.partition == "dimension":
        raise ConfigError("memory.owner_reduce needs memory.partition 'number' or 'auto'")
    dp_tp = world_size // p.pipeline_model_parallel_size
    if mem.group_size < 0 or (mem.group_size and dp_tp % mem.group_size):
        raise ConfigError(f"memory.group_size ({mem.group_size}) must divide the data x tensor parallel "
                          f"size ({dp_tp}) (0 = all of it)")
    G = mem.group_size or dp_tp
    slots = mem.num_keys * mem.num_keys
    dim = value_dim(config)
    if mem.partition in ("number", "auto") and slots % G:
        raise ConfigError(f"number-wise memory tables need the slot count ({slots}) to be divisible by "
                          f"the memory-parallel group size ({G})")
    if mem.partition in ("dimension", "auto") and dim % G:
        raise ConfigError(f"dimension-wise memory tables need the value dim ({dim}) to be divisible "
                          f"by the memory-parallel group size ({G})")
    if mem.type == "ultramem_v2" and mem.partition in ("dimension", "auto") and mem.pre_value_dim % G:
        raise ConfigError(f"dimension-wise memory tables need memory.pre_value_dim ({mem.pre_value_dim}) to be "
                          f"divisible by the memory-parallel group size ({G})")


def validate_value_optimizer(mem) -> None:
    """``memory.value_optimizer``: a known name; row-wise Adagrad needs whole rows on a rank;
    ``memory.value_dtype``: a storage dtype the kernels take; ``memory.fused_value_optimizer``: a
    row-wise optimizer to fuse."""
    if mem.value_dtype not in VALUE_DTYPES:
        raise ConfigError(f"memory.value_dtype must be one of {', '.join(VALUE_DTYPES)}, got '{mem.value_dtype}'")
    if mem.value_optimizer not in VALUE_OPTIMIZERS:
        raise ConfigError(f"memory.value_optimizer must be one of {', '.join(VALUE_OPTIMIZERS)}, "
                          f"got '{mem.value_optimizer}'")
    if mem.value_optimizer == "rowwise_adagrad" and mem.partition in ("dimension", "auto"):
        raise ConfigError(f"memory.value_optimizer 'rowwise_adagrad' keeps one accumulator per whole row, so it "
                          f"needs memory.partition 'local' or 'number', got '{mem.partition}'")
    if mem.fused_value_optimizer and mem.value_optimizer == "adamw":
        raise ConfigError("memory.fused_value_optimizer steps the rows in the lookups' backward with a row-wise "
                          "optimizer: it needs memory.value_optimizer 'sparse_adam' or 'rowwise_adagrad', got 'adamw'")


def validate_memory(config, world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` (one sentence) for impossible ``memory.*`` settings."""
    mem, m = config.memory, config.model
    if mem.type not in MEMORY_TYPES:
        raise ConfigError(f"memory.type '{mem.type}' is not available; valid: {', '.join(MEMORY_TYPES)}")
    p = config.parallel
    if mem.type != "moe" and (p.expert_model_parallel_size != 1 or p.expert_tensor_parallel_size is not None):
        raise ConfigError("parallel.expert_model_parallel_size and expert_tensor_parallel_size split MoE "
                          "experts; they need memory.type 'moe'")
    if mem.type == "none":
        return
    if m.arch not in ("transformer", "rmt"):
        raise ConfigError(f"memory.type '{mem.type}' needs model.arch 'transformer' or 'rmt' (the {m.arch} "
                          f"does not take memory layers)")
    if world_size is None:
        from rmt.config import world_size_from_env

        world_size = world_size_from_env()
    validate_memory_parallel(config, world_size)
    if mem.type != "ultramem_v2" and (mem.value_dim or mem.pre_value_dim or mem.pre_value_activation != "none"):
        raise ConfigError(f"memory.value_dim, pre_value_dim and pre_value_activation apply to memory.type "
                          f"'ultramem_v2', not '{mem.type}'")
    if mem.type != "ultramem_v2" and not mem.placement:
        raise ConfigError(f"memory.type '{mem.type}' needs memory.placement, e.g. '1:2'")
    if mem.type == "moe":
        if mem.query_batchnorm or mem.query_bias:
            raise ConfigError("memory.query_batchnorm and memory.query_bias apply to the queries of memory.type "
                              "'ultramem' or 'pkm'; MoE has none")
        validate_moe(config, world_size)
        return
    validate_memory_pipeline(config, memory_placement(config))
    for key in ("num_heads", "topk", "key_dim", "num_keys", "tucker_rank", "num_cores", "ive_blocks",
                "conv_kernel"):
        if getattr(mem, key) <= 0:
            raise ConfigError(f"memory.{key} must be positive, got {getattr(mem, key)}")
    if mem.init_samples < 0:
        raise ConfigError(f"memory.init_samples must be 0 (exact E[Y]) or a positive sample count, "
                          f"got {mem.init_samples}")
    if mem.value_init_std is not None and not mem.value_init_std > 0:
        raise ConfigError(f"memory.value_init_std must be positive (or null: the improved_init rule), "
                          f"got {mem.value_init_std}")
    if mem.value_lr_mult < 1.0:
        raise ConfigError(f"memory.value_lr_mult must be >= 1, got {mem.value_lr_mult}")
    validate_value_optimizer(mem)
    if mem.aux_loss_weight < 0 or mem.aux_loss_margin < 0:
        raise ConfigError("memory.aux_loss_weight and memory.aux_loss_margin must not be negative")
    if mem.type == "pkm":
        if mem.key_dim % 2:
            raise ConfigError(f"memory.key_dim ({mem.key_dim}) must be even for PKM (row and column halves)")
        if mem.topk > mem.num_keys:
            raise ConfigError(f"memory.topk ({mem.topk}) exceeds memory.num_keys ({mem.num_keys}) keys per side")
        return
    if mem.type == "ultramem_v2":
        validate_ultramem_v2(config)
    else:
        if mem.topk > mem.num_keys * mem.num_keys:
            raise ConfigError(f"memory.topk ({mem.topk}) exceeds the number of memory slots ({mem.num_keys ** 2})")
        if mem.retrieval == "tucker" and mem.key_dim % mem.tucker_rank:
            raise ConfigError(f"memory.key_dim ({mem.key_dim}) must be divisible by memory.tucker_rank "
                              f"({mem.tucker_rank})")
    validate_key_grid(config)


def validate_key_grid(config) -> None:
    """UltraMem's and UltraMemV2's retrieval, key grid and value columns."""
    mem = config.memory
    if mem.retrieval not in ("tucker", "product"):
        raise ConfigError(f"memory.retrieval must be 'tucker' or 'product', got '{mem.retrieval}'")
    side = math.isqrt(mem.ive_blocks)
    if side * side != mem.ive_blocks:
        raise ConfigError(
            f"memory.ive_blocks ({mem.ive_blocks}) must be a perfect square (the key grid grows by sqrt(E) per side)")
    if mem.topk > mem.num_keys * side:
        raise ConfigError(f"memory.topk ({mem.topk}) exceeds the {mem.num_keys * side} keys per side")
    if mem.retrieval == "product" and mem.num_cores != 1:
        raise ConfigError("memory.num_cores > 1 (multi-core scoring) needs memory.retrieval 'tucker'")
    dim = value_dim(config)
    if dim % mem.num_cores:
        raise ConfigError(f"the value dim ({dim}) must be divisible by memory.num_cores ({mem.num_cores})")


def validate_ultramem_v2(config) -> None:
    """``memory.type: ultramem_v2`` (:mod:`rmt.memory.layer_v2`): its own keys and the UltraMem
    switches it has no use for (its key grid: :func:`validate_key_grid`)."""
    mem = config.memory
    if mem.async_stream and config.model.arch != "transformer":
        raise ConfigError("memory.async_stream with memory.type 'ultramem_v2' needs model.arch 'transformer': the "
                          "RMT's memories apply the layer's FFN norm themselves, whose gradient the stream's "
                          "backward would add concurrently with the layer's")
    if mem.query_batchnorm or mem.query_bias or mem.softmax:
        raise ConfigError("memory.query_batchnorm, query_bias and softmax are PKM/UltraMem switches; "
                          "memory.type 'ultramem_v2' has RMS-normed queries without bias and no softmax")
    if mem.value_dim < 0 or mem.pre_value_dim < 0:
        raise ConfigError(f"memory.value_dim ({mem.value_dim}) and memory.pre_value_dim ({mem.pre_value_dim}) "
                          f"must not be negative")
    if mem.pre_value_activation not in PRE_VALUE_ACTIVATIONS:
        raise ConfigError(f"memory.pre_value_activation must be one of {', '.join(PRE_VALUE_ACTIVATIONS)}, "
                          f"got '{mem.pre_value_activation}'")
