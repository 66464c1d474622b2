"""Tokenizers: byte-level (default), a BPE trained on the corpus with HF ``tokenizers``, or
any HF tokenizer from a local path (a ``tokenizer.json`` or a directory holding one).

Each exposes what megatron-core's GPTDataset reads (``vocab_size``, ``eod``) plus
``tokenize``/``tokenize_batch``/``detokenize``, and a ``spec`` string stored beside preprocessed data.
"""

from __future__ import annotations

import os
from typing import Iterable, List, Optional

import numpy as np

from rmt.errors import UserError

_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes 0..255 and an end-of-document token 256."""

    spec = "byte"
    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def tokenize_batch(self, texts: List[str]) -> List[np.ndarray]:
        """The ids of each text as an array (no per-byte Python objects)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HF ``tokenizers`` tokenizer file (or its contents ``json_text``, as a checkpoint carries
    them, with ``path`` where it was). The end-of-document id is the first of the usual special
    tokens present, else one id past the vocabulary."""

    def __init__(self, path: str, json_text: Optional[str] = None):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if json_text is None and not os.path.isfile(file):
            raise UserError(f"tokenizer path '{path}' has no tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(file) if json_text is None else Tokenizer.from_str(json_text)
        except Exception as err:
            raise UserError(f"tokenizer file '{file}' could not be read ({err})") from None
        self.spec = os.path.abspath(file)
        n = self._tok.get_vocab_size(with_added_tokens=True)
        found = [self._tok.token_to_id(t) for t in _EOD_CANDIDATES]
        found = [i for i in found if i is not None]
        self.eod = found[0] if found else n
        self.vocab_size = max(n, self.eod + 1)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: List[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([i for i in ids if i != self.eod])


def bpe_path(cache_dir: str, vocab_size: int, max_documents=None) -> str:
    """Where ``tokenizer: bpe`` trained on the default corpus is cached."""
    return os.path.join(cache_dir, f"bpe_{vocab_size}_{max_documents or 'all'}.json")


def train_bpe(texts: Iterable[str], vocab_size: int, out_file: str) -> str:
    """Train a byte-level BPE (HF ``tokenizers``) and save it atomically to ``out_file``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = out_file + ".tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
        tok.save(tmp)
        os.replace(tmp, out_file)
    except Exception as err:  # OSError, or the Rust side's own error for an unwritable file
        raise UserError(
            f"cannot write the trained tokenizer '{out_file}' ({getattr(err, 'strerror', None) or err}); "
            f"the cache directory must be writable"
        ) from None
    return out_file


def build_tokenizer(spec: str, cache_dir: str = ".rmt_cache", bpe_vocab_size: int = 2048, max_documents=None):
    """``byte`` | ``bpe`` (trained on the default corpus once, cached) | a HF tokenizer path."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        from rmt.data.corpus import corpus_documents

        path = bpe_path(cache_dir, bpe_vocab_size, max_documents)
        if not os.path.isfile(path):
            train_bpe(corpus_documents(max_documents), bpe_vocab_size, path)
        return HFTokenizer(path)
    return HFTokenizer(spec)
