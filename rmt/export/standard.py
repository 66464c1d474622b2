"""The transformer baseline as a standard Hugging Face architecture, loadable by
``AutoModelForCausalLM.from_pretrained`` without custom code.

rmt's baseline is megatron-core's GPTModel with its local layer spec: pre-norm LayerNorm (or
RMSNorm), self-attention with one fused QKV projection, a two-matrix MLP, biases on every
linear layer, untied input and output embeddings, and learned absolute positions or RoPE
(base 10000, over the whole head, halves rotated: megatron's defaults). Two standard
architectures have exactly these layer semantics:

* learned positions + LayerNorm -> **GPT-2** (``GPT2LMHeadModel``; ``tie_word_embeddings``
  false, the activation by name: ``gelu`` erf, ``gelu_pytorch_tanh``, ``relu``, ``silu``);
* RoPE + LayerNorm -> **GPT-NeoX** (``GPTNeoXForCausalLM`` with ``use_parallel_residual``
  false, ``partial_rotary_factor`` 1).

RMSNorm has no standard match among them (Llama-family models use RMSNorm but a gated MLP and
no biases) and is refused, as is the MoE-MLP variant; both export through the
``trust_remote_code`` route instead.

Weight layouts. megatron's ``linear_qkv`` rows are grouped per head, ``[q_h, k_h, v_h]`` of
``head_dim`` rows each (one query group per head: rmt builds no grouped-query attention); this is
GPT-NeoX's ``query_key_value`` layout as it is, while GPT-2's ``c_attn`` wants all queries, then
all keys, then all values, and is a ``Conv1D`` (weights stored ``[in, out]``). The vocabulary is
the tokenizer's (``model.vocab_size``): the rows ``make_vocab_size_divisible_by`` pads are
dropped, so logits equal rmt's first ``vocab_size`` columns.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from rmt.config import RMTConfig
from rmt.errors import UserError
from rmt.models.activation import activation_name

#: rmt's activation name -> the name transformers' ACT2FN computes identically.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "silu": "silu"}


def standard_architecture(config: RMTConfig) -> str:
    """``gpt2`` or ``gpt_neox`` for a transformer baseline, or a one-sentence UserError."""
    m = config.model
    if m.arch != "transformer" or config.memory.type != "none":
        raise UserError(
            f"only the plain transformer baseline exports as a standard architecture (this is "
            f"model.arch '{m.arch}' with memory.type '{config.memory.type}'); export it with --format remote"
        )
    if m.normalization != "LayerNorm":
        raise UserError(
            f"no standard Hugging Face architecture matches model.normalization '{m.normalization}' with "
            f"a biased GELU MLP (GPT-2 and GPT-NeoX use LayerNorm); export it with --format remote"
        )
    return {"learned": "gpt2", "rope": "gpt_neox"}[m.position]


def hf_config(config: RMTConfig, eod: int):
    """The ``transformers`` config of the standard architecture of ``config``."""
    from transformers import GPT2Config, GPTNeoXConfig

    m = config.model
    common = dict(
        vocab_size=m.vocab_size, bos_token_id=eod, eos_token_id=eod, tie_word_embeddings=False, architectures=None
    )
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    act = HF_ACTIVATIONS[activation_name(config)]
    if standard_architecture(config) == "gpt2":
        cfg = GPT2Config(
            n_positions=m.seq_length,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_attention_heads,
            n_inner=ffn,
            activation_function=act,
            layer_norm_epsilon=m.layernorm_epsilon,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            scale_attn_weights=True,
            **common,
        )
        cfg.architectures = ["GPT2LMHeadModel"]
    else:
        cfg = GPTNeoXConfig(
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads,
            intermediate_size=ffn,
            hidden_act=act,
            max_position_embeddings=m.seq_length,
            layer_norm_eps=m.layernorm_epsilon,
            use_parallel_residual=False,
            attention_bias=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            **common,
        )
        cfg.architectures = ["GPTNeoXForCausalLM"]
    return cfg


def _heads_to_blocks(w: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron's per-head ``[q_h, k_h, v_h]`` rows -> ``[all q, all k, all v]``."""
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def hf_state_dict(config: RMTConfig, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """megatron GPTModel weights (single-process keys) -> the standard architecture's."""
    m = config.model
    v, heads = m.vocab_size, m.num_attention_heads
    w = {k: t for k, t in weights.items() if not k.endswith("_extra_state")}
    out: Dict[str, torch.Tensor] = {}
    gpt2 = standard_architecture(config) == "gpt2"

    def layer(i: int, name: str) -> torch.Tensor:
        return w[f"decoder.layers.{i}.{name}"]

    if gpt2:
        out["transformer.wte.weight"] = w["embedding.word_embeddings.weight"][:v]
        out["transformer.wpe.weight"] = w["embedding.position_embeddings.weight"]
        names: Tuple[Tuple[str, str, bool], ...] = (
            ("ln_1", "input_layernorm", False),
            ("attn.c_proj", "self_attention.linear_proj", True),
            ("ln_2", "pre_mlp_layernorm", False),
            ("mlp.c_fc", "mlp.linear_fc1", True),
            ("mlp.c_proj", "mlp.linear_fc2", True),
        )
        for i in range(m.num_layers):
            p = f"transformer.h.{i}."
            for hf, mg, conv in names:
                out[p + hf + ".weight"] = layer(i, mg + ".weight").t() if conv else layer(i, mg + ".weight")
                out[p + hf + ".bias"] = layer(i, mg + ".bias")
            out[p + "attn.c_attn.weight"] = _heads_to_blocks(layer(i, "self_attention.linear_qkv.weight"), heads).t()
            out[p + "attn.c_attn.bias"] = _heads_to_blocks(layer(i, "self_attention.linear_qkv.bias"), heads)
        out["transformer.ln_f.weight"] = w["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = w["decoder.final_layernorm.bias"]
        out["lm_head.weight"] = w["output_layer.weight"][:v]
    else:
        out["gpt_neox.embed_in.weight"] = w["embedding.word_embeddings.weight"][:v]
        names = (
            ("input_layernorm", "input_layernorm", False),
            ("attention.query_key_value", "self_attention.linear_qkv", False),
            ("attention.dense", "self_attention.linear_proj", False),
            ("post_attention_layernorm", "pre_mlp_layernorm", False),
            ("mlp.dense_h_to_4h", "mlp.linear_fc1", False),
            ("mlp.dense_4h_to_h", "mlp.linear_fc2", False),
        )
        for i in range(m.num_layers):
            p = f"gpt_neox.layers.{i}."
            for hf, mg, _ in names:
                out[p + hf + ".weight"] = layer(i, mg + ".weight")
                out[p + hf + ".bias"] = layer(i, mg + ".bias")
        out["gpt_neox.final_layer_norm.weight"] = w["decoder.final_layernorm.weight"]
        out["gpt_neox.final_layer_norm.bias"] = w["decoder.final_layernorm.bias"]
        out["lm_head.weight"] = w["output_layer.weight"][:v]
    return {k: t.detach().float().contiguous().clone() for k, t in out.items()}
