"""rmt's models as ``transformers`` classes (``trust_remote_code=True``): every architecture and
memory type that has no standard Hugging Face match (RMT, UltraMem / PKM / MoE, recurrent
transformers, mixers, and the RMSNorm transformer).

:class:`RMTForCausalLM` wraps rmt's own module: its config carries the checkpoint's full rmt
config, and building it rebuilds the model with :func:`rmt.models.build.build` on one process
(a one-process gloo group and megatron-core's parallel state are initialised where none
exist, and kept: megatron's layers read them at every forward). The exported directory's
``modeling_rmt.py`` and ``configuration_rmt.py`` re-export these classes, so loading needs rmt
installed. A self-contained copy is not offered: the models are megatron-core modules with
rmt's kernels (and their plain-torch fallbacks), whose copy would duplicate and drift from the
code they were trained with; the wrapper runs exactly that code, which is what makes its
logits equal rmt's.

Forward takes right-padded batches (every rmt architecture is causal; a row's padding never
reaches its real tokens, except the recurrent transformer, whose last block depends on the
padded length) and no KV cache: ``generate`` recomputes the sequence at every step, as
``rmt-generate --no-cache`` does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class RMTHFConfig(PreTrainedConfig):
    """``rmt``: the checkpoint's rmt config (``to_dict`` form) and the tokenizer's vocabulary."""

    model_type = "rmt"

    def __init__(self, rmt: Optional[dict] = None, **kwargs):
        self.rmt = rmt
        if rmt is not None:  # the sizes transformers' generic code reads
            m = rmt["model"]
            kwargs.setdefault("vocab_size", m["vocab_size"])
            kwargs.setdefault("max_position_embeddings", m["seq_length"])
            kwargs.setdefault("num_hidden_layers", m["num_layers"])
            kwargs.setdefault("hidden_size", m["hidden_size"])
            kwargs.setdefault("num_attention_heads", m["num_attention_heads"])
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", False)  # no KV cache: generate recomputes
        super().__init__(**kwargs)


def build_rmt_module(rmt: dict) -> torch.nn.Module:
    """rmt's model of ``rmt`` (a ``to_dict`` config) on one process."""
    from megatron.core import parallel_state

    from rmt import parallel
    from rmt.config import from_dict
    from rmt.config_checks import validate
    from rmt.models.build import build

    data = {
        **rmt,
        "parallel": {
            **rmt["parallel"],
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            "data_parallel_size": None,
            "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": None,
        },
    }
    config = validate(from_dict(data), 1)
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(config)
    if (
        parallel_state.get_tensor_model_parallel_world_size() != 1
        or parallel_state.get_pipeline_model_parallel_world_size() != 1
    ):
        raise ValueError(
            "an exported rmt model runs on one process; this process already holds a model-parallel layout"
        )
    return build(config)[0]


class RMTForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM over rmt's module: ``forward(input_ids, attention_mask=None, labels=None)``
    returns the logits over the tokenizer's vocabulary (and the shifted cross-entropy with
    ``labels``, -100 ignored)."""

    config_class = RMTHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: RMTHFConfig):
        super().__init__(config)
        # transformers builds under a meta-device context to skip allocation; rmt's build
        # initialises its weights through the sharded state dict, which needs real tensors
        with torch.device("cpu"):
            self.model = build_rmt_module(config.rmt)
        # transformers empties non-persistent buffers (ALiBi slopes, ...) while loading and
        # leaves them to _init_weights: their values as built, by module
        self._built_buffers = {
            id(mod): {n: b.clone() for n, b in mod.named_buffers(recurse=False) if n in mod._non_persistent_buffers_set}
            for mod in self.modules()
        }
        self.post_init()

    def state_dict(self, *args, **kwargs):
        """The tensors of the state dict: megatron's ``_extra_state`` entries (None, no tensor)
        left out, as the exported weights leave them out."""
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if isinstance(v, torch.Tensor)}

    def _init_weights(self, module):
        """Weights come from rmt's own init (:func:`rmt.models.build.build`) or the checkpoint;
        non-persistent buffers get back their built values."""
        for name, value in self._built_buffers.get(id(module), {}).items():
            module._buffers[name] = value.to(module._buffers[name].device).clone()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> CausalLMOutput:
        from rmt.decoding import positions
        from rmt.models.documents import causal_mask

        if (
            attention_mask is not None
            and attention_mask.shape[1] > 1
            and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any())
        ):
            raise ValueError("rmt models take right-padded batches only (an attention_mask of ones, then zeros)")
        b, s = input_ids.shape
        logits = self.model(input_ids, positions(0, s, b, input_ids.device), causal_mask(s, input_ids.device))
        logits = logits[..., : self.config.vocab_size].float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole sequence at every step (no cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
