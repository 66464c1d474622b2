"""The memory value table behind every memory layer.

Layers reach their values only through :meth:`MemoryTable.lookup_reduce`, so the sharded
variants (number-wise / dimension-wise over a memory-parallel group, UltraMem Appendix C
and D; :mod:`rmt.memory.sharded_table`) plug in here without touching the layers.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rmt.memory import sharded_table
from rmt.memory.comm_counter import CommCounter
from rmt.memory.comm_volume import choose_partition
from rmt.memory.host_table import HostTable
from rmt.ops import lookup_reduce
from rmt.ops.counter_normal import fill_normal_
from rmt.ops.sparse_optim import coalesced
from rmt.ops.validate import dtypes_supported

PARTITIONS = ("local", "number", "dimension", "auto")
LOCATIONS = ("device", "host")

_values_from_checkpoint = False


@contextlib.contextmanager
def values_from_checkpoint(enabled: bool = True):
    """Tables built inside (when ``enabled``) are allocated but not drawn: a checkpoint load will
    overwrite every value (``rmt.training.checkpoint.will_resume``). A restart then skips the draw
    (about 0.9 s per GiB on one CPU thread; the load pays the first touch of the pages instead)."""
    global _values_from_checkpoint
    before, _values_from_checkpoint = _values_from_checkpoint, enabled
    try:
        yield
    finally:
        _values_from_checkpoint = before


def resolve_partition(
    partition: str,
    num_slots: int,
    dim: int,
    group_size: int,
    plan: Optional[dict],
    owner_reduce: bool,
    value_bytes: int,
) -> str:
    """``auto`` -> the planner's choice (fewer bytes per training step, forward + backward)
    for ``plan = {"tokens": T, "topm": K, "ive": E, "cores": C}`` (``T`` = the tokens this
    rank looks up: its tensor-parallel chunk; the all-gather of the chunks costs both
    partitions the same; an optional ``"activation_bytes"``: the scores' element size, default
    ``value_bytes``, the table's); other names unchanged. Plain number-wise requests each distinct
    row once, so its volume is the planner's dedup estimate for uniform access over
    ``num_slots`` (the conservative case)."""
    if partition != "auto":
        return partition
    if plan is None:
        raise ValueError("MemoryTable partition 'auto' needs plan={'tokens', 'topm', 'ive', 'cores'}")
    return choose_partition(
        plan["tokens"],
        plan["topm"],
        dim,
        group_size,
        phase="forward_backward",
        owner_reduce=owner_reduce,
        ive=plan["ive"],
        cores=plan["cores"],
        index_bytes=4,
        value_bytes=value_bytes,
        activation_bytes=plan.get("activation_bytes"),
        dedup=not owner_reduce,
        slots=None if owner_reduce else num_slots,
    )


def _bound_sparse_grad(weight: torch.Tensor) -> None:
    """Coalesce an accumulated sparse gradient once it holds more entries than the shard has rows:
    torch sums sparse gradients by concatenation, so over a step's micro-batches the touched rows
    would pile up without bound (32 micro-batches of 2,048 tokens x 84 lookups of 4 KiB rows are
    21 GiB, against a 196 MiB shard of UltraMem-1.6B-x12 on 64 ranks). Bounded by the rows plus
    one micro-batch's rows (and a coalesced copy while it is made)."""
    grad = weight.grad
    if grad is not None and grad.is_sparse and grad._nnz() > weight.shape[0]:
        weight.grad = coalesced(grad)


FLAG_CHUNK = 1 << 26
"""Slot counters a host table sends through the device at a time (bytes)."""


def union_count(flags: torch.Tensor, group, device, chunk: int) -> torch.Tensor:
    """How many of the slot ``flags`` (uint8) are set on any rank of ``group``: their maximum
    over the group, ``chunk`` flags at a time on ``device`` (a copy: the flags stay as they are)."""
    count = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, flags.numel(), max(chunk, 1)):
        part = flags[start : start + chunk].to(device, copy=True)
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        count += part.sum(dtype=torch.int64)
    return count


class DeviceRows:
    """The two reads the lookup routes make of a shard on the compute device (the host shard's
    are :class:`rmt.memory.host_table.HostTable`'s): ``lookup`` (``lookup_reduce`` of its rows)
    and ``gather`` (rows, repeats allowed), with the table's sparse gradient or fused update."""

    def __init__(self, weight: torch.nn.Parameter, sparse_grad: bool, update):
        self.weight, self.sparse_grad, self.update = weight, sparse_grad, update

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def lookup(self, indices, scores, block_ids=None, num_blocks: int = 1, validate: bool = False):
        return lookup_reduce(
            self.weight,
            indices,
            scores,
            block_ids,
            num_blocks,
            sparse_grad=self.sparse_grad,
            validate=validate,
            update=self.update,
        )

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n]`` rows -> ``[n, D]``; with a fused update a unit-score lookup, so that the fused
        kernel sums the copies of a row."""
        if self.update is not None:
            ones = self.weight.new_ones(rows.numel(), 1, 1)
            return self.lookup(rows.view(-1, 1), ones).view(-1, self.weight.shape[1])
        return F.embedding(rows, self.weight, sparse=self.sparse_grad)


class MemoryTable(torch.nn.Module):
    """``num_slots x dim`` values; this rank holds a shard of them, and only that shard exists here.

    ``partition``: ``"local"`` (the whole table on every rank), ``"number"`` (rows split over
    ``group``, each distinct row requested once; ``owner_reduce`` pools at the owner),
    ``"dimension"`` (columns split) or ``"auto"`` (the planner's choice for the ``plan`` shapes).
    ``replica_index`` numbers this group among the groups holding copies of the same table
    (checkpoint replica id); ``replica_group`` joins this rank with the ranks holding the same
    shard in those copies. ``split_group`` (sharded tables under tensor parallelism): the ranks
    holding the same tokens; each looks up its chunk of them and the pooled outputs are
    all-gathered. The shard is allocated on ``device`` with ``dtype`` and filled with
    ``init_std`` times the normals of the counter stream ``init_key``
    (:func:`rmt.ops.counter_normal.fill_normal_` at the shard's global positions), so every layout
    starts from the same global table and no rank draws more than its shard.
    The weight carries ``memory_value = True`` (its own LR schedule in the optimizer), when
    sharded ``memory_sharded = True`` (its gradient arrives through the collectives, not DDP),
    and with ``sparse_grad`` ``memory_sparse_grad = True``: its gradient is a coalesced sparse
    tensor of the touched rows, for the row-wise optimizers (``memory.value_optimizer``), and it
    is kept out of DDP too (:mod:`rmt.memory.groups` reduces it); with a ``memory_fused_update``
    (``memory.fused_value_optimizer``) every lookup's backward steps the rows instead and the
    weight gets no gradient (:mod:`rmt.ops.fused_update`). In training mode the lookups
    mark the slots they hit in ``hits`` (one byte per owned slot, :meth:`pop_hit_fraction`).
    ``counter`` counts the bytes sent per collective. ``location`` ``"host"``
    (``memory.table_location``): the shard lives in host memory and every lookup stages its distinct rows on ``device`` (:mod:`rmt.memory.host_table`; the
    :class:`~rmt.memory.host_table.HostTable` is ``host``, and ``weight.memory_host``); it needs
    ``sparse_grad`` and stays on the host when the module is moved. ``host_cache_rows`` (host
    only, ``memory.host_cache_rows``): that many of the shard's rows are cached on ``device`` with
    their optimizer state, refreshed every ``host_cache_refresh`` steps
    (:mod:`rmt.memory.host_cache`; :meth:`pop_cache_hit_fraction`).
    """

    def __init__(
        self,
        num_slots: int,
        dim: int,
        init_std: float,
        partition: str = "local",
        group=None,
        *,
        owner_reduce: bool = False,
        replica_index: int = 0,
        replica_group=None,
        split_group=None,
        plan: Optional[dict] = None,
        dtype: torch.dtype = torch.float32,
        sparse_grad: bool = False,
        init_key: int = 0,
        device=None,
        location: str = "device",
        host_cache_rows: int = 0,
        host_cache_refresh: int = 1,
    ):
        super().__init__()
        if location not in LOCATIONS:
            raise ValueError(f"MemoryTable location must be one of {LOCATIONS}, got {location!r}")
        if location == "host" and not sparse_grad:
            raise ValueError("a host MemoryTable is stepped from its touched rows: it needs sparse_grad")
        if host_cache_rows and location != "host":
            raise ValueError(
                "a MemoryTable caches rows of a host shard on the device: host_cache_rows needs location host"
            )
        if partition not in PARTITIONS:
            raise ValueError(f"MemoryTable partition must be one of {PARTITIONS}, got {partition!r}")
        P = 1 if partition == "local" else dist.get_world_size(group)
        self.split_group = split_group if partition != "local" else None
        if plan is not None and self.split_group is not None:
            plan = dict(plan, tokens=max(1, plan["tokens"] // dist.get_world_size(split_group)))
        partition = resolve_partition(partition, num_slots, dim, P, plan, owner_reduce, torch.finfo(dtype).bits // 8)
        if partition == "number" and num_slots % P:
            raise ValueError(
                f"number-wise MemoryTable: num_slots ({num_slots}) must be divisible by "
                f"the memory-parallel group size ({P})"
            )
        if partition == "dimension" and dim % P:
            raise ValueError(
                f"dimension-wise MemoryTable: dim ({dim}) must be divisible by the memory-parallel group size ({P})"
            )
        self.num_slots, self.dim, self.partition = num_slots, dim, partition
        self.group, self.group_size, self.owner_reduce = group, P, owner_reduce
        self.rank = 0 if partition == "local" else dist.get_rank(group)
        self.replica_index, self.replica_group = replica_index, replica_group
        self.counter = CommCounter()
        shape = {"local": (num_slots, dim), "number": (num_slots // P, dim), "dimension": (num_slots, dim // P)}[
            partition
        ]
        # Only this rank's shard is ever allocated; its values are the global table's at the
        # shard's positions (counter-based, rmt.ops.counter_normal), whatever the layout.
        compute = torch.device(device if device is not None else "cpu")
        # a host shard stays pageable: its rows move through pinned staging buffers
        # (rmt.memory.host_table), and page-locking a TiB-sized shard would take it from the OS
        weight = torch.empty(shape, dtype=dtype, device="cpu" if location == "host" else device)
        if not _values_from_checkpoint:
            rows, cols = self.shard_index
            fill_normal_(weight, init_key, rows.start or 0, cols.start or 0, dim, init_std)
        self.weight = torch.nn.Parameter(weight)
        self.weight.memory_value = True
        self.host = None
        if location == "host":
            self.host = self.weight.memory_host = HostTable(self.weight, compute, host_cache_rows, host_cache_refresh)
        if sparse_grad:
            self.weight.memory_sparse_grad = True
            self.weight.register_post_accumulate_grad_hook(_bound_sparse_grad)
        if partition != "local":
            self.weight.memory_sharded = True
            self.weight.memory_group, self.weight.memory_replica_group = group, replica_group
        # Slot-usage counters of the slots this rank owns (owned_rows): whole rows of a number-wise
        # shard, an equal range of the rows of a dimension-wise one (ranks see every lookup of the
        # group there), all rows of a local table.
        # A host table's counters are in host memory too (the device holds no byte per slot),
        # marked from the staged rows' indices, which cross to the host anyway.
        self.owned_rows = self._owned_rows()
        self.register_buffer(
            "hits",
            torch.zeros(len(self.owned_rows), dtype=torch.uint8, device="cpu" if location == "host" else device),
            persistent=False,
        )
        if self.host is not None:
            self.host.mark_rows = self._mark_shard_rows

    def _apply(self, fn, recurse=True):
        """A host table's weight and slot counters stay where they are when the module is moved
        or cast."""
        if self.host is None:
            return super()._apply(fn, recurse)
        weight, hits = self._parameters.pop("weight"), self._buffers.pop("hits")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"], self._buffers["hits"] = weight, hits

    @property
    def rows(self):
        """This rank's shard as the lookup routes read it: the host table, or the weight with the
        table's sparse gradient and fused update (:class:`DeviceRows`)."""
        if self.host is not None:
            return self.host
        return DeviceRows(self.weight, self.sparse_grad, self.fused_update)

    def _owned_rows(self) -> range:
        if self.partition == "local":
            return range(self.num_slots)
        per = -(-self.num_slots // self.group_size)
        return range(min(self.rank * per, self.num_slots), min((self.rank + 1) * per, self.num_slots))

    @property
    def sparse_grad(self) -> bool:
        return getattr(self.weight, "memory_sparse_grad", False)

    @property
    def fused_update(self):
        """The :class:`rmt.ops.fused_update.FusedValueUpdate` stepping the weight inside the
        lookups' backward (``memory.fused_value_optimizer``; set by the trainer), or None."""
        return getattr(self.weight, "memory_fused_update", None)

    @property
    def shard_index(self):
        """Index of this rank's shard inside the global ``[num_slots, dim]`` table."""
        if self.partition == "number":
            rows = self.num_slots // self.group_size
            return slice(self.rank * rows, (self.rank + 1) * rows), slice(None)
        if self.partition == "dimension":
            cols = self.dim // self.group_size
            return slice(None), slice(self.rank * cols, (self.rank + 1) * cols)
        return slice(None), slice(None)

    def lookup_reduce(
        self, indices: torch.Tensor, scores: torch.Tensor, block_ids, num_blocks: int, validate: bool = True
    ):
        """``[T, K]`` slots, ``[T, K, C]`` scores, ``[T, K]`` virtual blocks or None ->
        ``[T, num_blocks, dim]`` pooled values (UltraMem Eq. 15 and 17; ``rmt.ops`` contract), in
        the scores' dtype: a bf16 table is read as stored and accumulated in fp32.

        ``validate=False`` skips the op's index range checks on a local table, a min/max each and,
        on a GPU, a host sync that drains the device queue: for slots in range by construction,
        like the memory layer's retrieval. The sharded paths index with slots they derive.

        Scores of a type the op does not pair with this table (bf16 scores of a float32 table: the
        retrieval's products under autocast) are widened to the type both promote to, exactly, as
        autocast's "promote" ops do."""
        if not dtypes_supported(self.weight.dtype, scores.dtype):
            scores = scores.to(torch.promote_types(scores.dtype, self.weight.dtype))
        if self.host is not None:  # the host shard marks the rows it stages (_mark_shard_rows)
            self.host.recording = self.training
        if self.partition == "local":
            if self.training and self.host is None:
                self.record_hits(indices)
            return self.rows.lookup(indices, scores, block_ids, num_blocks, validate=validate)
        if self.split_group is not None:
            return sharded_table.tensor_parallel_chunks(
                self._sharded_lookup, indices, scores, block_ids, num_blocks, self.split_group, self.counter
            )
        return self._sharded_lookup(indices, scores, block_ids, num_blocks)

    def _sharded_lookup(self, indices, scores, block_ids, num_blocks: int):
        record = self.record_hits if self.training and self.host is None else None
        if self.partition == "dimension":
            return sharded_table.dimension_lookup(
                self.rows,
                indices,
                scores,
                block_ids,
                num_blocks,
                self.num_slots,
                self.dim,
                self.group,
                self.counter,
                record,
            )
        route = sharded_table.number_owner_reduce_lookup if self.owner_reduce else sharded_table.number_lookup
        return route(self.rows, indices, scores, block_ids, num_blocks, self.group, self.counter, record)

    @torch.no_grad()
    def record_hits(self, slots: torch.Tensor) -> None:
        """Mark the slots among ``slots`` (global indices, any shape) that this rank owns as hit."""
        slots = slots.reshape(-1)
        first, count = self.owned_rows.start, len(self.owned_rows)
        if self.partition == "dimension":
            slots = slots[(slots >= first) & (slots < first + count)]
        self.hits[slots - first if first else slots] = 1

    @torch.no_grad()
    def _mark_shard_rows(self, rows: torch.Tensor) -> None:
        """Mark the slots of the shard's rows ``rows`` (host, local row numbers) that this rank
        owns as hit: a host table's counterpart of :meth:`record_hits`."""
        slots = rows + (self.shard_index[0].start or 0)
        first, count = self.owned_rows.start, len(self.owned_rows)
        if self.partition == "dimension":
            slots = slots[(slots >= first) & (slots < first + count)]
        self.hits[slots - first if first else slots] = 1

    @torch.no_grad()
    def pop_hit_fraction(self, group=None) -> float:
        """Fraction of the table's slots looked up since the last call; resets the counters.

        A local table takes the union over ``group`` (e.g. the data-parallel ranks): a 1-byte-per-
        slot maximum, the table being whole on every rank anyway. A sharded table sums the scalar
        counts of its owners over the memory-parallel group and its replicas: the mean over the
        replica groups of the fraction of slots that group's tokens hit (the union over all
        data-parallel ranks when one group spans them, ``memory.group_size: 0``). A host table's
        counters, in host memory, cross to the compute device for the collectives (the local
        table's maximum in chunks of :data:`FLAG_CHUNK`)."""
        hits = self.hits
        device = self.host.device if self.host is not None else hits.device
        if self.host is not None and self.host.cache is not None:
            self.host.cache.mark_hits()
        if self.partition == "local":
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                count = union_count(hits, group, device, hits.numel() if self.host is None else FLAG_CHUNK)
            else:
                count = hits.sum(dtype=torch.int64)
            total = self.num_slots
        else:
            count = hits.sum(dtype=torch.int64).reshape(1).to(device)
            dist.all_reduce(count, group=self.group)
            replicas = 1
            if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
                dist.all_reduce(count, group=self.replica_group)
                replicas = dist.get_world_size(self.replica_group)
            total = self.num_slots * replicas
        self.hits.zero_()
        return float(count) / total

    @torch.no_grad()
    def pop_cache_stats(self, group=None) -> Dict[str, float]:
        """With a device cache of the host shard (``host_cache_rows``): the fraction of the
        training lookups' distinct rows it served (``host_cache_hit_fraction``) and of their
        indices (``host_cache_lookup_hit_fraction``) since the last call, summed over ``group``
        (a local table's data-parallel copies) or over the memory-parallel group and its replicas
        (a sharded one: the owners' counts), as :meth:`pop_hit_fraction`; resets the counters.
        Empty without a cache."""
        cache = self.host.cache if self.host is not None else None
        if cache is None:
            return {}
        c = cache.pop_counts()
        counts = torch.tensor([c["row_hits"], c["rows"], c["lookup_hits"], c["lookups"]], dtype=torch.int64)
        counts = counts.to(self.host.device)
        groups = [group] if self.partition == "local" else [self.group, self.replica_group]
        for g in groups:
            if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1:
                dist.all_reduce(counts, group=g)
        row_hits, rows, lookup_hits, lookups = counts.tolist()
        return {
            "host_cache_hit_fraction": row_hits / max(rows, 1),
            "host_cache_lookup_hit_fraction": lookup_hits / max(lookups, 1),
        }

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as a shard of the global ``[num_slots, dim]`` tensor, so checkpoints
        (and AdamW moments) reshard to any group size; replicated when local."""
        if self.partition == "local":
            return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {}, sharded_offsets)
        axis = 0 if self.partition == "number" else 1
        return {
            f"{prefix}weight": ShardedTensor.from_rank_offsets(
                f"{prefix}weight",
                self.weight,
                *sharded_offsets,
                (axis + len(sharded_offsets), self.rank, self.group_size),
                replica_id=self.replica_index,
                prepend_axis_num=len(sharded_offsets),
            )
        }
