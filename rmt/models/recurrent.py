"""Recurrent transformer (``model.arch: recurrent``), from "Efficient LLM Architectures" §5.

One megatron-core ``TransformerLayer`` ``tau`` (local spec, causal attention) is slid over the
sequence in blocks of width ``k = model.block_width``, always on a window of ``2k`` tokens
(eqs. 6-8)::

    h_1 = tau(x_1)                                                   (6)
    (y_i, h_{i+1}) = tau(a A_i + h_i, a A_i + x_{i+1}),  a in [0, 1]  (7)
    y_t = tau(h_t)                                                   (8)

where, as in the authors' code, ``A_i`` is the first half of the previous window (``x_1`` for
the first step, then ``y_{i-1}``). ``a`` is the trainable accumulation parameter
(``model.recurrent_alpha`` initial value, learned unless ``model.recurrent_alpha_learned`` is
false), kept in [``model.recurrent_alpha_min``, 1] (default [0, 1]). The cost is linear in the sequence length (§5.1: ``r(4dlk + 2ld^2)``
against ``r(l^2 d + l d^2)``, see :mod:`rmt.planner.recurrent_ops`). ``model.num_layers``
recurrent layers (each with its own ``tau`` and ``a``) are stacked.

With ``k = l`` (one block) eqs. 6 and 8 give ``y = tau(tau(x))``: the layer applied twice.
A sequence length that is not a multiple of ``k`` is right-padded to one; causality makes the
outputs of the real positions exact.

Positions (``model.position``): ``learned`` adds a learned embedding of the absolute position
``0..s-1``; ``block`` adds one of the position within its block (``position mod k``, a table
of ``k`` rows), so every block enters the recurrence alike and the model is the same function at
any sequence length. Under a noise-length curriculum (§6.2) ``learned`` meets untrained rows at
every doubling: the recall tokens move to positions never seen in training.

Tensor and pipeline parallelism are not supported (rejected by the validator); data parallelism
works through the trainer.
"""

from __future__ import annotations

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.attention import with_attention_kernel
from rmt.models.build import register
from rmt.models.documents import document_starts, per_document
from rmt.models.megatron_config import transformer_config, validate_attention_shapes
from rmt.models.mixer import norm
from rmt.models.recompute import run_layers
from rmt.models.vocab import padded_vocab_size


def window_mask(length: int, device) -> torch.Tensor:
    """Causal ``[1, 1, n, n]`` mask, True above the diagonal (megatron-core's convention)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


class RecurrentLayer(MegatronModule):
    """One transformer layer applied recurrently over blocks of width ``k`` (eqs. 6-8)."""

    def __init__(self, config: RMTConfig, layer_number: int):
        tcfg = transformer_config(config)
        super().__init__(config=tcfg)
        self.block_width = config.model.block_width
        self.layer = build_module(
            with_attention_kernel(get_gpt_layer_local_spec(normalization=config.model.normalization), config),
            config=tcfg,
            layer_number=layer_number,
        )
        self.alpha = nn.Parameter(
            torch.tensor(float(config.model.recurrent_alpha)), requires_grad=config.model.recurrent_alpha_learned
        )
        self.alpha_min = float(config.model.recurrent_alpha_min)

    def accumulation(self) -> torch.Tensor:
        """The accumulation parameter ``a`` of eq. 7, clamped into [``alpha_min``, 1] in place first. The
        clamp goes through ``.data``: it changes the value only before the first use after an
        optimizer step, and a forward that runs several passes (documents batched by length)
        must not bump the version autograd checks of the earlier passes."""
        self.alpha.data.clamp_(self.alpha_min, 1.0)
        return self.alpha

    def tau(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, attention_mask=window_mask(x.shape[0], x.device))[0]

    def window(self, previous, block: torch.Tensor, a: torch.Tensor):
        """Halves ``(A_i, h_i)`` of the window of ``block`` (``[q, b, h]``, ``q <= k``): eq. 6 when
        ``previous`` is None (the first block), else eq. 7 on the previous complete window, with
        ``a = self.accumulation()``."""
        if previous is None:
            return block, self.tau(block)
        carried = a * previous[0]
        window = self.tau(torch.cat([carried + previous[1], carried[: block.shape[0]] + block]))
        k = previous[0].shape[0]
        return window[:k], window[k:]

    def final_output(self, window, a: torch.Tensor) -> torch.Tensor:
        """Outputs of a complete block once the next block exists: the first half of the next
        window, which by causality is ``tau(a A_i + h_i)`` alone (eq. 7)."""
        return self.tau(a * window[0] + window[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s, b, h]`` -> ``[s, b, h]``."""
        k, s = self.block_width, x.shape[0]
        pad = -s % k
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        blocks = x.split(k)
        a = self.accumulation()
        window = self.window(None, blocks[0], a)
        outputs = []
        for block in blocks[1:]:
            window = self.window(window, block, a)
            outputs.append(window[0])
        outputs.append(self.tau(window[1]))  # eq. 8
        return torch.cat(outputs)[:s]


class RecurrentTransformer(MegatronModule):
    """Token + learned position embeddings, recurrent layers, final norm, output layer."""

    def __init__(self, config: RMTConfig):
        super().__init__(config=transformer_config(config))
        m = config.model
        self.model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
        vocab = padded_vocab_size(config)
        self.embedding = nn.Embedding(vocab, m.hidden_size)
        self.block_positions = m.position == "block"
        self.position_embedding = nn.Embedding(m.position_rows(), m.hidden_size)
        self.layers = nn.ModuleList(RecurrentLayer(config, i + 1) for i in range(m.num_layers))
        self.final_norm = norm(config, m.hidden_size)
        self.output_layer = nn.Linear(m.hidden_size, vocab, bias=False)
        self.dropout = nn.Dropout(m.dropout)

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron-core's schedule; with one pipeline stage it always passes None."""
        assert all(t is None for t in input_tensor), "the recurrent transformer does not support pipeline parallelism"

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        """Logits ``[b, s, V]``. Each window builds its own causal mask; a document mask
        (``data.reset_attention_mask``, :mod:`rmt.models.documents`) runs every document as a
        sequence of its own, the exact per-document computation (block windows are aligned to
        the sequence start and its last block ends with eq. 8, so documents are batched by
        their number of blocks). ``position_ids`` default to ``0..s-1``."""
        starts = document_starts(attention_mask)
        if starts is not None:
            k = self.layers[0].block_width  # a document's last block ends its recurrence (eq. 8)
            return per_document(self._forward, input_ids, position_ids, starts, lambda n: (n + k - 1) // k)
        return self._forward(input_ids, position_ids)

    def _forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = run_layers(self.layers, self.embed(input_ids, position_ids), self.config, self.training)
        return self.head(x)

    def embed(self, input_ids, position_ids) -> torch.Tensor:
        """Token + position embeddings, ``[b, s]`` ids -> ``[s, b, h]``."""
        if self.block_positions:
            position_ids = position_ids % self.position_embedding.num_embeddings
        return self.dropout(self.embedding(input_ids) + self.position_embedding(position_ids)).transpose(0, 1)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> logits ``[b, s, V]``."""
        return self.output_layer(self.final_norm(x.transpose(0, 1)))


def validate_recurrent(config: RMTConfig) -> None:
    m, p = config.model, config.parallel
    validate_attention_shapes(config)
    if p.tensor_model_parallel_size > 1 or p.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "model.arch 'recurrent' supports data parallelism only; set "
            "parallel.tensor_model_parallel_size and pipeline_model_parallel_size to 1"
        )
    if m.block_width > m.seq_length:
        raise ConfigError(f"model.block_width ({m.block_width}) must not exceed model.seq_length ({m.seq_length})")
    if m.recurrent_alpha_min > m.recurrent_alpha:
        raise ConfigError(
            f"model.recurrent_alpha_min must lie in [0, model.recurrent_alpha = {m.recurrent_alpha}], "
            f"got {m.recurrent_alpha_min}"
        )
    if m.position not in ("learned", "block"):
        raise ConfigError(
            f"model.position must be 'learned' or 'block' for the recurrent transformer, got '{m.position}'"
        )


@register("recurrent", validate=validate_recurrent)
def build_recurrent(config: RMTConfig, pre_process: bool, post_process: bool, vp_stage):
    return RecurrentTransformer(config)
