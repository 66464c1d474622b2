"""``rmt-export``: an rmt checkpoint as a Hugging Face ``transformers`` model directory.

    rmt-export --checkpoint ckpt/ --out hf/
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/')"

The directory holds ``config.json``, ``model.safetensors``, the tokenizer files (the dataset's
own tokenizer, same ids) and ``rmt_config.json`` (the checkpoint's full rmt config, which
``train.load`` reads back). ``--format standard`` (the default for the transformer baseline)
writes a standard architecture (:mod:`rmt.export.standard`) and refuses, in one sentence, a
config that none matches. The model is rebuilt on one process (any saved TP/PP layout is
resharded on load, as in ``rmt-generate``).

This module imports torch, transformers and the model code only once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional

from rmt.errors import UserError, cli_entry
from rmt.outputs import check_output, write_json
from rmt.process import setup_process

RMT_CONFIG = "rmt_config.json"
WEIGHTS = "model.safetensors"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rmt-export", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="a save root (its newest complete checkpoint is used) or one iter_* directory",
    )
    ap.add_argument("--out", required=True, help="the Hugging Face model directory to write (new or empty)")
    ap.add_argument(
        "--format",
        choices=("auto", "standard", "remote"),
        default="auto",
        help="standard: a standard transformers architecture (the transformer baseline); remote: "
        "rmt's own classes, loaded with trust_remote_code=True; auto (default): standard where one matches",
    )
    ap.add_argument(
        "--average",
        action="store_true",
        help="export the checkpoint's weight average (train.ema_decay) instead of the trained weights",
    )
    return ap


def _check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(f"--out '{out}' exists and is not an empty directory; pick a new one")


def export(
    checkpoint: str,
    out: str,
    average: bool = False,
    fmt: str = "auto",
    chunk_bytes: int = 64 << 20,
    stream_tables: bool = True,
) -> str:
    """Write ``checkpoint`` as a Hugging Face model directory ``out``; returns its model type.
    Memory tables pass through host memory ``chunk_bytes`` at a time (``stream_tables=False``:
    loaded whole, the plain path ``tools/bench_export.py`` compares against)."""
    from rmt import parallel
    from rmt.config import from_dict, to_dict
    from rmt.export.standard import standard_architecture
    from rmt.export.tokenizer import hf_tokenizer
    from rmt.export.weights import data_bytes, write_safetensors
    from rmt.generate import checkpoint_tokenizer, load_model
    from rmt.training.checkpoint import find_checkpoint, load_common

    saved = from_dict(load_common(checkpoint)["config"])
    if fmt == "standard":
        standard_architecture(saved)  # refuses before any weight is read
    elif fmt == "auto":
        try:
            standard_architecture(saved)
            fmt = "standard"
        except UserError:
            fmt = "remote"
    # memory value tables go from their checkpoint files to the weights file in bounded chunks,
    # never whole in memory (allocated untouched by load_model); a weight average is loaded whole
    stream = fmt == "remote" and not average and stream_tables
    try:
        model, config, tokenizer_json = load_model(checkpoint, [], average, tables=not stream)
        tokenizer = checkpoint_tokenizer(config, tokenizer_json)
        streamed = {}
        if fmt == "standard":
            from rmt.export.standard import hf_config, hf_state_dict

            cfg, weights = hf_config(config, tokenizer.eod), hf_state_dict(config, model.state_dict())
        else:
            from rmt.export.remote import remote_config, remote_state_dict, streamed_tables

            if stream:
                streamed = streamed_tables(find_checkpoint(checkpoint), model, chunk_bytes)
            skip = {k.removeprefix("model.") for k in streamed}
            cfg, weights = remote_config(config, tokenizer.eod), remote_state_dict(model, skip)
        # the weights and 16 MiB for the header, configs, tokenizer files and remote code
        check_output(out, "--out", data_bytes(weights, streamed) + (16 << 20), directory=True)
        created = not os.path.exists(out)
        try:
            os.makedirs(out, exist_ok=True)
            write_safetensors(os.path.join(out, WEIGHTS), weights, streamed, {"format": "pt"})
            cfg.save_pretrained(out)
            if fmt == "remote":
                from rmt.export.remote import copy_code

                copy_code(out)
            hf_tokenizer(tokenizer, config.model.seq_length, tokenizer_json).save_pretrained(out)
            write_json(os.path.join(out, RMT_CONFIG), to_dict(config))
        except OSError as err:
            _remove_written(out, created)
            raise UserError(f"writing --out '{out}' failed ({err.strerror or err}); what was written is removed")
    finally:
        parallel.destroy()
    return cfg.model_type


def _remove_written(out: str, created: bool) -> None:
    """Remove what an export that failed wrote into ``out`` (empty or new when it began)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


@cli_entry("rmt-export")
def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_args(argv)
    _check_out(args.out)
    check_output(args.out, "--out", directory=True)
    kind = export(args.checkpoint, args.out, args.average, args.format)
    print(f"rmt-export: wrote {kind} model to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
