"""Parameters as pieces of global tensors, through megatron-core's ``sharded_state_dict``.

Every parameter of a model chunk is a shard of a *global* tensor named by a layout-independent
key (layer numbers are global, TP shards are offsets). This module maps local parameters to
those shards, so that weights can be initialised identically under any TP/PP/DP layout and
gradients or weights can be reassembled into full tensors (for equality tests and inspection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor


@dataclass
class Shard:
    key: str
    param: torch.nn.Parameter
    name: str
    global_shape: Tuple[int, ...]
    index: Tuple  # index of the local shard inside the global tensor
    is_main_replica: bool
    sharded: ShardedTensor  # megatron-core's description of this shard


def _index(sh: ShardedTensor) -> Tuple:
    pre = sh.prepend_axis_num
    lead = tuple(sh.global_offset[:pre])
    rest = tuple(slice(off, off + size) for off, size in zip(sh.global_offset[pre:], sh.local_shape))
    return lead + rest


def _replica_is_main(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def shards(chunks: Iterable[torch.nn.Module]) -> List[Shard]:
    """The shard of every parameter of ``chunks`` (each parameter exactly once)."""
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        by_ptr = {p.data_ptr(): (n, p) for n, p in module.named_parameters()}
        seen = set()
        for sh in module.sharded_state_dict().values():
            if not isinstance(sh, ShardedTensor) or sh.data is None:
                continue
            hit = by_ptr.get(sh.data.data_ptr())
            if hit is None or hit[0] in seen or hit[1].numel() != sh.data.numel():
                continue
            seen.add(hit[0])
            out.append(
                Shard(sh.key, hit[1], hit[0], tuple(sh.global_shape), _index(sh), _replica_is_main(sh.replica_id), sh)
            )
        missing = [n for n, _ in module.named_parameters() if n not in seen]
        if missing:
            raise RuntimeError(f"parameters without a sharded_state_dict entry: {missing}")
    return out


def gather_full(
    chunks: Iterable[torch.nn.Module],
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
    group=None,
) -> Dict[str, torch.Tensor]:
    """Reassemble full global tensors (``tensor_of(param)`` of every shard) on every rank of
    ``group`` (default: the world). Only main replicas contribute, so the result is exact."""
    local = shards(chunks)
    meta = {s.key: s.global_shape for s in local}
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1:
        metas = [None] * world
        dist.all_gather_object(metas, meta, group=group)
        for m in metas:
            meta.update(m)
    full = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in sorted(meta.items())}
    for s in local:
        if s.is_main_replica:
            value = tensor_of(s.param)
            full[s.key][s.index] = value.detach().float().cpu().reshape(full[s.key][s.index].shape)
    if world > 1:
        for k in full:
            dist.all_reduce(full[k], group=group)
    return full
