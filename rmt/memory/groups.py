"""Memory-parallel groups and the gradients of sharded memory tables (UltraMem Appendix C).

The memory-parallel group of a rank is the data x tensor parallel ranks of its pipeline stage
(megatron-core's tensor-and-data-parallel group), or, with ``memory.group_size = G``, the
subgroup of ``G`` consecutive ranks of it that holds this rank; the ``DP x TP / G`` subgroups
hold replicas of the same shards, and the ranks at the same position of every subgroup form
a replica group over which the shard gradients are all-reduced.

Tensor-parallel ranks hold the same tokens, so each looks up only its chunk of them and the
pooled outputs are all-gathered over a dedicated copy of the tensor-parallel group (its own
communicator: the async memory stream issues these collectives from its worker thread while
the main thread runs megatron's tensor-parallel collectives). Every lookup of a data-parallel
rank's tokens is thus made once, and the shard gradient summed over the group and its
replicas is ``DP`` times the data-parallel mean that DDP computes for replicated parameters;
the gradient finishing step divides by that.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

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
            subgroups = [ranks[i:i + G] for i in range(0, len(ranks), G)]
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


def sharded_params(modules: Iterable[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for m in modules for p in m.parameters() if getattr(p, "memory_sharded", False)]


class excluded_from_ddp:
    """Context: sharded table weights look frozen while megatron DDP wraps ``module``, so
    DDP neither buffers nor all-reduces them (their gradients arrive through the
    collectives); they accumulate into ``.grad`` as plain autograd leaves."""

    def __init__(self, module: torch.nn.Module):
        self.params = [p for p in sharded_params([module]) if p.requires_grad]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)


def finish_sharded_grads(modules: Iterable[torch.nn.Module]) -> None:
    """All-reduce shard gradients between replicas and divide by ``DP`` (see the module
    docstring), giving the data-parallel mean gradient of the global table."""
    scale = 1.0 / parallel_state.get_data_parallel_world_size()
    for p in sharded_params(modules):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        replicas = p.memory_replica_group
        if replicas is not None and dist.get_world_size(replicas) > 1:
            dist.all_reduce(p.grad, group=replicas)
        p.grad.mul_(scale)


def sharded_grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Squared L2 norm of the full gradients of the sharded tables among ``params`` (each
    shard counted once: summed over its memory-parallel group, then over the pipeline stages,
    whose tables differ). Collective over the pipeline group."""
    total = torch.zeros(1, dtype=torch.float64, device=compat.device())
    group = None
    for p in params:
        if getattr(p, "memory_sharded", False) and p.grad is not None:
            total += p.grad.detach().double().pow(2).sum()
            group = p.memory_group
    if group is not None:
        dist.all_reduce(total, group=group)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return float(total)
