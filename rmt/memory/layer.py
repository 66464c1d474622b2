"""UltraMem memory layer (arXiv 2411.12364 §3) and the PKM layer (Lample et al. 2019) as one
module whose every §3.2 / Table 2 improvement is a switch of :class:`MemorySpec`.

Forward of one layer on hidden states ``x [s, b, hidden]`` (sequence first):

1. input LayerNorm; optional causal depthwise conv over the sequence (§3.2 item 4);
2. query projection, per head, shared by row and column keys or not (item 5), with an optional
   bias and BatchNorm (PKM as published, :mod:`rmt.memory.batchnorm`);
3. optional LayerNorm of queries and keys (item 2), gains per Appendix A;
4. retrieval: product keys (Eq. 2-3) or TDQKR with multi-core scoring (Eq. 4-10, 16), by the
   fused streaming top-m (:mod:`rmt.ops.fused_retrieval`) or the unfused path
   (:mod:`rmt.memory.retrieval`), ``memory.retrieval_kernel``;
5. optional softmax over the top-m (PKM; removed in UltraMem, item 1);
6. IVE: shuffled virtual address -> (physical slot, virtual block) (Eq. 14);
7. ``MemoryTable.lookup_reduce`` pools per virtual block and core column (Eq. 15, 17);
8. per-block projectors ``W_p`` sum to the output (Eq. 15; with E = 1 this is the output
   projection of the halved value dim, item 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rmt.memory.batchnorm import QueryBatchNorm
from rmt.memory.ive import AddressShuffle
from rmt.memory.retrieval import (
    expected_topm_mean,
    grid_side,
    product_topk,
    rank1_selector,
    tucker_aux_loss,
    tucker_topk,
)
from rmt.memory.shapes import memory_width
from rmt.memory.shapes import value_dim as config_value_dim
from rmt.memory.table import MemoryTable
from rmt.models.init import set_init_std
from rmt.ops.counter_normal import stream_key
from rmt.ops.fused_retrieval import choose_backend, fused_retrieval


@dataclass(frozen=True)
class MemorySpec:
    """The resolved record of one memory layer: its shape and switches, built only by
    :meth:`from_config` from a config (which holds the defaults and their validation,
    :class:`~rmt.config.MemoryConfig` and :mod:`rmt.memory.config_checks`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    topk: int
    side_dim: int
    num_keys: int
    retrieval: str
    retrieval_kernel: str  # fused | unfused | auto (memory.retrieval_kernel)
    tucker_rank: int
    num_cores: int
    ive_blocks: int
    ive_shuffle: bool
    softmax: bool
    value_dim: int
    share_query: bool
    query_key_norm: bool
    query_batchnorm: bool
    query_bias: bool
    conv_kernel: int  # 0: no query convolution
    improved_init: bool
    init_samples: int
    value_init_std: Optional[float]
    aux_loss_weight: float
    aux_loss_margin: float
    init_std: float
    sparse_grad: bool  # value table gradients as touched rows (sparse optimizers)
    value_dtype: torch.dtype  # storage dtype of the value table
    host_cache_rows: int  # rows of a host table's shard cached on the device
    host_cache_refresh: int  # steps between the cache's refreshes
    seed: int
    version: int  # 2: UltraMemV2 (:mod:`rmt.memory.layer_v2`)
    pre_value_dim: int  # UltraMemV2: width of the PEER-style pre-values (0: none)
    pre_value_activation: str  # UltraMemV2: applied to the pre-value scores
    norm_eps: float  # UltraMemV2: epsilon of the query and key RMSNorms

    @classmethod
    def from_config(cls, config, index: int = 0) -> MemorySpec:
        """Memory layer ``index`` of ``config`` (its seed ``train.seed * 1000 + index``):
        ``memory.type`` ultramem (every switch from ``memory.*``), ultramem_v2 (version 2,
        :mod:`rmt.memory.layer_v2`: its value and pre-value widths, no softmax, conv or Table 2
        switches) or pkm (Lample et al.: product keys split in row/column halves, softmax, value
        dim = hidden, no norm/conv/IVE).
        The hidden width is :func:`~rmt.memory.shapes.memory_width` (``dk * dv`` for the RMT);
        the value width :func:`~rmt.memory.shapes.value_dim`."""
        mem, m = config.memory, config.model
        common = dict(
            hidden_size=memory_width(config),
            num_layers=m.num_layers,
            num_heads=mem.num_heads,
            topk=mem.topk,
            num_keys=mem.num_keys,
            value_dim=config_value_dim(config),
            init_std=m.init_std,
            norm_eps=m.layernorm_epsilon,
            init_samples=mem.init_samples,
            aux_loss_margin=mem.aux_loss_margin,
            sparse_grad=mem.value_optimizer != "adamw",
            seed=config.train.seed * 1000 + index,
            query_batchnorm=mem.query_batchnorm,
            retrieval_kernel=mem.retrieval_kernel,
            query_bias=mem.query_bias,
            value_init_std=mem.value_init_std,
            value_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[mem.value_dtype],
            host_cache_rows=mem.host_cache_rows,
            host_cache_refresh=mem.host_cache_refresh,
        )
        product = mem.retrieval == "product"
        key_grid = dict(  # UltraMem's and UltraMemV2's retrieval (TDQKR or product keys) and IVE
            side_dim=mem.key_dim,
            retrieval=mem.retrieval,
            tucker_rank=1 if product else mem.tucker_rank,
            num_cores=mem.num_cores,
            ive_blocks=mem.ive_blocks,
            ive_shuffle=mem.ive_shuffle,
            aux_loss_weight=0.0 if product else mem.aux_loss_weight,
        )
        if mem.type == "ultramem_v2":
            return cls(
                version=2,
                softmax=False,
                share_query=False,
                query_key_norm=True,
                conv_kernel=0,
                improved_init=False,
                pre_value_dim=mem.pre_value_dim,
                pre_value_activation=mem.pre_value_activation,
                **key_grid,
                **common,
            )
        v1 = dict(version=1, pre_value_dim=0, pre_value_activation="none")
        if mem.type == "pkm":
            return cls(
                side_dim=mem.key_dim // 2,
                retrieval="product",
                tucker_rank=1,
                num_cores=1,
                ive_blocks=1,
                ive_shuffle=False,
                softmax=True,
                share_query=False,
                query_key_norm=False,
                conv_kernel=0,
                improved_init=False,
                aux_loss_weight=0.0,
                **v1,
                **common,
            )
        return cls(
            softmax=mem.softmax,
            share_query=mem.share_query,
            query_key_norm=mem.query_key_norm,
            conv_kernel=mem.conv_kernel if mem.query_conv else 0,
            improved_init=mem.improved_init,
            **key_grid,
            **v1,
            **common,
        )

    @property
    def grid(self) -> int:
        return grid_side(self.num_keys, self.ive_blocks)

    @property
    def num_values(self) -> int:
        return self.num_keys * self.num_keys

    @property
    def value_std(self) -> float:
        """Init std of the values: ``value_init_std`` when given, else (UltraMemV2) the authors'
        0.02, else Appendix A's sqrt(E / (2 m H L)) with ``improved_init``, else 1 / sqrt(value
        dim) (Lample et al.)."""
        if self.value_init_std is not None:
            return self.value_init_std
        if self.version == 2:
            return 0.02  # UltraMemLayerV2.reset_parameters: values and pre-values
        if self.improved_init:
            return math.sqrt(self.ive_blocks / (2.0 * self.topk * self.num_heads * self.num_layers))
        return 1.0 / math.sqrt(self.value_dim)

    @property
    def value_init_key(self) -> int:
        """Counter stream of the value table (:mod:`rmt.ops.counter_normal`): the same for every
        layout, so a sharded table holds its shard of the table a single process draws."""
        return stream_key(self.seed, "memory.values")

    def table(self, **sharding) -> MemoryTable:
        """This layer's value table; ``sharding``: :class:`MemoryTable`'s partition arguments."""
        return MemoryTable(
            self.num_values,
            self.value_dim,
            self.value_std,
            sparse_grad=self.sparse_grad,
            init_key=self.value_init_key,
            dtype=self.value_dtype,
            host_cache_rows=self.host_cache_rows,
            host_cache_refresh=self.host_cache_refresh,
            **sharding,
        )

    def pre_table(self, **sharding) -> MemoryTable:
        """UltraMemV2's pre-value table (``pre_value_dim`` wide, one row per value slot), drawn
        like the values from its own counter stream."""
        return MemoryTable(
            self.num_values,
            self.pre_value_dim,
            self.value_std,
            sparse_grad=self.sparse_grad,
            init_key=stream_key(self.seed, "memory.pre_values"),
            dtype=self.value_dtype,
            host_cache_rows=self.host_cache_rows,
            host_cache_refresh=self.host_cache_refresh,
            **sharding,
        )


class MemoryLayer(torch.nn.Module):
    """One UltraMem / PKM layer; see the module docstring. ``aux_loss`` holds Eq. 12 of the
    last forward; slot-usage statistics accumulate in training mode (:meth:`pop_stats`).
    ``values``: the value table (``spec.table(...)``, e.g. sharded); default a local one."""

    def __init__(self, spec: MemorySpec, values: Optional[MemoryTable] = None):
        super().__init__()
        self.spec = s = spec
        H, r, n, E = s.num_heads, s.tucker_rank, s.grid, s.ive_blocks
        self.sub_dim = s.side_dim // r
        # With the query BatchNorm a constant shift of the query input cancels: the input norm has
        # no bias (its gradient would be rounding noise, which Adam turns into steps of ~0.1 lr).
        self.norm = torch.nn.LayerNorm(s.hidden_size, bias=not s.query_batchnorm)
        if s.conv_kernel:
            # Causal depthwise conv (§3.2 item 4), initialised to the identity (current token).
            w = torch.zeros(s.hidden_size, 1, s.conv_kernel)
            w[..., -1] = 1.0
            self.conv = set_init_std(torch.nn.Parameter(w), None)
        sides = 1 if s.share_query else 2
        self.query = torch.nn.Linear(s.hidden_size, H * sides * s.side_dim, bias=s.query_bias)
        set_init_std(self.query.weight, s.init_std)
        if s.query_bias:
            torch.nn.init.zeros_(self.query.bias)
            # BatchNorm subtracts the mean the bias adds (in training, and in evaluation through
            # the running mean): kept (XLM's parameters), not trained, as the norm's bias above.
            self.query.bias.requires_grad_(not s.query_batchnorm)
        self.query_bn = QueryBatchNorm(H * sides * s.side_dim) if s.query_batchnorm else None
        key_std = 1.0 / math.sqrt(self.sub_dim)
        self.keys = set_init_std(torch.nn.Parameter(torch.randn(H, 2, r, n, self.sub_dim) * key_std), key_std)
        if s.query_key_norm:
            self.query_norm = torch.nn.LayerNorm(self.sub_dim)
            self.key_norm = torch.nn.LayerNorm(self.sub_dim)
            if s.improved_init:
                # Appendix A: gains 1/sqrt(E[Y]) (query) and 1/sqrt(d) (keys).
                ey = expected_topm_mean(n * n, s.topk, s.init_samples, seed=s.seed)
                with torch.no_grad():
                    self.query_norm.weight.fill_(1.0 / math.sqrt(ey))
                    self.key_norm.weight.fill_(1.0 / math.sqrt(self.sub_dim))
        if s.retrieval == "tucker":
            core_std = 1.0 / (r * math.sqrt(s.num_cores))
            self.cores = set_init_std(torch.nn.Parameter(torch.randn(H, s.num_cores, r, r) * core_std), core_std)
        self.values = values if values is not None else s.table()
        self.has_proj = E > 1 or s.value_dim != s.hidden_size
        if self.has_proj:
            proj_std = (
                1.0 / math.sqrt(E * s.value_dim) if s.improved_init else s.init_std / math.sqrt(2.0 * s.num_layers)
            )
            self.proj = set_init_std(
                torch.nn.Parameter(torch.randn(E, s.value_dim, s.hidden_size) * proj_std), proj_std
            )
        self.shuffle = AddressShuffle(n, s.seed) if s.ive_shuffle and E > 1 else None
        self.register_buffer("score_stats", torch.zeros(4, dtype=torch.float64), persistent=False)
        self._reset_stats()
        self.aux_loss: Optional[torch.Tensor] = None
        self._frozen = None

    # -- pieces ----------------------------------------------------------------------------
    def query_input(
        self, x: torch.Tensor, state: Optional[Dict] = None, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Normed (and causally convolved) input ``[s, b, hidden]``. ``state`` (decoding) keeps
        the last ``kernel - 1`` normed inputs between calls. ``documents`` (``[b, s]`` document
        starts, :func:`~rmt.models.documents.document_starts`): the convolution's taps stop at
        each token's document start."""
        h = self.norm(x)
        if not self.spec.conv_kernel:
            return h
        k = self.spec.conv_kernel
        if documents is not None:
            return self._document_conv(h, documents)
        if state is not None:
            past = state.get("conv")
            if past is None:
                past = h.new_zeros(k - 1, *h.shape[1:])
            full = torch.cat([past, h], 0)
            state["conv"] = full[-(k - 1) :] if k > 1 else full[:0]
            left = 0
        else:
            full, left = h, k - 1
        y = F.conv1d(F.pad(full.permute(1, 2, 0), (left, 0)), self.conv, groups=self.spec.hidden_size)
        return y[..., -h.shape[0] :].permute(2, 0, 1)

    def _document_conv(self, h: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution as a sum of shifted inputs, each tap zeroed where it
        reaches before the token's document start: ``y_t = sum_d w[k-1-d] h_{t-d} [t-d >= start_t]``
        (with every start 0 it equals the ``conv1d`` path)."""
        k, seq = self.spec.conv_kernel, h.shape[0]
        t = torch.arange(seq, device=h.device)[:, None]
        y = h * self.conv[:, 0, k - 1].to(h.dtype)
        for d in range(1, min(k, seq)):
            inside = (t[d:] - d >= starts.t()[d:]).to(h.dtype)[..., None]  # [s-d, b, 1]
            tap = h[:-d] * inside * self.conv[:, 0, k - 1 - d].to(h.dtype)
            y = y + F.pad(tap, (0, 0, 0, 0, d, 0))
        return y

    def _weight_terms(self):
        """Normalised keys and the TDQKR selector (:func:`rank1_selector`; None for product keys):
        the retrieval terms that depend on weights only. Without autograd (decoding, evaluation)
        they are computed once and reused while every parameter they come from keeps its storage
        and version counter (optimizer steps, ``load_state_dict`` and ``.to`` all change one)."""
        s = self.spec
        tucker = s.retrieval == "tucker"

        def compute():
            keys = self.key_norm(self.keys) if s.query_key_norm else self.keys
            return keys, rank1_selector(self.cores) if tucker else None

        if torch.is_grad_enabled():
            return compute()
        params = [self.keys] + ([self.cores] if tucker else [])
        if s.query_key_norm:
            params += list(self.key_norm.parameters())
        tag = tuple((p.data_ptr(), p._version) for p in params)
        if self._frozen is None or self._frozen[0] != tag:
            self._frozen = (tag, *compute())
        return self._frozen[1:]

    def queries(self, h: torch.Tensor):
        """Row and column queries ``q_row, q_col``, each ``[T, H, r, sub_dim]`` (a shared query
        is one tensor twice)."""
        s = self.spec
        T = h.shape[0]
        q = self.query(h)
        if self.query_bn is not None:
            q = self.query_bn(q)
        q = q.view(T, s.num_heads, 1 if s.share_query else 2, s.tucker_rank, self.sub_dim)
        if s.query_key_norm:
            q = self.query_norm(q)
        return q[:, :, 0], q[:, :, -1]

    def side_scores(self, h: torch.Tensor, keys: torch.Tensor):
        """Row and column scores ``S_row, S_col`` of Eq. 4, each ``[T, H, r, n]`` (``keys``: the
        normalised keys of :meth:`_weight_terms`): the unfused path's."""
        # One product per side (a shared query serves both): slices of one [T, H, 2, r, n] product
        # would backpropagate through two zero-filled copies of it and their sum.
        return tuple(torch.einsum("thrd,hrnd->thrn", q, keys[:, side]) for side, q in enumerate(self.queries(h)))

    def retrieve(self, h: torch.Tensor):
        """Flat ``[T, H*m]`` virtual addresses and ``[T, H*m, C]`` scores."""
        s = self.spec
        keys, selector = self._weight_terms()
        cores = self.cores if s.retrieval == "tucker" else None
        backend = choose_backend(s.retrieval_kernel, keys.device, keys.dtype)
        if backend is not None:
            q_row, q_col = self.queries(h)
            addr, scores = fused_retrieval(q_row, q_col, keys, s.topk, cores, selector, backend=backend)
        else:
            s_row, s_col = self.side_scores(h, keys)
            if cores is not None:
                addr, scores = tucker_topk(s_row, s_col, cores, s.topk, selector)
            else:
                addr, scores = product_topk(s_row, s_col, s.topk)
        if self.training:
            self._record_scores(scores.detach().sum(-1))
        if s.softmax:
            scores = torch.softmax(scores.float(), dim=2).to(scores.dtype)
        T = h.shape[0]
        return addr.reshape(T, -1), scores.reshape(T, -1, scores.shape[-1])

    def physical(self, addr: torch.Tensor):
        """IVE (Eq. 14): virtual address -> (physical slot, virtual block)."""
        s = self.spec
        if self.shuffle is not None:
            addr = self.shuffle(addr)
        if s.ive_blocks == 1:
            return addr, None
        return addr % s.num_values, addr // s.num_values

    def forward(
        self, x: torch.Tensor, state: Optional[Dict] = None, documents: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``x [s, b, hidden]`` -> ``[s, b, hidden]``; ``documents``: see :meth:`query_input`."""
        s = self.spec
        seq, b = x.shape[:2]
        h = self.query_input(x, state, documents).reshape(seq * b, s.hidden_size)
        addr, scores = self.retrieve(h)
        slots, blocks = self.physical(addr)
        pooled = self.values.lookup_reduce(slots, scores, blocks, s.ive_blocks, validate=False)  # top-k slots
        if self.has_proj:
            out = pooled.flatten(1) @ self.proj.to(pooled.dtype).flatten(0, 1)
        else:
            out = pooled[:, 0]
        # Eq. 12 only regularises training: not computed without autograd (decoding, evaluation).
        self.aux_loss = (
            tucker_aux_loss(self.cores, s.aux_loss_weight, s.aux_loss_margin)
            if s.retrieval == "tucker" and torch.is_grad_enabled()
            else None
        )
        return out.reshape(seq, b, s.hidden_size).to(x.dtype)  # a table's dtype is its own (memory.value_dtype)

    # -- slot usage ------------------------------------------------------------------------
    @torch.no_grad()
    def _record_scores(self, agg: torch.Tensor) -> None:
        """Accumulate top-1 sum, top-1 max, mean top-m sum and count (``agg``: ``[T, H, m]``)."""
        top1 = agg.double().amax(-1)
        self.score_stats[0] += top1.sum()
        self.score_stats[1] = torch.maximum(self.score_stats[1], top1.max())
        self.score_stats[2] += agg.double().mean(-1).sum()
        self.score_stats[3] += top1.numel()

    def _reset_stats(self) -> None:
        self.score_stats.copy_(torch.tensor([0.0, -math.inf, 0.0, 0.0], dtype=torch.float64))

    @torch.no_grad()
    def pop_stats(self, group=None) -> Dict[str, float]:
        """Fraction of physical slots hit (:meth:`MemoryTable.pop_hit_fraction`), mean/max top-1
        score and mean top-m score since the last call (reduced over ``group``, e.g. the
        data-parallel ranks: a few scalars), and with a device cache of a host table its hit
        fractions (:meth:`MemoryTable.pop_cache_stats`); resets the counters."""
        stats = self.score_stats.clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            sums = stats[[0, 2, 3]].clone()
            mx = stats[1:2].clone()
            dist.all_reduce(sums, group=group)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            stats = torch.stack([sums[0], mx[0], sums[1], sums[2]])
        self._reset_stats()
        count = max(float(stats[3]), 1.0)
        return {
            "slot_hit_fraction": self.values.pop_hit_fraction(group),
            "top1_score_mean": float(stats[0]) / count,
            "top1_score_max": float(stats[1]),
            "topm_score_mean": float(stats[2]) / count,
            **self.values.pop_cache_stats(group),
        }
