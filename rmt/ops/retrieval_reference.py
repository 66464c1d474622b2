"""Plain-torch reference of the fused retrieval op's selection (:mod:`rmt.ops.fused_retrieval`):
the semantics every backend implements, streamed as a kernel streams them.

For each block of ``token_block`` tokens and each grid side, the keys are read in tiles of
``key_tile``; a tile's side scores ``[Tb, H, r, tile]`` are computed (the product ``q . k`` of the
inputs widened to the accumulation dtype, rounded once to the inputs' dtype), and only the running candidates stay:
product keys, the m best scores; TDQKR, the m largest and the m smallest rank-1 objectives
(Eq. 8-9), each with its r side scores (all keys while ``2m >= n``). Merging keeps the tie rule of
:mod:`rmt.ops.topm`: the running lists hold lower key indices than the tile, so in the
concatenation ``[list, tile]`` equal values stand in index order (the m largest), and in
``[tile reversed, list]`` in reverse index order (the m smallest). The exact grid top-m over the
candidates (:func:`rmt.ops.topm.grid_topm`) finishes the block. Nothing of size ``[T, H, r, n]``
is held: one tile's scores and ``O(T H r m)`` candidates.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .reference import acc_dtype
from .topm import grid_topm, ordered_topm, rank1_objective


def is_available(device) -> bool:
    """The reference runs on every device."""
    return True


def _top(o, idx, s, m):
    """The first ``min(m, len)`` of (o, idx, s) in the tie rule's order (positions in index order
    among equal values)."""
    _, pos = ordered_topm(o, min(m, o.shape[-1]))
    return o.gather(-1, pos), idx.gather(-1, pos), s.gather(-1, pos.unsqueeze(2).expand(-1, -1, s.shape[2], -1))


def _bottom(o, idx, s, m):
    """The last ``min(m, len)`` of the order, smallest first (positions in reverse index order
    among equal values)."""
    neg, pos = ordered_topm(-o, min(m, o.shape[-1]))
    return -neg, idx.gather(-1, pos), s.gather(-1, pos.unsqueeze(2).expand(-1, -1, s.shape[2], -1))


class _SideStream:
    """The running candidates of one grid side for one token block."""

    def __init__(self, w: Optional[torch.Tensor], m: int, n: int):
        self.w, self.m = w, m
        self.keep_all = w is not None and 2 * m >= n
        self.top = self.bottom = None

    def add(self, s: torch.Tensor, idx: torch.Tensor) -> None:
        """Merge a tile: scores ``s [Tb, H, r, tile]`` (accumulation dtype) of keys ``idx``."""
        o = s[:, :, 0] if self.w is None else rank1_objective(s, self.w)
        idx = idx.expand(o.shape)
        if self.keep_all:
            self.top = (o, idx, s) if self.top is None else tuple(torch.cat(p, -1) for p in zip(self.top, (o, idx, s)))
            return
        merged = (o, idx, s) if self.top is None else tuple(torch.cat(p, -1) for p in zip(self.top, (o, idx, s)))
        self.top = _top(*merged, self.m)
        if self.w is not None:
            flipped = (o.flip(-1), idx.flip(-1), s.flip(-1))
            if self.bottom is not None:
                flipped = tuple(torch.cat(p, -1) for p in zip(flipped, self.bottom))
            self.bottom = _bottom(*flipped, self.m)

    def candidates(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Key indices ``[Tb, H, c]`` and side scores ``[Tb, H, r, c]``."""
        if self.bottom is None:
            return self.top[1], self.top[2]
        return torch.cat([self.top[1], self.bottom[1]], -1), torch.cat([self.top[2], self.bottom[2]], -1)


KEY_TILE = 1024


def select(q_row, q_col, keys, m, selector=None, key_tile=None, token_block=None):
    """The fused op's selection (its contract: :mod:`rmt.ops.fused_retrieval`): grid addresses
    ``[T, H, m]`` (int64, best first) and the side scores at them ``[T, H, 2, r, m]`` in the
    inputs' dtype. ``key_tile`` None: :data:`KEY_TILE`; ``token_block`` None: all tokens in one
    block."""
    T, H, r, D = q_row.shape
    n = keys.shape[3]
    acc = acc_dtype(keys.dtype)
    key_tile = key_tile or KEY_TILE
    core = None if selector is None else selector[0]
    weights = (None, None) if selector is None else (selector[1], selector[2])
    step = token_block or max(T, 1)
    addrs, sels = [], []
    for t0 in range(0, T, step):
        sides = []
        for side, q in enumerate((q_row, q_col)):
            stream = _SideStream(weights[side], m, n)
            qb = q[t0 : t0 + step].to(acc)
            for j0 in range(0, n, key_tile):
                tile = keys[:, side, :, j0 : j0 + key_tile].to(acc)
                s = torch.einsum("thad,hajd->thaj", qb, tile).to(keys.dtype).to(acc)
                stream.add(s, torch.arange(j0, j0 + tile.shape[2], device=keys.device))
            sides.append(stream.candidates())
        addr, sel = grid_topm(*sides[0], *sides[1], m, n, core)
        addrs.append(addr)
        sels.append(sel.to(keys.dtype))
    if not addrs:
        return keys.new_zeros(0, H, m, dtype=torch.int64), keys.new_zeros(0, H, 2, r, m)
    return torch.cat(addrs), torch.cat(sels)
