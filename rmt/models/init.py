"""Layout-independent weight initialisation.

Each random global tensor is drawn in full from a generator seeded by (seed, key) and every
rank copies out its own shard, so TP/PP/DP layouts start from identical weights (the basis of
the 'distributed == single process' tests and of reproducible runs across cluster shapes). One
global tensor exists at a time. Constant-initialised tensors (biases, norm gains) and memory
value tables, which draw only their own shard from a counter-based stream
(:class:`rmt.memory.table.MemoryTable`), are left as the modules built them (the rule returns
None for them).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch

from rmt.config import RMTConfig
from rmt.parallel.sharding import shards

# Output projections of residual branches get std / sqrt(2 L) (GPT-2; megatron-core's
# scaled_init_method_normal).
_RESIDUAL_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


# The token and position embedding tables: megatron-core's GPT and the RMT name them
# word_/position_embeddings, the recurrent transformer and the mixer embedding /
# position_embedding.
EMBEDDING_TABLES = ("word_embeddings.weight", "position_embeddings.weight", "embedding.weight")


def embedding_std(config: RMTConfig) -> float:
    """The embedding tables' init std: ``model.embedding_init_std``, else ``model.init_std``."""
    m = config.model
    return m.init_std if m.embedding_init_std is None else m.embedding_init_std


def default_std_rule(config: RMTConfig) -> Callable[[str, torch.Tensor], Optional[float]]:
    std = config.model.init_std
    scaled = std / math.sqrt(2.0 * config.model.num_layers)
    embeddings = embedding_std(config)

    def rule(key: str, param: torch.Tensor) -> Optional[float]:
        if param.dim() < 2:
            return None
        if key.endswith(EMBEDDING_TABLES):
            return embeddings
        return scaled if key.endswith(_RESIDUAL_OUTPUTS) else std

    return rule


_OWN_STD = "_rmt_init_std"


def set_init_std(param: torch.Tensor, std: Optional[float]) -> torch.Tensor:
    """Give ``param`` an init std of its own, which :func:`initialize_weights` uses instead of
    the std rule's (None: keep the values its module built). Memory layers set it where their
    papers give each parameter its own scale."""
    setattr(param, _OWN_STD, std)
    return param


def std_of(param: torch.Tensor, key: str, std_rule: Callable[[str, torch.Tensor], Optional[float]]) -> Optional[float]:
    """The init std of ``param`` (global name ``key``): its own (:func:`set_init_std`), else the rule's."""
    return getattr(param, _OWN_STD) if hasattr(param, _OWN_STD) else std_rule(key, param)


@torch.no_grad()
def initialize_weights(
    chunks: Iterable[torch.nn.Module], seed: int, std_rule: Callable[[str, torch.Tensor], Optional[float]]
) -> None:
    by_key = defaultdict(list)  # layers stacked under one global key share its draw
    for shard in shards(chunks):
        std = std_of(shard.param, shard.key, std_rule)
        if std is not None:
            by_key[shard.key].append((shard, std))
    for key, pieces in by_key.items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        full = torch.randn(pieces[0][0].global_shape, generator=gen)
        for shard, std in pieces:
            piece = full[shard.index] * std
            shard.param.copy_(piece.reshape(shard.param.shape).to(shard.param.dtype))
