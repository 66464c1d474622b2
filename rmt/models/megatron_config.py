"""Translate an :class:`rmt.config.RMTConfig` into megatron-core's ``TransformerConfig``."""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.activation import activation
from rmt.parallel import compat


def validate_attention_shapes(config: RMTConfig) -> None:
    """What megatron-core's TransformerConfig and TP layers need of heads and widths (for the
    architectures built from ``model.hidden_size`` / ``num_attention_heads``)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({tp})"
        )
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_attention_heads "
            f"({m.num_attention_heads})"
        )
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        raise ConfigError(
            f"model.ffn_hidden_size ({ffn}) must be divisible by parallel.tensor_model_parallel_size ({tp})"
        )


def recompute_settings(config: RMTConfig) -> dict:
    """``train.recompute_*`` as megatron's ``TransformerConfig`` keys (``none`` = None). Selective
    recompute is megatron's default module list, the core attention (``recompute_modules``
    ``["core_attn"]``), which rmt's :class:`~rmt.models.attention.SDPAttention` is."""
    t = config.train
    granularity = None if t.recompute_granularity == "none" else t.recompute_granularity
    return dict(
        recompute_granularity=granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
    )


def transformer_config(config: RMTConfig, **extra) -> TransformerConfig:
    m, p, t = config.model, config.parallel, config.train
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    extra = {**recompute_settings(config), "sequence_parallel": p.sequence_parallel, **extra}
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        gated_linear_unit=m.gated_linear_unit,
        add_bias_linear=m.add_bias_linear,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        # initialised in fp32 under every precision (the same draw); the trainer casts to bf16
        params_dtype=torch.float32,
        bf16=t.precision == "bf16",
        use_cpu_initialization=not compat.cuda_available(),
        init_method_std=m.init_std,
        hidden_dropout=m.dropout,
        attention_dropout=m.dropout,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        activation_func=activation(config),
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=m.attention_kernel == "megatron_fused",
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        # gloo computes silently wrong interleaved-pipeline losses with batched p2p.
        batch_p2p_comm=False,
        **extra,
    )
