"""Whether a checkpoint holds the model a command asks for.

Resuming, evaluating or generating loads a checkpoint into the model the current settings
describe. Most contradictions also change a tensor's shape or name, which the load rejects, but
several do not (attention heads over the same width, RoPE vs ALiBi, the mixer kind, the
retrieval's top-m, ...) and would run the checkpoint's weights as another model. So the
settings that define the model are compared with the config saved in the checkpoint first, and
any difference is one sentence naming the key. Settings of the run rather than the model
(parallel layout, table partition, optimizer, learning rates, dropout, sequence length for
position-free models) may change.
"""

from __future__ import annotations

from typing import Optional

from rmt.config import RMTConfig

MODEL_KEYS = {
    "model": (
        "arch",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
        "make_vocab_size_divisible_by",
        "position",
        "normalization",
        "block_width",
        "recurrent_alpha_learned",
        "mixer_kind",
        "mixer_decay",
        "dk",
        "dv",
        "rank",
    ),
    "memory": (
        "type",
        "placement",
        "num_heads",
        "topk",
        "key_dim",
        "num_keys",
        "retrieval",
        "tucker_rank",
        "num_cores",
        "ive_blocks",
        "ive_shuffle",
        "softmax",
        "half_value_dim",
        "share_query",
        "query_key_norm",
        "query_conv",
        "conv_kernel",
        "num_experts",
        "moe_topk",
        "expert_hidden_size",
        "moe_placement",
    ),
}
# null means "derived": compared only when both sides name a value
_DERIVED = {"model.ffn_hidden_size", "memory.expert_hidden_size", "model.vocab_size"}


def model_difference(config: RMTConfig, saved: dict, where: str) -> Optional[str]:
    """One sentence for the first model-defining key whose value in ``config`` differs from the
    checkpoint's saved config ``saved`` (a :func:`rmt.config.to_dict`), else None."""
    for section, keys in MODEL_KEYS.items():
        for key in keys:
            name = f"{section}.{key}"
            ours = getattr(getattr(config, section), key)
            theirs = saved.get(section, {}).get(key, ours)
            if name in _DERIVED and (ours is None or theirs is None):
                continue
            if ours != theirs:
                return (
                    f"{name} is {ours!r} here but {theirs!r} in checkpoint '{where}', which holds "
                    f"another model; a checkpoint cannot change its model (train another in a new "
                    f"train.save directory)"
                )
    return None
