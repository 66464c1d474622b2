"""Cross-field checks of the ``memory.*`` keys (one :class:`ConfigError` sentence each), run by
:func:`rmt.config_checks.validate`. Each key's own choices and bounds are declared in the schema
(:mod:`rmt.config`) and checked there; these checks read the config and never change it."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from rmt.config import TABLE_TYPES
from rmt.errors import ConfigError
from rmt.memory.shapes import (
    expert_hidden_size,
    memory_placement,
    num_model_chunks,
    parse_moe_layers,
    parse_placement,
    value_dim,
)
from rmt.parallel.launch_env import world_size_from_env


def validate_moe(config, world_size: int) -> None:
    """``memory.type: moe`` keys and expert parallelism (megatron-core's MoELayer and groups)."""
    mem, m, p = config.memory, config.model, config.parallel
    if mem.value_optimizer != "adamw":
        raise ConfigError(
            "memory.value_optimizer applies to the value tables of memory.type 'ultramem' "
            "or 'pkm'; MoE experts are dense, leave it 'adamw'"
        )
    if mem.moe_topk > mem.num_experts:
        raise ConfigError(f"memory.moe_topk ({mem.moe_topk}) exceeds memory.num_experts ({mem.num_experts})")
    if mem.moe_placement == "mlp":
        if m.arch != "transformer":
            raise ConfigError(
                f"memory.moe_placement 'mlp' replaces the MLP of megatron's transformer layers and "
                f"needs model.arch 'transformer', got '{m.arch}' (use moe_placement 'skip')"
            )
        parse_moe_layers(mem.placement, m.num_layers)
    else:
        validate_memory_pipeline(config, parse_placement(mem.placement, m.num_layers))
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp
    if mem.num_experts % ep:
        raise ConfigError(
            f"memory.num_experts ({mem.num_experts}) must be divisible by parallel.expert_model_parallel_size ({ep})"
        )
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by expert tensor x expert model x pipeline parallel "
            f"size {etp} x {ep} x {pp} = {etp * ep * pp}"
        )
    if expert_hidden_size(config) % etp:
        raise ConfigError(
            f"the expert hidden size ({expert_hidden_size(config)}) must be divisible by the expert "
            f"tensor-parallel size ({etp})"
        )
    if tp > 1 and m.seq_length % tp:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({tp}): each tensor-parallel rank routes its "
            f"share of the sequence through the MoE"
        )


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
            what = (
                "stages" if chunks == config.parallel.pipeline_model_parallel_size else "model chunks (virtual stages)"
            )
            raise ConfigError(
                f"memory.placement '{start}:{end}' crosses the pipeline stage boundary after layer "
                f"{boundary}; with {chunks} {what} of {per} layers each placement must lie within layers {ranges}"
            )


def validate_memory_parallel(config, world_size: int) -> None:
    """``memory.partition`` / ``group_size`` / ``owner_reduce`` (UltraMem Appendix C/D): the
    group must divide the data x tensor parallel ranks of a stage and the split axis must
    divide evenly over it."""
    mem, p = config.memory, config.parallel
    if mem.partition == "local":
        if mem.owner_reduce:
            raise ConfigError("memory.owner_reduce needs memory.partition 'number' or 'auto'")
        return
    if mem.type == "moe":
        raise ConfigError("memory.partition must be 'local' for memory.type 'moe' (only UltraMem/PKM tables shard)")
    if mem.owner_reduce and mem.partition == "dimension":
        raise ConfigError("memory.owner_reduce needs memory.partition 'number' or 'auto'")
    dp_tp = world_size // p.pipeline_model_parallel_size
    if mem.group_size and dp_tp % mem.group_size:
        raise ConfigError(
            f"memory.group_size ({mem.group_size}) must divide the data x tensor parallel "
            f"size ({dp_tp}) (0 = all of it)"
        )
    G = mem.group_size or dp_tp
    slots = mem.num_keys * mem.num_keys
    dim = value_dim(config)
    if mem.partition in ("number", "auto") and slots % G:
        raise ConfigError(
            f"number-wise memory tables need the slot count ({slots}) to be divisible by "
            f"the memory-parallel group size ({G})"
        )
    if mem.partition in ("dimension", "auto") and dim % G:
        raise ConfigError(
            f"dimension-wise memory tables need the value dim ({dim}) to be divisible "
            f"by the memory-parallel group size ({G})"
        )
    if mem.type == "ultramem_v2" and mem.partition in ("dimension", "auto") and mem.pre_value_dim % G:
        raise ConfigError(
            f"dimension-wise memory tables need memory.pre_value_dim ({mem.pre_value_dim}) to be "
            f"divisible by the memory-parallel group size ({G})"
        )


def validate_value_optimizer(mem) -> None:
    """``memory.value_optimizer``: row-wise Adagrad needs whole rows on a rank;
    ``memory.fused_value_optimizer``: a row-wise optimizer to fuse."""
    if mem.value_optimizer == "rowwise_adagrad" and mem.partition in ("dimension", "auto"):
        raise ConfigError(
            f"memory.value_optimizer 'rowwise_adagrad' keeps one accumulator per whole row, so it "
            f"needs memory.partition 'local' or 'number', got '{mem.partition}'"
        )
    if mem.fused_value_optimizer and mem.value_optimizer == "adamw":
        raise ConfigError(
            "memory.fused_value_optimizer steps the rows in the lookups' backward with a row-wise "
            "optimizer: it needs memory.value_optimizer 'sparse_adam' or 'rowwise_adagrad', got 'adamw'"
        )


def validate_retrieval_kernel(config) -> None:
    """``memory.retrieval_kernel: fused`` needs a backend of the fused retrieval op for the
    run's device and precision (:func:`rmt.retrieval_backends.fused_retrieval_backends`, what
    the backends declare: nothing is built here)."""
    from rmt.parallel.compat import cuda_available
    from rmt.retrieval_backends import declared_devices, fused_retrieval_backends

    if config.memory.retrieval_kernel != "fused":
        return
    device = "cuda" if cuda_available() else "cpu"
    precision = config.train.precision
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    if not fused_retrieval_backends(device, dtype):
        raise ConfigError(
            f"memory.retrieval_kernel 'fused' has no backend for {device} tensors in train.precision "
            f"'{precision}' (the fused retrieval runs on: {declared_devices()}); use 'auto' (the unfused path where "
            f"the fused one has no backend) or 'unfused'"
        )


def validate_table_location(mem) -> None:
    """``memory.table_location: host``: value tables to hold, stepped on the host by a row-wise
    optimizer from their gathered row gradients; ``memory.host_cache_rows`` caches rows of them."""
    if mem.table_location != "host":
        if mem.host_cache_rows:
            raise ConfigError(
                f"memory.host_cache_rows caches rows of value tables held in host memory on the device: "
                f"it needs memory.table_location 'host', got '{mem.table_location}'"
            )
        return
    if mem.type not in TABLE_TYPES:
        raise ConfigError(
            f"memory.table_location 'host' keeps the value tables of memory.type 'ultramem', "
            f"'ultramem_v2' or 'pkm' in host memory; memory.type '{mem.type}' has none"
        )
    if mem.value_optimizer == "adamw":
        raise ConfigError(
            "memory.table_location 'host' steps the touched rows on the host: it needs "
            "memory.value_optimizer 'sparse_adam' or 'rowwise_adagrad', got 'adamw'"
        )
    if mem.fused_value_optimizer:
        raise ConfigError(
            "memory.table_location 'host' steps the rows on the host from their gradients, which "
            "memory.fused_value_optimizer never forms: set one of them"
        )


def validate_memory(config, world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` (one sentence) for impossible ``memory.*`` settings."""
    mem, m = config.memory, config.model
    p = config.parallel
    validate_table_location(mem)
    if mem.type != "moe" and (p.expert_model_parallel_size != 1 or p.expert_tensor_parallel_size is not None):
        raise ConfigError(
            "parallel.expert_model_parallel_size and expert_tensor_parallel_size split MoE "
            "experts; they need memory.type 'moe'"
        )
    if mem.type == "none":
        return
    if m.arch not in ("transformer", "rmt"):
        raise ConfigError(
            f"memory.type '{mem.type}' needs model.arch 'transformer' or 'rmt' (the {m.arch} "
            f"does not take memory layers)"
        )
    if world_size is None:
        world_size = world_size_from_env()
    validate_memory_parallel(config, world_size)
    if mem.type != "ultramem_v2" and (mem.value_dim or mem.pre_value_dim or mem.pre_value_activation != "none"):
        raise ConfigError(
            f"memory.value_dim, pre_value_dim and pre_value_activation apply to memory.type "
            f"'ultramem_v2', not '{mem.type}'"
        )
    if mem.type != "ultramem_v2" and not mem.placement:
        raise ConfigError(f"memory.type '{mem.type}' needs memory.placement, e.g. '1:2'")
    if mem.type == "moe":
        if mem.query_batchnorm or mem.query_bias:
            raise ConfigError(
                "memory.query_batchnorm and memory.query_bias apply to the queries of memory.type "
                "'ultramem' or 'pkm'; MoE has none"
            )
        validate_moe(config, world_size)
        return
    validate_memory_pipeline(config, memory_placement(config))
    validate_value_optimizer(mem)
    validate_retrieval_kernel(config)
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
            raise ConfigError(f"memory.topk ({mem.topk}) exceeds the number of memory slots ({mem.num_keys**2})")
        if mem.retrieval == "tucker" and mem.key_dim % mem.tucker_rank:
            raise ConfigError(
                f"memory.key_dim ({mem.key_dim}) must be divisible by memory.tucker_rank ({mem.tucker_rank})"
            )
    validate_key_grid(config)


def validate_key_grid(config) -> None:
    """UltraMem's and UltraMemV2's retrieval, key grid and value columns."""
    mem = config.memory
    side = math.isqrt(mem.ive_blocks)
    if side * side != mem.ive_blocks:
        raise ConfigError(
            f"memory.ive_blocks ({mem.ive_blocks}) must be a perfect square (the key grid grows by sqrt(E) per side)"
        )
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
    if mem.query_batchnorm or mem.query_bias or mem.softmax:
        raise ConfigError(
            "memory.query_batchnorm, query_bias and softmax are PKM/UltraMem switches; "
            "memory.type 'ultramem_v2' has RMS-normed queries without bias and no softmax"
        )
