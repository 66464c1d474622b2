"""Autoregressive decoding for every architecture, with each one's cache (``rmt-generate``,
:mod:`rmt.generate`, is the command-line front):

* transformer: megatron-core's KV cache (``StaticInferenceContext``);
* mixer with repeat heads: the recurrent form, one state vector per head per layer (constant
  memory per token, "Masked Recurrent Mixers");
* recurrent transformer: per layer the last complete window plus the current block's inputs
  (constant memory and work per token, whatever the position);
* otherwise (masked mixer, or no cache asked for): the full forward pass over the sequence so
  far at every step.

Every path yields the same tokens (they compute the same logits); tokens never leave the
model's ``seq_length``.
"""

from __future__ import annotations

import torch

from rmt.errors import UserError
from rmt.models.documents import causal_mask


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
            self._fold(self.pending[: self.k])
            self.pending = self.pending[self.k :]
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
        out = self.model(
            tokens,
            positions(0, s, b, tokens.device),
            causal_mask(s, tokens.device),
            inference_context=self.context,
            runtime_gather_output=True,
        )
        self.context.sequence_len_offset += s
        return out[:, -1]

    def next(self, token: torch.Tensor) -> torch.Tensor:
        start = self.context.sequence_len_offset
        out = self.model(
            token[:, None],
            positions(start, 1, token.shape[0], token.device),
            None,
            inference_context=self.context,
            runtime_gather_output=True,
        )
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


def sample_next(
    logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int, generator: torch.Generator
) -> torch.Tensor:
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
def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    vocab_size: int,
    max_length: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    decoder=None,
    stop=None,
) -> torch.Tensor:
    """``prompt`` ``[b, p]`` -> ``[b, p + max_new_tokens]`` sampled tokens, or fewer new tokens
    where ``stop(tokens so far)`` returns True (checked after every new token)."""
    if prompt.shape[1] < 1:
        raise UserError("the prompt must hold at least one token")
    if prompt.shape[1] + max_new_tokens > max_length:
        raise UserError(
            f"prompt ({prompt.shape[1]}) + max new tokens ({max_new_tokens}) exceeds "
            f"the model's seq_length {max_length}"
        )
    generator = torch.Generator().manual_seed(seed)
    decoder = decoder or decoder_for(model, max_length, use_cache)
    logits = decoder.prefill(prompt)
    out = [prompt]
    for i in range(max_new_tokens):
        token = sample_next(logits, vocab_size, temperature, top_k, generator)
        out.append(token[:, None])
        if i + 1 == max_new_tokens or (stop is not None and stop(torch.cat(out, 1))):
            break
        logits = decoder.next(token)
    return torch.cat(out, 1)
