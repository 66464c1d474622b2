"""Language-model loss on vocab-parallel logits: cross-entropy plus the optional z-loss
``z * logZ^2`` (PaLM; the RMT authors use z = 1e-4)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def log_partition(logits: torch.Tensor) -> torch.Tensor:
    """``log sum_v exp(logits_v)`` over the full vocabulary of vocab-parallel ``logits``."""
    local_max = logits.detach().max(dim=-1).values
    global_max = local_max.clone()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            global_max, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    sum_exp = torch.exp(logits - global_max.unsqueeze(-1)).sum(dim=-1)
    return torch.log(reduce_from_tensor_model_parallel_region(sum_exp)) + global_max


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, z_loss: float):
    """Mean over unmasked tokens of CE (+ z-loss). ``logits`` ``[b, s, V/tp]``. Returns
    ``(loss, cross_entropy)``, the second detached for reporting."""
    logits = logits.float()
    # megatron-core's cross-entropy overwrites its input (in-place max-subtract and exp): give
    # it a copy when the z-loss still needs the logits.
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.clone() if z_loss > 0 else logits, labels)
    mask = loss_mask.float()
    denom = mask.sum().clamp(min=1.0)
    ce_mean = (ce * mask).sum() / denom
    loss = ce_mean
    if z_loss > 0:
        loss = loss + z_loss * ((log_partition(logits) ** 2) * mask).sum() / denom
    return loss, ce_mean.detach()
