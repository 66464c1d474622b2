"""How a value table is split over the memory-parallel group: one scheme per module.

:mod:`~rmt.memory.distribution.local` (whole on every rank),
:mod:`~rmt.memory.distribution.number` (rows split, UltraMem Appendix C/D number-wise, plain or
with ``owner_reduce``), :mod:`~rmt.memory.distribution.dimension` (columns split); the sharded
two share :mod:`~rmt.memory.distribution.sharded` and the collectives of
:mod:`~rmt.memory.distribution.collectives`. A distribution knows the shard this rank holds
(``shard_shape``, ``shard_index``), routes a lookup to the storages holding the rows
(``lookup``), keeps the slot counters' ownership (``owned_rows``, ``owned``, ``hit_count``,
``stat_groups``) and describes the shard to checkpoints (``sharded_state_dict``).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter
from rmt.memory.comm_volume import choose_partition
from rmt.memory.distribution.dimension import DimensionDistribution
from rmt.memory.distribution.local import LocalDistribution
from rmt.memory.distribution.number import NumberDistribution

PARTITIONS = ("local", "number", "dimension", "auto")


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


def make_distribution(
    partition: str,
    num_slots: int,
    dim: int,
    group=None,
    *,
    owner_reduce: bool = False,
    replica_index: int = 0,
    replica_group=None,
    split_group=None,
    plan: Optional[dict] = None,
    value_bytes: int = 4,
    counter: Optional[CommCounter] = None,
):
    """The distribution of a ``num_slots x dim`` table (``partition`` ``auto`` resolved by
    :func:`resolve_partition` for ``plan``, whose tokens are divided over ``split_group``)."""
    if partition not in PARTITIONS:
        raise ValueError(f"MemoryTable partition must be one of {PARTITIONS}, got {partition!r}")
    if partition == "local":
        return LocalDistribution(num_slots, dim, counter)
    P = dist.get_world_size(group)
    if plan is not None and split_group is not None:
        plan = dict(plan, tokens=max(1, plan["tokens"] // dist.get_world_size(split_group)))
    partition = resolve_partition(partition, num_slots, dim, P, plan, owner_reduce, value_bytes)
    sharding = dict(replica_index=replica_index, replica_group=replica_group, split_group=split_group, counter=counter)
    if partition == "number":
        return NumberDistribution(num_slots, dim, group, owner_reduce=owner_reduce, **sharding)
    return DimensionDistribution(num_slots, dim, group, **sharding)
