"""Residual Matrix Transformer (Mak & Flanigan, §2.2) on megatron-core.

Every token carries a residual *matrix* instead of a residual vector. It is stored as
``[s, b, Dv, Dk]`` (``Dk`` contiguous; the paper's ``Dk x Dv`` matrix transposed), so that

* a **read** with R key vectors (Eq. 13, 22, 25, 27), ``x^(h) = r^(h) ._1 X``, is one GEMM
  ``[s*b*Dv, Dk] @ [Dk, n]`` over all tokens and all Dv columns at once, and
* a **write** of R data vectors with R key vectors (Eq. 12, 18-20, 23),
  ``X += sum_h w^(h) (x) x^(h)``, is one GEMM ``[s*b*Dv, n] @ [n, Dk]``.

That replaces the authors' per-head small-K tensor contractions (their Appendix E runtime gap)
with large GEMMs: K is small but M = tokens x Dv is large, which BLAS handles well.

Tensor parallelism splits the R heads: the attention read is a megatron
``ColumnParallelLinear`` ``Dk -> 3R`` (rows ordered head-major, ``h*3 + {q,k,v}``, so each rank
owns whole heads) and the attention write a ``RowParallelLinear`` ``R -> Dk`` (all-reduce of the
partial residual update). The feed-forward core W1/W2 is column/row parallel; its reads and
writes (R keys each) are replicated, as are the norms. Embedding and unembedding are
vocab-parallel. Pipeline stages pass the residual flattened to ``[s, b, Dk*Dv]``.

Feed-forward input ordering: Eq. 25 concatenates the R read vectors head-major
(``h*Dv + v``); here the FF input is laid out ``v*R + h`` (a free view of the read GEMM's
output). The two differ by a fixed permutation of W1's input columns (and W2's output rows),
i.e. the same model family with the same i.i.d. initialisation.

Choices of the authors' code (docs/reference-implementations.md): RMSNorm over all Dk*Dv
entries jointly with an elementwise gain, eps ``model.layernorm_epsilon``; attention logits
scaled by ``1/(sqrt(Dv) (l+1))`` (inverse layer scaling), softmax in fp32; ALiBi slopes
``geomspace(2^(-8/R), 2^-8)`` or learned positions written with their own keys (Eq. 19);
no biases; untied, zero-initialised unembedding; z-loss is ``train.z_loss``.

Memory layers (``memory.*``, UltraMem / PKM / MoE, :mod:`rmt.memory.attach`) hook onto the
layers at skip placements ``i:j``. A memory layer reads the residual matrix after layer i
flattened to ``Dv*Dk`` entries (its LayerNorm, query, values and output projection are that wide)
and its output, a full ``Dv x Dk`` update, is added to the residual after layer j. This is the
simplest design that keeps the memory layer architecture-agnostic: the memory sees the whole
residual state, as it does in the transformer, rather than R read vectors. Memory layers are
replicated over tensor-parallel ranks (the residual matrix is complete on every rank).
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import sharded_state_dict_default

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.build import register
from rmt.models.init import EMBEDDING_TABLES, embedding_std
from rmt.models.megatron_config import transformer_config
from rmt.models.recompute import core_attention, run_layers
from rmt.models.vocab import padded_vocab_size
from rmt.ops.matrix_rmsnorm import matrix_rms_norm, matrix_rms_norm_read
from rmt.ops.matrix_write import matrix_write

POSITIONS = ("alibi", "learned")
# The embedding's and unembedding's key matrices (parameter name suffixes): the authors decay
# them (``train.decay_rmt_keys``), unlike the tables they read and write.
RMT_KEY_MATRICES = ("embedding.word_keys", "embedding.position_keys", "output_layer.read.weight")


def ffn_hidden_size(config: RMTConfig) -> int:
    """W1's output size; default 4 R Dv (the transformer twin's 4 D with D = R Dv)."""
    m = config.model
    return m.ffn_hidden_size or 4 * m.rank * m.dv


def write(data: torch.Tensor, keys: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Store n data vectors (Eq. 12 without the norm): ``data [..., Dv, n]``, ``keys [Dk, n]``
    -> ``[..., Dv, Dk]`` with ``out[..., v, k] = sum_h keys[k, h] data[..., v, h]``, i.e.
    ``sum_h w^(h) (x) x^(h)`` transposed; into ``residual`` (``[..., Dv, Dk]``: ``residual +
    out``, Eq. 15-16) where given, added as the write stores its rows."""
    return matrix_write(data, keys, residual=residual)


def alibi_slopes(rank: int) -> torch.Tensor:
    """``geomspace(2^(-8/R), 2^-8, R)`` = ``2^(-8 (h+1) / R)``."""
    return torch.pow(2.0, -8.0 * torch.arange(1, rank + 1, dtype=torch.float64) / rank).float()


class MatrixRMSNorm(torch.nn.Module):
    """RMSNorm over all Dk*Dv entries of a token's residual matrix, elementwise gain (ones)
    (:func:`rmt.ops.matrix_rmsnorm.matrix_rms_norm`).
    The gain is stored flat so that the optimizer treats it as a norm (no weight decay)."""

    def __init__(self, dv: int, dk: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dv * dk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.weight.numel())
        return matrix_rms_norm(flat, self.weight, self.eps).view(x.shape)

    def read(self, x: torch.Tensor, keys: torch.Tensor, key_major: bool = False, pass_residual: bool = False):
        """The norm followed by a read with ``keys [n, Dk]``, fused
        (:func:`rmt.ops.matrix_rmsnorm.matrix_rms_norm_read`): ``[tokens*Dv, n]``, or
        ``[n, tokens*Dv]`` with ``key_major``; with ``pass_residual``, ``(read, x)`` (x as given),
        x's later gradient added in the norm's backward."""
        flat = x.reshape(-1, self.weight.numel())
        if not pass_residual:
            return matrix_rms_norm_read(flat, self.weight, keys, self.eps, key_major)
        out, flat = matrix_rms_norm_read(flat, self.weight, keys, self.eps, key_major, pass_residual=True)
        return out, flat.view(x.shape)


class RMTEmbedding(MegatronModule):
    """Eq. 18-19: vocab-parallel table ``(V, Dv*R)`` (laid out ``(Dv, R)``) written into the
    residual with keys ``(Dk, R)``; learned positions have their own table and keys, written
    in the same GEMM."""

    def __init__(self, config: TransformerConfig, m, vocab: int):
        super().__init__(config=config)
        self.dv, self.rank = m.dv, m.rank
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab, m.dv * m.rank, init_method=config.init_method, config=config
        )
        self.word_keys = torch.nn.Parameter(torch.empty(m.dk, m.rank))
        self.learned = m.position == "learned"
        if self.learned:
            self.position_embeddings = torch.nn.Embedding(m.seq_length, m.dv * m.rank)
            self.position_keys = torch.nn.Parameter(torch.empty(m.dk, m.rank))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        s, b = input_ids.shape[1], input_ids.shape[0]
        data = self.word_embeddings(input_ids.t()).view(s, b, self.dv, self.rank)
        keys = self.word_keys
        if self.learned:
            pos = self.position_embeddings(position_ids.t()).view(s, b, self.dv, self.rank)
            data = torch.cat([data, pos], dim=-1)
            keys = torch.cat([keys, self.position_keys], dim=-1)
        return write(data, keys)


class RMTLayer(MegatronModule):
    """One attention (Eq. 15, 20-22) and one feed-forward (Eq. 16, 23-25) block."""

    def __init__(self, config: TransformerConfig, m, layer_number: int, ffn: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # global, 1-based
        self.dk, self.dv, self.rank = m.dk, m.dv, m.rank
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.local_heads = m.rank // tp
        self.scale = 1.0 / (math.sqrt(m.dv) * layer_number)
        linear = dict(config=config, init_method=config.init_method, bias=False)
        self.attn_norm = MatrixRMSNorm(m.dv, m.dk, m.layernorm_epsilon)
        self.attn_read = tensor_parallel.ColumnParallelLinear(m.dk, 3 * m.rank, gather_output=False, **linear)
        self.attn_write = tensor_parallel.RowParallelLinear(
            m.rank, m.dk, input_is_parallel=True, skip_bias_add=True, **linear
        )
        self.ff_norm = MatrixRMSNorm(m.dv, m.dk, m.layernorm_epsilon)
        self.ff_read = torch.nn.Linear(m.dk, m.rank, bias=False)
        self.fc1 = tensor_parallel.ColumnParallelLinear(m.rank * m.dv, ffn, gather_output=False, **linear)
        self.fc2 = tensor_parallel.RowParallelLinear(
            ffn, m.rank * m.dv, input_is_parallel=True, skip_bias_add=True, **linear
        )
        self.ff_write = torch.nn.Linear(m.rank, m.dk, bias=False)
        self.activation = config.activation_func
        # The residual entering the feed-forward: where a memory beside the FFN (UltraMemV2,
        # rmt.memory.attach) takes its input (the norm is fused into the FFN's read).
        self.ffn_input = torch.nn.Identity()

    def attention(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Eq. 15, 20-22: ``x`` plus the attention's write. The read is key-major, ``[3*heads,
        s*b*Dv]``, so q, k and v are strided views with Dv innermost in the ``[b, heads, s, Dv]``
        shape the fused attention kernel takes, and its output, laid out like q, is a free view of
        the ``[s, b*Dv, heads]`` input of the write (no permutation copy either way). Without TP
        the norm passes x on as the residual and the write adds it (one pass each way). Under TP
        each rank reads its own heads: x and the gain enter through megatron's copy-to-TP region,
        which sums their gradients (linear in the read's gradient) over the heads of all ranks,
        and the residual is added after the sum over ranks."""
        s, b = x.shape[:2]
        heads = self.local_heads
        single = parallel_state.get_tensor_model_parallel_world_size() == 1
        if single:  # the residual continues from the read's x: its two gradients added in one pass
            qkv, x = self.attn_norm.read(x, self.attn_read.weight, key_major=True, pass_residual=True)
        else:
            x_tp, gain_tp = (
                tensor_parallel.copy_to_tensor_model_parallel_region(t) for t in (x, self.attn_norm.weight)
            )
            qkv = matrix_rms_norm_read(
                x_tp.reshape(s * b, -1), gain_tp, self.attn_read.weight, self.attn_norm.eps, key_major=True
            )
        qkv = qkv.view(heads, 3, s, b, self.dv)
        q, k, v = (t.permute(2, 0, 1, 3).float() for t in qkv.unbind(1))
        ctx = core_attention(self.core_attention, self.config, self.training, q, k, v, bias)
        ctx = ctx.to(qkv.dtype).permute(2, 0, 3, 1).reshape(s, b * self.dv, heads)
        # attn_write is a RowParallelLinear for its weight's TP sharding: its forward (a linear
        # layer, then the sum over TP ranks) computed by the write kernel, which adds the residual
        # itself where there is no sum over ranks after it.
        if single:
            return write(ctx.view(s, b, self.dv, heads), self.attn_write.weight, residual=x)
        out = tensor_parallel.reduce_from_tensor_model_parallel_region(write(ctx, self.attn_write.weight))
        return x + out.view(s, b, self.dv, self.dk)

    def core_attention(self, q, k, v, bias) -> torch.Tensor:
        """softmax(q k^T scale + bias) v in fp32 (recomputed under selective recompute)."""
        with torch.autocast(device_type=q.device.type, enabled=False):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Eq. 16, 23-25: ``x`` plus the feed-forward's write."""
        s, b = x.shape[:2]
        h, x = self.ff_norm.read(x, self.ff_read.weight, pass_residual=True)
        h = h.view(s, b, self.dv * self.rank)
        h, _ = self.fc1(h)
        h, _ = self.fc2(self.activation(h))
        return write(h.view(s, b, self.dv, self.rank), self.ff_write.weight, residual=x)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_input(self.attention(x, bias)))


class RMTUnembedding(MegatronModule):
    """Eq. 26-27: R reads, then a vocab-parallel ``Dv*R -> V`` projection (zero-initialised)."""

    def __init__(self, config: TransformerConfig, m, vocab: int):
        super().__init__(config=config)
        self.dv, self.rank = m.dv, m.rank
        self.read = torch.nn.Linear(m.dk, m.rank, bias=False)
        self.linear = tensor_parallel.ColumnParallelLinear(
            m.dv * m.rank, vocab, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
        )

    def forward(self, x: torch.Tensor, norm: MatrixRMSNorm) -> torch.Tensor:
        """``x`` the residual matrix ``[s, b, Dv, Dk]``, ``norm`` the final norm (its own module
        for checkpoint compatibility), fused with the reads."""
        s, b = x.shape[:2]
        logits, _ = self.linear(norm.read(x, self.read.weight).view(s, b, self.dv * self.rank))
        return logits


class RMTModel(MegatronModule):
    """One pipeline chunk. ``forward(input_ids [b,s], position_ids [b,s], attention_mask
    [1,1,s,s] bool, True = masked)`` returns vocab-parallel logits ``[b, s, V/tp]`` on the last
    stage, else the residual flattened to ``[s, b, Dk*Dv]``."""

    def __init__(self, config: RMTConfig, pre_process: bool, post_process: bool, vp_stage: Optional[int]):
        m = config.model
        tconfig = rmt_transformer_config(config)
        super().__init__(config=tconfig)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.dk, self.dv, self.rank = m.dk, m.dv, m.rank
        self.alibi = m.position == "alibi"
        vocab = padded_vocab_size(config)
        if pre_process:
            self.embedding = RMTEmbedding(tconfig, m, vocab)
        offset = get_transformer_layer_offset(tconfig, vp_stage)
        count = get_num_layers_to_build(tconfig, vp_stage)
        ffn = ffn_hidden_size(config)
        self.layers = torch.nn.ModuleList(RMTLayer(tconfig, m, offset + i + 1, ffn) for i in range(count))
        if post_process:
            self.final_norm = MatrixRMSNorm(m.dv, m.dk, m.layernorm_epsilon)
            self.output_layer = RMTUnembedding(tconfig, m, vocab)
        tp, tp_rank = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
        local = m.rank // tp
        self.register_buffer("slopes", alibi_slopes(m.rank)[tp_rank * local : (tp_rank + 1) * local], persistent=False)
        self.input_tensor = None

    def memory_hook_layers(self):
        """The global layers of this chunk and the residual's sequence dim, for memory hooks."""
        return self.layers, 0

    def set_input_tensor(self, input_tensor) -> None:
        """megatron-core's pipeline hook: the previous stage's output."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def attention_bias(self, s: int, attention_mask: Optional[torch.Tensor], device) -> torch.Tensor:
        """``[B, R/tp, s, s]`` additive logit bias: ALiBi ``-slope_h (i - j)`` (or 0) and -inf
        where ``attention_mask`` (``[B, 1, s, s]``, B = 1 or the batch: per-sample document
        masks) is True (causal when no mask is given)."""
        if attention_mask is None:
            attention_mask = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
        pos = torch.arange(s, device=device, dtype=torch.float32)
        if self.alibi:
            bias = -self.slopes.to(device)[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        else:
            bias = torch.zeros(1, s, s, device=device)
        return bias.unsqueeze(0).masked_fill(attention_mask.view(-1, 1, s, s), float("-inf"))

    def forward(self, input_ids, position_ids, attention_mask=None):
        if self.pre_process:
            x = self.embedding(input_ids, position_ids)
        else:
            x = self.input_tensor.view(*self.input_tensor.shape[:2], self.dv, self.dk)
        if self.layers:
            bias = self.attention_bias(x.shape[0], attention_mask, x.device)
            x = run_layers(self.layers, x, self.config, self.training, bias)
        if not self.post_process:
            return x.reshape(*x.shape[:2], self.dv * self.dk)
        return self.output_layer(x, self.final_norm).transpose(0, 1).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Global keys: layers by their global number (``layers.{l-1}.``), TP shards by offset
        (megatron's layers), everything else replicated."""
        out = {}
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for name, module in self.named_children():
            if name != "layers":
                out.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=tp_group)
                )
        for i, layer in enumerate(self.layers):
            local = f"{prefix}layers.{i}."
            sd = layer.sharded_state_dict(local, sharded_offsets, metadata)
            replace_prefix_for_sharding(sd, local, f"{prefix}layers.{layer.layer_number - 1}.")
            out.update(sd)
        return out


def rmt_transformer_config(config: RMTConfig) -> TransformerConfig:
    """megatron-core's config for the RMT: hidden size Dk*Dv (the pipeline p2p buffers carry
    the flattened residual matrix), R heads of size Dv."""
    twin = copy.deepcopy(config)
    m = twin.model
    m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = m.dk * m.dv, m.rank, ffn_hidden_size(config)
    return transformer_config(twin, kv_channels=m.dv)


# Global fan-in of every random weight (the authors' N(0, std / sqrt(fan_in)) init).
def _fan_in(config: RMTConfig) -> dict:
    m = config.model
    return {
        "embedding.word_keys": m.rank,
        "embedding.position_keys": m.rank,
        "attn_read.weight": m.dk,
        "attn_write.weight": m.rank,
        "ff_read.weight": m.dk,
        "fc1.weight": m.rank * m.dv,
        "fc2.weight": ffn_hidden_size(config),
        "ff_write.weight": m.rank,
        "output_layer.read.weight": m.dk,
    }


_WRITES = ("attn_write.weight", "ff_write.weight")


def rmt_std_rule(config: RMTConfig) -> Callable[[str, torch.Tensor], Optional[float]]:
    """Init std per global key: embedding tables ``init_std`` (``embedding_init_std`` where
    set); every other matrix ``init_std / sqrt(fan_in)``, layer writes additionally ``/ sqrt(2L)``; norms (ones) and
    the unembedding projection (zeros) keep the module's constant init (None)."""
    std, embeddings = config.model.init_std, embedding_std(config)
    fan_in = _fan_in(config)
    depth = math.sqrt(2.0 * config.model.num_layers)

    def rule(key: str, param: torch.Tensor) -> Optional[float]:
        if key.endswith(EMBEDDING_TABLES):
            return embeddings
        for suffix, fan in fan_in.items():
            if key.endswith(suffix):
                return std / math.sqrt(fan) / (depth if key.endswith(_WRITES) else 1.0)
        return None

    return rule


def validate_rmt(config: RMTConfig) -> None:
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    if m.position not in POSITIONS:
        raise ConfigError(f"model.position must be 'alibi' or 'learned' for the rmt, got '{m.position}'")
    if m.dropout:
        raise ConfigError(f"model.dropout is not supported by the rmt (got {m.dropout}); set it to 0")
    if m.rank % tp:
        raise ConfigError(
            f"model.rank ({m.rank}) must be divisible by parallel.tensor_model_parallel_size "
            f"({tp}): the R attention heads are split across tensor-parallel ranks"
        )
    if ffn_hidden_size(config) % tp:
        raise ConfigError(
            f"model.ffn_hidden_size ({ffn_hidden_size(config)}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({tp})"
        )


@register("rmt", std_rule=rmt_std_rule, validate=validate_rmt)
def build_rmt(config: RMTConfig, pre_process: bool, post_process: bool, vp_stage):
    return RMTModel(config, pre_process, post_process, vp_stage)
