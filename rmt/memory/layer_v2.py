"""UltraMemV2 memory layer (Huang et al. 2025, arXiv 2508.18756), following the authors' public
code (``olmo/ultramem_layer_v2.py``, ``UltraMemLayerV2``, commit "support ultramemv2") where the
paper is not specific; docs/reference-implementations.md lists where rmt differs.

What changes from UltraMem (:class:`rmt.memory.layer.MemoryLayer`, whose retrieval, IVE
addressing, tables and statistics this layer reuses):

* placement: one layer in every transformer block, beside the FFN: its input is the block's
  normed FFN input and its output is added to the block's output (the wiring,
  :mod:`rmt.memory.attach`); so the layer has no input norm and no query convolution;
* queries: one row and one column query of the full key width per head, each scored against
  every Tucker rank's keys (``keys [H, 2, r, n, Kd]``; the authors' per-rank query layout,
  ``mem_q_for_each_tucker_rank``), with RMSNorms of queries and keys;
* implicit value expansion by a single linear projection: the virtual addresses of the
  ``sqrt(E)``-times larger key grid fold onto the physical slots (``v mod N`` after the shuffle)
  and the pooled rows of every virtual block share one output projection ``W_o [Dv, W]``;
* PEER-style value processing: a token's pre-value input ``p = W_pre x`` is dotted with each
  retrieved slot's pre-value row, ``g_k = act(<P[slot_k], p>)``, and multiplies the slot's
  multi-core scores before the values are pooled (Eq. 17's core columns);
* the authors' initialization: query and key norm gains ``Kd^-0.4``; the query projection and
  the keys ``N(0, 1/Kd)``; the output projection ``N(0, 1/Dv)``; the pre-value projection
  ``N(0, 1/W)``; Tucker cores ``U(0, 1)``; values and pre-values ``N(0, 0.02^2)``.

Forward on ``x [s, b, W]`` (the FFN's normed input), per token with ``H`` heads and top-m::

    q_row, q_col = RMSNorm(W_q x)                       [H, Kd] each
    S_row[h, i, n] = <q_row[h], RMSNorm(K_row[h, i, n])>  (and S_col), Tucker ranks i < r
    (addr, s) = TDQKR top-m of S_row^T C^(c) S_col        (Eq. 7-10, 16; s [H m, C])
    slot = shuffle(addr) mod N
    s *= act(<P[slot], W_pre x>)                          (with pre-values)
    y = W_o^T  sum_k  [s_k,0 V[slot_k, :Dv/C], ..., s_k,C-1 V[slot_k, -Dv/C:]]
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from rmt.memory.ive import AddressShuffle
from rmt.memory.layer import MemoryLayer, MemorySpec
from rmt.memory.retrieval import tucker_aux_loss
from rmt.memory.table import MemoryTable
from rmt.models.init import set_init_std
from rmt.ops.counter_normal import stream_key

PRE_VALUE_ACTIVATIONS = {"none": lambda g: g, "gelu": F.gelu}


class UltraMemV2Layer(MemoryLayer):
    """One UltraMemV2 layer (module docstring). ``values`` / ``pre_values``: the value and
    pre-value tables (``spec.table(...)``, ``spec.pre_table(...)``, e.g. sharded); default local
    ones. Reuses :class:`MemoryLayer`'s retrieval, IVE addressing and slot statistics."""

    def __init__(
        self, spec: MemorySpec, values: Optional[MemoryTable] = None, pre_values: Optional[MemoryTable] = None
    ):
        torch.nn.Module.__init__(self)
        if spec.version != 2:
            raise ValueError(f"UltraMemV2Layer needs a version-2 MemorySpec, got version {spec.version}")
        self.spec = s = spec
        W, H, r, n, C, Kd = s.hidden_size, s.num_heads, s.tucker_rank, s.grid, s.num_cores, s.side_dim
        self.sub_dim = Kd  # every Tucker rank's keys are the full key width
        self.query = torch.nn.Linear(W, H * 2 * Kd, bias=False)
        set_init_std(self.query.weight, 1.0 / math.sqrt(Kd))
        self.keys = set_init_std(torch.nn.Parameter(torch.randn(H, 2, r, n, Kd) / math.sqrt(Kd)), 1.0 / math.sqrt(Kd))
        self.query_norm = torch.nn.RMSNorm(Kd, eps=s.norm_eps)
        self.key_norm = torch.nn.RMSNorm(Kd, eps=s.norm_eps)
        with torch.no_grad():
            self.query_norm.weight.fill_(Kd**-0.4)
            self.key_norm.weight.fill_(Kd**-0.4)
        if s.retrieval == "tucker":
            # U(0, 1) from the layer's own seed (the model's init rule leaves a None-tagged tensor
            # as built), so every layout draws the same cores.
            gen = torch.Generator().manual_seed(stream_key(s.seed, "memory.cores") % 2**63)
            self.cores = set_init_std(torch.nn.Parameter(torch.rand(H, C, r, r, generator=gen)), None)
        self.values = values if values is not None else s.table()
        self.pre_values = None
        if s.pre_value_dim:
            self.pre_values = pre_values if pre_values is not None else s.pre_table()
            self.pre_proj = torch.nn.Linear(W, s.pre_value_dim, bias=False)
            set_init_std(self.pre_proj.weight, 1.0 / math.sqrt(W))
        self.proj = torch.nn.Linear(s.value_dim, W, bias=False)
        set_init_std(self.proj.weight, 1.0 / math.sqrt(s.value_dim))
        self.shuffle = AddressShuffle(n, s.seed) if s.ive_shuffle and s.ive_blocks > 1 else None
        self.register_buffer("score_stats", torch.zeros(4, dtype=torch.float64), persistent=False)
        self._reset_stats()
        self.aux_loss: Optional[torch.Tensor] = None
        self._frozen = None

    def query_input(
        self, x: torch.Tensor, state: Optional[Dict] = None, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The input itself (the block's normed FFN input: no norm, no convolution here)."""
        return x

    def queries(self, h: torch.Tensor):
        """Row and column queries ``[T, H, r, Kd]``: each side's one query, expanded over the
        Tucker ranks (every rank's keys score the same query)."""
        s = self.spec
        T = h.shape[0]
        q = self.query(h).view(T, s.num_heads, 2, s.side_dim)
        # The norm in its gain's dtype: autocast has no rule for rms_norm (a bf16 query against an
        # fp32 gain would take torch's unfused path), as it computes layer_norm in fp32.
        q = self.query_norm(q.to(self.query_norm.weight.dtype))
        shape = (T, s.num_heads, s.tucker_rank, s.side_dim)
        return q[:, :, 0, None].expand(shape), q[:, :, 1, None].expand(shape)

    def gates(self, h: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """PEER-style value processing: ``act(<P[slot], W_pre h>)`` per lookup, ``[T, K]``. The
        pre-value rows come through the table's lookup-reduce with one lookup of score 1 per
        row (a gather that every table layout, fused kernel and value optimizer serves)."""
        T, K = slots.shape
        p = self.pre_proj(h)
        ones = p.new_ones(T * K, 1, 1)
        rows = self.pre_values.lookup_reduce(slots.reshape(T * K, 1), ones, None, 1, validate=False)
        g = (rows.view(T, K, -1) * p.unsqueeze(1)).sum(-1)
        return PRE_VALUE_ACTIVATIONS[self.spec.pre_value_activation](g)

    def forward(
        self, x: torch.Tensor, state: Optional[Dict] = None, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``x [s, b, W]`` (the normed FFN input) -> ``[s, b, W]``; ``state`` and ``documents``
        are accepted for the wiring's sake (the layer keeps no decoding state)."""
        s = self.spec
        seq, b = x.shape[:2]
        h = x.reshape(seq * b, s.hidden_size)
        addr, scores = self.retrieve(h)
        slots, _ = self.physical(addr)  # one output projection: the virtual blocks are summed
        if self.pre_values is not None:
            scores = scores * self.gates(h, slots).unsqueeze(-1).to(scores.dtype)
        pooled = self.values.lookup_reduce(slots, scores, None, 1, validate=False)
        out = self.proj(pooled[:, 0].to(self.proj.weight.dtype))
        # Eq. 12 (the authors' v2 computes it but adds none: their configs set aux_loss_weight 0).
        self.aux_loss = (
            tucker_aux_loss(self.cores, s.aux_loss_weight, s.aux_loss_margin)
            if s.retrieval == "tucker" and torch.is_grad_enabled()
            else None
        )
        return out.reshape(seq, b, s.hidden_size)

    def pop_stats(self, group=None) -> Dict[str, float]:
        """:meth:`MemoryLayer.pop_stats` (the values' slot usage and cache hits); the pre-value
        table, hit at the same slots, resets its counters too."""
        if self.pre_values is not None:
            self.pre_values.pop_hit_fraction(group)
            self.pre_values.pop_cache_stats(group)
        return super().pop_stats(group)
