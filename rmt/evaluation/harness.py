"""The lm-evaluation-harness model class of rmt checkpoints, registered as ``rmt``.

It implements lm-eval's three request types for every architecture and memory type:

* ``loglikelihood``: (context, continuation) -> (summed log-probability, greedy), by
  :func:`rmt.evaluation.scoring.score_rows` on batches of ``batch_size`` rows sorted by length
  (:func:`rmt.evaluation.scoring.batches`);
  lm-eval's :class:`~lm_eval.api.model.TemplateLM` tokenizes (context and continuation split at
  the token boundary of their concatenation, an empty context replaced by the end-of-document
  token);
* ``loglikelihood_rolling``: a document's full log-probability, in lm-eval's disjoint windows
  of at most ``model.seq_length`` tokens, each conditioned on its preceding tokens;
* ``generate_until``: :func:`rmt.decoding.generate` with the architecture's cache (KV cache,
  recurrent state), greedy unless the task samples, on batches of prompts of equal length;
  generation stops at the end-of-document token or at a stop sequence.

Inputs longer than ``model.seq_length`` keep their last tokens (the continuation and as much
context as fits). The tokenizer is the dataset's own, as in ``rmt-generate``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from rmt.decoding import generate
from rmt.errors import UserError
from rmt.evaluation.scoring import batches, model_device, score_rows


@register_model("rmt")
class RMTLM(TemplateLM):
    """An rmt model for lm-eval: from a checkpoint (``checkpoint=DIR``, loaded on one process
    through :func:`rmt.generate.load_model`, any saved TP/PP layout resharded) or from a built
    ``model`` with its ``config`` and ``tokenizer``. ``overrides`` is a list (or a
    space-separated string) of ``section.key=value`` overrides of the saved config;
    ``average`` evaluates the checkpoint's weight average."""

    def __init__(
        self,
        checkpoint: Optional[str] = None,
        batch_size=8,
        max_gen_toks: int = 256,
        overrides=(),
        average: bool = False,
        device: Optional[str] = None,
        model=None,
        config=None,
        tokenizer=None,
        **_ignored,
    ):
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise UserError("the rmt lm-eval model needs either checkpoint=DIR or a built model")
        if checkpoint is not None:
            from rmt.generate import checkpoint_tokenizer, load_model

            if isinstance(overrides, str):
                overrides = overrides.split()
            model, config, tokenizer_json = load_model(checkpoint, list(overrides), bool(average))
            tokenizer = checkpoint_tokenizer(config, tokenizer_json)
        if device is not None:
            model = model.to(device)
        self.model, self.config, self.tokenizer = model.eval(), config, tokenizer
        self._device = model_device(model)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        if self.batch_size < 1:
            raise UserError(f"batch_size must be positive, got {batch_size}")
        self.max_gen_toks = int(max_gen_toks)
        self.vocab_size = config.model.vocab_size

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod

    @property
    def max_length(self) -> int:
        return self.config.model.seq_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "spec", "byte")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> List[int]:
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.detokenize(tokens)

    def _row(self, context: Sequence[int], continuation: Sequence[int]) -> Tuple[List[int], int]:
        """The scored row: the last ``seq_length + 1`` tokens, the continuation's scored."""
        whole = list(context) + list(continuation)
        whole = whole[-(self.max_length + 1) :]
        return whole, min(len(continuation), len(whole) - 1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        rows = [self._row(ctx, cont) for _, ctx, cont in requests]
        results: List[Optional[Tuple[float, bool]]] = [None] * len(rows)
        for batch in tqdm(
            batches(self.model, rows, self.batch_size), desc="rmt loglikelihood", disable=disable_tqdm or self.rank != 0
        ):
            for i, answer in zip(
                batch, score_rows(self.model, [rows[i] for i in batch], self.vocab_size, self.eot_token_id)
            ):
                results[i] = answer
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        groups: Dict[tuple, List[Tuple[int, List[int]]]] = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = tuple(handle_stop_sequences(kw.get("until"), None))
            new = max(1, min(kw["max_gen_toks"], self.max_length - 1))
            ids = self.tok_encode(context)[-(self.max_length - new) :] or [self.eot_token_id]
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            key = (len(ids), new, temperature, int(kw.get("top_k", 0) or 0), int(kw.get("seed", 0) or 0), until)
            groups.setdefault(key, []).append((i, ids))
        results: List[Optional[str]] = [None] * len(requests)
        prompts = [
            (key, members[j : j + self.batch_size])
            for key, members in sorted(groups.items(), key=lambda g: -g[0][0])
            for j in range(0, len(members), self.batch_size)
        ]
        for (length, new, temperature, top_k, seed, until), batch in tqdm(
            prompts, desc="rmt generate_until", disable=disable_tqdm or self.rank != 0
        ):
            prompt = torch.tensor([ids for _, ids in batch], device=self.device)
            out = generate(
                self.model,
                prompt,
                new,
                self.vocab_size,
                self.max_length,
                True,
                temperature,
                top_k,
                seed,
                stop=lambda tokens: all(self._finished(row[length:], until) for row in tokens.tolist()),
            )
            for (i, _), row in zip(batch, out.tolist()):
                results[i] = self._text(row[length:], until)
                self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results

    def _finished(self, generated: List[int], until: Sequence[str]) -> bool:
        return self.eot_token_id in generated or any(s in self._text(generated, ()) for s in until)

    def _text(self, generated: List[int], until: Sequence[str]) -> str:
        """The generated text up to the end-of-document token and the first stop sequence."""
        if self.eot_token_id in generated:
            generated = generated[: generated.index(self.eot_token_id)]
        text = self.tok_decode(generated)
        for s in until:
            text = text.split(s)[0]
        return text
