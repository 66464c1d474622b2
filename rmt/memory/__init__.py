"""Sparse memory layers: UltraMem (arXiv 2411.12364), PKM (Lample et al. 2019) and an MoE
baseline (megatron-core's MoELayer), pluggable into any architecture at skip placements ``i:j``
(see :mod:`.attach`); the MoE also as the MLP of chosen transformer layers (:mod:`.moe`)."""

from .attach import attach_memory, build_memory_layer, memory_modules, pop_aux_loss, pop_memory_stats
from .layer import MemoryLayer, MemorySpec
from .moe import MoE, SkipMoE
from .optim import ValueLRScheduler, split_value_group, value_lr_multiplier
from .table import MemoryTable
from .validate import parse_placement, validate_memory

__all__ = ["MemoryLayer", "MemorySpec", "MemoryTable", "MoE", "SkipMoE", "ValueLRScheduler", "attach_memory",
           "build_memory_layer", "memory_modules", "parse_placement", "pop_aux_loss", "pop_memory_stats",
           "split_value_group", "validate_memory", "value_lr_multiplier"]
