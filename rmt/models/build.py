"""Architecture registry: ``model.arch`` -> a builder of one pipeline chunk.

A builder is ``fn(config, pre_process, post_process, vp_stage) -> torch.nn.Module``. The module's
``forward(input_ids, position_ids, attention_mask)`` returns vocab-parallel logits
``[batch, seq, vocab / tp]`` on the last stage and hidden states elsewhere, and it supports
megatron-core's ``set_input_tensor`` for pipeline parallelism.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List

import torch
from megatron.core import parallel_state

from rmt.config import RMTConfig
from rmt.models.init import default_std_rule, initialize_weights

_BUILDERS: Dict[str, Callable] = {}
_STD_RULES: Dict[str, Callable] = {}
_VALIDATORS: Dict[str, Callable] = {}
# Modules that register architectures when imported.
_ARCH_MODULES = ("rmt.models.transformer", "rmt.models.rmt", "rmt.models.mixer", "rmt.models.recurrent")


def register(name: str, std_rule: Callable = default_std_rule, validate: Callable = None):
    """Register a chunk builder. ``std_rule(config)(key, param)`` gives the init std of each
    global parameter (None keeps the module's own constant init, see :mod:`rmt.models.init`);
    ``validate(config)`` raises ``ConfigError`` for settings this architecture cannot take."""

    def deco(fn):
        _BUILDERS[name] = fn
        _STD_RULES[name] = std_rule
        if validate is not None:
            _VALIDATORS[name] = validate
        return fn

    return deco


def registered_archs() -> List[str]:
    for mod in _ARCH_MODULES:
        importlib.import_module(mod)
    return sorted(_BUILDERS)


def validate_arch(config: RMTConfig) -> None:
    """Run the architecture's own checks (``model.arch`` must be registered)."""
    registered_archs()
    check = _VALIDATORS.get(config.model.arch)
    if check is not None:
        check(config)


def build(config: RMTConfig) -> List[torch.nn.Module]:
    """The model chunks of this rank (one, or one per virtual pipeline stage), initialised
    identically under every parallel layout."""
    registered_archs()
    builder = _BUILDERS[config.model.arch]
    vpp = config.parallel.virtual_pipeline_model_parallel_size
    if vpp is None:
        chunks = [
            builder(config, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage(), None)
        ]
    else:
        chunks = [
            builder(
                config,
                parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                i,
            )
            for i in range(vpp)
        ]
    std_rule = _STD_RULES[config.model.arch](config)
    if config.memory.type != "none":
        from rmt.memory.attach import attach_memory

        std_rule = attach_memory(chunks, config, std_rule)
    initialize_weights(chunks, config.train.seed, std_rule)
    return chunks
