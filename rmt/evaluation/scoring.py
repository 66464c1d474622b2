"""Log-probabilities of token continuations under an rmt model, for every architecture.

A row is a token list whose last ``n`` tokens are scored: the model reads ``tokens[:-1]`` and
the log-probability of ``tokens[-n:]`` is the sum of ``log p(tokens[t] | tokens[:t])`` over
those positions. Rows of a batch are right-padded to the longest. Every architecture is causal (attention
masks, position-indexed mixing, causal query convolutions), so a padded position never reaches
an earlier one, with one exception: the recurrent transformer ends its last block with eq. 8
("Efficient LLM Architectures"), which a padded block would move. Its rows share a batch only
with rows of as many blocks (:func:`padding_class`), as its document packing does. A row's
scores are then those of the row alone, up to fp32 rounding of the wider products.

Probabilities are normalised over the tokenizer's vocabulary (``model.vocab_size``): the
padded rows that ``model.make_vocab_size_divisible_by`` adds to the tables are dropped, as
``rmt-generate`` drops them when sampling and as an exported Hugging Face model lacks them.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from rmt.decoding import positions
from rmt.models.documents import causal_mask


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def padding_class(model, length: int) -> int:
    """Rows of ``length`` input tokens may be padded together exactly when their classes agree:
    the number of blocks for the recurrent transformer, one class otherwise."""
    from rmt.models.recurrent import RecurrentTransformer

    if isinstance(model, RecurrentTransformer):
        return -(-length // model.layers[0].block_width)
    return 0


def batches(model, rows: Sequence[Tuple[Sequence[int], int]], size: int) -> List[List[int]]:
    """Indices of ``rows`` in batches of at most ``size`` that may be padded together, the
    longest rows first (the first batch shows at once whether the largest one fits), ties by
    their tokens: which rows share a batch, and so every fp32 rounding, does not depend on the
    order of the requests (lm-eval orders them by task name, for one)."""
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), tuple(rows[i][0])))
    groups = {}
    for i in order:
        groups.setdefault(padding_class(model, len(rows[i][0]) - 1), []).append(i)
    return [members[j : j + size] for members in groups.values() for j in range(0, len(members), size)]


@torch.no_grad()
def token_logprobs(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[b, s]`` input ids -> ``[b, s, vocab_size]`` fp32 next-token log-probabilities."""
    b, s = tokens.shape
    logits = model(tokens, positions(0, s, b, tokens.device), causal_mask(s, tokens.device))
    return torch.log_softmax(logits[..., :vocab_size].float(), -1)


def score_rows(
    model, rows: Sequence[Tuple[Sequence[int], int]], vocab_size: int, pad_id: int = 0
) -> List[Tuple[float, bool]]:
    """``(summed log-probability, greedy)`` of the last ``n`` tokens of each ``(tokens, n)``,
    the rows run as one right-padded batch; ``greedy`` is True where every scored token is the
    model's argmax."""
    device = model_device(model)
    length = max(len(t) - 1 for t, _ in rows)
    batch = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, (t, _) in enumerate(rows):
        batch[i, : len(t) - 1] = torch.as_tensor(t[:-1])
    logp = token_logprobs(model, batch.to(device), vocab_size)
    out = []
    for i, (t, n) in enumerate(rows):
        end = len(t) - 1
        lp = logp[i, end - n : end]
        target = torch.as_tensor(t[-n:], device=device)
        out.append((float(lp.gather(-1, target[:, None]).sum()), bool(torch.equal(lp.argmax(-1), target))))
    return out
