"""What tables in host memory move and compute per step: ``rmt-plan memory --table-location host``.

With ``memory.table_location: host`` (:class:`rmt.memory.storage.HostStorage`) a rank's shard, its row-wise
optimizer state and its gradient live in host memory (:func:`rmt.planner.memory.host_phases`);
every lookup of a table stages its ``U`` distinct rows (:func:`rmt.planner.memory.staged_rows`)
on the device. Per table lookup (one micro-batch, ``D`` the shard's columns, ``b`` bytes of
``memory.value_dtype``), as :class:`rmt.memory.storage.HostStorage` counts in its ``link``:

``forward``
    ``d2h_indices`` = ``8 U`` (the distinct rows' int64 indices to the host), ``h2d_rows`` =
    ``U D b`` (the staged rows to the device);
``backward``
    ``d2h_row_grads`` = ``U D b`` (the staged rows' gradient, summed over each row's lookups on
    the device, in the table's dtype).

An UltraMemV2 layer with pre-values has two tables staging the same rows (``index_tables = 2``:
twice the indices, ``D = Dv + Dp``). With data-parallel copies of a shard (``replicas > 1``) the
step's sparse gradient (``G`` rows of the step, :func:`rmt.planner.memory.staged_rows` over its
``m`` micro-batches) is summed over them through the device (NCCL takes device tensors,
:func:`rmt.memory.groups.sum_sparse_grads`): ``h2d_grad_rows`` = ``G (8 + D b)`` up,
``d2h_summed_grad_rows`` = ``replicas G (8 + D b)`` (every copy's rows) back, once per step, outside
the overlap window and outside ``HostStorage.link``.

The host optimizer steps the rows the step touched on any copy, ``R`` = the distinct rows of
``replicas x m`` micro-batches: ``R D`` elements, each reading the gradient and the row and
writing the row (``3 b`` bytes), plus two fp32 moments read and written (``sparse_adam``,
16 bytes) or one fp32 accumulator per row (``rowwise_adagrad``, 8 bytes per row).

Overlap: with ``memory.async_stream`` a memory layer placed ``i:j`` runs its lookup beside the
dense layers ``i+1..j`` (UltraMemV2's, beside its block's FFN). A lookup's transfers are serial
(the indices before the rows), so its forward takes ``(8 U + U D b) / link`` and its backward
``U D b / link`` at ``link_gbps`` GB/s per direction; the forward window is those layers' forward
FLOPs on the rank (``1/t`` of them under tensor parallelism) at ``tflops``, the backward window
twice it (:data:`BACKWARD_WINDOW`). What exceeds its window (all of it without the async
stream) is exposed. The host's gather of the rows and its optimizer step are not timed.

A device cache (``cache_rows`` ``C``, ``memory.host_cache_rows``, :mod:`rmt.memory.host_cache`)
serves a fraction ``h`` of each lookup's distinct rows (:func:`rmt.planner.memory.hit_fraction`):
only ``(1 - h) U`` rows cross forward and backward, the replicas' gradient sum and the host
optimizer take ``(1 - h)`` of their rows, and each step sends the host rows' indices and squared
norms to the device for the gradient norm (``step`` ``h2d_grad_row_norms``, 16 bytes a row of
``R``, each table). A refresh moves at most every cached row both ways with its optimizer state
(:func:`cache_refresh_bytes`, once per ``memory.host_cache_refresh`` steps, waiting for the host
step; not in ``per_step``).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from rmt.planner.memory import (
    CACHE_INDEX_BYTES,
    DTYPE_BYTES,
    TablePlan,
    cache_row_bytes,
    cached_rows,
    hit_fraction,
    lookups_staged,
    staged_rows,
)

INDEX_BYTES = 8
"""Bytes per staged row's index: int64, as :data:`rmt.memory.host_cache.INDEX_BYTES`."""
HOST_LINK_GBPS = 25.0
"""GB/s per direction of a GPU's host link: PCIe 4.0 x16 signals 16 GT/s on 16 lanes, 31.5 GB/s
after its 128b/130b coding, of which pinned copies achieve about 25 (CUDA's bandwidthTest on
such hosts); PCIe 5.0 x16 (H100, H200) doubles both."""
TFLOPS = 400.0
"""Achieved dense TFLOP/s per GPU of the window's layers, the default of ``rmt-plan memory
--tflops`` (about 40% of an H100's bf16 peak; ``rmt-plan time`` times the window with a hardware
profile instead)."""
BACKWARD_WINDOW = 2
"""The backward of the window's layers does about twice their forward FLOPs (the gradients of
the inputs and of the weights)."""
COUNT_BYTES = 8
"""Bytes of a candidate row's lookup count, and of a host row's squared gradient norm
(int64, float64: :data:`rmt.memory.host_cache.COUNT_BYTES`)."""
SPARSE_ADAM_STATE_BYTES = 16  # two fp32 moments, read and written, per element
ADAGRAD_STATE_BYTES = 8  # one fp32 accumulator, read and written, per row


def host_link_bytes(unique_rows: int, cols: int, value_bytes: int) -> Dict[str, Dict[str, int]]:
    """Bytes one lookup of a host table moves over the host link when it stages ``unique_rows``
    distinct rows of ``cols`` columns of ``value_bytes`` each, under the names of
    :class:`rmt.memory.storage.HostStorage`'s ``link`` counter."""
    row = unique_rows * cols * value_bytes
    return {"forward": {"d2h_indices": INDEX_BYTES * unique_rows, "h2d_rows": row}, "backward": {"d2h_row_grads": row}}


def layer_link_bytes(plan: TablePlan) -> Dict[str, Dict[str, int]]:
    """:func:`host_link_bytes` of one memory layer's lookup at the expected ``U``, less the
    fraction ``h`` a device cache serves (:func:`rmt.planner.memory.hit_fraction`): ``(1 - h) U``
    rows cross (its ``index_tables`` tables each send the indices)."""
    missed = round(staged_rows(plan) * (1 - hit_fraction(plan)))
    out = host_link_bytes(missed, plan.shard_shape[1], DTYPE_BYTES[plan.value_dtype])
    out["forward"]["d2h_indices"] *= plan.index_tables
    return out


def host_step_rows(plan: TablePlan, microbatches: int) -> int:
    """Rows of a table's step gradient on the host over ``microbatches`` micro-batches: the
    distinct rows they stage, at most the shard's, less the cached ones."""
    rows = plan.shard_shape[0]
    return round(min(rows, staged_rows(plan, microbatches)) * (1 - hit_fraction(plan)))


def cache_refresh_bytes(plan: TablePlan) -> Dict[str, int]:
    """Bytes over the host link of one cache refresh of a rank's tables at most, when it replaces
    every cached row (:meth:`rmt.memory.host_cache.HostCache.refresh`'s ``refresh`` counts):
    ``C`` candidates (index and count, 16 bytes each) to the device, ``C`` evicted rows with their
    indices and state back, ``C`` admitted rows' indices back and their rows and state up."""
    C, L = cached_rows(plan), plan.layers
    row = cache_row_bytes(plan) - CACHE_INDEX_BYTES * plan.index_tables
    n = L * C * plan.index_tables
    return {
        "h2d_candidates": n * (INDEX_BYTES + COUNT_BYTES),
        "d2h_evicted_indices": n * INDEX_BYTES,
        "d2h_evicted_rows": L * C * row,
        "d2h_admitted_indices": n * INDEX_BYTES,
        "h2d_admitted_rows": L * C * row,
    }


def optimizer_work(plan: TablePlan) -> Dict[str, int]:
    """The host optimizer's step on a rank (all its memory layers): rows touched, elements
    stepped, bytes read and written (module docstring)."""
    cols = plan.shard_shape[1]
    b = DTYPE_BYTES[plan.value_dtype]
    touched = host_step_rows(plan, plan.microbatches * plan.replicas)
    elements = touched * cols
    if plan.value_optimizer == "sparse_adam":
        moved = elements * (3 * b + SPARSE_ADAM_STATE_BYTES)
    else:
        moved = elements * 3 * b + touched * ADAGRAD_STATE_BYTES
    L = plan.layers
    return {"touched_rows": L * touched, "elements": L * elements, "bytes": L * moved}


def step_link_bytes(plan: TablePlan) -> Dict[str, Dict[str, int]]:
    """Bytes over the host link per step on a rank: every layer's lookups of every micro-batch
    (forward, backward) and the replicas' gradient sum (step)."""
    per = layer_link_bytes(plan)
    n = plan.microbatches * plan.layers
    out = {phase: {k: n * v for k, v in d.items()} for phase, d in per.items()}
    out["step"] = {}
    if plan.replicas > 1:
        cols = plan.shard_shape[1]
        grad = host_step_rows(plan, plan.microbatches) * (INDEX_BYTES + cols * DTYPE_BYTES[plan.value_dtype])
        out["step"] = {"h2d_grad_rows": plan.layers * grad, "d2h_summed_grad_rows": plan.layers * plan.replicas * grad}
    if plan.cache_rows:  # the host rows' squared norms join the cached rows' on the device
        rows = host_step_rows(plan, plan.microbatches * plan.replicas)
        out["step"]["h2d_grad_row_norms"] = plan.layers * plan.index_tables * rows * (INDEX_BYTES + COUNT_BYTES)
    return out


def overlap(
    plan: TablePlan,
    window_flops: List[float],
    link_gbps: float = HOST_LINK_GBPS,
    tflops: float = TFLOPS,
    async_stream: bool = True,
) -> Dict:
    """Each memory layer's transfers against its overlap window (``window_flops``: the forward
    FLOPs on one rank of the dense layers beside it, one micro-batch; one entry per layer), and
    the seconds per step they leave exposed."""
    per = layer_link_bytes(plan)
    forward_s = sum(per["forward"].values()) / (link_gbps * 1e9)
    backward_s = sum(per["backward"].values()) / (link_gbps * 1e9)
    layers, exposed = [], 0.0
    for flops in window_flops:
        fwd_window = flops / (tflops * 1e12) if async_stream else 0.0
        bwd_window = BACKWARD_WINDOW * fwd_window
        layers.append(
            {
                "window_flops": flops,
                "forward_s": forward_s,
                "forward_window_s": fwd_window,
                "backward_s": backward_s,
                "backward_window_s": bwd_window,
                "fits": forward_s <= fwd_window and backward_s <= bwd_window,
            }
        )
        exposed += max(0.0, forward_s - fwd_window) + max(0.0, backward_s - bwd_window)
    return {"layers": layers, "fits": all(r["fits"] for r in layers), "exposed_s_per_step": plan.microbatches * exposed}


def host_report(
    plan: TablePlan,
    window_flops: Optional[List[float]] = None,
    link_gbps: float = HOST_LINK_GBPS,
    tflops: float = TFLOPS,
    async_stream: bool = True,
) -> Dict:
    """The host-link part of ``rmt-plan memory --table-location host``'s JSON document:
    the staged rows, the bytes per lookup and per step, the host optimizer's work, the
    transfer seconds and, given the windows' FLOPs, the overlap."""
    if plan.location != "host":
        raise ValueError("the host link is planned for tables in host memory: it needs the host table location.")
    unique = staged_rows(plan)
    lookups = lookups_staged(plan)
    per_step = step_link_bytes(plan)
    per = layer_link_bytes(plan)
    doc = {
        "staged_rows": unique,
        "lookups_staged": lookups,
        "unique_fraction": unique / lookups,
        "per_lookup": per,
        "per_step": per_step,
        "per_step_total": sum(v for d in per_step.values() for v in d.values()),
        "optimizer": optimizer_work(plan),
        "cache": None,
        "link_gbps": link_gbps,
        "tflops": tflops,
        "async_stream": async_stream,
        "forward_s_per_lookup": sum(per["forward"].values()) / (link_gbps * 1e9),
        "backward_s_per_lookup": sum(per["backward"].values()) / (link_gbps * 1e9),
        "overlap": None,
    }
    if window_flops is not None:
        doc["overlap"] = overlap(plan, window_flops, link_gbps, tflops, async_stream)
    if plan.cache_rows:
        doc["cache"] = {
            "rows": cached_rows(plan),
            "hit_fraction": hit_fraction(plan),
            "hit_fraction_given": plan.cache_hit is not None,
            "device_bytes": plan.layers * cached_rows(plan) * cache_row_bytes(plan),
            "refresh_bytes_max": cache_refresh_bytes(plan),
        }
    return doc


def dense_layer_flops_per_token(config) -> float:
    """Forward FLOPs per token of one dense layer of ``config``'s model
    (:func:`rmt.planner.flops.plan_model` without its memory layers, logits and the RMT's
    embedding writes, over the layers)."""
    from rmt.models.vocab import padded_vocab_size
    from rmt.planner.flops import plan_model

    m = config.model
    doc = plan_model(config)
    rest = doc["flops_per_token"] - doc.get("memory", {}).get("flops_per_token", 0)
    if m.arch == "rmt":
        key = 2 * m.dk * m.dv * m.rank  # one read or write of R key vectors (rmt_counts)
        rest -= 2 * m.rank * m.dv * padded_vocab_size(config) + key * (3 if m.position == "learned" else 2)
    else:
        rest -= 2 * m.hidden_size * padded_vocab_size(config)
    return rest / m.num_layers


def window_flops(config, placements, tensor_parallel: int) -> List[float]:
    """Forward FLOPs on one rank, per micro-batch, of the dense work each memory layer at
    ``placements`` (``(i, j)`` pairs) overlaps: layers ``i+1..j``; UltraMemV2's ``(i, i)``, the FFN
    of block ``i`` it runs beside (:func:`rmt.planner.memory_layers.ffn_flops_per_token`)."""
    from rmt.planner.memory_layers import ffn_flops_per_token

    tokens = config.train.micro_batch_size * config.model.seq_length
    per_layer = dense_layer_flops_per_token(config)
    ffn = ffn_flops_per_token(config)
    return [tokens * ((j - i) * per_layer if j > i else ffn) / tensor_parallel for i, j in placements]


def stage_placements(config, layout, stage: int) -> List:
    """The placements ``(i, j)`` of the memory layers on a rank of pipeline ``stage``."""
    from rmt.memory.shapes import memory_placement
    from rmt.planner.rank import chunks_of

    spans = chunks_of(config, layout, stage)
    return [(i, j) for i, j in memory_placement(config) if any(f <= i <= last for f, last in spans)]
