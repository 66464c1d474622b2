"""BatchNorm of PKM queries (``memory.query_batchnorm``; Lample et al. 2019 §3.2, XLM's
``HashingMemory`` with ``mem_query_batchnorm``), with statistics that do not depend on the
parallel layout.

Which ranks the statistics come from:

* **Batch statistics** (training forward): the tokens of the current microbatch on this
  data-parallel rank, never across ranks. Tensor-parallel ranks hold the same tokens (memory
  layers are replicated over them) and compute the same statistics; with pipeline parallelism
  the stage that holds the memory layer computes them. A microbatch of ``micro_batch_size``
  samples is the same set of tokens under every layout (megatron's sampler gives data-parallel
  rank r's j-th microbatch the samples a single process sees in its (j·DP + r)-th), so the
  normalised queries, and every gradient, equal the single-process run with the same
  ``micro_batch_size``; changing ``micro_batch_size`` changes them, as it does in XLM.
* **Running statistics** (evaluation and decoding): torch's momentum update
  ``r <- (1 - m) r + m s`` with the unbiased batch variance, applied once per training step
  over every microbatch of the global batch in the single-process order: each rank records its
  microbatches' statistics, :func:`sync_running_stats` all-gathers them over the data-parallel
  group (2·C floats per microbatch) and every rank applies them in that order. The buffers are
  thus identical on every rank and equal to the single-process run's.

torch's ``BatchNorm1d`` updates its running statistics inside each forward from the local
microbatch only (and ``SyncBatchNorm`` pools the batch statistics over ranks, which changes
the normalisation itself), hence this module; the normalisation is ``F.batch_norm``.
"""

from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist
import torch.nn.functional as F


class QueryBatchNorm(torch.nn.Module):
    """``BatchNorm1d(num_features)`` over ``[tokens, num_features]`` queries (affine, eps 1e-5,
    momentum 0.1, torch's defaults) whose running statistics are updated by
    :func:`sync_running_stats` (see the module docstring)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = torch.nn.Parameter(torch.ones(num_features))
        self.bias = torch.nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.pending: List[torch.Tensor] = []  # [2, C] (mean, unbiased var) per training microbatch

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(q, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        with torch.no_grad():
            var, mean = torch.var_mean(q.detach().float(), dim=0, correction=1)
            self.pending.append(torch.stack([mean, var]))
        return F.batch_norm(q, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def apply_pending(self, stats: torch.Tensor) -> None:
        """Momentum updates from ``stats [n, 2, C]`` in order; clears the recorded statistics."""
        m = self.momentum
        for mean, var in stats.to(self.running_mean.dtype):
            self.running_mean.mul_(1 - m).add_(mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var, alpha=m)
        self.pending = []


@torch.no_grad()
def sync_running_stats(modules: Iterable[torch.nn.Module], group=None) -> None:
    """After a training step's microbatches: update the running statistics of every
    :class:`QueryBatchNorm` in ``modules`` from all data-parallel ranks' microbatches (``group``),
    in the single-process order (microbatch j of rank r is the single process's j·DP + r)."""
    norms = [m for module in modules for m in module.modules() if isinstance(m, QueryBatchNorm)]
    for norm in norms:
        if not norm.pending:
            continue
        local = torch.stack(norm.pending)  # [n, 2, C]
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local, group=group)
            local = torch.stack(gathered, dim=1).flatten(0, 1)  # microbatch-major, then rank
        norm.apply_pending(local)
