"""The memory value table behind every memory layer: one storage and one distribution.

Layers reach their values only through :meth:`MemoryTable.lookup_reduce`. The table composes a
storage (:mod:`rmt.memory.storage`: the shard on the device, in host memory, or in host memory
with a device cache) with a distribution (:mod:`rmt.memory.distribution`: local, number-wise or
dimension-wise over a memory-parallel group, UltraMem Appendix C and D), and attaches the
weight's :class:`~rmt.memory.descriptor.TableDescriptor`, so the sharded and host variants plug in
here without touching the layers or the training loop.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.distributed as dist

from rmt.memory.descriptor import TableDescriptor, describe, descriptor
from rmt.memory.distribution import make_distribution
from rmt.memory.storage import make_storage
from rmt.ops.counter_normal import fill_normal_
from rmt.ops.sparse_optim import coalesced
from rmt.ops.validate import dtypes_supported

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


def _bound_sparse_grad(weight: torch.Tensor) -> None:
    """Coalesce an accumulated sparse gradient once it holds more entries than the shard has rows:
    torch sums sparse gradients by concatenation, so over a step's micro-batches the touched rows
    would pile up without bound (32 micro-batches of 2,048 tokens x 84 lookups of 4 KiB rows are
    21 GiB, against a 196 MiB shard of UltraMem-1.6B-x12 on 64 ranks). Bounded by the rows plus
    one micro-batch's rows (and a coalesced copy while it is made)."""
    grad = weight.grad
    if grad is not None and grad.is_sparse and grad._nnz() > weight.shape[0]:
        weight.grad = coalesced(grad)


class MemoryTable(torch.nn.Module):
    """``num_slots x dim`` values; this rank holds a shard of them, and only that shard exists here.

    ``partition`` and ``sharding`` (the distribution,
    :func:`rmt.memory.distribution.make_distribution`'s ``owner_reduce``, ``replica_index``,
    ``replica_group``, ``split_group``, ``plan``): ``"local"`` (the whole table on every rank), ``"number"`` (rows split over ``group``, each
    distinct row requested once; ``owner_reduce`` pools at the owner), ``"dimension"`` (columns
    split) or ``"auto"`` (the planner's choice for the ``plan`` shapes). ``replica_index`` numbers
    this group among the groups holding copies of the same table (checkpoint replica id);
    ``replica_group`` joins this rank with the ranks holding the same shard in those copies.
    ``split_group`` (sharded tables under tensor parallelism): the ranks holding the same tokens;
    each looks up its chunk of them and the pooled outputs are all-gathered.

    ``location`` (the storage, :func:`rmt.memory.storage.make_storage`; ``memory.table_location``):
    ``"device"`` (the shard on ``device``) or ``"host"`` (in host memory, every lookup staging
    its distinct rows on ``device``; it needs ``sparse_grad`` and stays on the host when the module
    is moved); ``host_cache_rows`` (host only, ``memory.host_cache_rows``): that many of the
    shard's rows are cached on ``device`` with their optimizer state, refreshed every
    ``host_cache_refresh`` steps (:meth:`pop_cache_stats`).

    The shard is allocated with ``dtype`` and filled with ``init_std`` times the normals of the
    counter stream ``init_key`` (:func:`rmt.ops.counter_normal.fill_normal_` at the shard's global
    positions), so every layout starts from the same global table and no rank draws more than its
    shard. The weight's :class:`~rmt.memory.descriptor.TableDescriptor` says what it is to the
    optimizers, DDP and checkpoints; with ``sparse_grad`` its gradient is a coalesced sparse
    tensor of the touched rows, for the row-wise optimizers (``memory.value_optimizer``), and with
    a fused update (``memory.fused_value_optimizer``) every lookup's backward steps the rows
    instead and the weight gets no gradient (:mod:`rmt.ops.fused_update`). In training mode the
    lookups mark the slots they hit in ``hits`` (one byte per owned slot, :meth:`pop_hit_fraction`).
    ``counter`` counts the bytes sent per collective.
    """

    def __init__(
        self,
        num_slots: int,
        dim: int,
        init_std: float,
        partition: str = "local",
        group=None,
        *,
        dtype: torch.dtype = torch.float32,
        sparse_grad: bool = False,
        init_key: int = 0,
        device=None,
        location: str = "device",
        host_cache_rows: int = 0,
        host_cache_refresh: int = 1,
        **sharding,
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
        self.num_slots, self.dim = num_slots, dim
        self.distribution = make_distribution(
            partition, num_slots, dim, group, value_bytes=torch.finfo(dtype).bits // 8, **sharding
        )
        self.storage = make_storage(location, device, host_cache_rows, host_cache_refresh)
        # Only this rank's shard is ever allocated; its values are the global table's at the
        # shard's positions (counter-based, rmt.ops.counter_normal), whatever the layout.
        weight = self.storage.allocate(self.distribution.shard_shape, dtype)
        if not _values_from_checkpoint:
            rows, cols = self.shard_index
            fill_normal_(weight, init_key, rows.start or 0, cols.start or 0, dim, init_std)
        self.weight = torch.nn.Parameter(weight)
        d = self.distribution
        describe(
            self.weight,
            TableDescriptor(num_slots, dim, self.storage, d.name, d.group, d.replica_group, sparse_grad=sparse_grad),
        )
        if sparse_grad:
            self.weight.register_post_accumulate_grad_hook(_bound_sparse_grad)
        # Slot-usage counters of the slots this rank owns (the distribution's owned_rows), where
        # the storage keeps them; the storage marks the rows its training lookups read.
        self.owned_rows = d.owned_rows
        self.register_buffer("hits", self.storage.flags(len(self.owned_rows)), persistent=False)
        self.storage.bind(self, self._mark_shard_rows)

    def _apply(self, fn, recurse=True):
        """The storage decides what stays where it is when the module is moved or cast."""
        with self.storage.stays_put(self):
            return super()._apply(fn, recurse)

    @property
    def counter(self):
        return self.distribution.counter

    @property
    def partition(self) -> str:
        return self.distribution.name

    @property
    def group(self):
        return self.distribution.group

    @property
    def replica_group(self):
        return self.distribution.replica_group

    @property
    def sparse_grad(self) -> bool:
        return descriptor(self.weight).sparse_grad

    @property
    def fused_update(self):
        """The :class:`rmt.ops.fused_update.FusedValueUpdate` stepping the weight inside the
        lookups' backward (``memory.fused_value_optimizer``; set by the trainer), or None."""
        return descriptor(self.weight).fused_update

    @property
    def shard_index(self):
        """Index of this rank's shard inside the global ``[num_slots, dim]`` table."""
        return self.distribution.shard_index

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
        self.storage.recording = self.training  # the storage marks the rows it serves
        return self.distribution.lookup(self.storage, indices, scores, block_ids, num_blocks, validate)

    @torch.no_grad()
    def _mark_shard_rows(self, rows: torch.Tensor) -> None:
        """Mark the slots of the shard's rows ``rows`` (local row numbers, where the counters
        are) that this rank owns as hit."""
        row0 = self.shard_index[0].start or 0
        slots = self.distribution.owned(rows + row0 if row0 else rows)
        first = self.owned_rows.start
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
        table's maximum in chunks of :data:`rmt.memory.storage.FLAG_CHUNK`)."""
        self.storage.flush_marks()
        hits = self.hits
        count, total = self.distribution.hit_count(
            hits, group, self.storage.compute_device, self.storage.flag_chunk(hits.numel())
        )
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
        c = self.storage.pop_cache_counts()
        if c is None:
            return {}
        counts = torch.tensor([c["row_hits"], c["rows"], c["lookup_hits"], c["lookups"]], dtype=torch.int64)
        counts = counts.to(self.storage.compute_device)
        for g in self.distribution.stat_groups(group):
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
        return self.distribution.sharded_state_dict(self.weight, prefix, sharded_offsets)
