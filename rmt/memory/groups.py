"""Memory-parallel groups and the gradients of sharded memory tables (UltraMem Appendix C).

The memory-parallel group of a rank is the data x tensor parallel ranks of its pipeline stage
(megatron-core's tensor-and-data-parallel group), or, with ``memory.group_size = G``, the
subgroup of ``G`` consecutive ranks of it that holds this rank; the ``DP x TP / G`` subgroups
hold replicas of the same shards, and the ranks at the same position of every subgroup form
a replica group over which the shard gradients are all-reduced.

Tensor-parallel ranks hold the same tokens (under sequence parallelism too: the memory layers
gather the sequence first, :mod:`rmt.memory.attach`), so each looks up only its chunk of them and the
pooled outputs are all-gathered over a dedicated copy of the tensor-parallel group (its own
communicator: the async memory stream issues these collectives from its worker thread while
the main thread runs megatron's tensor-parallel collectives). Every lookup of a data-parallel
rank's tokens is thus made once, and the shard gradient summed over the group and its
replicas is ``DP`` times the data-parallel mean that DDP computes for replicated parameters;
the gradient finishing step divides by that.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rmt.memory.descriptor import amend, descriptor
from rmt.ops.sparse_optim import coalesced, row_square_sums
from rmt.parallel import compat

_CACHE: Dict[Tuple, Tuple] = {}


def memory_parallel_groups(group_size: int = 0):
    """``(group, replica_group, replica_index, split_group)`` of this rank; ``group_size`` 0 =
    the whole data x tensor parallel group of the stage; ``split_group`` is this rank's copy of
    its tensor-parallel group (None without tensor parallelism). Collective on first use
    (every rank creates every subgroup, in the same order)."""
    td = parallel_state.get_tensor_and_data_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_group()
    key = (group_size, id(td))
    if key not in _CACHE:
        me = dist.get_rank()
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, dist.get_process_group_ranks(td))
        found = None
        for ranks in sorted({tuple(s) for s in stages}):
            G = group_size or len(ranks)
            subgroups = [ranks[i : i + G] for i in range(0, len(ranks), G)]
            made = [dist.new_group(list(s)) for s in subgroups]
            replicas = [dist.new_group([s[i] for s in subgroups]) for i in range(G)]
            for index, s in enumerate(subgroups):
                if me in s:
                    found = (made[index], replicas[s.index(me)], index)
        split_group = None
        if dist.get_world_size(tp) > 1:
            tp_groups = [None] * dist.get_world_size()
            dist.all_gather_object(tp_groups, dist.get_process_group_ranks(tp))
            for ranks in sorted({tuple(s) for s in tp_groups}):
                made = dist.new_group(list(ranks))
                if me in ranks:
                    split_group = made
        _CACHE[key] = found + (split_group,)
    return _CACHE[key]


def fused_update(p: torch.nn.Parameter):
    """The :class:`rmt.ops.fused_update.FusedValueUpdate` that steps ``p`` inside its lookups'
    backward (``memory.fused_value_optimizer``), or None."""
    record = descriptor(p)
    return None if record is None else record.fused_update


def host_cache(p: torch.nn.Parameter):
    """The device cache of table ``p``'s host shard (``memory.host_cache_rows``), or None."""
    record = descriptor(p)
    return None if record is None else record.storage.cache


def attach_fused_updates(params: Iterable[torch.nn.Parameter], optimizer) -> List:
    """Step every value table among ``params`` (sparse-gradient tables held by ``optimizer``, a
    SparseAdam or RowWiseAdagrad) inside its lookups' backward: its lookups of the step are summed
    over its replicas (the data-parallel group of a local table, the replica group of a shard) and
    scaled by ``1 / DP``, the data-parallel mean :func:`finish_memory_grads` makes of the unfused
    gradient. Returns the updates."""
    from rmt.ops.fused_update import FusedValueUpdate

    scale = 1.0 / parallel_state.get_data_parallel_world_size()
    updates = []
    for p in params:
        record = descriptor(p)
        if record is None or not record.sparse_grad:
            continue
        update = FusedValueUpdate(p, optimizer, group=replica_group(p), grad_scale=scale)
        amend(p, fused_update=update)
        updates.append(update)
    return updates


def replica_group(p: torch.nn.Parameter):
    """The ranks holding copies of table ``p``'s shard, over which its gradient is summed: the
    replica group of a sharded table, the data-parallel group of a local one."""
    record = descriptor(p)
    if record.sharded:
        return record.replica_group
    return parallel_state.get_data_parallel_group()


def self_reduced(p: torch.nn.Parameter) -> bool:
    """Whether the memory code, not megatron DDP, reduces ``p``'s gradient: sharded tables
    (gradients through the collectives), tables with sparse touched-row gradients, and the
    tables :func:`reduce_tables_outside_ddp` marked (:attr:`TableDescriptor.self_reduced
    <rmt.memory.descriptor.TableDescriptor.self_reduced>`)."""
    record = descriptor(p)
    return record is not None and record.self_reduced


def reduce_tables_outside_ddp(module: torch.nn.Module) -> None:
    """Mark ``module``'s local dense-gradient value tables self-reduced (all-reduced by
    :func:`finish_memory_grads`). For megatron's distributed optimizer: its DDP reduce-scatters
    the gradient buffers, leaving each rank the gradient of its shard of the buffer only, while a
    table is stepped whole by its own optimizer on every rank."""
    for p in module.parameters():
        if descriptor(p) is not None and not self_reduced(p):
            amend(p, outside_ddp=True)


def self_reduced_params(modules: Iterable[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for m in modules for p in m.parameters() if self_reduced(p)]


def grad_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a gradient: the touched rows of a sparse one, else all of it."""
    return coalesced(grad).values() if grad.is_sparse else grad


class frozen:
    """Context: the trainable ``params`` look frozen (``requires_grad`` off) while it lasts, so
    that megatron's DDP or optimizer, built meanwhile, leaves them out."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)


def excluded_from_ddp(module: torch.nn.Module) -> frozen:
    """Context: self-reduced table weights (:func:`self_reduced`) look frozen while megatron
    DDP wraps ``module``, so DDP neither buffers nor all-reduces them; they accumulate into
    ``.grad`` as plain autograd leaves."""
    return frozen(self_reduced_params([module]))


def sum_sparse_grads(grad: Optional[torch.Tensor], param: torch.Tensor, group, home=None) -> torch.Tensor:
    """Coalesced sum over ``group`` of the ranks' sparse row gradients of ``param`` (None: no
    rows), on ``home`` (default: ``param``'s device). The ranks' (rows, values) pairs are
    all-gathered, padded to the longest, and concatenated in rank order, so every rank builds the
    same tensor; a host table's through the compute device (NCCL's collectives take device
    tensors), the sum back on the host."""
    home, device, shape = torch.device(home or param.device), compat.device(), param.shape
    if grad is None:
        rows = torch.zeros(0, dtype=torch.int64, device=home)
        values = torch.zeros((0,) + tuple(shape[1:]), dtype=param.dtype, device=home)
    else:
        grad = coalesced(grad)
        rows, values = grad.indices()[0], grad.values()
    if group is not None and dist.get_world_size(group) > 1:
        rows, values = rows.to(device), values.to(device)
        P = dist.get_world_size(group)
        count = torch.tensor([rows.numel()], device=device)
        counts = [torch.zeros_like(count) for _ in range(P)]
        dist.all_gather(counts, count, group=group)
        counts = [int(c) for c in counts]
        longest = max(counts)
        pad = longest - rows.numel()
        rows = torch.cat([rows, rows.new_zeros(pad)])
        values = torch.cat([values, values.new_zeros((pad,) + tuple(values.shape[1:]))])
        all_rows = [torch.empty_like(rows) for _ in range(P)]
        all_values = [torch.empty_like(values) for _ in range(P)]
        dist.all_gather(all_rows, rows, group=group)
        dist.all_gather(all_values, values, group=group)
        rows = torch.cat([r[:c] for r, c in zip(all_rows, counts)]).to(home)
        values = torch.cat([v[:c] for v, c in zip(all_values, counts)]).to(home)
    return coalesced(torch.sparse_coo_tensor(rows.unsqueeze(0), values, tuple(shape), check_invariants=False))


def finish_memory_grads(modules: Iterable[torch.nn.Module]) -> None:
    """The data-parallel mean gradient of every self-reduced table: shard gradients are
    summed over their replicas and divided by ``DP`` (see the module docstring); replicated
    (local) tables with sparse gradients are summed over the data-parallel group and divided
    by ``DP``, as DDP does for dense ones. Sparse gradients stay sparse (coalesced). Tables with a
    :func:`fused_update` have no gradient: their rows were stepped in the backward (the update's
    leftover lookups, if any, are stepped here). A host table's gradient is the row gradients its
    backwards brought to the host (:meth:`rmt.memory.storage.HostStorage.collect_grad`)."""
    scale = 1.0 / parallel_state.get_data_parallel_world_size()
    for p in self_reduced_params(modules):
        record = descriptor(p)
        record.storage.collect_grad()
        if record.fused_update is not None:
            record.fused_update.flush()
            continue
        group = replica_group(p)
        if record.sparse_grad:
            p.grad = sum_sparse_grads(p.grad, p, group) * scale
            cache = record.storage.cache
            if cache is not None:
                cache.grad = sum_sparse_grads(cache.take_grad(), p, group, home=cache.device) * scale
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
        p.grad.mul_(scale)


def square_sum(values: torch.Tensor) -> torch.Tensor:
    """float64 sum of squares of ``values``: the sum of its rows' (:func:`row_square_sums`, in
    row order), so that a gradient split by rows sums alike (a host table's cached rows,
    :meth:`rmt.memory.host_cache.HostCache.grad_sq_norm`)."""
    return row_square_sums(values).sum()


def memory_grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Squared L2 norm of the full gradients of the memory value tables among ``params``: each
    shard counted once (summed over its memory-parallel group), replicated tables once (their
    reduced gradient, by DDP or :func:`finish_memory_grads`, is the same on every
    tensor-parallel rank), then summed over the pipeline stages, whose tables differ. Collective
    over the pipeline group (and the memory-parallel group where a stage has shards), on every
    rank alike whatever tables its stage holds. A table stepped in its backward
    (:func:`fused_update`) counts the squared norm of the gradient it stepped with. A one-element
    fp64 tensor on the compute device: nothing here waits for the device."""
    device = compat.device()
    sharded, local = (
        torch.zeros(1, dtype=torch.float64, device=device),
        torch.zeros(1, dtype=torch.float64, device=device),
    )
    group = None
    for p in params:
        record = descriptor(p)
        if record is None or (p.grad is None and record.fused_update is None):
            continue
        if record.fused_update is not None:
            sq = torch.as_tensor(record.fused_update.pop_sq_norm(host=False), dtype=torch.float64, device=device)
        elif record.storage.cache is not None:
            sq = record.storage.cache.grad_sq_norm(p.grad.detach())
        else:
            sq = square_sum(grad_values(p.grad.detach())).to(device)
        if record.sharded:
            sharded += sq
            group = record.group
        else:
            local += sq
    if group is not None:
        dist.all_reduce(sharded, group=group)
    total = sharded + local
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total
