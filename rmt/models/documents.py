"""Document boundaries inside packed sequences (``data.reset_attention_mask``).

megatron-core's GPTDataset marks them with a per-sample block-causal attention mask ``[b, 1,
s, s]`` (True = masked: no token sees a token before the end-of-document token that precedes
it). The transformer and the RMT apply that mask in attention. Models whose token mixing is
indexed by position rather than masked attention (the recurrent transformer's block windows, the
mixers' position-indexed mixing weights) instead run each document as a sequence of its own,
from position 0, which is exactly the per-document computation; UltraMem's causal query
convolution skips the taps that reach into the previous document.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

#: Attribute that marks a mask made by :func:`causal_mask`: one document per row.
SINGLE_DOCUMENT = "rmt_single_document"


def causal_mask(length: int, device) -> torch.Tensor:
    """``[1, 1, s, s]`` boolean mask, True above the diagonal (megatron-core's convention): every
    row one document. Marked (:data:`SINGLE_DOCUMENT`) so that :func:`document_starts` knows it
    without reading it, a wait for the device on a GPU. Always passed explicitly: megatron
    builds an implicit one on CUDA."""
    mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]
    setattr(mask, SINGLE_DOCUMENT, True)
    return mask


def document_starts(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[b, s]``: the position where each token's document starts (its row's first unmasked
    column), or None when every row is one document (a plain causal mask, or none). Reading
    another mask waits for the device on a GPU; one made by :func:`causal_mask` is not read."""
    if attention_mask is None or getattr(attention_mask, SINGLE_DOCUMENT, False):
        return None
    s = attention_mask.shape[-1]
    rows = attention_mask.reshape(-1, s, s)
    if not rows[:, :, 0].any():  # column 0 visible from every row: no boundary anywhere
        return None
    return (~rows).to(torch.uint8).argmax(-1)


class Documents:
    """Where each token of a packed ``[b, s]`` batch sits when every document is a row of its
    own: ``row[b, t]`` (documents numbered in batch order) and ``offset[b, t]`` (its position
    in the document); ``num`` documents of ``lengths`` tokens, the longest ``length``."""

    def __init__(self, starts: torch.Tensor):
        positions = torch.arange(starts.shape[1], device=starts.device)
        self.offset = positions - starts
        self.row = (self.offset == 0).flatten().cumsum(0).view(starts.shape) - 1
        self.num = int(self.row[-1, -1]) + 1
        self.lengths = torch.bincount(self.row.flatten(), minlength=self.num)
        self.length = int(self.lengths.max())

    def unpack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """``x [b, s, ...]`` -> ``[num, length, ...]``, each document left-aligned in its row and
        right-padded with ``fill`` (differentiable in ``x``)."""
        out = x.new_full((self.num, self.length) + tuple(x.shape[2:]), fill)
        return out.index_put((self.row.flatten(), self.offset.flatten()), x.flatten(0, 1))

    def pack(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`unpack` on the real tokens: ``[num, length, ...]`` -> ``[b, s, ...]``."""
        return rows[self.row, self.offset]


def per_document(
    forward,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor],
    starts: torch.Tensor,
    bucket: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """``forward(ids [n, L], positions [n, L])`` run on every document as its own sequence,
    right-padded to the longest document of its bucket (``bucket(lengths)``: a key per
    document, None: one bucket), which must leave a model's real positions unchanged (causal
    models: any padding; the recurrent transformer: padding within its last block). Returns
    the ``[b, s, ...]`` outputs packed back. ``position_ids`` (None: the document offsets) are
    the dataset's, which restart at each document with ``data.reset_position_ids``."""
    docs = Documents(starts)
    positions = docs.offset if position_ids is None else position_ids.expand_as(input_ids)
    ids, pos = docs.unpack(input_ids), docs.unpack(positions)
    if bucket is None:
        return docs.pack(forward(ids, pos))
    keys = bucket(docs.lengths)
    outputs = [None] * docs.num
    for key in keys.unique():
        members = (keys == key).nonzero()[:, 0]
        width = int(docs.lengths[members].max())
        out = forward(ids[members, :width], pos[members, :width])
        for i, doc in enumerate(members.tolist()):
            outputs[doc] = F.pad(out[i], (0, 0) * (out.dim() - 2) + (0, docs.length - width))
    return docs.pack(torch.stack(outputs))
