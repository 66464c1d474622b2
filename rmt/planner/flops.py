"""Parameters, forward FLOPs and activation bytes per token of the transformer and the RMT.

Two counts for each architecture:

* **exact**: what :func:`rmt.models.build` builds (megatron GPTModel with the local spec:
  biased linears, LayerNorm with bias or RMSNorm, learned positions unless RoPE, untied output
  layer, vocabulary padded to ``make_vocab_size_divisible_by``; the RMT of
  :mod:`rmt.models.rmt`). Parameter counts equal ``sum(p.numel())`` of the built model.
* **paper**: Table 7 of the RMT paper (Appendix A, after Hoffmann et al.) as printed, with one
  repair: the transformer's FLOPs ``4N(V + ...)`` lack the factor D on V (Chinchilla's
  ``2NVD`` embedding + ``2NVD`` logits); ``D V`` is used.

``differences`` itemizes ``exact - paper`` term by term (the items sum to the difference).

FLOP convention (both counts): 2 FLOPs per multiply-accumulate, attention scores and
attention-weighted values over the full ``N x N`` (no causal discount) plus 3 FLOPs per logit
for the softmax, as Table 7. Exact counts treat embedding lookups as gathers (0 FLOPs) and
skip norms, biases and residual adds.

Activation bytes per token: tensors kept for the backward pass of one training step without
recomputation (inputs of every matmul and norm, GELU input and output, attention
probabilities ``heads x N`` of an unfused softmax), in the model dtype, plus the fp32 logits.
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List

from rmt.config import RMTConfig, load_config
from rmt.errors import UserError
from rmt.planner.recurrent_ops import recurrent_ops_per_sample, transformer_ops_per_sample

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def _pad(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def transformer_counts(L: int, D: int, H: int, Dh: int, Dff: int, V: int, N: int,
                       Vp: int = None, position: str = "learned", normalization: str = "LayerNorm",
                       dtype_bytes: int = 4) -> Dict:
    """Exact and Table 7 counts of megatron's GPTModel (local spec, linear biases on)."""
    Vp = V if Vp is None else Vp
    A = H * Dh
    norm = 2 * D if normalization == "LayerNorm" else D
    learned = position == "learned"
    params = (Vp * D + (N * D if learned else 0)
              + L * (norm + D * 3 * A + 3 * A + A * D + D + norm + D * Dff + Dff + Dff * D + D)
              + norm + Vp * D)
    paper_params = D * (L * (4 * H * Dh + 2 * Dff) + V)
    diff_params = [
        ("linear biases L(3 H Dh + 2 D + Dff), not counted", L * (3 * A + 2 * D + Dff)),
        (f"{normalization} parameters (2L+1) x {norm}, not counted", (2 * L + 1) * norm),
        ("learned position table N D, not counted" if learned else "RoPE: no position table", N * D if learned else 0),
        ("untied output layer V D (Table 7 counts one V D table)", V * D),
        ("vocabulary padded to Vp, input and output tables 2 D (Vp - V)", 2 * D * (Vp - V)),
    ]
    layer_flops = 2 * D * 3 * A + 2 * N * A + 3 * H * N + 2 * N * A + 2 * A * D + 4 * D * Dff
    flops = L * layer_flops + 2 * D * Vp
    paper_flops = 4 * (D * V + L * D * (2 * Dh * H + Dff) + L * (N * Dh * H + 0.75 * N * H))
    diff_flops = [
        ("embedding lookup is a gather; Chinchilla counts it as a one-hot matmul (2 D V)", -2 * D * V),
        ("logits over the padded vocabulary 2 D (Vp - V)", 2 * D * (Vp - V)),
    ]
    layer_act = 4 * D + 4 * A + H * N + 2 * Dff
    act = (L * layer_act + 2 * D) * dtype_bytes + 4 * Vp
    return _doc("transformer", params, paper_params, diff_params, flops, paper_flops, diff_flops, act)


def rmt_counts(L: int, Dk: int, Dv: int, R: int, Dff: int, V: int, N: int, Vp: int = None,
               position: str = "alibi", dtype_bytes: int = 4) -> Dict:
    """Exact and Table 7 counts of :class:`rmt.models.rmt.RMTModel`."""
    Vp = V if Vp is None else Vp
    learned = position == "learned"
    params = (Vp * Dv * R + Dk * R + ((N * Dv * R + Dk * R) if learned else 0)
              + L * (2 * Dk * Dv + 3 * R * Dk + R * Dk + R * Dk + 2 * R * Dv * Dff + R * Dk)
              + Dk * Dv + R * Dk + Vp * Dv * R)
    paper_params = R * (2 * Dk * (3 * L + 1) + Dv * (2 * L * Dff + V + N))
    diff_params = [
        ("unembedding table R Dv V: in A.1's itemization, missing from its total", R * Dv * V),
        ("unembedding read keys R Dk: in A.1's itemization, missing from its total", R * Dk),
        ("RMSNorm gains (2L+1) Dk Dv, not counted", (2 * L + 1) * Dk * Dv),
        ("vocabulary padded to Vp, embedding and unembedding 2 R Dv (Vp - V)", 2 * R * Dv * (Vp - V)),
    ]
    if not learned:
        diff_params.append(("ALiBi: no position table R N Dv and no position keys R Dk",
                            -(R * N * Dv + R * Dk)))
    key = 2 * Dk * Dv * R  # one read or write of R vectors, per token
    layer_flops = 3 * key + 2 * N * Dv * R + 3 * R * N + 2 * N * Dv * R + key + 4 * R * Dv * Dff + 2 * key
    flops = key * (2 if learned else 1) + L * layer_flops + key + 2 * R * Dv * Vp
    paper_flops = 6 * R * Dk * Dv * (1 + L) + R * (4 * V * Dv + L * (4 * N * Dv + 3 * N + 4 * Dv * Dff))
    diff_flops = [
        ("layer key vectors: A.2 itemizes 12 Dk Dv R per layer, its total has 6", 6 * L * Dk * Dv * R),
        ("word and position lookups are gathers; the total counts them as one-hot matmuls (4 V R Dv)",
         -4 * V * R * Dv),
        ("unembedding logits 2 R Dv Vp: in A.2's itemization, missing from its total", 2 * R * Dv * Vp),
    ]
    if not learned:
        diff_flops.append(("ALiBi: no position-key write (2 Dk Dv R)", -key))
    layer_act = 4 * Dk * Dv + 5 * R * Dv + R * N + 2 * Dff
    act = (L * layer_act + 2 * Dk * Dv + R * Dv) * dtype_bytes + 4 * Vp
    return _doc("rmt", params, paper_params, diff_params, flops, paper_flops, diff_flops, act)


def _doc(arch, params, paper_params, diff_params, flops, paper_flops, diff_flops, act):
    return {
        "arch": arch,
        "params": params,
        "paper_params": paper_params,
        "params_differences": [{"item": k, "count": v} for k, v in diff_params if v],
        "flops_per_token": flops,
        "paper_flops_per_token": paper_flops,
        "flops_differences": [{"item": k, "count": v} for k, v in diff_flops if v],
        "activation_bytes_per_token": act,
    }


def _with_per_sequence(doc: Dict, N: int) -> Dict:
    doc["flops_per_sequence"] = doc["flops_per_token"] * N
    doc["paper_flops_per_sequence"] = doc["paper_flops_per_token"] * N
    return doc


def recurrent_plan(config: RMTConfig) -> Dict:
    """Ops per sample of the recurrent transformer against a regular transformer of the same
    shape (the paper's accounting, :mod:`rmt.planner.recurrent_ops`)."""
    m = config.model
    recurrent = recurrent_ops_per_sample(m.num_layers, m.hidden_size, m.seq_length, m.block_width)
    regular = transformer_ops_per_sample(m.num_layers, m.hidden_size, m.seq_length)
    return {"arch": "recurrent", "ops_per_sample": recurrent, "transformer_ops_per_sample": regular,
            "ops_ratio_recurrent_over_transformer": recurrent / regular}


def plan_model(config: RMTConfig) -> Dict:
    """Counts for ``config.model`` (``arch`` transformer, rmt or recurrent)."""
    m = config.model
    if m.arch == "recurrent":
        return recurrent_plan(config)
    if m.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count parameters")
    Vp = _pad(m.vocab_size, m.make_vocab_size_divisible_by)
    dtype = DTYPE_BYTES[config.train.precision]
    if m.arch == "transformer":
        doc = transformer_counts(m.num_layers, m.hidden_size, m.num_attention_heads,
                                 m.hidden_size // m.num_attention_heads,
                                 m.ffn_hidden_size or 4 * m.hidden_size, m.vocab_size,
                                 m.seq_length, Vp, m.position, m.normalization, dtype)
    elif m.arch == "rmt":
        doc = rmt_counts(m.num_layers, m.dk, m.dv, m.rank, m.ffn_hidden_size or 4 * m.rank * m.dv,
                         m.vocab_size, m.seq_length, Vp, m.position, dtype)
    else:
        raise ValueError(f"model.arch '{m.arch}' has no FLOP model; valid: transformer, rmt, recurrent")
    return _with_per_sequence(doc, m.seq_length)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (model.arch transformer, rmt or recurrent)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")


def _lines(doc: Dict) -> List[str]:
    if doc["arch"] == "recurrent":
        return [f"recurrent: ops per sample r(4dlk + 2ld^2) = {doc['ops_per_sample']:,}",
                f"transformer of the same shape: r(l^2 d + l d^2) = {doc['transformer_ops_per_sample']:,}",
                f"ratio recurrent / transformer = {doc['ops_ratio_recurrent_over_transformer']:.3f}"]
    out = [f"{doc['arch']}: parameters {doc['params']:,} (Table 7 formula: "
           f"{doc['paper_params']:,.0f}, exact - formula = {doc['params'] - doc['paper_params']:+,.0f})"]
    out += [f"  {d['count']:+16,}  {d['item']}" for d in doc["params_differences"]]
    out.append(f"forward FLOPs per token {doc['flops_per_token']:,} (Table 7 formula: "
               f"{doc['paper_flops_per_token']:,.0f}; per sequence {doc['flops_per_sequence']:,})")
    out += [f"  {d['count']:+16,}  {d['item']}" for d in doc["flops_differences"]]
    out.append(f"activation bytes per token (training, no recompute): "
               f"{doc['activation_bytes_per_token']:,}")
    return out


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
    except UserError as err:
        raise ValueError(str(err)) from None
    doc = plan_model(config)
    print("\n".join(_lines(doc)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0
