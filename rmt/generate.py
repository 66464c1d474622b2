"""``rmt-generate``: sample tokens from a checkpoint of any architecture.

    rmt-generate --checkpoint ckpt/ --prompt "def " --max-new-tokens 64 --temperature 0.8

The model is rebuilt from the config saved in the checkpoint (on one process; any saved
TP/PP layout is resharded on load). Decoding uses the architecture's cache unless
``--no-cache``:

* transformer: megatron-core's KV cache (``StaticInferenceContext``);
* mixer with repeat heads: the recurrent form, one state vector per head per layer (constant
  memory per token, "Masked Recurrent Mixers");
* recurrent transformer: per layer the last complete window plus the current block's inputs
  (constant memory and work per token, whatever the position);
* otherwise (masked mixer, ``--no-cache``): the full forward pass over the sequence so far at
  every step.

Every path yields the same tokens (they compute the same logits); tokens never leave the
model's ``seq_length``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import List, Optional

import torch

from rmt.errors import UserError, cli_entry


def causal_mask(length: int, device) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]


def positions(start: int, length: int, batch: int, device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device)[None].expand(batch, -1)


class RecomputeDecoder:
    """Full forward pass over the whole sequence at every step (works for every model)."""

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens = tokens
        return self._last()

    def next(self, token: torch.Tensor) -> torch.Tensor:
        self.tokens = torch.cat([self.tokens, token[:, None]], 1)
        return self._last()

    def _last(self) -> torch.Tensor:
        b, s = self.tokens.shape
        dev = self.tokens.device
        return self.model(self.tokens, positions(0, s, b, dev), causal_mask(s, dev))[:, -1]


class RecurrentMixerDecoder:
    """The repeat mixer's recurrent form: state is one vector per head per layer."""

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.state = self.model.init_state(tokens.shape[0])
        self.position = 0
        for t in range(tokens.shape[1]):
            logits = self.next(tokens[:, t])
        return logits

    def next(self, token: torch.Tensor) -> torch.Tensor:
        logits, self.state = self.model.step(token, self.state, self.position)
        self.position += 1
        return logits


class BlockRecurrentDecoder:
    """The recurrent transformer over its blocks ("Efficient LLM Architectures" eqs. 6-8).

    State: per layer the halves ``(A_j, h_j)`` of the window of the last complete block, and the
    embedded inputs of the current block. A new token re-runs, per layer, the current block's
    window (at most ``2k`` positions, eq. 7) and eq. 8 on its second half; the logits of the
    newest position are the last of these. A block is folded into the state only once a token
    of the next block arrives, because a complete last block still ends with eq. 8: each layer's
    window is then recomputed from the layer below's final outputs ``tau(a A_j + h_j)``.
    """

    def __init__(self, model):
        self.model = model
        self.k = model.layers[0].block_width

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.windows = [None] * len(self.model.layers)
        self.pending = None  # embedded inputs of the current block, [q, b, h]
        self.position = 0
        return self._extend(tokens)

    def next(self, token: torch.Tensor) -> torch.Tensor:
        return self._extend(token[:, None])

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        x = self.model.embed(tokens, positions(self.position, s, b, tokens.device))
        self.position += s
        self.pending = x if self.pending is None else torch.cat([self.pending, x])
        while self.pending.shape[0] > self.k:
            self._fold(self.pending[:self.k])
            self.pending = self.pending[self.k:]
        x = self.pending
        for layer, window in zip(self.model.layers, self.windows):
            x = layer.tau(layer.window(window, x, layer.accumulation())[1])  # eq. 8
        return self.model.head(x[-1:])[:, -1]

    def _fold(self, block: torch.Tensor) -> None:
        for i, layer in enumerate(self.model.layers):
            a = layer.accumulation()
            self.windows[i] = layer.window(self.windows[i], block, a)
            block = layer.final_output(self.windows[i], a)


class KVCacheDecoder:
    """megatron-core GPTModel with its static KV cache."""

    def __init__(self, model, max_length: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model, self.max_length, self.context_cls = model, max_length, StaticInferenceContext

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        self.context = self.context_cls(b, self.max_length)
        out = self.model(tokens, positions(0, s, b, tokens.device), causal_mask(s, tokens.device),
                         inference_context=self.context, runtime_gather_output=True)
        self.context.sequence_len_offset += s
        return out[:, -1]

    def next(self, token: torch.Tensor) -> torch.Tensor:
        start = self.context.sequence_len_offset
        out = self.model(token[:, None], positions(start, 1, token.shape[0], token.device), None,
                         inference_context=self.context, runtime_gather_output=True)
        self.context.sequence_len_offset += 1
        return out[:, -1]


def decoder_for(model, max_length: int, use_cache: bool):
    """The cached decoder of ``model``'s architecture, or the recompute decoder."""
    from megatron.core.models.gpt import GPTModel

    from rmt.models.mixer import MixerModel
    from rmt.models.recurrent import RecurrentTransformer

    if use_cache and isinstance(model, GPTModel):
        return KVCacheDecoder(model, max_length)
    if use_cache and isinstance(model, MixerModel) and model.layers[0].mixing.token_weight.dim() == 2:
        return RecurrentMixerDecoder(model)
    if use_cache and isinstance(model, RecurrentTransformer):
        return BlockRecurrentDecoder(model)
    return RecomputeDecoder(model)


def sample_next(logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int,
                generator: torch.Generator) -> torch.Tensor:
    """Greedy at temperature 0, else softmax(logits / T) over the top-k of the real vocabulary."""
    logits = logits[:, :vocab_size].float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < vocab_size:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(logits.device)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, vocab_size: int, max_length: int,
             use_cache: bool = True, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             decoder=None) -> torch.Tensor:
    """``prompt`` ``[b, p]`` -> ``[b, p + max_new_tokens]`` sampled tokens."""
    if prompt.shape[1] < 1:
        raise UserError("the prompt must hold at least one token")
    if prompt.shape[1] + max_new_tokens > max_length:
        raise UserError(f"prompt ({prompt.shape[1]}) + max new tokens ({max_new_tokens}) exceeds "
                        f"the model's seq_length {max_length}")
    generator = torch.Generator().manual_seed(seed)
    decoder = decoder or decoder_for(model, max_length, use_cache)
    logits = decoder.prefill(prompt)
    out = [prompt]
    for i in range(max_new_tokens):
        token = sample_next(logits, vocab_size, temperature, top_k, generator)
        out.append(token[:, None])
        if i + 1 < max_new_tokens:
            logits = decoder.next(token)
    return torch.cat(out, 1)


def load_model(path: str, overrides: List[str]):
    """``(model, config)`` rebuilt from a checkpoint's saved config on one process (process
    groups initialised; the caller runs ``rmt.parallel.destroy()``)."""
    from omegaconf import OmegaConf

    from rmt import parallel
    from rmt.config import from_dict, validate
    from rmt.models.build import build
    from rmt.training.checkpoint import load_checkpoint, load_common

    saved = load_common(path)["config"]
    saved["parallel"].update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                             virtual_pipeline_model_parallel_size=None, data_parallel_size=None)
    saved["train"].update(load=None, save=None, save_interval=0)
    if overrides:
        saved = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(saved), OmegaConf.from_dotlist(overrides)))
    config = from_dict(saved)
    validate(config, 1)
    parallel.initialize(config)
    chunks = build(config)
    load_checkpoint(path, chunks, None)
    return chunks[0].eval(), config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rmt-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True,
                    help="a save root (its newest complete checkpoint is used) or one iter_* directory")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="\n", help="prompt text, tokenized with the checkpoint's tokenizer")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    ap.add_argument("--num-samples", type=int, default=1, help="samples generated as one batch")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--no-cache", action="store_true",
                    help="recompute the full forward pass per token instead of the KV cache / recurrent state")
    ap.add_argument("--json", metavar="FILE", help="write prompt, token ids and text as JSON")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value",
                    help="overrides of the saved config (e.g. train.precision=fp32)")
    return ap


@cli_entry("rmt-generate")
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    if args.max_new_tokens < 1 or args.num_samples < 1 or args.temperature < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens and --num-samples must be positive, --temperature and --top-k non-negative")
    from rmt import parallel
    from rmt.data.tokenizers import build_tokenizer

    try:
        model, config = load_model(args.checkpoint, args.overrides)
        tokenizer = None
        if args.prompt_ids is not None:
            try:
                ids = [int(x) for x in args.prompt_ids.split(",")]
            except ValueError:
                raise UserError(f"--prompt-ids must be comma-separated integers, got '{args.prompt_ids}'") from None
        else:
            d = config.data
            tokenizer = build_tokenizer(d.tokenizer, d.cache_dir, d.bpe_vocab_size)
            ids = tokenizer.tokenize(args.prompt)
        if any(not 0 <= i < config.model.vocab_size for i in ids):
            raise UserError(f"prompt token ids must lie in [0, {config.model.vocab_size})")
        device = next(model.parameters()).device
        prompt = torch.tensor([ids] * args.num_samples, device=device)
        out = generate(model, prompt, args.max_new_tokens, config.model.vocab_size, config.model.seq_length,
                       not args.no_cache, args.temperature, args.top_k, args.seed)
        result = {"prompt_ids": ids, "samples": []}
        for row in out.tolist():
            text = tokenizer.detokenize(row) if tokenizer is not None else None
            result["samples"].append({"ids": row, "text": text})
            print(text if text is not None else " ".join(map(str, row)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
