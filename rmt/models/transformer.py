"""Transformer baseline: megatron-core's GPTModel with its local (torch-only) layer spec, its core
attention computed by ``model.attention_kernel`` (:mod:`rmt.models.attention`).

Pre-norm, GELU MLP (or a gated one, :mod:`rmt.models.gated_mlp`; grouped-query attention with
``model.num_query_groups``), learned absolute positions or RoPE, untied input/output embeddings. With
``memory.type: moe`` and ``memory.moe_placement: mlp`` the MLP of the listed layers is
megatron's MoE (:mod:`rmt.memory.moe`, megatron's decoder block spec with ``moe_layer_freq``).
``parallel.sequence_parallel`` is megatron's (``TransformerConfig.sequence_parallel``), its torch
norms marked for it (:mod:`rmt.models.sequence_parallel`); ``train.recompute_*`` are megatron's
too (:func:`rmt.models.megatron_config.recompute_settings`).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from rmt.config import RMTConfig
from rmt.errors import ConfigError
from rmt.models.attention import with_attention_kernel
from rmt.models.build import register
from rmt.models.gated_mlp import with_gated_mlp
from rmt.models.megatron_config import transformer_config, validate_attention_shapes
from rmt.models.sequence_parallel import with_sequence_parallel_norms
from rmt.models.vocab import padded_vocab_size
from rmt.quiet import quiet_mlp_type_warning

_POSITIONS = {"learned": "learned_absolute", "rope": "rope"}


def validate_transformer(config: RMTConfig) -> None:
    validate_attention_shapes(config)
    if config.model.position not in _POSITIONS:
        raise ConfigError(
            f"model.position must be 'learned' or 'rope' for the transformer, got '{config.model.position}'"
        )


def _moe_mlp(config: RMTConfig) -> bool:
    return config.memory.type == "moe" and config.memory.moe_placement == "mlp"


@register("transformer", validate=validate_transformer)
def build_transformer(config: RMTConfig, pre_process: bool, post_process: bool, vp_stage):
    m = config.model
    if _moe_mlp(config):
        from rmt.memory.moe import moe_block_spec, moe_layer_pattern

        # Dense and MoE layers mixed: checkpoint keys per layer, as megatron does for a
        # moe_layer_freq pattern (stacked keys need every layer to have the same tensors).
        tcfg = transformer_config(config, hetereogenous_dist_checkpoint=0 in moe_layer_pattern(config))
        with quiet_mlp_type_warning():
            return _gpt(config, tcfg, moe_block_spec(config, tcfg, vp_stage), pre_process, post_process, vp_stage)
    spec = with_gated_mlp(
        with_attention_kernel(get_gpt_layer_local_spec(normalization=m.normalization), config), config
    )
    with quiet_mlp_type_warning():
        return _gpt(config, transformer_config(config), spec, pre_process, post_process, vp_stage)


def _gpt(config: RMTConfig, tcfg, layer_spec, pre_process: bool, post_process: bool, vp_stage) -> GPTModel:
    m = config.model
    return GPTModel(
        config=tcfg,
        transformer_layer_spec=with_sequence_parallel_norms(layer_spec, tcfg, vp_stage),
        vocab_size=padded_vocab_size(config),
        max_sequence_length=m.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type=_POSITIONS[m.position],
        vp_stage=vp_stage,
    )
