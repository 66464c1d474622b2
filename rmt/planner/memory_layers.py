"""Parameters and forward FLOPs per token of the memory layers: UltraMem / PKM
(:class:`rmt.memory.layer.MemoryLayer`) and megatron's MoE (:mod:`rmt.memory.moe`), at skip
placements or as the MLP of transformer layers.

Same convention as :mod:`rmt.planner.flops`: 2 FLOPs per multiply-accumulate of every matmul-like
product the forward computes, norms, activations, softmaxes, top-k selections and adds skipped.
Per token of one layer of width W:

* UltraMem / PKM (UltraMem Eq. 4-17): causal conv ``2 W K``; query ``2 W H s Kd`` (s = 1 shared
  or 2 sides); row and column key scores of all ``n = Knum sqrt(E)`` keys per side, Eq. 4,
  ``2 H 2 n Kd``; the TDQKR selection (Eq. 7-10, :func:`rmt.memory.retrieval.tucker_select`,
  as its CPU kernel computes it): rank-1 objectives ``2 H 2 r n``, the candidate grid
  ``S_row^T C S_col`` over ``c = min(2m, n)`` candidates per side ``2 H (c r^2 + c^2 r)``;
  multi-core scores at the m selected pairs (Eq. 16) ``2 H m r^2 h``; the weighted pooling of
  the ``H m`` value rows (Eq. 15, 17; lookup-reduce) ``2 H m Dv``; the block projectors
  ``2 E Dv W`` (none when E = 1 and Dv = W).
* UltraMemV2 (:mod:`rmt.memory.layer_v2`): query ``2 W H 2 Kd`` (a row and a column query per
  head); key scores of every Tucker rank's full-width keys ``2 H 2 r n Kd``; the TDQKR
  selection and multi-core scores as above; with pre-values the pre-value projection
  ``2 W Dp`` and the ``H m`` pre-value dot products ``2 H m Dp``; the pooling ``2 H m Dv``; one
  output projection ``2 Dv W``.
* MoE: router ``2 W N``; the k experts a token is routed to, ``k 4 W F`` (no capacity
  dropping counted). *Activated* parameters are those a token's forward multiplies with:
  the router and k of the N experts (and of a memory table the ``H m`` retrieved rows).
"""

from __future__ import annotations

from typing import Dict, List

from rmt.memory.shapes import expert_hidden_size, memory_placement, memory_width, parse_moe_layers, parse_placement


def _tdqkr_flops(s) -> int:
    """The TDQKR selection (rank-1 objectives, candidate grid) and the multi-core scores at the m
    selected pairs, per token (``s`` a ``MemorySpec``; 0 for product keys)."""
    if s.retrieval != "tucker":
        return 0
    H, r, n, m, C = s.num_heads, s.tucker_rank, s.grid, s.topk, s.num_cores
    c = min(2 * m, n)
    return 2 * H * (2 * r * n + c * r * r + c * c * r + m * r * r * C)


def ultramem_v2_counts(spec) -> Dict[str, int]:
    """``params``, ``activated_params`` and ``flops_per_token`` of one
    :class:`~rmt.memory.layer_v2.UltraMemV2Layer` with resolved ``spec``."""
    s = spec
    W, H, Kd, r, C, n, m = s.hidden_size, s.num_heads, s.side_dim, s.tucker_rank, s.num_cores, s.grid, s.topk
    Dv, Dp = s.value_dim, s.pre_value_dim
    dense = {
        "query": W * H * 2 * Kd,
        "keys": H * 2 * r * n * Kd,
        "query_key_norms": 2 * Kd,
        "cores": H * C * r * r if s.retrieval == "tucker" else 0,
        "pre_proj": W * Dp,
        "proj": Dv * W,
    }
    flops = (
        2 * W * H * 2 * Kd
        + 2 * H * 2 * r * n * Kd
        + _tdqkr_flops(s)
        + 2 * W * Dp
        + 2 * H * m * Dp
        + 2 * H * m * Dv
        + 2 * Dv * W
    )
    return {
        "params": sum(dense.values()) + s.num_values * (Dv + Dp),
        "activated_params": sum(dense.values()) + H * m * (Dv + Dp),
        "flops_per_token": flops,
    }


def ultramem_counts(spec) -> Dict[str, int]:
    """``params``, ``activated_params`` and ``flops_per_token`` of one
    :class:`~rmt.memory.layer.MemoryLayer` with resolved ``spec`` (a ``MemorySpec``;
    UltraMemV2's: :func:`ultramem_v2_counts`)."""
    s = spec
    if s.version == 2:
        return ultramem_v2_counts(s)
    W, H, Kd, r, E, C = s.hidden_size, s.num_heads, s.side_dim, s.tucker_rank, s.ive_blocks, s.num_cores
    n, m, Dv = s.grid, s.topk, s.value_dim
    sides = 1 if s.share_query else 2
    sub = Kd // r
    tucker = s.retrieval == "tucker"
    proj = E > 1 or Dv != W
    dense = {
        "norm": 2 * W,
        "conv": W * s.conv_kernel,
        "query": W * H * sides * Kd,
        "keys": H * 2 * r * n * sub,
        "query_key_norms": 4 * sub if s.query_key_norm else 0,
        "cores": H * C * r * r if tucker else 0,
        "proj": E * Dv * W if proj else 0,
    }
    values = s.num_values * Dv
    flops = 2 * (
        W * s.conv_kernel + W * H * sides * Kd + H * 2 * n * Kd + H * m * Dv + (E * Dv * W if proj else 0)
    ) + _tdqkr_flops(s)
    return {
        "params": sum(dense.values()) + values,
        "activated_params": sum(dense.values()) + H * m * Dv,
        "flops_per_token": flops,
    }


def moe_counts(width: int, experts: int, topk: int, expert_hidden: int, norm: bool) -> Dict[str, int]:
    """One MoE (router without bias, bias-free GELU experts); ``norm``: its own LayerNorm (skip
    placements; an MLP replacement uses the layer's pre-MLP norm)."""
    expert = 2 * width * expert_hidden
    base = width * experts + (2 * width if norm else 0)
    return {
        "params": base + experts * expert,
        "activated_params": base + topk * expert,
        "flops_per_token": 2 * width * experts + topk * 2 * expert,
    }


def memory_plan(config) -> Dict:
    """Counts of all memory layers of ``config`` (``memory.type`` not none): per placement and
    in total. For ``moe_placement: mlp`` these are the MoE MLPs that replace dense ones."""
    mem, m = config.memory, config.model
    width = memory_width(config)
    if mem.type == "moe":
        F = expert_hidden_size(config)
        if mem.moe_placement == "mlp":
            where = [str(layer) for layer in parse_moe_layers(mem.placement, m.num_layers)]
        else:
            where = [f"{i}:{j}" for i, j in parse_placement(mem.placement, m.num_layers)]
        each = [moe_counts(width, mem.num_experts, mem.moe_topk, F, mem.moe_placement == "skip") for _ in where]
    else:
        from rmt.memory.layer import MemorySpec

        where = [str(i) if mem.type == "ultramem_v2" else f"{i}:{j}" for i, j in memory_placement(config)]
        each = [ultramem_counts(MemorySpec.from_config(config, k)) for k in range(len(where))]
    layers: List[Dict] = [{"placement": p, **c} for p, c in zip(where, each)]
    total = {key: sum(c[key] for c in each) for key in ("params", "activated_params", "flops_per_token")}
    plan = {
        "type": mem.type,
        "placement": mem.moe_placement if mem.type == "moe" else "ffn" if mem.type == "ultramem_v2" else "skip",
        "layers": layers,
        **total,
    }
    if mem.type == "ultramem_v2":
        plan["memory_over_ffn_flops"] = total["flops_per_token"] / (len(layers) * ffn_flops_per_token(config))
    return plan


def ffn_flops_per_token(config) -> int:
    """Forward FLOPs per token of one layer's FFN (its two matmuls, ``2 x 2 x in x ffn``; ``in`` the
    transformer's hidden size or the RMT's ``rank x dv``): the denominator of UltraMemV2's
    memory/FFN compute ratio."""
    m = config.model
    width = m.rank * m.dv if m.arch == "rmt" else m.hidden_size
    return 4 * width * (m.ffn_hidden_size or 4 * width)
