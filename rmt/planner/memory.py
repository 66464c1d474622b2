"""Bytes per rank of a sharded memory table: shard, gradients, optimizer states.

UltraMem's Appendix C shards the value table over a memory-parallel group of ``P`` ranks
because table plus optimizer states exceed one device. This module answers "how much
memory does each rank need" and "how many ranks does the table need".

Conventions:

* Shard: number-wise a rank holds ``ceil(N/P)`` rows of ``D`` columns (the largest
  shard); dimension-wise ``N`` rows of ``ceil(D/P)`` columns.
* ``master_fp32``: mixed precision with an fp32 master copy of the shard (none if the
  table is already fp32); gradients are then accumulated in fp32 and optimizer states
  kept in fp32. Without it, gradients and optimizer states use the table's dtype
  (fp32 tables: fp32 everywhere).
* Optimizer states per element: Adam 2 (first and second moment; SparseAdam too, its
  moments are dense), Adagrad 1 (sum of squares), SGD 0 (no momentum). Row-wise Adagrad
  (``rowwise_adagrad``, ``memory.value_optimizer``) keeps one fp32 accumulator per row of
  the shard instead, whatever the width.
* Gradients, ``grad="dense"``: one table-shard-sized buffer (what autograd of an
  embedding lookup materializes). ``grad="sparse"``: the rows touched in a step, kept
  uncoalesced as (int64 row index, row gradient) pairs. With ``tokens`` = T tokens per
  rank and ``topm`` = K, number-wise each rank receives ``T K`` rows of ``D`` in
  expectation (``T K / P`` from each of ``P`` requesters); dimension-wise it computes
  ``P T K`` rows of its ``ceil(D/P)`` columns.
"""

from __future__ import annotations

import math

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_STATES = {"adam": 2, "adagrad": 1, "sgd": 0, "rowwise_adagrad": 0}  # per element
ROW_STATE_BYTES = {"rowwise_adagrad": 4}  # per row
GRAD_MODES = ("dense", "sparse")
PARTITIONS = ("number", "dimension")
SPARSE_INDEX_BYTES = 8
GIB = 1 << 30


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _validate(slots, dim, P, dtype, optimizer, grad, tokens, topm, partition) -> None:
    for name, value in (("slots", slots), ("dim", dim), ("group size P", P)):
        _positive_int(name, value)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, "
                         f"got {optimizer!r}.")
    if grad not in GRAD_MODES:
        raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}.")
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}.")
    split, what = (slots, "slots") if partition == "number" else (dim, "dim")
    if P > split:
        raise ValueError(f"group size ({P}) exceeds {what} ({split}): a {partition}-wise "
                         f"shard would be empty.")
    if grad == "sparse" and (tokens is None or topm is None):
        raise ValueError("sparse gradients need tokens and topm per step.")
    for name, value in (("tokens", tokens), ("topm", topm)):
        if value is not None:
            _positive_int(name, value)
    if topm is not None and topm > slots:
        raise ValueError(f"top-m ({topm}) cannot exceed the number of slots ({slots}).")


def memory_per_rank(slots: int, dim: int, P: int, *, dtype: str = "bf16",
                    optimizer: str = "adam", master_fp32: bool = False,
                    grad: str = "dense", tokens: int | None = None,
                    topm: int | None = None, partition: str = "number") -> dict:
    """Bytes one rank of a ``P``-rank memory-parallel group holds for the table.

    Returns ``{"elements": table elements on this rank, "table": shard bytes,
    "gradients": bytes of the ``grad`` mode, "gradients_dense": dense gradient bytes,
    "gradients_sparse": sparse gradient bytes or None without tokens/topm,
    "master_weights": fp32 master copy bytes, "optimizer_states": bytes,
    "total": table + gradients + master_weights + optimizer_states}``.
    """
    _validate(slots, dim, P, dtype, optimizer, grad, tokens, topm, partition)
    if partition == "number":
        rows, cols = math.ceil(slots / P), dim
    else:
        rows, cols = slots, math.ceil(dim / P)
    touched_rows = None
    if tokens is not None and topm is not None:
        touched_rows = tokens * topm * (1 if partition == "number" else P)
    elements = rows * cols
    param_bytes = DTYPE_BYTES[dtype]
    wide = master_fp32 or dtype == "fp32"
    grad_bytes = state_bytes = 4 if wide else param_bytes
    dense = elements * grad_bytes
    sparse = None if touched_rows is None else touched_rows * (
        cols * grad_bytes + SPARSE_INDEX_BYTES)
    table = elements * param_bytes
    master = elements * 4 if master_fp32 and dtype != "fp32" else 0
    states = elements * OPTIMIZER_STATES[optimizer] * state_bytes + rows * ROW_STATE_BYTES.get(optimizer, 0)
    gradients = dense if grad == "dense" else sparse
    return {"elements": elements, "table": table, "gradients": gradients,
            "gradients_dense": dense, "gradients_sparse": sparse,
            "master_weights": master, "optimizer_states": states,
            "total": table + gradients + master + states}


def min_group_size(slots: int, dim: int, budget_bytes: int, **options) -> int | None:
    """Smallest ``P`` whose per-rank total (:func:`memory_per_rank`) fits ``budget_bytes``.

    ``None`` if no group size fits (for example when sparse gradients alone exceed the
    budget). Number-wise totals never grow with ``P`` (binary search over 1..N);
    dimension-wise sparse gradients can, so that case scans 1..D.
    """
    partition = options.get("partition", "number")

    def fits(p: int) -> bool:
        return memory_per_rank(slots, dim, p, **options)["total"] <= budget_bytes

    if partition == "dimension":
        return next((p for p in range(1, dim + 1) if fits(p)), None)
    if not fits(slots):
        return None
    lo, hi = 1, slots
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_memory(slots: int, dim: int, P: int = 1, *, gpu_mem_gib: float = 80.0,
                reserve_gib: float = 0.0, **options) -> dict:
    """The ``rmt-plan memory`` JSON document.

    ``options`` are :func:`memory_per_rank`'s keyword options. The budget per rank is
    ``(gpu_mem_gib - reserve_gib) * 2**30`` bytes (``reserve_gib``: what the dense model,
    activations and workspace need). Returns the inputs, ``"bytes_per_rank"`` at ``P``,
    ``"budget_bytes"``, ``"fits"`` (total at ``P`` within budget), ``"min_group_size"``
    (or None) and ``"min_group_bytes_per_rank"`` (the breakdown at that size, or None).
    """
    if not gpu_mem_gib > 0:
        raise ValueError(f"GPU memory must be positive, got {gpu_mem_gib!r} GiB.")
    if not 0 <= reserve_gib < gpu_mem_gib:
        raise ValueError(f"reserve ({reserve_gib!r} GiB) must be non-negative and below "
                         f"the GPU memory ({gpu_mem_gib!r} GiB).")
    per_rank = memory_per_rank(slots, dim, P, **options)
    budget = math.floor((gpu_mem_gib - reserve_gib) * GIB)
    p_min = min_group_size(slots, dim, budget, **options)
    return {"slots": slots, "dim": dim, "group_size": P,
            "dtype": options.get("dtype", "bf16"),
            "optimizer": options.get("optimizer", "adam"),
            "master_fp32": options.get("master_fp32", False),
            "grad": options.get("grad", "dense"),
            "partition": options.get("partition", "number"),
            "gpu_mem_gib": gpu_mem_gib, "reserve_gib": reserve_gib,
            "bytes_per_rank": per_rank, "budget_bytes": budget,
            "fits": per_rank["total"] <= budget, "min_group_size": p_min,
            "min_group_bytes_per_rank": None if p_min is None
            else memory_per_rank(slots, dim, p_min, **options)}
