"""The settings a run takes from its data, as one named step after the config checks.

``data.tokenizer: null`` means "the tokenizer the data was made with" (the ``.json`` record of
``rmt-preprocess``, :func:`rmt.data.metadata.dataset_tokenizer`) and ``model.vocab_size: null``
for a synthetic task means its alphabet. :func:`resolve_from_data` returns a config with those
filled in and one line per setting it filled, which the entry points log; the config it was
given is left as it was (the checks, :func:`rmt.config_checks.validate`, never change one).
The default corpus and vocabularies known only from a dataset's contents are decided where the
data is built (:func:`rmt.data.gpt_data.resolve_data`).

File reads only (no torch, no megatron).
"""

from __future__ import annotations

import copy
import logging
from typing import List, Tuple

from rmt.config import RMTConfig
from rmt.data.blend import blend_prefixes, data_blends
from rmt.data.metadata import dataset_tokenizer

log = logging.getLogger(__name__)


def resolve_from_data(config: RMTConfig) -> Tuple[RMTConfig, List[str]]:
    """``(resolved, notes)``: a copy of ``config`` with the tokenizer of ``data.path``'s datasets and
    a synthetic task's vocabulary filled in, and a line ``"key = value (why)"`` per setting
    filled in (also logged at INFO on ``rmt.data.resolution``). Raises ``ConfigError`` as
    :func:`~rmt.data.metadata.dataset_tokenizer` does."""
    resolved = copy.deepcopy(config)
    d, m = resolved.data, resolved.model
    notes = []
    blends = data_blends(d)
    if blends is not None:
        tokenizer = dataset_tokenizer(d.tokenizer, blend_prefixes(blends))
        if tokenizer != d.tokenizer:
            notes.append(
                f"data.tokenizer = {tokenizer!r} (what the data records, or the default for data without a record)"
            )
            d.tokenizer = tokenizer
    if d.task != "none" and m.vocab_size is None:
        m.vocab_size = d.task_alphabet
        notes.append(f"model.vocab_size = {m.vocab_size} (data.task_alphabet)")
    for note in notes:
        log.info("config from the data: %s", note)
    return resolved, notes
