"""``rmt-generate``: sample tokens from a checkpoint of any architecture.

    rmt-generate --checkpoint ckpt/ --prompt "def " --max-new-tokens 64 --temperature 0.8

The model is rebuilt from the config saved in the checkpoint (on one process; any saved
TP/PP layout is resharded on load). Decoding (:mod:`rmt.decoding`) uses the architecture's
cache (KV cache, recurrent state) unless ``--no-cache``; every path yields the same tokens.

This module imports torch, megatron-core and the model code only once the arguments are
parsed, so ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from rmt.errors import UserError, cli_entry
from rmt.outputs import check_output, write_json
from rmt.process import setup_process


def load_model(path: str, overrides: List[str], average: bool = False, tables: bool = True):
    """``(model, config, tokenizer_json)`` rebuilt from a checkpoint's saved config on one process
    (process groups initialised; the caller runs ``rmt.parallel.destroy()``), holding the trained
    weights or, with ``average``, the checkpoint's weight average (``train.ema_decay``);
    ``tokenizer_json`` is the tokenizer file the checkpoint carries (None for byte tokens and
    older checkpoints). ``tables=False`` allocates the memory value tables without drawing or
    loading them (untouched pages: no host memory), for a caller that reads their files."""
    from omegaconf import OmegaConf

    from rmt import parallel
    from rmt.config import from_dict
    from rmt.config_checks import validate
    from rmt.memory.table import values_from_checkpoint
    from rmt.models.build import build
    from rmt.training.checkpoint import find_checkpoint, load_checkpoint, load_common
    from rmt.training.same_model import model_difference
    from rmt.training.weight_average import WeightAverage

    common = load_common(path)
    if average and not common.get("ema"):
        raise UserError(
            f"checkpoint '{find_checkpoint(path)}' has no weight average (it was trained without "
            f"train.ema_decay); leave out --average"
        )
    saved, tokenizer_json = common["config"], common.get("tokenizer_json")
    if tokenizer_json is not None and not os.path.isfile(saved["data"]["tokenizer"]):
        saved["data"]["tokenizer"] = None  # moved or deleted since training: the carried copy serves
    saved["parallel"].update(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        data_parallel_size=None,
        sequence_parallel=False,
    )
    saved["train"].update(load=None, save=None, save_interval=0)
    saved["data"]["path"] = None  # generating needs no data: the saved data.tokenizer is the data's
    if overrides:
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(saved), OmegaConf.from_dotlist(overrides)))
        problem = model_difference(from_dict(merged), saved, find_checkpoint(path))
        if problem is not None:
            raise UserError(problem)
        saved = merged
    config = from_dict(saved)
    validate(config, 1)
    parallel.initialize(config)
    with values_from_checkpoint(not tables):
        chunks = build(config)
    weights = WeightAverage(chunks, config.train.ema_decay) if average else None
    load_checkpoint(path, chunks, None, weights.by_param() if weights else None, tables)
    if weights:
        weights.put_in()
    return chunks[0].eval(), config, tokenizer_json


def checkpoint_tokenizer(config, tokenizer_json: Optional[str]):
    """The dataset's own tokenizer: the copy the checkpoint carries, else the saved
    ``data.tokenizer`` spec (byte tokens by default)."""
    from rmt.data.tokenizers import HFTokenizer, build_tokenizer

    d = config.data
    if tokenizer_json is not None:
        return HFTokenizer(d.tokenizer or "tokenizer.json", tokenizer_json)
    return build_tokenizer(d.tokenizer or "byte", d.cache_dir, d.bpe_vocab_size, d.max_documents)


def prompt_text(prompt: str) -> str:
    """``--prompt`` as text; the command line delivers bytes that are not UTF-8 as surrogate
    escapes, which no tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(
            f"the prompt is not valid UTF-8 (character {err.start} is an undecodable byte); "
            f"pass UTF-8 text or token ids with --prompt-ids"
        ) from None
    return prompt


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rmt-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="a save root (its newest complete checkpoint is used) or one iter_* directory",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="\n", help="prompt text, tokenized with the checkpoint's tokenizer")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    ap.add_argument("--num-samples", type=int, default=1, help="samples generated as one batch")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the full forward pass per token instead of the KV cache / recurrent state",
    )
    ap.add_argument(
        "--average",
        action="store_true",
        help="generate with the checkpoint's weight average (train.ema_decay) instead of the trained weights",
    )
    ap.add_argument("--json", metavar="FILE", help="write prompt, token ids and text as JSON")
    ap.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides of the saved config (e.g. train.precision=fp32)",
    )
    return ap


@cli_entry("rmt-generate")
def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow the options
    if args.max_new_tokens < 1 or args.num_samples < 1 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens and --num-samples must be positive, --temperature and --top-k non-negative")
    prompt_string = None if args.prompt_ids is not None else prompt_text(args.prompt)
    if args.json:
        check_output(args.json, "--json")
    import torch

    from rmt import parallel
    from rmt.decoding import generate

    try:
        model, config, tokenizer_json = load_model(args.checkpoint, args.overrides, args.average)
        tokenizer = None
        if args.prompt_ids is not None:
            try:
                ids = [int(x) for x in args.prompt_ids.split(",")]
            except ValueError:
                raise UserError(f"--prompt-ids must be comma-separated integers, got '{args.prompt_ids}'") from None
        else:
            tokenizer = checkpoint_tokenizer(config, tokenizer_json)
            ids = tokenizer.tokenize(prompt_string)
        if any(not 0 <= i < config.model.vocab_size for i in ids):
            raise UserError(f"prompt token ids must lie in [0, {config.model.vocab_size})")
        device = next(model.parameters()).device
        prompt = torch.tensor([ids] * args.num_samples, device=device)
        out = generate(
            model,
            prompt,
            args.max_new_tokens,
            config.model.vocab_size,
            config.model.seq_length,
            not args.no_cache,
            args.temperature,
            args.top_k,
            args.seed,
        )
        result = {"prompt_ids": ids, "samples": []}
        for row in out.tolist():
            text = tokenizer.detokenize(row) if tokenizer is not None else None
            result["samples"].append({"ids": row, "text": text})
            print(text if text is not None else " ".join(map(str, row)))
        if args.json:
            write_json(args.json, result)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
