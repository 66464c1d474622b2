"""MoE baseline for memory-layer placements: top-k of N GELU experts with the Switch balance
loss (Fedus et al. 2022; UltraMem §5.1: top-2, weight 0.01).

Our own module rather than megatron-core's ``MoELayer``: on CPU megatron's MoE needs CUDA
stream/event and TE-GEMM shims beyond ``rmt.parallel.compat``, and its aux loss is scaled by
the pipeline schedule only when the backbone's ``TransformerConfig`` declares
``num_moe_experts``, which a skip-placed module inside a dense model does not. This module only
touches the experts its tokens route to (what decoding latency depends on).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


class MoELayer(torch.nn.Module):
    """``x [s, b, hidden]`` -> sum over the top-k experts of ``gate * expert(LN(x))``;
    ``aux_loss`` = ``weight * N * sum_i f_i P_i`` of the last forward."""

    def __init__(self, hidden_size: int, num_experts: int, expert_hidden: int, topk: int = 2,
                 balance_loss_weight: float = 0.01, init_std: float = 0.02, num_layers: int = 1):
        super().__init__()
        self.num_experts, self.topk, self.weight = num_experts, topk, balance_loss_weight
        self.norm = torch.nn.LayerNorm(hidden_size)
        self.router = torch.nn.Linear(hidden_size, num_experts, bias=False)
        self.router.weight.memory_init_std = init_std
        out_std = init_std / math.sqrt(2.0 * num_layers)
        self.fc1 = torch.nn.Parameter(torch.randn(num_experts, hidden_size, expert_hidden) * init_std)
        self.fc2 = torch.nn.Parameter(torch.randn(num_experts, expert_hidden, hidden_size) * out_std)
        self.fc1.memory_init_std, self.fc2.memory_init_std = init_std, out_std
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, state=None) -> torch.Tensor:
        shape = x.shape
        h = self.norm(x).reshape(-1, shape[-1])
        probs = torch.softmax(self.router(h).to(torch.promote_types(h.dtype, torch.float32)), dim=-1)
        gate, expert = probs.topk(self.topk, dim=-1)
        gate = (gate / gate.sum(-1, keepdim=True)).to(h.dtype)
        counts = torch.bincount(expert.reshape(-1), minlength=self.num_experts)
        frac = counts.to(probs.dtype) / expert.numel()
        self.aux_loss = self.weight * self.num_experts * (frac * probs.mean(0)).sum()
        out = torch.zeros_like(h)
        flat_expert = expert.reshape(-1)
        order = flat_expert.argsort()
        token = torch.arange(h.shape[0], device=h.device).repeat_interleave(self.topk)[order]
        weights = gate.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            tok = token[start:start + c]
            y = F.gelu(h[tok] @ self.fc1[e]) @ self.fc2[e]
            out.index_add_(0, tok, y * weights[start:start + c, None])
            start += c
        return out.reshape(shape)
