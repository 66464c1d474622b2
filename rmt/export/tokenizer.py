"""The dataset's tokenizer as Hugging Face tokenizer files (``tokenizer.json`` and its config),
with the same ids: byte tokens as a merge-free byte-level BPE whose id of each byte is its
value, a trained or given BPE as itself; the end-of-document token is the eos (and bos) token.
"""

from __future__ import annotations

from typing import Optional

EOD_TEXT = "<|endoftext|>"


def byte_tokenizer():
    """UTF-8 bytes as ids 0..255 (GPT-2's byte-to-character alphabet, no merges, no splitting)
    and ``<|endoftext|>`` as 256: rmt's byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TEXT])
    return tok


def hf_tokenizer(tokenizer, max_length: int, tokenizer_json: Optional[str] = None):
    """A ``PreTrainedTokenizerFast`` for ``max_length`` tokens with ``tokenizer``'s ids (an rmt ``ByteTokenizer`` or
    ``HFTokenizer``; ``tokenizer_json`` is the copy a checkpoint carries)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rmt.data.tokenizers import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        tok = byte_tokenizer()
    else:
        tok = Tokenizer.from_str(tokenizer_json) if tokenizer_json is not None else Tokenizer.from_file(tokenizer.spec)
        if tokenizer.eod >= tok.get_vocab_size(with_added_tokens=True):  # rmt's one-past-the-vocabulary eod
            tok.add_special_tokens([EOD_TEXT])
    eod = tok.id_to_token(tokenizer.eod)
    assert tok.token_to_id(eod) == tokenizer.eod
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eod, bos_token=eod, model_max_length=max_length)
