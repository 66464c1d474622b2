"""Checkpoints through ``megatron.core.dist_checkpointing`` (torch_dist format).

A checkpoint holds the model shards and the Adam moments (AdamW, SparseAdam) as shards of the same
global tensors (so both reshard to any TP/PP layout), and a common part: iteration, samples
consumed, scheduler state and the config. Memory value tables and their optimizer states
(moments, row-wise Adagrad's per-row sums) are streamed shard by shard beside it
(:mod:`rmt.training.table_checkpoint`), so no rank ever holds more than its shard of them. Writing is atomic: every rank writes into
``iter_NNNNNNN.tmp``; once all are done global rank 0 renames it and then rewrites ``latest``.
A crash mid-save leaves only a ``.tmp`` directory, which loading ignores.
"""

from __future__ import annotations

import os
import shutil
from typing import List

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from rmt.errors import UserError
from rmt.parallel.sharding import shards
from rmt.training.optimizer import ChainedOptimizer
from rmt.training.table_checkpoint import FORMAT as TABLE_FORMAT
from rmt.training.table_checkpoint import load_tables, save_tables, table_shards

_MOMENTS = ("exp_avg", "exp_avg_sq")


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


def sharded_state(chunks: List[torch.nn.Module], optimizer, common: dict) -> dict:
    """megatron's part of a checkpoint: everything but the memory value tables and their states."""
    tables = {s.key for s in table_shards(chunks)}
    state = {f"model{i}": {k: v for k, v in getattr(c, "module", c).sharded_state_dict().items() if k not in tables}
             for i, c in enumerate(chunks)}
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        # Dict keys only need to be unique locally (layers stacked under one global key share
        # it); the ShardedTensor keys are what checkpoints match on.
        for i, shard in enumerate(shards(chunks)):
            if shard.key in tables:
                continue
            st = optimizer.state[shard.param]
            for name in _MOMENTS:
                if name in st:
                    state[f"optimizer.{name}.{i}"] = make_sharded_optimizer_tensor(
                        shard.sharded, st[name], prefix=f"optimizer.{name}")
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
    dist_checkpointing.save(sharded_state(chunks, optimizer, dict(common, table_format=TABLE_FORMAT)), tmp)
    save_tables(tmp, chunks, optimizer)
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
    common = load_common(path)
    tables = table_shards(chunks)
    if tables and common.get("table_format") != TABLE_FORMAT:
        raise UserError(f"checkpoint '{path}' stores its memory tables in an older format "
                        f"({common.get('table_format', 'inside the torch_dist files')}); this rmt reads "
                        f"format {TABLE_FORMAT}")
    load_tables(path, chunks, optimizer)
    names = {s.key for s in tables}
    for i, chunk in enumerate(chunks):
        missing, unexpected = getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        if unexpected or set(missing) - names:  # the tables were filled in place above
            raise UserError(f"checkpoint '{path}' does not fit this model (missing {sorted(set(missing) - names)}, "
                            f"unexpected {sorted(unexpected)})")
    if optimizer is not None:
        for i, shard in enumerate(shards(chunks)):
            if shard.key in names:
                continue
            st = optimizer.state[shard.param]
            for name in _MOMENTS:
                if name in st:
                    st[name].copy_(loaded[f"optimizer.{name}.{i}"].view_as(st[name]))
    return common


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
