"""Core attention (softmax(q k^T / sqrt(d)) v) of the architectures built on megatron-core layers.

megatron-core's local layer spec computes it with ``DotProductAttention``: a ``baddbmm`` into a
materialized ``[b, heads, s, s]`` score tensor, a masked softmax, a ``bmm``, and the permutes
between. Without Transformer Engine (rmt's CPU runs, and GPU runs without it) that is megatron's
only kernel. ``model.attention_kernel: sdpa`` (the default) swaps it for
:class:`SDPAttention`: the same module and arguments, computed by torch's
``scaled_dot_product_attention``, which fuses the steps (a flash-attention kernel on CPU and
GPU for causal attention, no ``s x s`` tensor kept for the backward). ``megatron`` keeps
megatron's kernel, the reference the tests compare against. ``megatron_fused`` keeps it with
megatron's fused scale-mask-softmax (``masked_softmax_fusion``): under bf16 one CUDA kernel
scales, masks and normalizes the 16-bit scores where megatron's shape rules allow it; that kernel
is a compiled extension (Megatron-LM's ``fused_kernels`` or Apex), so a bf16 model is refused
where it is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from rmt.config import RMTConfig
from rmt.models.fused_softmax import check_fused_softmax

KERNELS = ("sdpa", "megatron", "megatron_fused")


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by ``F.scaled_dot_product_attention``.

    Same constructor, parameters (none) and state dict; ``forward`` takes megatron's
    ``[s, b, heads, head_dim]`` query, key and value and its boolean mask (True = masked,
    ``[b or 1, 1, s, s]``; None with a causal mask type = causal over more than one query) and
    returns ``[s, b, hidden]``. Dropout on the attention probabilities draws from the same
    model-parallel RNG as megatron's (``get_cuda_rng_tracker().fork()``), but in torch's kernel
    order, so a run with attention dropout is not bit-equal across the two kernels. A query whose
    keys are all masked gets NaN here and uniform weights from megatron (whose fill is -10000,
    not -inf); rmt's causal and document masks always leave a query its own position."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert packed_seq_params is None and attention_bias is None, (
            "SDPAttention, like megatron's DotProductAttention, takes neither packed sequences nor a bias"
        )
        assert self.softmax_offset is None, "SDPAttention supports vanilla softmax"
        s, b = query.shape[0], query.shape[1]
        group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if group > 1:  # each key and value head serves its group's query heads, as megatron's kernel
            key, value = (x.repeat_interleave(group, dim=2) for x in (key, value))
        # megatron folds apply_query_key_layer_scaling's 1/layer_number into softmax_scale and
        # multiplies it back inside its softmax; the product is the scale of the logits.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        # megatron's softmax makes the causal mask itself when none is given, for more than one
        # query (a single decoding query sees every cached key).
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and s > 1
        mask = None if attention_mask is None else ~attention_mask
        p = self.attention_dropout.p if self.training else 0.0
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, head_dim]
        with tensor_parallel.get_cuda_rng_tracker().fork() if p else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale
            )
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def with_attention_kernel(layer_spec: ModuleSpec, config: RMTConfig) -> ModuleSpec:
    """``layer_spec`` (a megatron-core transformer layer spec) with its self-attention's core
    attention computed by ``model.attention_kernel``."""
    check_fused_softmax(config)
    if config.model.attention_kernel != "sdpa":
        return layer_spec
    attention = layer_spec.submodules.self_attention
    core = dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    return dataclasses.replace(
        layer_spec,
        submodules=dataclasses.replace(
            layer_spec.submodules, self_attention=dataclasses.replace(attention, submodules=core)
        ),
    )
