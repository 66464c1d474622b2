"""The widths and placements a config gives its memory layers: what the memory runtime
(:mod:`rmt.memory.layer`, :mod:`rmt.memory.attach`, :mod:`rmt.memory.moe`), the planner and the
config checks (:mod:`rmt.memory.config_checks`) all compute the same way. Plain arithmetic on the
config (no torch); a placement that cannot be parsed is a :class:`ConfigError`."""

from __future__ import annotations

from typing import List, Optional, Tuple

from rmt.errors import ConfigError


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
            f"base-60 number, so quote it (memory.placement='3:5')"
        )
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
                f"memory.placement entry '{item}' must lie within layers 1..model.num_layers ({num_layers})"
            )
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
            raise ConfigError(
                f"memory.placement entry '{item}' must be a layer 'i' or a range 'i-j' "
                f"(memory.moe_placement 'mlp' and memory.type 'ultramem_v2' list layers)"
            )
        if len(parts) > 2 or first > last:
            raise ConfigError(f"memory.placement entry '{item}' must be a layer 'i' or a range 'i-j' with i <= j")
        if first < 1 or last > num_layers:
            raise ConfigError(
                f"memory.placement entry '{item}' must lie within layers 1..model.num_layers ({num_layers})"
            )
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
