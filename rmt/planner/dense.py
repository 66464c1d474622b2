"""Bytes per dense parameter on a rank, by precision and optimizer, as megatron-core holds them.

The dense parameters (everything but the memory value tables) live in megatron's DDP buffers and
its optimizer (:mod:`rmt.training.optimizer`). Per parameter element on a rank:

========================  ==================  =====================================
                          plain optimizer     ``train.distributed_optimizer``
========================  ==================  =====================================
parameter                 4 (fp32), 2 (bf16)  the same
gradient (``main_grad``)  4                   4 (reduced in fp32 then scattered)
fp32 main copy            0 (fp32), 4 (bf16)  0 (fp32), 4 / DP (bf16)
Adam's two moments        8                   8 / DP
========================  ==================  =====================================

so fp32 costs 16 bytes (plain) or 8 + 8 / DP; bf16 18 or 6 + 12 / DP (megatron's own table of
the distributed optimizer). The gradient buffer (and, with the distributed optimizer, the
parameter buffer) is padded: every bucket to a multiple of lcm(DP, 128) elements, every
parameter's start to a multiple of 64; the shards of the optimizer state cover the parameters'
elements only, so their total over the data-parallel ranks is exactly the plain optimizer's.
"""

from __future__ import annotations

from typing import Dict


def dense_bytes_per_param(precision: str, distributed_optimizer: bool, dp: int) -> Dict[str, float]:
    """Bytes per dense parameter element on one rank, by kind (see the module's table)."""
    bf16 = precision == "bf16"
    shard = dp if distributed_optimizer else 1
    return {
        "param": 2.0 if bf16 else 4.0,
        "grad": 4.0,
        "main_param": (4.0 / shard) if bf16 else 0.0,
        "exp_avg": 4.0 / shard,
        "exp_avg_sq": 4.0 / shard,
    }
