"""Sparse memory layers: UltraMem (arXiv 2411.12364), PKM (Lample et al. 2019) and an MoE
baseline (megatron-core's MoELayer), pluggable into any architecture at skip placements ``i:j``
(see :mod:`.attach`); the MoE also as the MLP of chosen transformer layers (:mod:`.moe`).

The names below are imported on first use, so that the light modules of this package (the
config checks and the shapes, which the CLIs read before any work) do not import torch."""

import importlib

_WHERE = {
    "attach_memory": "attach",
    "build_memory_layer": "attach",
    "memory_modules": "attach",
    "pop_aux_loss": "attach",
    "pop_memory_stats": "attach",
    "MemoryLayer": "layer",
    "MemorySpec": "layer",
    "MoE": "moe",
    "SkipMoE": "moe",
    "ValueLRScheduler": "optim",
    "split_value_group": "optim",
    "value_lr_multiplier": "optim",
    "MemoryTable": "table",
    "parse_placement": "shapes",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"rmt.memory.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rmt.memory' has no attribute '{name}'")
