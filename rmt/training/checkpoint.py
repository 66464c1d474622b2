"""Checkpoints through ``megatron.core.dist_checkpointing`` (torch_dist format).

A checkpoint holds the model shards and the Adam moments (AdamW, SparseAdam) as shards of the same
global tensors (so both reshard to any TP/PP layout), and a common part: iteration, samples
consumed, scheduler state and the config. Memory value tables and their optimizer states
(moments, row-wise Adagrad's per-row sums) are streamed shard by shard beside it
(:mod:`rmt.training.table_checkpoint`), so no rank ever holds more than its shard of them.

Saving (:func:`save_checkpoint`): global rank 0 checks the free space against the size of the
state about to be written, every rank writes into ``iter_NNNNNNN.tmp``, rank 0 adds a manifest
(every file with its size), renames the directory, rewrites ``latest`` and deletes checkpoints
beyond ``train.keep_checkpoints``. A save that fails removes its ``.tmp`` and raises one sentence
on every rank. Loading (:func:`resume`) continues from the newest complete checkpoint and falls
back to older ones past incomplete or corrupt ones. Directory logic lives in
``rmt.training.checkpoint_dirs``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from torch.distributed.checkpoint.api import CheckpointException

from rmt.errors import CheckpointMismatch, UserError
from rmt.outputs import output_problem
from rmt.parallel import compat
from rmt.parallel.lifetime import forked_children_die_with_this_process
from rmt.parallel.sharding import shards
from rmt.training import checkpoint_dirs
from rmt.training.checkpoint_dirs import iteration_dir
from rmt.training.dense_state import MOMENTS, dense_states, inner_optimizers
from rmt.training.table_checkpoint import FORMAT as TABLE_FORMAT
from rmt.training.table_checkpoint import load_tables, save_tables, table_shards, table_tensors


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _ensure_optimizer_state(optimizer, device: Optional[str] = None) -> list:
    """The optimizers create their state lazily; create it (zeros) so it can be loaded into.
    ``device="meta"``: shapes and dtypes only, nothing allocated. Returns the states created."""
    created = []
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                like = p if device is None else torch.empty_like(p, device=device)
                if hasattr(inner, "initial_state"):  # rmt's SparseAdam and RowWiseAdagrad
                    state.update(inner.initial_state(like))
                else:
                    # as torch's own lazy init: a fused or capturable Adam keeps its step count on
                    # the parameter's device (its CUDA kernel refuses a CPU one), the others on the CPU
                    on_device = group.get("fused") or group.get("capturable")
                    state["step"] = torch.zeros((), dtype=torch.float32, device=like.device if on_device else "cpu")
                    for name in MOMENTS:
                        state[name] = torch.zeros_like(like, memory_format=torch.preserve_format)
                created.append(state)
    return created


def _dense_sharded(shard, state, name: str):
    """The ShardedTensors of optimizer tensor ``name`` of ``shard``'s parameter: pieces of the
    same global tensor as the parameter, under the key ``optimizer.<name>.<parameter key>``. The
    whole local shard for a plain optimizer; for the distributed optimizer the boxes that tile the
    flattened range this rank holds (:func:`flat_range_boxes`; megatron-core 0.16 no longer takes
    flattened ranges and writes such pieces as uneven shards), each the main replica of its
    elements (the data-parallel replica coordinate is 0)."""
    tensor = state.tensors[name]
    prefix = f"optimizer.{name}"
    if state.flat_range is None:
        return make_sharded_optimizer_tensor(shard.sharded, tensor.view(shard.sharded.local_shape), prefix=prefix)
    sh = shard.sharded
    replica = tuple(sh.replica_id[:-1]) + (0,) if isinstance(sh.replica_id, tuple) else 0
    pre = sh.prepend_axis_num
    pieces, pos = [], 0
    for offset, size in flat_range_boxes(tuple(sh.local_shape), state.flat_range.start, state.flat_range.stop):
        numel = math.prod(size)
        size = (
            1,
        ) * pre + size  # a layer of stacked layers as a box of the stack (uneven shards take no prepended axes)
        pieces.append(
            ShardedTensor(
                key=f"{prefix}.{sh.key}",
                data=tensor.reshape(-1)[pos : pos + numel].view(size),
                dtype=tensor.dtype,
                local_shape=size,
                global_shape=tuple(sh.global_shape),
                global_offset=tuple(sh.global_offset[:pre])
                + tuple(o + g for o, g in zip(offset, sh.global_offset[pre:])),
                axis_fragmentations=None,
                replica_id=replica,
            )
        )
        pos += numel
    return pieces


def flat_range_boxes(shape: Tuple[int, ...], start: int, end: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``(offset, size)`` boxes of a C-order tensor of ``shape`` that together hold exactly its
    flattened elements ``start:end``, in that order, each a run of consecutive elements (at most
    ``2 * len(shape) - 1`` of them)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, lead = divmod(start, inner)
    last, tail = divmod(end, inner)

    def rows(row, lo, hi):
        return [((row,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return rows(first, lead, tail)
    out = []
    if lead:
        out += rows(first, lead, inner)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
    if tail:
        out += rows(last, 0, tail)
    return out


def sharded_state(
    chunks: List[torch.nn.Module],
    optimizer,
    common: dict,
    averages: Optional[Dict[torch.nn.Parameter, torch.Tensor]] = None,
) -> dict:
    """megatron's part of a checkpoint: everything but the memory value tables and their states.
    ``averages`` (:meth:`rmt.training.weight_average.WeightAverage.by_param`) are sharded as their
    parameters are, under the prefix ``ema``."""
    tables = {s.key for s in table_shards(chunks)}
    state = {
        f"model{i}": {k: v for k, v in getattr(c, "module", c).sharded_state_dict().items() if k not in tables}
        for i, c in enumerate(chunks)
    }
    for i, shard in enumerate(shards(chunks) if averages else []):
        if shard.param in averages:
            average = averages[shard.param].view(shard.sharded.local_shape)
            state[f"ema.{i}"] = make_sharded_optimizer_tensor(shard.sharded, average, prefix="ema")
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        dense = dense_states(optimizer.dense_optimizers)
        # Dict keys only need to be unique locally (layers stacked under one global key share
        # it); the ShardedTensor keys are what checkpoints match on.
        for i, shard in enumerate(shards(chunks)):
            if shard.key in tables or shard.param not in dense:
                continue
            for name in dense[shard.param].tensors:
                piece = _dense_sharded(shard, dense[shard.param], name)
                if piece != []:  # a distributed optimizer's empty range of this parameter
                    state[f"optimizer.{name}.{i}"] = piece
    state["common"] = common
    return state


class CheckpointSaveError(UserError):
    """A save that could not complete (no space, a failed write); nothing half-written is left.
    A restart would fail the same way until the operator acts, hence a user error (exit 2)."""


# torch's CheckpointException derives from BaseException, so ``except Exception`` misses it.
_CHECKPOINT_ERRORS = (Exception, CheckpointException)
_MORE_ROOM = "free space, or keep fewer checkpoints with train.keep_checkpoints"


def _from_rank0(value):
    """``value`` as global rank 0 has it, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _first_problem(problem):
    """The lowest rank's ``problem`` that is not None, on every rank (None when no rank has one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problem)
    return next((p for p in every if p is not None), None)


def _innermost(err: BaseException) -> BaseException:
    """The error behind ``err`` (torch's CheckpointException wraps each rank's exception with its
    traceback; megatron-core chains them)."""
    while True:
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            err = inner[0] if isinstance(inner, tuple) else inner
        elif err.__cause__ is not None:
            err = err.__cause__
        else:
            return err


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost error behind ``err``, said plainly."""
    err = _innermost(err)
    text = str(err).strip().splitlines()
    cause = (text[0] if text else type(err).__name__)[:300]
    if "unexpected pos" in cause:  # torch's zip writer, when a write to its file came up short
        cause = f"a write was cut short: the disk is full or a quota or file-size limit was hit ({cause})"
    return cause


def _state_bytes(state: dict, chunks, optimizer) -> int:
    """Bytes of tensor data the whole job writes for megatron's ``state`` and the memory tables
    (main replicas only, summed over ranks): the size the new checkpoint will have, up to
    metadata."""
    local = sum(
        v.data.numel() * v.data.element_size()
        for v in nested_values(state)
        if torch.is_tensor(getattr(v, "data", None)) and hasattr(v, "replica_id") and is_main_replica(v.replica_id)
    )
    local += sum(
        t.numel() * t.element_size()
        for shard in table_shards(chunks)
        if shard.is_main_replica
        for t in table_tensors(shard, optimizer).values()
    )
    total = torch.tensor([local], dtype=torch.int64, device=compat.device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return int(total.item())


def _bytes_needed(state: dict, chunks, optimizer) -> int:
    """Free space a save of ``state`` needs: its tensor bytes, and for metadata (torch's
    .metadata, common.pt, table descriptors) 5% and 16 MiB on top."""
    return int(_state_bytes(state, chunks, optimizer) * 1.05) + 16 * 2**20


def _room(root: str, need: int) -> Optional[str]:
    """Why ``root`` cannot take a checkpoint of ``need`` bytes, or None (:mod:`rmt.outputs`)."""
    return output_problem(root, "train.save", need, directory=True, hint=_MORE_ROOM)


def _prepare(root: str, need: int, tmp: Optional[str] = None) -> None:
    """Global rank 0 creates ``root``, checks that it can write there and its free space against
    ``need``, and makes an empty ``tmp``; every rank raises :class:`CheckpointSaveError` when it
    cannot."""
    problem = None
    if _rank() == 0:
        problem = _room(root, need)
        if problem is None:
            try:
                os.makedirs(root, exist_ok=True)
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    os.makedirs(tmp)
            except OSError as err:
                problem = f"cannot create '{tmp or root}': {err.strerror or err}"
    problem = _from_rank0(problem)
    if problem is not None:
        raise CheckpointSaveError(problem)


def check_space(root: str, chunks, optimizer, averages=None) -> None:
    """Before training: raise :class:`CheckpointSaveError` now, not after the first steps, when
    ``root`` cannot be written or has no room for one checkpoint of this model (collective). The optimizer states
    that do not exist yet are sized on the meta device: creating them here would hold
    table-sized moments from start-up on, before the first step needs them."""
    created = _ensure_optimizer_state(optimizer, device="meta")
    try:
        need = _bytes_needed(sharded_state(chunks, optimizer, {}, averages), chunks, optimizer)
    finally:
        for state in created:
            state.clear()
    _prepare(root, need)


def save_checkpoint(root: str, iteration: int, chunks, optimizer, common: dict, keep: int = 0, averages=None) -> str:
    """Write ``root/iter_NNNNNNN`` (collective), with the weight ``averages`` if given. Returns its
    path; raises :class:`CheckpointSaveError` on every rank when the save cannot complete."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    state = sharded_state(chunks, optimizer, dict(common, table_format=TABLE_FORMAT, ema=bool(averages)), averages)
    need = _bytes_needed(state, chunks, optimizer)
    _prepare(root, need, tmp)
    forked_children_die_with_this_process()
    failure = None
    quiet = logging.getLogger("megatron.core.dist_checkpointing")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failed write is reported below, in one sentence
    try:
        dist_checkpointing.save(state, tmp)
        save_tables(tmp, chunks, optimizer)
    except _CHECKPOINT_ERRORS as err:
        failure = _root_cause(err)
    finally:
        quiet.setLevel(level)
    failure = _first_problem(failure)
    if failure is None and _rank() == 0:
        try:
            checkpoint_dirs.write_manifest(tmp, iteration)
            checkpoint_dirs.publish(tmp, final, root, iteration)
        except OSError as err:
            failure = str(err)
    failure = _from_rank0(failure)
    if failure is not None:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            space = _room(root, need) if os.path.isdir(root) else None
            failure += f"; {space}" if space else ""
        _barrier()
        raise CheckpointSaveError(
            f"saving checkpoint '{final}' failed ({failure}); its incomplete directory was removed"
        )
    if _rank() == 0:
        checkpoint_dirs.rotate(root, keep)
    _barrier()
    return final


def find_checkpoint(path: str) -> str:
    """``path`` is an ``iter_*`` directory (which must be complete) or a save root (its newest
    complete checkpoint)."""
    return checkpoint_dirs.resolve(path)


def load_common(path: str) -> dict:
    try:
        return dist_checkpointing.load_common_state_dict(find_checkpoint(path))["common"]
    except UserError:
        raise
    except _CHECKPOINT_ERRORS as err:
        raise UserError(f"checkpoint '{path}' is corrupt ({_root_cause(err)})") from None


def load_checkpoint(path: str, chunks, optimizer, averages=None, with_tables: bool = True) -> dict:
    """Load model (and optimizer moments, if ``optimizer``; and the weight ``averages``, if given
    and saved: ``common["ema"]``) in place; returns the common part. ``with_tables=False`` leaves the
    memory value tables as they are (``rmt-export`` streams them from their files)."""
    path = find_checkpoint(path)
    common = load_common(path)
    if not common.get("ema"):
        averages = None
    template = sharded_state(chunks, optimizer, {}, averages)
    template.pop("common")
    try:
        saved = dist_checkpointing.load_tensors_metadata(path)
        for key in [
            k
            for k, v in template.items()
            if k.startswith("optimizer.main_param.") and (v[0] if isinstance(v, list) else v).key not in saved
        ]:
            del template[key]  # saved by a run with fp32 parameters: its weights are the main copy
        loaded = dist_checkpointing.load(template, path)
    except _CHECKPOINT_ERRORS as err:
        # megatron-core validates keys and global shapes before reading: a mismatch there is
        # another model; anything else is a file that cannot be read.
        if isinstance(_innermost(err), (CheckpointingException, KeyError)):
            raise CheckpointMismatch(f"checkpoint '{path}' does not fit this model ({_root_cause(err)})") from None
        raise UserError(f"checkpoint '{path}' is corrupt or unreadable ({_root_cause(err)})") from None
    tables = table_shards(chunks)
    if tables and common.get("table_format") != TABLE_FORMAT:
        raise UserError(
            f"checkpoint '{path}' stores its memory tables in an older format "
            f"({common.get('table_format', 'inside the torch_dist files')}); this rmt reads "
            f"format {TABLE_FORMAT}"
        )
    if with_tables:
        load_tables(path, chunks, optimizer)
    names = {s.key for s in tables}
    for i, chunk in enumerate(chunks):
        missing, unexpected = getattr(chunk, "module", chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        if unexpected or set(missing) - names:  # the tables were filled in place above
            raise CheckpointMismatch(
                f"checkpoint '{path}' does not fit this model (missing {sorted(set(missing) - names)}, "
                f"unexpected {sorted(unexpected)})"
            )
    for key, loaded_average in loaded.items():
        if key.startswith("ema."):
            template[key].data.copy_(loaded_average.view_as(template[key].data))
    if optimizer is not None:
        dense = dense_states(optimizer.dense_optimizers)
        for i, shard in enumerate(shards(chunks)):
            if shard.key in names or shard.param not in dense:
                continue
            for name, tensor in dense[shard.param].tensors.items():
                key = f"optimizer.{name}.{i}"
                if key not in loaded:  # a main copy that a checkpoint of fp32 parameters has no need of
                    tensor.copy_(_flat(shard.param, dense[shard.param].flat_range).view_as(tensor))
                elif isinstance(loaded[key], list):  # the pieces of a distributed optimizer's range
                    tensor.copy_(torch.cat([t.reshape(-1) for t in loaded[key]]).view_as(tensor))
                else:
                    tensor.copy_(loaded[key].view_as(tensor))
    return common


def _flat(param: torch.Tensor, flat_range: Optional[slice]) -> torch.Tensor:
    flat = param.detach().reshape(-1)
    return flat if flat_range is None else flat[flat_range]


def will_resume(save: Optional[str], load: Optional[str]) -> bool:
    """Whether :func:`resume` will load a checkpoint (collective): there is a complete one to try.
    :func:`resume` then either loads one completely or stops the run, so the model's initial
    values are never used. A problem with the directories is left for :func:`resume` to report."""
    found = False
    if _rank() == 0:
        try:
            found = bool(checkpoint_dirs.resume_plan(save, load)[0])
        except UserError:
            found = False
    return _from_rank0(found)


def _starts_from_hf(save: Optional[str], load: Optional[str]) -> bool:
    """``load`` is a Hugging Face model directory (``rmt-export``'s, or a standard one) and
    ``save`` holds no complete checkpoint to continue instead."""
    from rmt.export.importer import is_hf_directory

    return is_hf_directory(load) and not (save and checkpoint_dirs.complete_checkpoints(save)[0])


def resume(
    save: Optional[str],
    load: Optional[str],
    chunks,
    optimizer,
    say: Callable[[str], None],
    model_problem: Optional[Callable[[dict, str], Optional[str]]] = None,
    averages=None,
) -> Optional[Tuple[str, dict]]:
    """Load the checkpoint a run continues from (collective; see
    ``checkpoint_dirs.resume_plan``) and return its path and common part, or None for a fresh
    start. A complete-looking checkpoint that cannot be read is reported and the next older one
    tried; one of another model (:class:`CheckpointMismatch`) is an error at once, as every
    older one would fail the same way. A Hugging Face model directory as ``load``
    (:mod:`rmt.export.importer`) gives the starting weights when ``save`` has no checkpoint yet.
    ``say`` receives each sentence worth telling (called on
    global rank 0 only). ``model_problem(saved_config, path)`` says why a checkpoint's saved
    config is of another model (None when it is this one); such a checkpoint is a mismatch."""
    if _from_rank0(_starts_from_hf(save, load) if _rank() == 0 else None):
        from rmt.export.importer import load_hf_directory

        load_hf_directory(load, chunks, model_problem)
        if _rank() == 0:
            say(f"loaded the weights of the Hugging Face model '{load}' (optimizer, step and data start afresh)")
        return load, {"iteration": 0, "consumed_samples": 0}
    plan = None
    if _rank() == 0:
        try:
            plan = checkpoint_dirs.resume_plan(save, load)
            for stale in checkpoint_dirs.remove_stale_saves(save) if save else []:
                say(f"removed '{stale}', a save that an earlier run did not finish")
        except UserError as err:
            plan = str(err)
    plan = _from_rank0(plan)
    if isinstance(plan, str):
        raise UserError(plan)
    candidates, notes, explicit = plan
    if _rank() == 0:
        for note in notes:
            say(note)
    failures = []
    for path in candidates:
        problem = None
        try:
            if model_problem is not None:
                problem = model_problem(load_common(path)["config"], path)
                if problem is not None:
                    raise CheckpointMismatch(problem)
            common = load_checkpoint(path, chunks, optimizer, averages)
        except UserError as err:
            problem = (str(err), isinstance(err, CheckpointMismatch))
        problem = _first_problem(problem)
        if problem is None:
            return path, common
        problem, mismatch = problem
        if explicit or mismatch:
            raise UserError(problem)
        failures.append(problem)
        if _rank() == 0 and path != candidates[-1]:
            say(f"{problem}; falling back to the previous checkpoint")
    if failures:  # the model may hold parts of a failed load: do not train from it
        raise UserError(
            failures[0]
            if len(failures) == 1
            else f"none of {len(failures)} checkpoints could be loaded: {'; '.join(failures)}"
        )
    return None


def set_optimizer_step(optimizer, step: int) -> None:
    """Adam's bias-correction step count (a tensor in AdamW, an int in SparseAdam)."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if p in inner.state and "step" in inner.state[p]:
                    state = inner.state[p]
                    if torch.is_tensor(state["step"]):
                        state["step"].fill_(float(step))
                    else:
                        state["step"] = step
