"""The training loop's one view of the memory layers (:class:`MemoryHooks`).

The trainer calls it at named points of its setup and of each step and imports nothing else
from :mod:`rmt.memory`, so a new sparse-parameter feature (a table reduced outside DDP, a value
table stepped in its backward, a statistic synchronised after the microbatches) changes this
module and the memory code, not the loop.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from rmt.memory.attach import pop_aux_loss, pop_memory_stats
from rmt.memory.batchnorm import sync_running_stats
from rmt.memory.descriptor import descriptor, is_table
from rmt.memory.groups import (
    excluded_from_ddp,
    finish_memory_grads,
    fused_update,
    host_cache,
    reduce_tables_outside_ddp,
    replica_group,
)
from rmt.memory.host_steps import settle_all
from rmt.memory.table import values_from_checkpoint


class MemoryHooks:
    """What the memory layers of a rank's model chunks need from the training loop, in the
    loop's order:

    * :meth:`building` around the model's construction (tables a checkpoint will fill skip their
      random draw);
    * :meth:`outside_ddp` around wrapping each chunk in megatron's DDP (the tables whose
      gradients the memory code reduces stay out of DDP's buffers);
    * :meth:`bind` once the chunks are wrapped and the optimizer is built (it finds the value
      tables stepped inside their lookups' backward, ``memory.fused_value_optimizer``);
    * per step: :meth:`start_step` (host tables' device caches refreshed when due), then per
      micro-batch :meth:`before_forward` and
      :meth:`pop_aux_loss` (the auxiliary losses of the forward just run), and after the
      schedule's backward :meth:`after_backward` (gradients finished, statistics synchronised)
      before the optimizer reads any gradient;
    * :meth:`settle` before the loop reads the tables outside a step (an evaluation, a
      checkpoint, the end of training);
    * :meth:`pop_stats` when the loop logs.

    Without memory layers every call is a no-op.
    """

    def __init__(self, config):
        self.config = config
        self.chunks: List[torch.nn.Module] = []
        self.num_microbatches = 1
        self._fused: List[List] = []
        self._caches: List[Tuple] = []  # (cached host storage, its replica group)
        self._forwards: List[int] = []

    # -- setup -------------------------------------------------------------------------
    @staticmethod
    def is_table(p: torch.nn.Parameter) -> bool:
        """Whether ``p`` is a memory value table's weight (its own dtype, optimizer and
        reduction)."""
        return is_table(p)

    def building(self, from_checkpoint: bool) -> ContextManager:
        """Context for building the model: with ``from_checkpoint`` the value tables are
        allocated but not drawn, as a checkpoint load overwrites every value."""
        return values_from_checkpoint(from_checkpoint)

    @contextlib.contextmanager
    def outside_ddp(self, chunk: torch.nn.Module):
        """Context for wrapping ``chunk`` in megatron's DDP: sharded and sparse-gradient tables
        (and, under ``train.distributed_optimizer``, every local value table, whose gradient the
        reduce-scatter would leave 1/DP of on each rank) are left out of its buffers;
        :meth:`after_backward` reduces them."""
        if self.config.train.distributed_optimizer:
            reduce_tables_outside_ddp(chunk)
        with excluded_from_ddp(chunk):
            yield

    def bind(self, chunks: List[torch.nn.Module], num_microbatches: int) -> None:
        """The wrapped ``chunks`` the loop runs, ``num_microbatches`` per step, after the
        optimizer is built (it attaches the fused value updates)."""
        self.chunks, self.num_microbatches = list(chunks), num_microbatches
        self._fused = [[fused_update(p) for p in c.parameters() if fused_update(p) is not None] for c in self.chunks]
        self._caches = [
            (descriptor(p).storage, replica_group(p)) for c in self.chunks for p in c.parameters() if host_cache(p)
        ]
        self._forwards = [0] * len(self.chunks)

    # -- one step ----------------------------------------------------------------------
    def start_step(self) -> None:
        """Before the step's schedule: no micro-batch has run yet. The device caches of host
        tables whose refresh is due admit and evict rows (``memory.host_cache_refresh``,
        :meth:`rmt.memory.host_cache.HostCache.refresh`; collective over each table's replicas)."""
        self._forwards = [0] * len(self.chunks)
        for storage, replicas in self._caches:
            if storage.cache.due:
                storage.refresh(replicas)

    def before_forward(self, chunk: int) -> None:
        """Before a micro-batch's forward through chunk number ``chunk``: the fused value
        updates step the tables in the backward of the step's last micro-batch."""
        self._forwards[chunk] += 1
        for update in self._fused[chunk]:
            update.final = self._forwards[chunk] >= self.num_microbatches

    def pop_aux_loss(self, model: torch.nn.Module) -> Optional[torch.Tensor]:
        """The auxiliary losses of ``model``'s last forward, summed (None when there are none),
        for the loss function; clears them."""
        return pop_aux_loss(model)

    def after_backward(self) -> None:
        """After the schedule's backward, before the optimizer: the data-parallel mean gradient
        of every table the memory code reduces (leftover fused updates stepped), and the query
        BatchNorms' running statistics from every data-parallel rank's micro-batches."""
        finish_memory_grads(self.chunks)
        sync_running_stats(self.chunks, parallel_state.get_data_parallel_group())

    def settle(self) -> None:
        """Finish the host-memory tables' steps still running on their thread and write their
        device caches back (``memory.table_location: host``, :mod:`rmt.memory.host_steps`)."""
        settle_all(self.chunks)

    # -- logging -----------------------------------------------------------------------
    def pop_stats(self) -> Dict[str, float]:
        """Slot-usage and load scalars since the last call (collective over the data-parallel
        group)."""
        return pop_memory_stats(self.chunks, parallel_state.get_data_parallel_group())
