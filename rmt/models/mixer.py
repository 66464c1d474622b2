"""Masked mixer and repeat mixers (``model.arch: mixer``), from "Masked Recurrent Mixers".

A mixer is a transformer with attention replaced by a *data-independent* causal token mixing
``Y = X M + beta`` (the paper's first displayed equation, with ``M`` upper-triangular ``T x T``,
shared across channels). Each block is, in the reference's order::

    x = x + FFN(LN(x))          # Linear(d, 4d), SiLU (model.activation), Linear(4d, d)
    x = x + Mix(LN(x))          # per-head Linear(d, d/H), token mixing per head, concat, out_proj

``model.mixer_kind`` picks the token mixing of every head:

* ``masked``: the full masked mixer, ``M_h`` a learned upper-triangular matrix (O(T^2)).
* ``row``: row repeat, ``M[i, j] = v_i``, so ``Y_j = sum_{i<=j} v_i X_i`` (the paper's
  "repeat one value per row" expansion ``Y_n = alpha_n X_n + sum_{m<n} alpha_m X_m + beta``).
* ``column``: column repeat, ``M[i, j] = v_j``, so ``Y_j = v_j sum_{i<=j} X_i`` (the paper's
  column-repeat expansion ``Y_n = alpha_n X_n + alpha_n sum_{m<n} X_m + beta``).
* ``mixed``: the first half of the heads column repeat, the second half row repeat.

``model.mixer_decay`` multiplies ``M[i, j]`` by ``clip(d_h, 0.9, 1) ** ((j - i) / c)`` with a
learned ``d_h`` per head and ``c = model.mixer_decay_scale`` (the paper's "weight decay with
increased distance from the main diagonal").

The parallel form (training) builds ``M_h`` explicitly. Repeat heads also have the recurrent
form (inference): one running-sum vector per head per layer, ``s_t = g s_{t-1} + u_t`` with
``u_t = v_t x_t`` (row) or ``x_t`` (column), output ``s_t`` (row) or ``v_t s_t`` (column), plus
the position bias. The state is the sum itself (the reference divides by ``v_t``, unstable near
zero). Memory per generated token is constant.

Tensor and pipeline parallelism are not supported (rejected by the validator); data parallelism
works through the trainer.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.activation import activation
from rmt.models.build import register
from rmt.models.documents import document_starts, per_document
from rmt.models.init import default_std_rule
from rmt.models.megatron_config import transformer_config, validate_attention_shapes
from rmt.models.recompute import run_layers
from rmt.models.vocab import padded_vocab_size

_DECAY_MIN = 0.9


def head_kinds(kind: str, heads: int) -> List[str]:
    """Token-mixing kind of each head (``mixed``: first half column, second half row)."""
    if kind == "mixed":
        return ["column"] * (heads // 2) + ["row"] * (heads - heads // 2)
    return [kind] * heads


def norm(config: RMTConfig, dim: int) -> nn.Module:
    m = config.model
    if m.normalization == "RMSNorm":
        return nn.RMSNorm(dim, eps=m.layernorm_epsilon)
    return nn.LayerNorm(dim, eps=m.layernorm_epsilon)


class TokenMixing(nn.Module):
    """Multi-head causal token mixing ``Y_h = X_h M_h + beta_h`` followed by ``out_proj``.

    Input/output ``[b, s, d]``; ``s <= model.seq_length`` (weights exist per position).
    """

    def __init__(self, config: RMTConfig):
        super().__init__()
        m = config.model
        self.heads = m.num_attention_heads
        self.length = m.seq_length
        self.kinds = head_kinds(m.mixer_kind, self.heads)
        self.decay_scale = m.mixer_decay_scale
        d = m.hidden_size
        self.linear_qkv = nn.Linear(d, d)
        self.linear_proj = nn.Linear(d, d)
        shape = (self.heads, self.length, self.length) if m.mixer_kind == "masked" else (self.heads, self.length)
        self.token_weight = nn.Parameter(torch.empty(shape))
        self.token_bias = nn.Parameter(torch.zeros(self.heads, self.length))
        self.decay = nn.Parameter(torch.ones(self.heads)) if m.mixer_decay else None
        nn.init.zeros_(self.linear_qkv.bias)
        nn.init.zeros_(self.linear_proj.bias)
        # Column-repeat heads take v[j] (the column), row-repeat heads v[i] (the row).
        self.register_buffer("is_row", torch.tensor([k == "row" for k in self.kinds]), persistent=False)

    def gamma(self) -> Optional[torch.Tensor]:
        """Per-head decay factor per position step, ``clip(d, 0.9, 1) ** (1 / c)``."""
        if self.decay is None:
            return None
        return self.decay.clamp(_DECAY_MIN, 1.0) ** (1.0 / self.decay_scale)

    def mixing_matrix(self, s: int) -> torch.Tensor:
        """``M`` ``[H, s, s]``: ``M[h, i, j]`` weights input position i into output position j."""
        upper = torch.ones(s, s, dtype=torch.bool, device=self.token_weight.device).triu()
        if self.token_weight.dim() == 3:
            mat = self.token_weight[:, :s, :s]
        else:
            v = self.token_weight[:, :s]
            mat = torch.where(
                self.is_row[:, None, None], v[:, :, None].expand(-1, s, s), v[:, None, :].expand(-1, s, s)
            )
        g = self.gamma()
        if g is not None:
            pos = torch.arange(s, device=mat.device, dtype=mat.dtype)
            dist = (pos[None, :] - pos[:, None]).clamp(min=0)
            mat = mat * g[:, None, None] ** dist
        return mat * upper

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        return self.linear_qkv(x).view(b, s, self.heads, d // self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Parallel form: ``Y_j = sum_{i<=j} M[i, j] X_i + beta_j`` per head."""
        b, s, d = x.shape
        if s > self.length:
            raise ValueError(f"sequence of {s} tokens is longer than model.seq_length={self.length}")
        u = self.split(x)
        y = torch.einsum("hij,bihc->bjhc", self.mixing_matrix(s), u)
        y = y + self.token_bias[:, :s].t()[None, :, :, None]
        return self.linear_proj(y.reshape(b, s, d))

    def init_state(self, batch: int, device, dtype) -> torch.Tensor:
        """Recurrent state ``[b, H, d/H]``: one running-sum vector per head."""
        if self.token_weight.dim() == 3:
            raise ValueError(
                "the masked mixer (mixer_kind=masked) has no constant-memory "
                "recurrent form; use a repeat kind (row, column, mixed)"
            )
        d = self.linear_qkv.in_features
        return torch.zeros(batch, self.heads, d // self.heads, device=device, dtype=dtype)

    def step(self, x: torch.Tensor, state: torch.Tensor, t: int):
        """Recurrent form for one position ``t``: ``x`` ``[b, d]`` -> (output ``[b, d]``, state)."""
        if t >= self.length:
            raise ValueError(f"position {t} is beyond model.seq_length={self.length}")
        b, d = x.shape
        u = self.split(x[:, None])[:, 0]  # [b, H, c]
        v = self.token_weight[:, t][None, :, None]
        g = self.gamma()
        carried = state if g is None else state * g[None, :, None]
        row = self.is_row[None, :, None]
        state = carried + torch.where(row, v * u, u)
        y = torch.where(row, state, v * state) + self.token_bias[:, t][None, :, None]
        return self.linear_proj(y.reshape(b, d)), state


class MixerBlock(nn.Module):
    """FFN sublayer then token-mixing sublayer, each pre-norm with a residual (reference order)."""

    def __init__(self, config: RMTConfig):
        super().__init__()
        m = config.model
        d, f = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size
        self.ffn_norm = norm(config, d)
        self.linear_fc1 = nn.Linear(d, f)
        self.linear_fc2 = nn.Linear(f, d)
        self.mix_norm = norm(config, d)
        self.mixing = TokenMixing(config)
        self.dropout = nn.Dropout(m.dropout)
        self.activation = activation(config)
        nn.init.zeros_(self.linear_fc1.bias)
        nn.init.zeros_(self.linear_fc2.bias)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.linear_fc2(self.activation(self.linear_fc1(self.ffn_norm(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ffn(x)
        return x + self.dropout(self.mixing(self.mix_norm(x)))

    def step(self, x: torch.Tensor, state: torch.Tensor, t: int):
        x = self.ffn(x)
        y, state = self.mixing.step(self.mix_norm(x), state, t)
        return x + self.dropout(y), state


class MixerModel(MegatronModule):
    """Embedding, ``num_layers`` mixer blocks, final norm, output layer (full vocabulary)."""

    def __init__(self, config: RMTConfig):
        super().__init__(config=transformer_config(config))
        m = config.model
        self.model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
        vocab = padded_vocab_size(config)
        self.embedding = nn.Embedding(vocab, m.hidden_size)
        self.layers = nn.ModuleList(MixerBlock(config) for _ in range(m.num_layers))
        self.final_norm = norm(config, m.hidden_size)
        self.output_layer = nn.Linear(m.hidden_size, vocab, bias=False)

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron-core's schedule; with one pipeline stage it always passes None."""
        assert all(t is None for t in input_tensor), "the mixer does not support pipeline parallelism"

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        """Logits ``[b, s, V]``. Causality is built into the token mixing, whose weights are
        indexed by position (so position ids are not used); a document mask
        (``data.reset_attention_mask``, :mod:`rmt.models.documents`) runs every document as a
        sequence of its own from position 0."""
        starts = document_starts(attention_mask)
        if starts is not None:
            return per_document(lambda ids, _: self._forward(ids), input_ids, None, starts)
        return self._forward(input_ids)

    def _forward(self, input_ids):
        x = run_layers(self.layers, self.embedding(input_ids), self.config, self.training)
        return self.output_layer(self.final_norm(x))

    def init_state(self, batch: int) -> List[torch.Tensor]:
        w = self.output_layer.weight
        return [layer.mixing.init_state(batch, w.device, w.dtype) for layer in self.layers]

    def step(self, input_ids: torch.Tensor, state: List[torch.Tensor], t: int):
        """Recurrent form: tokens ``[b]`` at position ``t`` -> (logits ``[b, V]``, new state)."""
        x = self.embedding(input_ids)
        new_state = []
        for layer, s in zip(self.layers, state):
            x, s = layer.step(x, s, t)
            new_state.append(s)
        return self.output_layer(self.final_norm(x)), new_state


def mixer_std_rule(config: RMTConfig):
    """Token-mixing weights ~ N(0, 1/T) (a sum over T positions keeps unit scale); decay and
    position biases keep their constant init; everything else follows the default rule."""
    base = default_std_rule(config)
    mix_std = 1.0 / math.sqrt(config.model.seq_length)

    def rule(key: str, param: torch.Tensor) -> Optional[float]:
        if key.endswith("token_weight"):
            return mix_std
        if key.endswith(("token_bias", "decay")):
            return None
        return base(key, param)

    return rule


def validate_mixer(config: RMTConfig) -> None:
    m, p = config.model, config.parallel
    validate_attention_shapes(config)
    if p.tensor_model_parallel_size > 1 or p.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "model.arch 'mixer' supports data parallelism only; set "
            "parallel.tensor_model_parallel_size and pipeline_model_parallel_size to 1"
        )
    if m.mixer_kind == "mixed" and m.num_attention_heads < 2:
        raise ConfigError("model.mixer_kind 'mixed' needs model.num_attention_heads >= 2 (half column, half row)")


@register("mixer", std_rule=mixer_std_rule, validate=validate_mixer)
def build_mixer(config: RMTConfig, pre_process: bool, post_process: bool, vp_stage):
    return MixerModel(config)
