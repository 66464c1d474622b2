"""Hugging Face model directories as starting weights (``train.load=HF_DIR``): an ``rmt-export``
directory of any architecture, or a standard GPT-2 / GPT-NeoX checkpoint whose layers match
rmt's transformer baseline (:mod:`rmt.export.standard`, the inverse maps).

The directory's model is described as an rmt config (its ``rmt_config.json`` or ``rmt`` entry,
else derived from the standard config) and compared with the run's model by the same check as a
checkpoint (:func:`rmt.training.same_model.model_difference`); activation and norm epsilon are
compared too. Weights are read per tensor from the safetensors files and copied into the
run's parameters; the vocabulary rows that ``make_vocab_size_divisible_by`` pads are zero.
Optimizer state, step and data position start afresh. The run's model must be whole on every
rank (tensor, pipeline and expert parallel size 1; data parallelism is fine).
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

from rmt.errors import CheckpointMismatch, UserError

if TYPE_CHECKING:
    import torch

STANDARD = ("gpt2", "gpt_neox")


def is_hf_directory(path: Optional[str]) -> bool:
    """A directory with a ``config.json`` and safetensors weights (not an rmt save root)."""
    return (
        bool(path)
        and os.path.isfile(os.path.join(path, "config.json"))
        and bool(glob.glob(os.path.join(path, "*.safetensors")))
    )


def _hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: Dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(file))
    return out


def described_model(path: str) -> Tuple[dict, Optional[str], Optional[float]]:
    """``(saved config, activation, layernorm epsilon)`` of the directory's model: the rmt config
    an ``rmt-export`` carries, else the model section a standard config implies (with its
    activation and epsilon, which the model check does not cover)."""
    from rmt.export.standard import HF_ACTIVATIONS

    cfg = _hf_config(path)
    kind = cfg.get("model_type")
    if kind == "rmt":
        return cfg["rmt"], None, None
    if kind not in STANDARD:
        raise UserError(
            f"Hugging Face model '{path}' is a '{kind}', which no rmt architecture matches "
            f"(rmt imports gpt2, gpt_neox and its own exports)"
        )
    rmt_act = {hf: ours for ours, hf in HF_ACTIVATIONS.items()}
    rmt_act["gelu_new"] = "gelu_tanh"  # GPT-2's own name for the tanh approximation
    if kind == "gpt2":
        model = {
            "arch": "transformer",
            "position": "learned",
            "normalization": "LayerNorm",
            "num_layers": cfg["n_layer"],
            "hidden_size": cfg["n_embd"],
            "num_attention_heads": cfg["n_head"],
            "ffn_hidden_size": cfg.get("n_inner") or 4 * cfg["n_embd"],
            "vocab_size": cfg["vocab_size"],
        }
        act, eps = cfg.get("activation_function", "gelu_new"), cfg.get("layer_norm_epsilon", 1e-5)
        if cfg.get("tie_word_embeddings", True):
            raise UserError(
                f"Hugging Face model '{path}' ties its input and output embeddings, which rmt's transformer keeps apart"
            )
    else:
        rope = cfg.get("rope_parameters") or {}
        if (
            cfg.get("use_parallel_residual", True)
            or rope.get("partial_rotary_factor", 1.0) != 1.0
            or rope.get("rope_type", "default") != "default"
            or rope.get("rope_theta", 10000.0) != 10000.0
        ):
            raise UserError(
                f"Hugging Face model '{path}' uses parallel residuals or rotary embeddings other than "
                f"rmt's (whole head, base 10000)"
            )
        model = {
            "arch": "transformer",
            "position": "rope",
            "normalization": "LayerNorm",
            "num_layers": cfg["num_hidden_layers"],
            "hidden_size": cfg["hidden_size"],
            "num_attention_heads": cfg["num_attention_heads"],
            "ffn_hidden_size": cfg["intermediate_size"],
            "vocab_size": cfg["vocab_size"],
        }
        act, eps = cfg.get("hidden_act", "gelu"), cfg.get("layer_norm_eps", 1e-5)
    if act not in rmt_act:
        raise UserError(f"Hugging Face model '{path}' uses activation '{act}', which rmt does not have")
    return {"model": model, "memory": {"type": "none"}}, rmt_act[act], eps


def rmt_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """The directory's weights under rmt's single-process keys (vocabulary rows unpadded)."""
    cfg, w = _hf_config(path), _tensors(path)
    kind = cfg["model_type"]
    if kind == "rmt":
        return {k.removeprefix("model."): v for k, v in w.items()}
    out: Dict[str, torch.Tensor] = {}
    if kind == "gpt2":
        heads, layers = cfg["n_head"], cfg["n_layer"]
        w = {k.removeprefix("transformer."): v for k, v in w.items()}
        out["embedding.word_embeddings.weight"] = w["wte.weight"]
        out["embedding.position_embeddings.weight"] = w["wpe.weight"]
        for i in range(layers):
            p, q = f"h.{i}.", f"decoder.layers.{i}."
            for hf, ours, conv in (
                ("ln_1", "input_layernorm", False),
                ("attn.c_proj", "self_attention.linear_proj", True),
                ("ln_2", "pre_mlp_layernorm", False),
                ("mlp.c_fc", "mlp.linear_fc1", True),
                ("mlp.c_proj", "mlp.linear_fc2", True),
            ):
                out[q + ours + ".weight"] = w[p + hf + ".weight"].t() if conv else w[p + hf + ".weight"]
                out[q + ours + ".bias"] = w[p + hf + ".bias"]
            qkv, bias = w[p + "attn.c_attn.weight"].t(), w[p + "attn.c_attn.bias"]
            # [all q, all k, all v] -> megatron's per-head [q_h, k_h, v_h]
            out[q + "self_attention.linear_qkv.weight"] = (
                qkv.reshape(3, heads, -1, qkv.shape[1]).transpose(0, 1).reshape(qkv.shape)
            )
            out[q + "self_attention.linear_qkv.bias"] = bias.reshape(3, heads, -1).transpose(0, 1).reshape(bias.shape)
        out["decoder.final_layernorm.weight"], out["decoder.final_layernorm.bias"] = w["ln_f.weight"], w["ln_f.bias"]
        out["output_layer.weight"] = w["lm_head.weight"]
    else:
        w = {k.removeprefix("gpt_neox."): v for k, v in w.items()}
        out["embedding.word_embeddings.weight"] = w["embed_in.weight"]
        for i in range(cfg["num_hidden_layers"]):
            p, q = f"layers.{i}.", f"decoder.layers.{i}."
            for hf, ours in (
                ("input_layernorm", "input_layernorm"),
                ("attention.query_key_value", "self_attention.linear_qkv"),
                ("attention.dense", "self_attention.linear_proj"),
                ("post_attention_layernorm", "pre_mlp_layernorm"),
                ("mlp.dense_h_to_4h", "mlp.linear_fc1"),
                ("mlp.dense_4h_to_h", "mlp.linear_fc2"),
            ):
                out[q + ours + ".weight"], out[q + ours + ".bias"] = w[p + hf + ".weight"], w[p + hf + ".bias"]
        out["decoder.final_layernorm.weight"] = w["final_layer_norm.weight"]
        out["decoder.final_layernorm.bias"] = w["final_layer_norm.bias"]
        out["output_layer.weight"] = w.get("lm_head.weight", w.get("embed_out.weight"))
    return out


def load_hf_directory(path: str, chunks, model_problem: Optional[Callable[[dict, str], Optional[str]]] = None) -> None:
    """Copy the weights of the Hugging Face directory ``path`` into ``chunks`` (one sentence,
    a ``CheckpointMismatch``, when it holds another model)."""
    import torch
    from megatron.core import parallel_state

    from rmt.models.activation import ACTIVATIONS

    if (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    ) != (1, 1, 1):
        raise UserError(
            f"train.load of the Hugging Face model '{path}' needs the model whole on every rank: set "
            f"parallel.tensor_model_parallel_size, pipeline_model_parallel_size and "
            f"expert_model_parallel_size to 1 (data parallelism is fine)"
        )
    saved, act, eps = described_model(path)
    problem = model_problem(saved, path) if model_problem is not None else None
    module = getattr(chunks[0], "module", chunks[0])
    tconfig = getattr(module, "config", None)
    if problem is None and act is not None and tconfig is not None and tconfig.activation_func is not ACTIVATIONS[act]:
        problem = f"Hugging Face model '{path}' uses activation '{act}', another than this model's"
    if problem is None and eps is not None and tconfig is not None and tconfig.layernorm_epsilon != eps:
        problem = (
            f"model.layernorm_epsilon is {tconfig.layernorm_epsilon} here but {eps} in Hugging Face model '{path}'"
        )
    if problem is not None:
        raise CheckpointMismatch(problem)
    state = rmt_state_dict(path)
    target = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    if missing or unexpected:
        raise CheckpointMismatch(
            f"Hugging Face model '{path}' does not fit this model (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    filled = {}
    for key, ours in target.items():
        theirs = state[key]
        if theirs.shape != ours.shape:
            padded = theirs.dim() == 2 and theirs.shape[1] == ours.shape[1] and theirs.shape[0] < ours.shape[0]
            if not (padded and key.endswith(("word_embeddings.weight", "output_layer.weight"))):
                raise CheckpointMismatch(
                    f"Hugging Face model '{path}' does not fit this model ({key} is "
                    f"{list(theirs.shape)} there but {list(ours.shape)} here)"
                )
            theirs = torch.cat([theirs, theirs.new_zeros(ours.shape[0] - theirs.shape[0], ours.shape[1])])
        filled[key] = theirs.to(ours.dtype)
    module.load_state_dict(filled, strict=False)
