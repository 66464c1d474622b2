"""The metadata sidecar ``P.json`` of an indexed dataset, and the tokenizer it decides.

``rmt-preprocess`` (and the default corpus's build) record the tokenizer they encoded with in
``P.json`` beside ``P.bin/.idx``: ``byte`` or the absolute path of a HF ``tokenizer.json`` (the
trained ``bpe`` is such a file in the cache). Training and evaluation set ``data.tokenizer`` to
that record, so the checkpoint's config names the tokenizer that made its data and
``rmt-generate`` encodes and decodes with it. ``data.tokenizer`` left unset (``null``) takes the
record; a setting that names another tokenizer is an error, never silently used.

Plain file reads only (no torch, no megatron): this runs inside ``rmt.config_checks.validate``.
"""

from __future__ import annotations

import filecmp
import json
import os
from typing import Optional, Sequence, Tuple, Union

from rmt.errors import ConfigError, UserError

DEFAULT = "byte"


def read_metadata(prefix: str) -> Optional[dict]:
    """The ``prefix.json`` sidecar of an indexed dataset, or None for datasets made elsewhere."""
    path = prefix + ".json"
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"dataset metadata '{path}' is unreadable ({err})") from None
    if not isinstance(meta, dict):
        raise UserError(f"dataset metadata '{path}' is not a JSON object")
    return meta


def check_metadata(prefix: str, meta: dict) -> None:
    """Reject a sidecar whose numbers contradict each other (e.g. a vocabulary smaller than the
    largest token id it records): the model would be built too small for its data."""
    path = prefix + ".json"
    for key in ("vocab_size", "eod"):
        if not isinstance(meta.get(key), int) or meta[key] < 0:
            raise UserError(f"dataset metadata '{path}' has no valid '{key}' (a non-negative integer)")
    vocab = meta["vocab_size"]
    for key in ("eod", "max_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value >= vocab:
            raise UserError(
                f"dataset metadata '{path}' understates the vocabulary: vocab_size {vocab} "
                f"but {key} {value}; re-run rmt-preprocess to rewrite it"
            )


def _same_tokenizer(setting: str, recorded: str) -> bool:
    """Whether the ``data.tokenizer`` setting names the tokenizer the dataset records."""
    if setting == DEFAULT or recorded == DEFAULT:
        return setting == recorded
    if setting == "bpe":  # rmt's own BPE (rmt.data.tokenizers.bpe_path), whatever cache and vocabulary made it
        return os.path.basename(recorded).startswith("bpe_")
    if os.path.isdir(setting):
        setting = os.path.join(setting, "tokenizer.json")
    if os.path.realpath(setting) == os.path.realpath(recorded):
        return True
    return os.path.isfile(setting) and os.path.isfile(recorded) and filecmp.cmp(setting, recorded, shallow=False)


def _same_recorded(a: str, b: str) -> bool:
    """Whether two recorded tokenizers (``byte`` or absolute file paths) are the same one."""
    if a == b:
        return True
    if DEFAULT in (a, b):
        return False
    return os.path.isfile(a) and os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)


def shared_tokenizer(prefixes: Sequence[str]) -> Optional[Tuple[str, str]]:
    """``(prefix, tokenizer)``: the tokenizer the datasets ``prefixes`` record, and the first
    dataset that records it (None when none has metadata). Raises UserError naming two datasets
    whose tokenizers differ: a blend must share one tokenizer (one vocabulary for every id)."""
    first = None
    for prefix in prefixes:
        meta = read_metadata(prefix)
        if meta is None or "tokenizer" not in meta:
            continue
        check_metadata(prefix, meta)
        if first is None:
            first = (prefix, meta["tokenizer"])
        elif not _same_recorded(first[1], meta["tokenizer"]):
            raise UserError(
                f"the datasets of the blend were made with different tokenizers: '{first[0]}' "
                f"with '{first[1]}' and '{prefix}' with '{meta['tokenizer']}'; every dataset of "
                f"a blend must share one tokenizer (re-run rmt-preprocess with one of them)"
            )
    return first


def dataset_tokenizer(setting: Optional[str], prefixes: Union[str, Sequence[str]]) -> str:
    """The tokenizer a run of the dataset(s) ``prefixes`` uses: the one their metadata records (all
    of a blend's must agree, :func:`shared_tokenizer`), or the setting ``data.tokenizer`` (``byte``
    when unset) for datasets without metadata. Raises :class:`ConfigError` when an explicit
    setting names another tokenizer than the recorded one. Reads files only; the caller decides
    what to do with the answer (:func:`rmt.data.resolution.resolve_from_data` records it)."""
    found = shared_tokenizer([prefixes] if isinstance(prefixes, str) else prefixes)
    if found is None:
        return setting or DEFAULT
    prefix, recorded = found
    if setting is not None and not _same_tokenizer(setting, recorded):
        raise ConfigError(
            f"data.tokenizer '{setting}' contradicts the tokenizer '{recorded}' that "
            f"'{prefix}.json' records for the data; leave data.tokenizer unset to use the data's own"
        )
    if recorded != DEFAULT and not os.path.isfile(recorded):
        raise UserError(
            f"the tokenizer '{recorded}' that '{prefix}.json' records for the data does not exist "
            f"(the dataset was made on another machine or its tokenizer cache was removed)"
        )
    return recorded


def tokenizer_file_text(spec: Optional[str]) -> Optional[str]:
    """The contents of tokenizer file ``spec`` (``data.tokenizer`` once resolved), for a checkpoint
    to carry so that generating needs neither the data nor its tokenizer cache; None for byte."""
    if spec in (None, DEFAULT, "bpe") or not os.path.isfile(spec):
        return None
    with open(spec) as f:
        return f.read()


def known_vocab_size(config) -> Optional[int]:
    """The vocabulary a run of ``config`` gets, where it is known without building data: the
    one the metadata of ``data.path``'s datasets records, or the byte tokenizer's; else None."""
    from rmt.data.blend import blend_prefixes, data_blends

    d = config.data
    for prefix in blend_prefixes(data_blends(d)):
        meta = read_metadata(prefix)
        if meta is not None and "vocab_size" in meta:
            check_metadata(prefix, meta)
            return int(meta["vocab_size"])
    if (d.tokenizer or DEFAULT) == DEFAULT:
        from rmt.data.tokenizers import ByteTokenizer

        return ByteTokenizer.vocab_size
    return None
