"""What a memory value table's weight is, in one record attached where the table is built.

Every consumer of a table parameter (the optimizers, DDP wrapping, gradient finishing and
clipping, the training precision, checkpoints, the weight average, the host steps) asks
:func:`descriptor` of the parameter instead of reading loose attributes; a parameter without a
record is not a value table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

_ATTRIBUTE = "_rmt_table"


@dataclass(frozen=True)
class TableDescriptor:
    """One value table's weight, as :class:`rmt.memory.table.MemoryTable` builds it.

    ``num_slots``, ``dim``
        the global table's shape (this rank holds a shard of it).
    ``storage``
        where the shard lives and how lookups read it: a strategy of :mod:`rmt.memory.storage`
        (``location`` ``"device"`` or ``"host"``; a host shard's device ``cache`` or None).
    ``distribution``
        how the table is split over the memory-parallel group: ``"local"`` (whole on every rank),
        ``"number"`` (rows split) or ``"dimension"`` (columns split),
        :mod:`rmt.memory.distribution`.
    ``group``
        the memory-parallel group the shard's lookups go through (None when local).
    ``replica_group``
        the ranks holding copies of this shard in the other memory-parallel groups, over which
        its gradient is summed (None when local: the data-parallel group then).
    ``sparse_grad``
        the gradient is a coalesced sparse tensor of the touched rows, for the row-wise
        optimizers (``memory.value_optimizer`` ``sparse_adam`` or ``rowwise_adagrad``); such a
        table stays out of DDP (:mod:`rmt.memory.groups` reduces it).
    ``fused_update``
        the :class:`rmt.ops.fused_update.FusedValueUpdate` stepping the rows inside the lookups'
        backward (``memory.fused_value_optimizer``; attached once the optimizer exists), or None;
        the weight then gets no gradient.
    ``outside_ddp``
        a local dense-gradient table whose gradient the memory code all-reduces rather than
        DDP (marked under ``train.distributed_optimizer``, whose reduce-scatter would leave each
        rank 1/DP of it).

    Derived: ``sharded`` (not local) and ``self_reduced`` (the memory code, not megatron DDP,
    reduces the gradient: sharded, sparse-gradient and ``outside_ddp`` tables).
    """

    num_slots: int
    dim: int
    storage: Any = None
    distribution: str = "local"
    group: Any = None
    replica_group: Any = None
    sparse_grad: bool = False
    fused_update: Any = None
    outside_ddp: bool = False

    @property
    def sharded(self) -> bool:
        return self.distribution != "local"

    @property
    def self_reduced(self) -> bool:
        return self.sharded or self.sparse_grad or self.outside_ddp


def describe(param: torch.nn.Parameter, record: TableDescriptor) -> None:
    """Attach ``record`` to ``param`` (replacing any earlier one)."""
    setattr(param, _ATTRIBUTE, record)


def descriptor(param: torch.Tensor) -> Optional[TableDescriptor]:
    """The record of value table ``param``, or None for any other parameter."""
    return getattr(param, _ATTRIBUTE, None)


def is_table(param: torch.Tensor) -> bool:
    """Whether ``param`` is a memory value table's weight."""
    return descriptor(param) is not None


def amend(param: torch.nn.Parameter, **changes) -> TableDescriptor:
    """Replace fields of ``param``'s record (a table's later facts: its fused update, its
    reduction outside DDP); returns the new record."""
    record = replace(descriptor(param), **changes)
    describe(param, record)
    return record
