"""Activation recomputation (``train.recompute_*``) of the layer stacks that are rmt's own (RMT,
recurrent, mixer), with megatron-core's semantics and its RNG-tracked checkpoint function.

megatron's ``TransformerBlock`` (the transformer) reads the same settings from its
``TransformerConfig`` (:func:`rmt.models.megatron_config.recompute_settings`); :func:`run_layers`
is its ``_checkpointed_forward`` for a plain list of layers: ``uniform`` recomputes spans of
``recompute_num_layers`` layers from their inputs, ``block`` the first ``recompute_num_layers``
layers of the chunk one by one, each span through ``tensor_parallel.checkpoint`` (the forward
under no_grad keeping the span's inputs only; the backward restores the CPU, CUDA and
model-parallel tracker RNG states and runs the span again). Selective recompute is the core
attention's: megatron's attention (the recurrent layer's ``tau``) takes it from its config, the
RMT's from :func:`core_attention`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer import TransformerConfig


def run_layers(
    layers: Sequence[torch.nn.Module], x: torch.Tensor, config: TransformerConfig, training: bool, *args
) -> torch.Tensor:
    """``x`` through ``layers`` (``layer(x, *args)`` each), recomputing the spans that
    ``config.recompute_method`` / ``recompute_num_layers`` pick when ``training`` and
    ``config.recompute_granularity`` is ``full``."""
    if not training or config.recompute_granularity != "full":
        for layer in layers:
            x = layer(x, *args)
        return x

    def span(start: int, end: int) -> Callable:
        def forward(x, *args):
            for layer in layers[start:end]:
                x = layer(x, *args)
            return x

        return forward

    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            x = tensor_parallel.checkpoint(span(start, start + n), False, x, *args)
        return x
    for i in range(len(layers)):
        x = tensor_parallel.checkpoint(span(i, i + 1), False, x, *args) if i < n else span(i, i + 1)(x, *args)
    return x


def recomputes_core_attention(config: TransformerConfig) -> bool:
    """megatron's test (``Attention.checkpoint_core_attention``)."""
    return config.recompute_granularity == "selective" and "core_attn" in (config.recompute_modules or ())


def core_attention(fn: Callable, config: TransformerConfig, training: bool, *args) -> torch.Tensor:
    """``fn(*args)``, the core attention, recomputed in the backward under selective recompute
    when ``training`` (megatron's ``_checkpointed_attention_forward``)."""
    if training and recomputes_core_attention(config):
        return tensor_parallel.checkpoint(fn, False, *args)
    return fn(*args)
