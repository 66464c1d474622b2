"""Norms of megatron-core's local (torch-only) layer spec under sequence parallelism
(``parallel.sequence_parallel``).

megatron's ``WrappedTorchNorm`` (the local spec's norm without Apex or Transformer Engine)
refuses ``sequence_parallel``: under it a norm sees ``1 / TP`` of the tokens on each
tensor-parallel rank, so its weight gradients are partial sums that megatron's
``finalize_model_grads`` all-reduces over the TP group for every parameter marked
``sequence_parallel`` (as Apex's ``FusedLayerNorm`` and TE's norms mark theirs); the torch norm
does not mark them. :class:`SequenceParallelNorm` is the same torch norm with its parameters
marked, and :func:`with_sequence_parallel_norms` puts it in a GPT layer or block spec in place
of megatron's, the decoder's final norm included (the block spec's ``layer_norm``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelNorm:
    """``WrappedTorchNorm``'s constructor (same arguments) returning torch's ``LayerNorm`` or
    ``RMSNorm`` with every parameter's ``sequence_parallel`` set from the config."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _layer(spec: ModuleSpec) -> ModuleSpec:
    changes = {
        name: SequenceParallelNorm
        for name in ("input_layernorm", "pre_mlp_layernorm")
        if getattr(spec.submodules, name, None) is WrappedTorchNorm
    }
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes)) if changes else spec


def with_sequence_parallel_norms(
    spec: Union[ModuleSpec, TransformerBlockSubmodules], tcfg: TransformerConfig, vp_stage: Optional[int]
) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """``spec`` (a transformer layer spec, or a decoder block spec) with megatron's torch norms
    replaced by :class:`SequenceParallelNorm` when ``tcfg.sequence_parallel``; a layer spec
    becomes the block spec megatron would make of it (one layer spec per layer of the chunk)."""
    if not tcfg.sequence_parallel:
        return spec
    if isinstance(spec, ModuleSpec):
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage), layer_norm=WrappedTorchNorm
        )
    final = SequenceParallelNorm if spec.layer_norm is WrappedTorchNorm else spec.layer_norm
    return dataclasses.replace(spec, layer_specs=[_layer(s) for s in spec.layer_specs], layer_norm=final)
