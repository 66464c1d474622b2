"""Checkpoints through ``megatron.core.dist_checkpointing`` (torch_dist format).

A checkpoint holds the model shards, the Adam moments (AdamW, SparseAdam) as shards of the same
global tensors (so both reshard to any TP/PP layout), row-wise Adagrad's per-row accumulators as
shards of a ``[rows, 1]`` tensor beside each table, and a common part: iteration, samples consumed,
scheduler state and the config. Writing is atomic: every rank writes into
``iter_NNNNNNN.tmp``; once all are done global rank 0 renames it and then rewrites ``latest``.
A crash mid-save leaves only a ``.tmp`` directory, which loading ignores.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from typing import List

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from rmt.errors import UserError
from rmt.parallel.sharding import shards
from rmt.training.optimizer import ChainedOptimizer

_MOMENTS = ("exp_avg", "exp_avg_sq")
_ROW_STATE = "sum"  # RowWiseAdagrad's per-row accumulator (its initial_state)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ensure_optimizer_state(optimizer) -> None:
    """The optimizers create their state lazily; create it (zeros) so it can be loaded into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            owner = optimizer.owner(p) if isinstance(optimizer, ChainedOptimizer) else optimizer
            if hasattr(owner, "initial_state"):  # rmt's SparseAdam and RowWiseAdagrad
                state.update(owner.initial_state(p))
                continue
            state["step"] = torch.tensor(0.0)
            for name in _MOMENTS:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _row_state_tensor(sharded, row_state: torch.Tensor):
    """``row_state`` [rows] of a table whose weight shard is ``sharded`` as a shard of a global
    ``[num_slots, 1]`` tensor (rows split like the table's; whole rows only)."""
    local = row_state.view(-1, 1)
    out = replace(sharded, key=f"optimizer.{_ROW_STATE}.{sharded.key}", data=local, dtype=local.dtype,
                  local_shape=tuple(local.shape), global_shape=tuple(sharded.global_shape[:-1]) + (1,))
    out.validate_metadata_integrity()
    return out


def sharded_state(chunks: List[torch.nn.Module], optimizer, common: dict) -> dict:
    state = {f"model{i}": getattr(c, "module", c).sharded_state_dict() for i, c in enumerate(chunks)}
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        # Dict keys only need to be unique locally (layers stacked under one global key share
        # it); the ShardedTensor keys are what checkpoints match on.
        for i, shard in enumerate(shards(chunks)):
            st = optimizer.state[shard.param]
            for name in _MOMENTS:
                if name in st:
                    state[f"optimizer.{name}.{i}"] = make_sharded_optimizer_tensor(
                        shard.sharded, st[name], prefix=f"optimizer.{name}")
            if _ROW_STATE in st:
                state[f"optimizer.{_ROW_STATE}.{i}"] = _row_state_tensor(shard.sharded, st[_ROW_STATE])
    state["common"] = common
    return state


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(root: str, iteration: int, chunks, optimizer, common: dict) -> str:
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    dist_checkpointing.save(sharded_state(chunks, optimizer, common), tmp)
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _barrier()
    return final


def find_checkpoint(path: str) -> str:
    """``path`` is an ``iter_*`` directory or a root with a ``latest`` file."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                path = iteration_dir(path, int(f.read().strip()))
        except ValueError:
            raise UserError(f"checkpoint file '{latest}' is corrupt") from None
    if not os.path.isdir(path) or not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise UserError(f"'{path}' is not a complete rmt checkpoint (no dist_checkpointing metadata)")
    return path


def load_common(path: str) -> dict:
    try:
        return dist_checkpointing.load_common_state_dict(find_checkpoint(path))["common"]
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"checkpoint '{path}' is corrupt ({str(err).splitlines()[0]})") from None


def load_checkpoint(path: str, chunks, optimizer) -> dict:
    """Load model (and optimizer moments, if ``optimizer``) in place; returns the common part."""
    path = find_checkpoint(path)
    template = sharded_state(chunks, optimizer, {})
    template.pop("common")
    try:
        loaded = dist_checkpointing.load(template, path)
    except Exception as err:
        raise UserError(
            f"checkpoint '{path}' does not fit this model or is corrupt "
            f"({str(err).splitlines()[0][:300]})") from None
    for i, chunk in enumerate(chunks):
        getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer is not None:
        for i, shard in enumerate(shards(chunks)):
            st = optimizer.state[shard.param]
            for name in _MOMENTS + (_ROW_STATE,):
                if name in st:
                    st[name].copy_(loaded[f"optimizer.{name}.{i}"].view_as(st[name]))
    return load_common(path)


def set_optimizer_step(optimizer, step: int) -> None:
    """Adam's bias-correction step count (a tensor in AdamW, an int in SparseAdam)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in optimizer.state and "step" in optimizer.state[p]:
                state = optimizer.state[p]
                if torch.is_tensor(state["step"]):
                    state["step"].fill_(float(step))
                else:
                    state["step"] = step
