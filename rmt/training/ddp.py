"""Model chunks wrapped in megatron-core's ``DistributedDataParallel`` as the trainer runs them."""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from rmt.config import RMTConfig
from rmt.memory.hooks import MemoryHooks
from rmt.parallel import compat


def ddp_config(config: RMTConfig) -> DistributedDataParallelConfig:
    """Gradients accumulated and reduced in fp32 (also for bf16 parameters); with
    ``train.distributed_optimizer`` reduce-scattered (and the parameters all-gathered) in
    megatron's buckets, overlapped with the backward (forward) where asked."""
    t = config.train
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=t.overlap_grad_reduce,
        use_distributed_optimizer=t.distributed_optimizer,
        overlap_param_gather=t.overlap_param_gather,
    )


def to_training_precision(chunk: torch.nn.Module, config: RMTConfig) -> None:
    """``train.precision: bf16``: cast ``chunk``'s floating parameters and buffers to bf16 in
    place, as megatron's ``Float16Module`` does (after the fp32 initialisation, so every precision
    starts from the same draw, rounded), except the memory value tables, which keep
    ``memory.value_dtype``. Their fp32 main copies are megatron's optimizer's."""
    if config.train.precision != "bf16":
        return
    for module in chunk.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and not MemoryHooks.is_table(p):
                p.data = p.data.to(torch.bfloat16)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and not name.startswith("running_"):
                setattr(module, name, b.to(torch.bfloat16))


def wrap_chunks(
    chunks: List[torch.nn.Module], config: RMTConfig, memory: Optional[MemoryHooks] = None
) -> List[DistributedDataParallel]:
    """Move ``chunks`` to the compute device in the training precision
    (:func:`to_training_precision`) and wrap each in megatron's DDP, with the memory tables whose
    gradients the memory code reduces left out of its buffers (``memory``'s
    :meth:`~rmt.memory.hooks.MemoryHooks.outside_ddp`); the first chunk's ``TransformerConfig``
    gets the schedule's gradient finishing and ``no_sync``."""
    memory = memory if memory is not None else MemoryHooks(config)
    wrapped = []
    for i, chunk in enumerate(chunks):
        chunk.to(compat.device())
        to_training_precision(chunk, config)
        with memory.outside_ddp(chunk):
            wrapped.append(
                DistributedDataParallel(
                    config=chunk.config, ddp_config=ddp_config(config), module=chunk, disable_bucketing=i > 0
                )
            )
    mcfg = wrapped[0].config
    mcfg.finalize_model_grads_func = finalize_model_grads
    mcfg.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped
