"""Bytes per rank of sharded memory tables, phase by phase: what ``rmt-plan memory`` answers.

UltraMem's Appendix C shards the value table over a memory-parallel group of ``P`` ranks because
table plus optimizer states exceed one device. This module counts every byte per rank that grows
with the table's slots, as rmt's implementation holds them, for each phase of a run, so that
"how many ranks does this table need" is answered before the run (``tools/bench_memory_scale.py``
measures the same phases against it).

Per memory layer on a rank (``b`` = bytes of ``value_dtype``; a number-wise shard is ``N/P`` rows
of ``D``, a dimension-wise one ``N`` rows of ``D/P``; ``n = num_keys * sqrt(E)`` keys per grid side):

``table``
    the shard, ``rows x cols x b``.
``slot_stats``
    one byte per slot this rank owns (``ceil(N/P)``), the slot-hit flags.
``gradients``
    ``adamw``: the dense shard-sized gradient, twice while micro-batches accumulate (the new one
    before it is added). ``sparse_adam`` / ``rowwise_adagrad``: the touched rows, ``(cols x b + 8)``
    bytes each (int64 row index), accumulated over the step's micro-batches: number-wise each
    owner serves ``T x topm`` lookups per micro-batch, dimension-wise ``P x T x topm``; once that
    exceeds the shard's rows the table coalesces its gradient after each micro-batch, so it holds
    at most ``2 rows + served`` (the gradient, its coalesced copy and one micro-batch's rows).
    ``fused`` (``memory.fused_value_optimizer``): no gradient exists; the backwards of a step's
    first ``m - 1`` micro-batches keep the lookups the fused kernel needs (their output gradient,
    indices, scores and block ids, :mod:`rmt.ops.fused_update`) and the last one concatenates
    all ``m``, so ``(2m - 1) x kept`` for ``m > 1`` micro-batches and nothing for one (the kernel
    reads the backward's own tensors). ``kept`` per micro-batch, with ``s`` = 4 bytes (2 under
    ``precision: bf16`` with a bf16 table, :func:`rmt.memory.byte_sizes.lookup_bytes`) per score and output gradient
    element: a local table (``P = 1``)
    ``T x (E x D x s + topm x (8 + C x s + 8 [E > 1]))``; number-wise, the owner's unit-score
    lookup of the served rows in the table's dtype, ``served x (cols x b + 8 + b)``;
    dimension-wise, the lookups of all ``P`` requesters on the shard's columns,
    ``P x T x (E x cols x s + topm x (8 + C' x s + 8 [E > 1]))`` with ``C'`` the score columns the
    shard's slice spans. As for the sparse gradient, the data-parallel replicas' copies are not
    counted.
``optimizer_states``
    ``adamw``: torch's two moments in the table's dtype; ``sparse_adam``: two fp32 moments per
    element; ``rowwise_adagrad``: one fp32 per row.
``keys``
    the row and column keys ``[H, 2, r, n, Dk / r]`` (fp32, on every rank): with their fp32 DDP
    gradient and two Adam moments, 4 copies in training.
``retrieval_activations``
    one layer's retrieval at its peak, by the path ``memory.retrieval_kernel`` takes on the
    device and precision (:func:`rmt.retrieval_backends.takes_fused`, the runtime's rule), with
    ``b`` the bytes of the retrieval's dtype (4, or 2 under ``precision: bf16``), ``r`` the Tucker
    rank (1 for product keys), ``m`` the top-m, ``Ds = key_dim / r``:

    * unfused: the score tensors of both grid sides, ``A = T x H x 2 x r x n`` scores: their
      backward holds ``2 A`` bytes of them (each side's score gradient and the copy its product's
      backward makes; measured with a TorchDispatchMode at three grid sizes);
    * fused (:mod:`rmt.ops.fused_retrieval`, :func:`fused_retrieval_bytes`): the larger of its
      forward, ``T H 2 c (8 + 4 r)`` bytes of candidates (``c`` = m for product keys, ``2m`` for
      TDQKR, ``n`` while ``2m >= n``), the outputs it keeps and, on a CPU, each worker thread's
      tile working set; and its backward, the side scores' gradient and its score-gradient
      buffer, the lookups' int64 rows, the queries' gradient and their stacked copy
      (``T H 2 r Ds b`` each) and the keys' gradient (the keys' elements in ``b``).

    What the backward keeps from the forward (:func:`retrieval_saved_bytes`: the fused op's
    addresses and, for TDQKR, selected side scores, ``T H m (8 + 2 r b)``, product keys ``8 T H
    m``; the unfused path's ``T H 2 r n 4`` scores) is
    counted with the rest of the activations by the whole-rank plan (:mod:`rmt.planner.rank`).
    One layer's backward at a time.

Phases (per rank; ``L`` memory layers on the rank):

``init``  ``L x (table + slot_stats + 2 keys + ddp_buffer)`` + ``2 keys``: the shards, the keys
          and their DDP gradient buffer, and one key tensor drawn whole and scaled (dense init);
          ``ddp_buffer``, the tables' fp32 gradient buffer where megatron's DDP holds it
          (``ddp_buffered``: local dense-gradient tables without the distributed optimizer),
          allocated when DDP wraps the model.
``step``  ``L x (table + slot_stats + 4 keys + optimizer_states + gradients)`` + the retrieval
          activations of one layer (the fused optimizers and torch's fused AdamW step in place).
``save``  as ``step`` without the activations: gradients are held until the next step; a GPU
          shard is written through one host chunk (``host_chunk``, not device memory).
``load``  ``L x (table + slot_stats + 4 keys + optimizer_states + ddp_buffer)`` + ``max(2 keys, chunk)``:
          a checkpoint of the same partition is read straight into the shard (chunk 0);
          ``load_resharded`` is a load from the other partition (one read buffer of at
          most :data:`rmt.memory.byte_sizes.CHECKPOINT_CHUNK_BYTES`, and at most the overlap of one saved block with
          the new shard: the shard for a dimension-wise target, ``1/P`` of it for a number-wise one).

Bytes that do not grow with the slots (the dense model, its optimizer and activations, the
framework) are not counted here: ``--reserve-gib`` sets them aside.

Tables in host memory (``location="host"``, ``memory.table_location: host``,
:mod:`rmt.memory.storage`): ``table``, ``slot_stats``, ``optimizer_states`` and ``gradients``
leave the device's phases for the host's (:func:`host_phases`); the host's gradient is the staged rows'
(``U`` per lookup, :func:`staged_rows`, not the ``served`` lookups: the device sums a row's
lookups before its gradient crosses), bounded as above at ``2 rows + U``. The device instead
holds ``staging`` = ``U x cols x b`` per layer of every micro-batch in flight (``staged_layers``:
the staged rows are saved for the backward), the host of a GPU the same again in pinned staging
buffers (kept by the pinned-memory cache from the first step on: ``step`` and ``save``). The keys
and the retrieval activations stay on the device; a resharding load reads its chunk into host
memory. :mod:`rmt.planner.host` adds what crosses the host link.

A device cache of ``C`` rows of each host shard (``cache_rows``, ``memory.host_cache_rows``,
:mod:`rmt.memory.host_cache`) serves a fraction ``h`` of each lookup's ``U`` distinct rows
(:func:`hit_fraction`: ``cache_hit`` as measured, else the uniform-access expectation ``C /
rows``). The device holds ``cache`` = ``C`` x (:func:`cache_row_bytes`: the row, its optimizer
state and 33 bytes of index) and ``cache_gradients``, the cached rows' sparse gradient (``hU``
rows per micro-batch, bounded like the host's at ``2C + hU``), in ``step`` and ``save`` (the cache
fills at its first refresh, after a load). The host's gradient and pinned staging shrink to the
``(1 - h) U`` missed rows; the staged rows on the device stay ``U``. The host also counts the
missed rows' lookups between refreshes, at most 32 bytes a shard row, not counted here.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

from rmt.memory.byte_sizes import CHECKPOINT_CHUNK_BYTES, DTYPE_BYTES, lookup_bytes
from rmt.memory.comm_volume import PARTITIONS, expected_unique
from rmt.retrieval_backends import CPU_KEY_TILE, CPU_TOKEN_BLOCK, KERNELS, takes_fused

VALUE_OPTIMIZERS = ("adamw", "sparse_adam", "rowwise_adagrad")
PRECISIONS = ("fp32", "bf16")
PHASES = ("init", "step", "save", "load", "load_resharded")
LOCATIONS = ("device", "host")
DEFAULT_GIB = 80.0
"""Memory per rank of a plan given none: an 80 GB GPU (H100, A100 SXM)."""
HOST_OPTIMIZERS = ("sparse_adam", "rowwise_adagrad")
RETRIEVAL_ACTIVATION_FACTOR = 2  # score tensors alive in the unfused retrieval's backward (see above)
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SPARSE_INDEX_BYTES = 8
CACHE_INDEX_BYTES = (
    33  # a cache slot's row, lookup count and hit flag, a cached row's sorted index (rmt.memory.host_cache)
)
GIB = 1 << 30


@dataclass(frozen=True)
class TablePlan:
    """One rank's memory layers: the table shape and layout, and what a step feeds them."""

    slots: int
    """Slots N of each value table (UltraMem / PKM: ``num_keys ** 2``)."""
    dim: int
    """Value dimension D."""
    group_size: int = 1
    """Ranks P of the memory-parallel group the tables are sharded over."""
    partition: str = "number"
    value_optimizer: str = "adamw"
    value_dtype: str = "fp32"
    layers: int = 1
    """Memory layers (tables) on the rank (its pipeline stage)."""
    tokens: int = 256
    """Tokens per micro-batch on the rank (micro-batch size x sequence length)."""
    microbatches: int = 1
    """Micro-batches per step on the rank (gradients accumulate over them)."""
    heads: int = 2
    topk: int = 16
    key_dim: int = 64
    tucker_rank: int = 2
    ive_blocks: int = 4
    precision: str = "fp32"
    """Training precision (``bf16``: bf16 dense parameters, the score tensors are bf16)."""
    device: str = "cpu"
    """``cpu`` or ``gpu``: where the tables live (a GPU save stages through host memory)."""
    fused: bool = False
    """``memory.fused_value_optimizer``: the row-wise optimizer steps the rows in the lookups'
    backward (no gradient; the kept lookups instead)."""
    cores: int = 1
    """Score columns C of multi-core scoring (``memory.num_cores``; PKM 1)."""
    location: str = "device"
    """``memory.table_location``: ``device`` or ``host`` (the shards in host memory, rows staged
    per lookup)."""
    tensor_parallel: int = 1
    """Ranks sharing a micro-batch's tokens over which a sharded table splits its lookups (each
    looks up ``ceil(T / t)``); 1 for a local table, which every tensor-parallel rank looks up
    whole. Used by the host tables' staged rows."""
    replicas: int = 1
    """Copies of each shard whose row gradients are summed before the step (a local table's:
    the data-parallel ranks). Used by the host tables' optimizer work."""
    staged_layers: int | None = None
    """Host tables: memory layers whose staged rows a rank holds at the step's peak (every layer
    of each micro-batch in flight; :func:`rmt.planner.rank.in_flight`); None: ``layers``."""
    index_tables: int = 1
    """Host tables: value tables per memory layer, each staging the layer's rows with its own
    indices (UltraMemV2 with pre-values: 2, their columns summed in ``dim``)."""
    unique_fraction: float | None = None
    """Host tables: the measured distinct fraction of the lookups a table stages
    (``U = f x lookups``); None: the uniform-access expectation (:func:`staged_rows`)."""
    cache_rows: int = 0
    """Host tables: rows of each table shard cached on the device with their optimizer state
    (``memory.host_cache_rows``; at most the shard's rows)."""
    cache_hit: float | None = None
    """Host tables with a cache: the fraction of a lookup's distinct rows the cache holds
    (measured: ``tools/bench_host_cache.py``); None: uniform access, the cache's share of the
    shard's rows (:func:`hit_fraction`)."""
    retrieval_kernel: str = "auto"
    """``memory.retrieval_kernel``: ``auto``, ``fused`` or ``unfused`` (:attr:`fused_retrieval`)."""
    threads: int = 1
    """Worker threads of a CPU rank (``train.threads``): each holds one tile working set of the
    fused retrieval's CPU selection."""
    ddp_buffered: bool = False
    """Whether megatron's DDP buffers the tables' gradient (:func:`ddp_buffers_tables`): its fp32
    buffer is allocated when DDP wraps the model, so it is held from ``init`` on."""

    @property
    def fused_retrieval(self) -> bool:
        """Whether the retrieval runs the fused op here (:func:`rmt.retrieval_backends.takes_fused`
        for the plan's device and precision)."""
        return takes_fused(
            self.retrieval_kernel, "cuda" if self.device == "gpu" else "cpu", TORCH_DTYPES[self.precision]
        )

    @property
    def num_keys(self) -> int:
        return math.isqrt(self.slots)

    @property
    def grid_side(self) -> int:
        return self.num_keys * math.isqrt(self.ive_blocks)

    @property
    def topm(self) -> int:
        """Lookups per token (heads x top-m)."""
        return self.heads * self.topk

    @property
    def shard_shape(self):
        if self.partition == "number":
            return self.slots // self.group_size, self.dim
        return self.slots, self.dim // self.group_size


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def validate_plan(plan: TablePlan) -> None:
    """One sentence (``ValueError``) for a layout rmt cannot run."""
    for name in (
        "slots",
        "dim",
        "group_size",
        "tensor_parallel",
        "replicas",
        "index_tables",
        "layers",
        "tokens",
        "microbatches",
        "heads",
        "topk",
        "key_dim",
        "tucker_rank",
        "ive_blocks",
        "cores",
        "threads",
    ):
        _positive_int(name.replace("_", " "), getattr(plan, name))
    for name, value, allowed in (
        ("partition", plan.partition, PARTITIONS),
        ("value optimizer", plan.value_optimizer, VALUE_OPTIMIZERS),
        ("value dtype", plan.value_dtype, tuple(DTYPE_BYTES)),
        ("precision", plan.precision, PRECISIONS),
        ("device", plan.device, ("cpu", "gpu")),
        ("table location", plan.location, LOCATIONS),
        ("retrieval kernel", plan.retrieval_kernel, KERNELS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}.")
    k = plan.num_keys
    if k * k != plan.slots:
        raise ValueError(
            f"UltraMem and PKM tables have num_keys^2 slots; {plan.slots:,} is not a square "
            f"(nearest: {k * k:,} = {k}^2 or {(k + 1) ** 2:,} = {k + 1}^2)."
        )
    if math.isqrt(plan.ive_blocks) ** 2 != plan.ive_blocks:
        raise ValueError(f"IVE blocks must be a perfect square (the key grid grows by sqrt(E)), got {plan.ive_blocks}.")
    if plan.key_dim % plan.tucker_rank:
        raise ValueError(f"key dim ({plan.key_dim}) must be divisible by the Tucker rank ({plan.tucker_rank}).")
    if plan.partition == "number" and plan.slots % plan.group_size:
        raise ValueError(
            f"a number-wise table needs slots ({plan.slots:,}) divisible by the group size ({plan.group_size})."
        )
    if plan.partition == "dimension" and plan.dim % plan.group_size:
        raise ValueError(
            f"a dimension-wise table needs the value dim ({plan.dim}) divisible by the group size ({plan.group_size})."
        )
    if plan.value_optimizer == "rowwise_adagrad" and plan.partition == "dimension":
        raise ValueError("rowwise_adagrad keeps one accumulator per whole row, so it needs a number-wise table.")
    if plan.fused and plan.value_optimizer == "adamw":
        raise ValueError("a fused value optimizer is sparse_adam or rowwise_adagrad, not adamw.")
    if plan.dim % plan.cores:
        raise ValueError(f"the value dim ({plan.dim}) must be divisible by the score cores ({plan.cores}).")
    if plan.location == "host" and plan.value_optimizer not in HOST_OPTIMIZERS:
        raise ValueError(
            "a table in host memory is stepped on the host from its touched rows: it needs the value "
            f"optimizer sparse_adam or rowwise_adagrad, got {plan.value_optimizer}."
        )
    if plan.location == "host" and plan.fused:
        raise ValueError(
            "a table in host memory is stepped on the host from its row gradients, which a fused value "
            "optimizer never forms: drop one of them."
        )
    if plan.location == "host" and plan.topk > plan.slots:
        raise ValueError(f"top-k ({plan.topk}) cannot exceed the slots ({plan.slots:,}).")
    if plan.staged_layers is not None and (
        isinstance(plan.staged_layers, bool) or not isinstance(plan.staged_layers, int) or plan.staged_layers < 0
    ):
        raise ValueError(f"staged layers must be a non-negative integer, got {plan.staged_layers!r}.")
    if isinstance(plan.cache_rows, bool) or not isinstance(plan.cache_rows, int) or plan.cache_rows < 0:
        raise ValueError(f"cache rows must be a non-negative integer, got {plan.cache_rows!r}.")
    if plan.cache_rows and plan.location != "host":
        raise ValueError("a device cache holds rows of tables in host memory: it needs the host table location.")
    if plan.cache_hit is not None:
        if not plan.cache_rows:
            raise ValueError("a cache hit fraction is the share of rows a device cache serves: it needs cache rows.")
        if not 0 <= plan.cache_hit <= 1:
            raise ValueError(f"the cache hit fraction must be in [0, 1], got {plan.cache_hit!r}.")
    if plan.unique_fraction is not None:
        if plan.location != "host":
            raise ValueError("a unique fraction sets the rows a host table stages: it needs the host table location.")
        if not 0 < plan.unique_fraction <= 1:
            raise ValueError(f"the unique fraction must be in (0, 1], got {plan.unique_fraction!r}.")


def fused_kept_bytes(plan: TablePlan) -> int:
    """Bytes one micro-batch's lookups keep for the fused optimizer step (module docstring)."""
    rows, cols = plan.shard_shape
    s = lookup_bytes(plan.precision, plan.value_dtype)
    E, T, block = plan.ive_blocks, plan.tokens, 8 if plan.ive_blocks > 1 else 0
    if plan.group_size == 1:
        return T * (E * cols * s + plan.topm * (8 + plan.cores * s + block))
    if plan.partition == "number":
        b = DTYPE_BYTES[plan.value_dtype]
        return T * plan.topm * (cols * b + 8 + b)
    core_width = plan.dim // plan.cores
    spanned = cols // math.gcd(cols, core_width)  # rmt.memory.distribution.dimension._core_columns
    return plan.group_size * T * (E * cols * s + plan.topm * (8 + spanned * s + block))


def lookups_staged(plan: TablePlan, microbatches: int = 1) -> int:
    """Lookups (token x head x top-k) whose rows one table of a rank stages, over ``microbatches``
    micro-batches: a local table its ``T K``; a number-wise owner ``T' K`` (the ``P T' K`` of
    the group, ``T' = ceil(T / t)`` per rank, spread over ``P`` owners); a dimension-wise shard
    all ``P T' K``."""
    P = plan.group_size
    T = -(-plan.tokens // plan.tensor_parallel)
    return microbatches * T * plan.topm * (P if plan.partition == "dimension" else 1)


def staged_rows(plan: TablePlan, microbatches: int = 1) -> float:
    """``U``: the distinct rows one lookup of a table stages on a rank (over ``microbatches``
    micro-batches together: the rows a step touches), the expectation under uniform access.

    Each of the group's ``P T' H`` (token, head) pairs per micro-batch draws its top-k distinct
    slots uniformly from the ``N`` physical rows (IVE's virtual blocks index the same rows), so a
    row is missed by all ``G`` pairs with probability ``(1 - k/N)^G`` and the expected distinct
    rows are ``N (1 - (1 - k/N)^G)`` (:func:`rmt.memory.comm_volume.expected_unique`; with ``k = 1``
    the familiar ``N (1 - (1 - 1/N)^n)`` of ``n`` uniform draws). A dimension-wise shard stages
    all of them; a number-wise owner the ``1/P`` in its range (plain or owner-reduce: the union
    of the requesters' distinct rows is the distinct rows of their union); a local table those
    of its own ``T H`` pairs. Uniform access is the worst case for dedup: skewed access repeats
    rows more. With ``plan.unique_fraction`` ``f``: ``U = f x`` :func:`lookups_staged`."""
    validate_plan(plan)
    if plan.unique_fraction is not None:
        return min(plan.unique_fraction * lookups_staged(plan, microbatches), plan.shard_shape[0])
    P = plan.group_size
    T = -(-plan.tokens // plan.tensor_parallel)
    unique = expected_unique(microbatches * P * T * plan.heads, plan.topk, plan.slots)
    return unique / P if plan.partition == "number" else unique


def cached_rows(plan: TablePlan) -> int:
    """Rows of each shard the device caches: ``cache_rows``, at most the shard's rows."""
    return min(plan.cache_rows, plan.shard_shape[0])


def hit_fraction(plan: TablePlan) -> float:
    """The fraction of a lookup's distinct rows found in the device cache: ``cache_hit`` as
    given, else under uniform access the cached share of the shard's rows (0 without a cache)."""
    if plan.cache_hit is not None:
        return plan.cache_hit
    return cached_rows(plan) / plan.shard_shape[0]


def cache_row_bytes(plan: TablePlan) -> int:
    """Device bytes of one cached row: its value, its optimizer state (two fp32 moments per
    element, or one fp32 accumulator per table) and its index (:data:`CACHE_INDEX_BYTES` per
    table)."""
    cols = plan.shard_shape[1]
    state = 2 * cols * 4 if plan.value_optimizer == "sparse_adam" else 4 * plan.index_tables
    return cols * DTYPE_BYTES[plan.value_dtype] + state + CACHE_INDEX_BYTES * plan.index_tables


def components(plan: TablePlan) -> dict:
    """Bytes per memory layer on one rank (see the module docstring), plus the transients; a
    host table's (``plan.location``) also its ``staging`` (one micro-batch's staged rows)."""
    validate_plan(plan)
    rows, cols = plan.shard_shape
    b = DTYPE_BYTES[plan.value_dtype]
    elements = rows * cols
    host = plan.location == "host"
    staged = round(staged_rows(plan)) if host else 0
    hit = hit_fraction(plan) if host else 0.0
    if plan.value_optimizer == "adamw":
        gradients = elements * b * (2 if plan.microbatches > 1 else 1)
        states = 2 * elements * b
    else:
        states = 2 * elements * 4 if plan.value_optimizer == "sparse_adam" else rows * 4
        served = plan.tokens * plan.topm * (1 if plan.partition == "number" else plan.group_size)
        if host:  # the device sums the lookups of each staged row before its gradient crosses
            served = round(staged * (1 - hit))  # the cached rows' gradients stay on the device
        gradients = _sparse_gradient(plan.microbatches, served, rows) * (cols * b + SPARSE_INDEX_BYTES)
    if plan.fused:
        gradients = (2 * plan.microbatches - 1) * fused_kept_bytes(plan) if plan.microbatches > 1 else 0
    keys = plan.heads * 2 * plan.grid_side * plan.key_dim * 4
    if plan.fused_retrieval:
        fused = fused_retrieval_bytes(plan)
        retrieval = max(fused["forward"], fused["backward"])
    else:
        scores = plan.tokens * plan.heads * 2 * plan.tucker_rank * plan.grid_side * DTYPE_BYTES[plan.precision]
        retrieval = RETRIEVAL_ACTIVATION_FACTOR * scores
    table = elements * b
    out = {
        "table": table,
        "slot_stats": -(-plan.slots // plan.group_size),
        "gradients": gradients,
        "ddp_buffer": elements * 4 if plan.ddp_buffered else 0,
        "optimizer_states": states,
        "keys": keys,
        "retrieval_activations": retrieval,
        "checkpoint_chunk": min(CHECKPOINT_CHUNK_BYTES, resharding_read(plan, table)),
    }
    if host:
        out["staging"] = staged * cols * b
        out["pinned_staging"] = round(staged * (1 - hit)) * cols * b
    if plan.cache_rows:
        C = cached_rows(plan)
        out["cache"] = C * cache_row_bytes(plan)
        hits = round(staged * hit)
        out["cache_gradients"] = _sparse_gradient(plan.microbatches, hits, C) * (cols * b + SPARSE_INDEX_BYTES)
    return out


def fused_retrieval_bytes(plan: TablePlan) -> dict:
    """Bytes of one layer's fused retrieval (:mod:`rmt.ops.fused_retrieval`, the module docstring's
    ``retrieval_activations``) per micro-batch: ``saved`` (what its backward keeps: the int64
    addresses and, for TDQKR, the selected side scores), ``forward`` (its peak while selecting) and
    ``backward`` (its peak while differentiating)."""
    T, H, m, r, n = plan.tokens, plan.heads, plan.topk, plan.tucker_rank, plan.grid_side
    b = DTYPE_BYTES[plan.precision]
    Ds = plan.key_dim // r
    tucker = r > 1
    keep_all = tucker and 2 * m >= n
    c = n if keep_all else (2 * m if tucker else m)
    saved = T * H * m * (8 + (2 * r * b if tucker else 0))  # product keys' sum keeps no operand
    candidates = T * H * 2 * c * (8 + 4 * r)  # int64 keys and r float32 side scores each
    forward = candidates + saved
    if plan.device == "cpu":  # a GPU backend's tiles live in shared memory
        Tb, tile = min(CPU_TOKEN_BLOCK, T), min(CPU_KEY_TILE, n)
        lists, width = (1, n) if keep_all else (2 if tucker else 1, m)
        task = 4 * (r * Tb * (Ds + tile) + (tile * Ds if b < 4 else 0) + tile) + 8 * tile
        task += Tb * lists * width * (4 * (1 + r) + 8)  # a block's running lists: scores, keys
        forward += plan.threads * task
    lookups = T * H * 2 * r * m
    backward = (
        2 * lookups * b  # the selected side scores' gradient and the score-gradient buffer
        + lookups * 8
        + T * H * 2 * m * 8  # the lookups' rows and the (row, column) pairs they come from
        + 2 * T * H * 2 * r * Ds * b  # the queries' gradient and their stacked copy
        + H * 2 * r * n * Ds * b  # the keys' gradient
    )
    return {"saved": saved, "forward": forward, "backward": backward}


def retrieval_saved_bytes(plan: TablePlan) -> int:
    """Bytes one layer's retrieval keeps for its backward per micro-batch: the fused op's
    addresses and selected side scores, or the unfused path's fp32 scores of both grid sides."""
    if plan.fused_retrieval:
        return fused_retrieval_bytes(plan)["saved"]
    return plan.tokens * plan.heads * 2 * plan.tucker_rank * plan.grid_side * 4


def _sparse_gradient(microbatches: int, served: int, rows: int) -> int:
    """Entries a sparse gradient of ``rows`` rows holds at most over ``microbatches`` of ``served``
    rows each: all of them, or once they exceed the rows, the coalesced gradient, its copy and
    one micro-batch's."""
    entries = microbatches * served
    return 2 * rows + served if entries > rows else entries


def resharding_read(plan: TablePlan, table: int) -> int:
    """Bytes of one saved block's overlap with the new shard when the checkpoint has the other
    partition: a dimension-wise shard reads whole rows of ``N/P x D`` files (its shard's bytes); a
    number-wise shard reads its rows of ``N x D/P`` files (``1/P`` of its shard)."""
    return table if plan.partition == "dimension" else -(-table // plan.group_size)


def phases(plan: TablePlan, keys: bool = True) -> dict:
    """Peak bytes per rank that grow with the slots, per phase (see the module docstring);
    ``keys=False``: without the keys and their gradients and moments (the whole-rank plan,
    :mod:`rmt.planner.rank`, counts them with the dense parameters)."""
    c = components(plan)
    if not keys:
        c["keys"] = 0
    L = plan.layers
    staged = 0
    if plan.location == "host":  # the shard, its counters, state and gradient on the host (host_phases)
        staged = (L if plan.staged_layers is None else plan.staged_layers) * c["staging"]
        c.update(table=0, slot_stats=0, optimizer_states=0, gradients=0, checkpoint_chunk=0)
    cache = L * (c.get("cache", 0) + c.get("cache_gradients", 0))  # filled from the first refresh on
    held = c["table"] + c["slot_stats"]
    trained = held + 4 * c["keys"] + c["optimizer_states"]
    buffer = L * c["ddp_buffer"]
    return {
        "init": L * (held + 2 * c["keys"]) + 2 * c["keys"] + buffer,
        "step": L * (trained + c["gradients"]) + c["retrieval_activations"] + staged + cache,
        "save": L * (trained + c["gradients"]) + cache,
        "load": L * trained + 2 * c["keys"] + buffer,
        "load_resharded": L * trained + max(2 * c["keys"], c["checkpoint_chunk"]) + buffer,
    }


def host_phases(plan: TablePlan) -> dict:
    """Peak bytes per rank in host memory by phase of tables in host memory (all zero for device
    tables): the shards, their optimizer states and gradients as :func:`phases` counts them on a
    device, the pinned staging buffers (``staged_layers x staging``, on a GPU machine) once a step
    has run, and a resharding load's read chunk. On a CPU rank both are the same memory: its
    whole-rank plan adds them (:func:`rmt.planner.rank.rank_phases`)."""
    if plan.location != "host":
        return {p: 0 for p in PHASES}
    c = components(plan)
    L = plan.layers
    pinned = (L if plan.staged_layers is None else plan.staged_layers) * c["pinned_staging"]
    if plan.device != "gpu":  # a CPU rank's staged rows are the gather's output (phases counts it)
        pinned = 0
    trained = L * (c["table"] + c["slot_stats"] + c["optimizer_states"])
    return {
        "init": L * (c["table"] + c["slot_stats"]),
        "step": trained + L * c["gradients"] + pinned,
        "save": trained + L * c["gradients"] + pinned,
        "load": trained,
        "load_resharded": trained + c["checkpoint_chunk"],
    }


def checkpoint_bytes(plan: TablePlan) -> int:
    """Bytes on disk of the tables and their optimizer states (all ranks together)."""
    c = components(
        replace(
            plan,
            group_size=1,
            partition="number",
            location="device",
            unique_fraction=None,
            cache_rows=0,
            cache_hit=None,
        )
    )
    return plan.layers * (c["table"] + c["optimizer_states"])


def group_sizes(plan: TablePlan):
    """The group sizes rmt can run for this table: divisors of the slots (number-wise) or of
    the value dim (dimension-wise), ascending."""
    n = plan.slots if plan.partition == "number" else plan.dim
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def min_group_size(plan: TablePlan, budget_bytes: int, host_budget_bytes: int | None = None) -> int | None:
    """Smallest runnable ``P`` whose peak phase fits ``budget_bytes`` per rank (and, given
    ``host_budget_bytes``, whose host tables' peak fits that; None if none)."""
    for P in group_sizes(plan):
        at = replace(plan, group_size=P)
        if max(phases(at).values()) > budget_bytes:
            continue
        if host_budget_bytes is None or max(host_phases(at).values()) <= host_budget_bytes:
            return P
    return None


def plan_memory(
    plan: TablePlan, gpu_mem_gib: float = DEFAULT_GIB, reserve_gib: float = 0.0, host_gib: float | None = None
) -> dict:
    """The ``rmt-plan memory`` JSON document: the inputs, the per-layer components and per-rank
    phases at ``plan.group_size``, the peak, the checkpoint size, and the smallest group whose
    peak fits ``(gpu_mem_gib - reserve_gib) GiB`` per rank (``reserve_gib``: the dense model,
    its optimizer and activations, the framework). Host tables add their ``host_phases`` and
    ``host_peak``; with ``host_gib`` (host memory per rank for the tables) ``host_fits``, and the
    smallest group must fit it too."""
    if not gpu_mem_gib > 0:
        raise ValueError(f"the memory per rank must be positive, got {gpu_mem_gib!r} GiB.")
    if not 0 <= reserve_gib < gpu_mem_gib:
        raise ValueError(
            f"the reserve ({reserve_gib!r} GiB) must be non-negative and below the memory per rank "
            f"({gpu_mem_gib!r} GiB)."
        )
    if host_gib is not None and plan.location != "host":
        raise ValueError(
            "host memory per rank is the budget of tables in host memory: it needs the host table location."
        )
    if host_gib is not None and not host_gib > 0:
        raise ValueError(f"the host memory per rank must be positive, got {host_gib!r} GiB.")
    per_phase = phases(plan)
    budget = math.floor((gpu_mem_gib - reserve_gib) * GIB)
    host_budget = None if host_gib is None else math.floor(host_gib * GIB)
    p_min = min_group_size(plan, budget, host_budget)
    host = {}
    if plan.location == "host":
        on_host = host_phases(plan)
        host = {"host_phases": on_host, "host_peak": max(on_host.values()), "host_gib": host_gib}
        if host_budget is not None:
            host["host_fits"] = host["host_peak"] <= host_budget
    doc = {
        "inputs": asdict(plan),
        "num_keys": plan.num_keys,
        "grid_side": plan.grid_side,
        "shard_shape": list(plan.shard_shape),
        "components_per_layer": components(plan),
        "phases": per_phase,
        "peak": max(per_phase.values()),
        "host_chunk": CHECKPOINT_CHUNK_BYTES if plan.device == "gpu" and plan.location == "device" else 0,
        "checkpoint_bytes": checkpoint_bytes(plan),
        "gpu_mem_gib": gpu_mem_gib,
        "reserve_gib": reserve_gib,
        "budget_bytes": budget,
        "fits": max(per_phase.values()) <= budget,
        "min_group_size": p_min,
        "min_group_phases": None if p_min is None else phases(replace(plan, group_size=p_min)),
    }
    doc.update(host)
    return doc


def plan_from_config(
    config,
    group_size: int,
    layers: int,
    microbatches: int,
    tensor_parallel: int = 1,
    replicas: int = 1,
    staged_layers: int | None = None,
) -> TablePlan:
    """The :class:`TablePlan` of an UltraMem/UltraMemV2/PKM config (``rmt.config.RMTConfig``) for
    a rank holding ``layers`` memory layers in a group of ``group_size`` ranks (``tensor_parallel``
    ranks sharing its tokens, ``replicas`` copies of each shard, ``staged_layers`` as
    :class:`TablePlan`'s: they count for tables in host memory only). UltraMemV2's value
    and pre-value tables (the same rows, sharded alike) are counted as one table of ``Dv + Dp``
    columns, and its full-width keys of every Tucker rank as a key dim of ``r x Kd``; its lookups
    pool one block (no IVE projectors), which the plan's ``ive_blocks`` (the grid's) overstates
    in the fused optimizers' kept lookups."""
    from rmt.memory.shapes import value_dim

    mem, m, t = config.memory, config.model, config.train
    pkm, v2 = mem.type == "pkm", mem.type == "ultramem_v2"
    if v2:
        config_dim = value_dim(config) + mem.pre_value_dim
        key_dim = mem.key_dim * (1 if mem.retrieval == "product" else mem.tucker_rank)
    else:
        config_dim, key_dim = value_dim(config), mem.key_dim // 2 if pkm else mem.key_dim
    return TablePlan(
        slots=mem.num_keys**2,
        dim=config_dim,
        group_size=group_size,
        partition="number" if mem.partition == "local" else mem.partition,
        value_optimizer=mem.value_optimizer,
        value_dtype=mem.value_dtype,
        layers=layers,
        tokens=t.micro_batch_size * m.seq_length,
        microbatches=microbatches,
        heads=mem.num_heads,
        topk=mem.topk,
        key_dim=key_dim,
        tucker_rank=1 if pkm or mem.retrieval == "product" else mem.tucker_rank,
        ive_blocks=1 if pkm else mem.ive_blocks,
        precision=t.precision,
        fused=mem.fused_value_optimizer,
        cores=1 if pkm else mem.num_cores,
        location=mem.table_location,
        tensor_parallel=1 if mem.partition == "local" else tensor_parallel,
        replicas=replicas,
        staged_layers=staged_layers,
        index_tables=2 if v2 and mem.pre_value_dim else 1,
        cache_rows=mem.host_cache_rows,
        retrieval_kernel=mem.retrieval_kernel,
        threads=t.threads or os.cpu_count() or 1,
        ddp_buffered=ddp_buffers_tables(config),
    )


def ddp_buffers_tables(config) -> bool:
    """Whether megatron's DDP buffers the value tables' gradient: local tables with a dense
    gradient (``adamw``) without the distributed optimizer (:mod:`rmt.memory.groups`: every other
    table is reduced by the memory code, outside DDP)."""
    mem = config.memory
    return mem.partition == "local" and mem.value_optimizer == "adamw" and not config.train.distributed_optimizer
