"""``rmt-preprocess``: jsonl / txt / parquet (read with HF ``datasets``, local files only) ->
megatron-core indexed dataset ``PREFIX.bin/.idx`` plus ``PREFIX.json``.

torch, megatron-core and HF ``datasets`` are imported only once the arguments are checked, so
``--help`` and argument errors answer at once."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from rmt.data.tokenizers import build_tokenizer
from rmt.errors import UserError, cli_entry

_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text",
            ".parquet": "parquet"}


def _format_of(paths: List[str]) -> str:
    kinds = {_FORMATS.get(os.path.splitext(p)[1].lower()) for p in paths}
    if None in kinds:
        bad = [p for p in paths if os.path.splitext(p)[1].lower() not in _FORMATS]
        raise UserError(f"input '{bad[0]}' is not .jsonl, .json, .txt or .parquet")
    if len(kinds) > 1:
        raise UserError("all inputs must have the same format (jsonl, txt or parquet)")
    return kinds.pop()


def preprocess(inputs: List[str], output_prefix: str, tokenizer_spec: str = "byte",
               text_key: str = "text", cache_dir: str = ".rmt_cache",
               bpe_vocab_size: int = 2048) -> dict:
    for p in inputs:
        if not os.path.isfile(p):
            raise UserError(f"input file '{p}' does not exist")
    fmt = _format_of(inputs)
    if fmt != "parquet":
        for p in inputs:
            _check_has_text(p)
    from rmt.data.indexed import write_indexed

    tokenizer = build_tokenizer(tokenizer_spec, cache_dir, bpe_vocab_size)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(fmt, data_files=inputs, split="train",
                                   cache_dir=os.path.join(cache_dir, "hf_datasets"))
    except Exception as err:
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"could not read {inputs[0]} as {fmt} ({cause})") from None
    if text_key not in ds.column_names:
        raise UserError(f"inputs have no '{text_key}' field; fields are: {', '.join(ds.column_names)}")
    if not any(t for batch in ds.iter(batch_size=1024) for t in batch[text_key]):
        raise UserError(f"the inputs hold no text: every '{text_key}' is empty")
    return write_indexed(output_prefix, _tokenized(ds, text_key, tokenizer), tokenizer)


def _check_has_text(path: str) -> None:
    """A jsonl or txt input with nothing but white space is a mistake (HF ``datasets`` fails on
    it with a message that does not say so)."""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                raise UserError(f"input file '{path}' is empty" if f.tell() == 0 else
                                f"input file '{path}' holds nothing but white space")
            if chunk.strip():
                return


def _tokenized(ds, text_key: str, tokenizer, batch_size: int = 1024):
    """Token ids per document with text, in order; empty documents (blank lines of a txt file)
    are left out. (Not ``Dataset.map``: its fingerprinting pickles the function, and pickling a
    Rust tokenizer crashes; HF tokenizers batch-encode in parallel.)"""
    encode = getattr(tokenizer, "tokenize_batch", None)
    for batch in ds.iter(batch_size=batch_size):
        texts = [t for t in batch[text_key] if t]
        yield from (encode(texts) if encode else [tokenizer.tokenize(t) for t in texts])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rmt-preprocess",
        description="Tokenize jsonl/txt/parquet files into a megatron-core indexed dataset.")
    ap.add_argument("--input", nargs="+", required=True,
                    help="input files: .jsonl/.json (one object per line), .txt (one document "
                         "per line) or .parquet")
    ap.add_argument("--output-prefix", required=True,
                    help="writes PREFIX.bin, PREFIX.idx and PREFIX.json (tokenizer metadata)")
    ap.add_argument("--tokenizer", default="byte",
                    help="'byte' (default), 'bpe' (trained on the default corpus) or a path to a "
                         "HF tokenizer.json / directory")
    ap.add_argument("--text-key", default="text", help="field holding the text (jsonl/parquet)")
    ap.add_argument("--bpe-vocab-size", type=int, default=2048, help="vocabulary of the 'bpe' tokenizer")
    ap.add_argument("--cache-dir", default=".rmt_cache", help="where trained tokenizers and HF caches live")
    return ap


@cli_entry("rmt-preprocess")
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bpe_vocab_size < 1:
        raise UserError("--bpe-vocab-size must be positive")
    meta = preprocess(args.input, args.output_prefix, args.tokenizer, args.text_key,
                      args.cache_dir, args.bpe_vocab_size)
    print(f"wrote {args.output_prefix}.bin/.idx: {meta['num_documents']} documents, "
          f"{meta['num_tokens']} tokens, vocab {meta['vocab_size']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
