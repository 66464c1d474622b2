"""Transformer baseline: megatron-core's GPTModel with its local (torch-only) layer spec.

Pre-norm, GELU MLP, learned absolute positions or RoPE, untied input/output embeddings.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.build import register
from rmt.models.megatron_config import padded_vocab_size, transformer_config, validate_attention_shapes

_POSITIONS = {"learned": "learned_absolute", "rope": "rope"}


def validate_transformer(config: RMTConfig) -> None:
    validate_attention_shapes(config)
    if config.model.position not in _POSITIONS:
        raise ConfigError(f"model.position must be 'learned' or 'rope' for the transformer, got '{config.model.position}'")


@register("transformer", validate=validate_transformer)
def build_transformer(config: RMTConfig, pre_process: bool, post_process: bool, vp_stage):
    m = config.model
    return GPTModel(
        config=transformer_config(config),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=m.normalization),
        vocab_size=padded_vocab_size(config),
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type=_POSITIONS[m.position],
        vp_stage=vp_stage,
    )
