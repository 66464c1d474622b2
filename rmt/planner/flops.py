"""Parameters, forward FLOPs and activation bytes per token of every architecture (transformer,
RMT, recurrent transformer, masked / repeat mixer) with its memory layers (UltraMem, PKM, MoE;
:mod:`rmt.planner.memory_layers`).

Two counts for the transformer and the RMT (the exact one for the others):

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
recomputation (inputs of every matmul and norm, GELU input and output, a gated layer's
:func:`ffn_kept_elements`; the RMT's norms are
fused with the reads after them, which keep the norm's input only; of the attention, the
fused kernel's fp32 log-sum-exp per head, or with megatron's kernels the softmax's
probabilities ``heads x N``; under ``model.dropout`` each dropout's one-byte mask, as a GPU's
fused dropout keeps it, and the attention's dropped probabilities), in the model dtype, plus the fp32 logits
(transformer and RMT; memory layers at skip placements not included). Under ``train.recompute_*``
(:func:`recomputed_activation_bytes`) a recomputed span keeps only its input hidden state.

The recurrent transformer (:mod:`rmt.models.recurrent`) runs its layer on windows: per layer
two of k tokens and ``ceil(N/k) - 1`` of 2k (the sequence padded to a multiple of k), attention
within each window. The mixer (:mod:`rmt.models.mixer`) applies its token mixing as a dense
``N x N`` product per head (``2 N D`` per token), FFN with SiLU, biased linears.

Memory layers add their parameters and FLOPs (itemized under ``memory``; in the Table 7
differences as one item each). ``non_embedding_params`` leaves out the token and position
tables and the output layer (UltraMem Table 6's "Param"); ``activated_non_embedding_params``
further leaves out the experts and value rows a token does not use (2x it is Table 6's FLOPs).
"""

from __future__ import annotations

import argparse
from typing import Dict, List

from rmt.config import RMTConfig, load_config
from rmt.errors import UserError
from rmt.memory.byte_sizes import DTYPE_BYTES
from rmt.models.vocab import padded_vocab_size
from rmt.outputs import write_json
from rmt.planner.recurrent_ops import recurrent_ops_per_sample, transformer_ops_per_sample


def norm_params(normalization: str, D: int) -> int:
    """Parameters of one norm of a width-``D`` hidden state: LayerNorm's gain and bias, RMSNorm's
    gain."""
    return 2 * D if normalization == "LayerNorm" else D


def qkv_width(H: int, G: int, Dh: int) -> int:
    """Output width of the fused query-key-value projection: ``H`` query heads and ``G`` key and
    value heads (grouped-query attention; ``G = H`` multi-head) of width ``Dh``."""
    return (H + 2 * G) * Dh


def fc1_width(Dff: int, glu: bool) -> int:
    """Output width of the feed-forward layer's first linear: both halves of a gated one."""
    return 2 * Dff if glu else Dff


def ffn_kept_elements(Dff: int, glu: bool) -> int:
    """Elements per token the feed-forward layer keeps between its linears for the backward:
    the activation's input and output (``2 Dff``), or in megatron's gated layer the first
    linear's biased output (both halves), the activation's output, the linear half plus
    ``glu_linear_offset`` (a new tensor) and their product: ``5 Dff``."""
    return 5 * Dff if glu else 2 * Dff


def linear_biases(D: int, qkv: int, f1: int, bias: bool = True) -> int:
    """Bias elements of one layer's four linears (none without ``model.add_bias_linear``)."""
    return qkv + D + f1 + D if bias else 0


def _layer_counts(
    D: int, H: int, Dh: int, Dff: int, w: int, norm: int, G: int = 0, glu: bool = False, bias: bool = True
) -> Dict:
    """One megatron transformer layer (local spec; ``G`` key-value heads, 0: ``H``; ``glu``: a
    gated feed-forward layer; ``bias``: biased linears) on a sequence of ``w`` tokens: its
    parameters and forward FLOPs (attention over all ``w x w`` pairs)."""
    A, qkv, f1 = H * Dh, qkv_width(H, G or H, Dh), fc1_width(Dff, glu)
    params = 2 * norm + D * qkv + A * D + D * f1 + Dff * D + linear_biases(D, qkv, f1, bias)
    flops = w * (2 * D * qkv + 2 * A * D + 2 * D * f1 + 2 * Dff * D) + w * w * (4 * A + 3 * H)
    return {"params": params, "flops": flops}


def transformer_counts(
    L: int,
    D: int,
    H: int,
    Dh: int,
    Dff: int,
    V: int,
    N: int,
    Vp: int = None,
    position: str = "learned",
    normalization: str = "LayerNorm",
    dtype_bytes: int = 4,
    fused_attention: bool = True,
    dropout: bool = False,
    groups: int = 0,
    glu: bool = False,
    bias: bool = True,
) -> Dict:
    """Exact and Table 7 counts of megatron's GPTModel (local spec);
    ``fused_attention``: ``model.attention_kernel`` is ``sdpa``; ``dropout``: ``model.dropout``
    is on; ``groups``: key-value heads of grouped-query attention (0: ``H``); ``glu``: gated
    feed-forward layers; ``bias``: biased linears."""
    Vp = V if Vp is None else Vp
    A = H * Dh
    G = groups or H
    qkv, f1 = qkv_width(H, G, Dh), fc1_width(Dff, glu)
    norm = norm_params(normalization, D)
    learned = position == "learned"
    layer = _layer_counts(D, H, Dh, Dff, N, norm, G, glu, bias)
    params = Vp * D + (N * D if learned else 0) + L * layer["params"] + norm + Vp * D
    paper_params = D * (L * (4 * H * Dh + 2 * Dff) + V)
    diff_params = [
        ("grouped-query attention: key and value weights L D 2 (G - H) Dh", L * D * 2 * (G - H) * Dh),
        ("gated feed-forward layers: the second half of the first linear L D Dff", L * D * (f1 - Dff)),
        ("linear biases L(qkv + 2 D + fc1), not counted", L * linear_biases(D, qkv, f1, bias)),
        (f"{normalization} parameters (2L+1) x {norm}, not counted", (2 * L + 1) * norm),
        ("learned position table N D, not counted" if learned else "RoPE: no position table", N * D if learned else 0),
        ("untied output layer V D (Table 7 counts one V D table)", V * D),
        ("vocabulary padded to Vp, input and output tables 2 D (Vp - V)", 2 * D * (Vp - V)),
    ]
    flops = L * layer["flops"] // N + 2 * D * Vp
    paper_flops = 4 * (D * V + L * D * (2 * Dh * H + Dff) + L * (N * Dh * H + 0.75 * N * H))
    diff_flops = [
        ("grouped-query attention: key and value projections 4 L D (G - H) Dh", 4 * L * D * (G - H) * Dh),
        ("gated feed-forward layers: the first linear's second half 2 L D Dff", 2 * L * D * (f1 - Dff)),
        ("embedding lookup is a gather; Chinchilla counts it as a one-hot matmul (2 D V)", -2 * D * V),
        ("logits over the padded vocabulary 2 D (Vp - V)", 2 * D * (Vp - V)),
    ]
    layer_act = 4 * D + 4 * A + ffn_kept_elements(Dff, glu)
    mask = 1 if dropout else 0  # bytes a dropout keeps an element (a GPU's bool mask)
    # the core attention's own state: the fused kernel's log-sum-exp, or the probabilities and
    # under dropout its mask and the dropped probabilities
    dropped = dtype_bytes + mask if dropout else 0
    core = attention_lse_bytes(H, True) if fused_attention else H * N * (dtype_bytes + dropped)
    layer_bytes = layer_act * dtype_bytes + core + 2 * D * mask  # the hidden dropouts' masks
    act = L * layer_bytes + 2 * D * dtype_bytes + D * mask + 4 * Vp  # and the embedding's
    doc = _doc("transformer", params, paper_params, diff_params, flops, paper_flops, diff_flops, act)
    doc["layer_activation_bytes_per_token"] = layer_bytes
    doc["core_attention_bytes_per_token"] = core
    doc["hidden_bytes_per_token"] = D * dtype_bytes
    doc["first_layer_input_counted"] = True  # among the 2 D: the embedding's output
    return doc


def rmt_counts(
    L: int,
    Dk: int,
    Dv: int,
    R: int,
    Dff: int,
    V: int,
    N: int,
    Vp: int = None,
    position: str = "alibi",
    dtype_bytes: int = 4,
    micro_batch: int = 1,
) -> Dict:
    """Exact and Table 7 counts of :class:`rmt.models.rmt.RMTModel`; ``micro_batch`` samples
    share one fp32 attention bias ``[R, N, N]`` (kept as the attention's input)."""
    Vp = V if Vp is None else Vp
    learned = position == "learned"
    params = (
        Vp * Dv * R
        + Dk * R
        + ((N * Dv * R + Dk * R) if learned else 0)
        + L * (2 * Dk * Dv + 3 * R * Dk + R * Dk + R * Dk + 2 * R * Dv * Dff + R * Dk)
        + Dk * Dv
        + R * Dk
        + Vp * Dv * R
    )
    paper_params = R * (2 * Dk * (3 * L + 1) + Dv * (2 * L * Dff + V + N))
    diff_params = [
        ("unembedding table R Dv V: in A.1's itemization, missing from its total", R * Dv * V),
        ("unembedding read keys R Dk: in A.1's itemization, missing from its total", R * Dk),
        ("RMSNorm gains (2L+1) Dk Dv, not counted", (2 * L + 1) * Dk * Dv),
        ("vocabulary padded to Vp, embedding and unembedding 2 R Dv (Vp - V)", 2 * R * Dv * (Vp - V)),
    ]
    if not learned:
        diff_params.append(("ALiBi: no position table R N Dv and no position keys R Dk", -(R * N * Dv + R * Dk)))
    key = 2 * Dk * Dv * R  # one read or write of R vectors, per token
    layer_flops = 3 * key + 2 * N * Dv * R + 3 * R * N + 2 * N * Dv * R + key + 4 * R * Dv * Dff + 2 * key
    flops = key * (2 if learned else 1) + L * layer_flops + key + 2 * R * Dv * Vp
    paper_flops = 6 * R * Dk * Dv * (1 + L) + R * (4 * V * Dv + L * (4 * N * Dv + 3 * N + 4 * Dv * Dff))
    diff_flops = [
        ("layer key vectors: A.2 itemizes 12 Dk Dv R per layer, its total has 6", 6 * L * Dk * Dv * R),
        ("word and position lookups are gathers; the total counts them as one-hot matmuls (4 V R Dv)", -4 * V * R * Dv),
        ("unembedding logits 2 R Dv Vp: in A.2's itemization, missing from its total", 2 * R * Dv * Vp),
    ]
    if not learned:
        diff_flops.append(("ALiBi: no position-key write (2 Dk Dv R)", -key))
    # The RMT's norms are fused with the reads that follow them: only their input is kept.
    layer_act = 2 * Dk * Dv + 5 * R * Dv + 2 * Dff
    # besides the layers: the embedding write's gathered rows R Dv, the final norm's input Dk Dv,
    # the unembedding's reads R Dv, the logits, and the bias shared by the micro-batch
    act = (
        (L * layer_act + Dk * Dv + 2 * R * Dv) * dtype_bytes
        + L * attention_lse_bytes(R, True)
        + 4 * Vp
        + 4 * R * N // micro_batch
    )
    doc = _doc("rmt", params, paper_params, diff_params, flops, paper_flops, diff_flops, act)
    doc["first_layer_input_counted"] = False  # the embedding's output: kept by layer 1 only
    doc["layer_activation_bytes_per_token"] = layer_act * dtype_bytes + attention_lse_bytes(R, True)
    doc["core_attention_bytes_per_token"] = attention_lse_bytes(R, True)
    doc["hidden_bytes_per_token"] = Dk * Dv * dtype_bytes
    return doc


def attention_lse_bytes(heads: int, fused: bool) -> int:
    """Per token and layer, what a fused attention kernel keeps for its backward besides its
    inputs and output: one fp32 log-sum-exp per head (none for the unfused kernel, whose
    probabilities are counted in the model dtype)."""
    return 4 * heads if fused else 0


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


def recurrent_counts(config: RMTConfig, Vp: int) -> Dict:
    """Exact counts of :class:`rmt.models.recurrent.RecurrentTransformer` (module docstring),
    with the paper's ops per sample (§5.1, :mod:`rmt.planner.recurrent_ops`) beside them."""
    m = config.model
    D, H, L, N, k = m.hidden_size, m.num_attention_heads, m.num_layers, m.seq_length, m.block_width
    Dff = m.ffn_hidden_size or 4 * D
    norm = norm_params(m.normalization, D)
    blocks = -(-N // k)
    block, window = (_layer_counts(D, H, D // H, Dff, w, norm) for w in (k, 2 * k))
    embedding = Vp * D + m.position_rows() * D + Vp * D  # tokens, positions, output layer
    params = embedding + L * (block["params"] + 1) + norm
    flops = L * (2 * block["flops"] + (blocks - 1) * window["flops"]) + N * 2 * D * Vp
    recurrent = recurrent_ops_per_sample(L, D, N, k)
    regular = transformer_ops_per_sample(L, D, N)
    return {
        "arch": "recurrent",
        "params": params,
        "embedding_params": embedding,
        "flops_per_sequence": flops,
        "flops_per_token": flops / N,
        "ops_per_sample": recurrent,
        "transformer_ops_per_sample": regular,
        "ops_ratio_recurrent_over_transformer": recurrent / regular,
    }


def mixer_counts(config: RMTConfig, Vp: int) -> Dict:
    """Exact counts of :class:`rmt.models.mixer.MixerModel` (module docstring)."""
    m = config.model
    D, H, L, N = m.hidden_size, m.num_attention_heads, m.num_layers, m.seq_length
    Dff = m.ffn_hidden_size or 4 * D
    norm = norm_params(m.normalization, D)
    token = H * N * N if m.mixer_kind == "masked" else H * N
    layer = norm + D * Dff + Dff + Dff * D + D + norm + 2 * (D * D + D) + token + H * N + (H if m.mixer_decay else 0)
    params = Vp * D + L * layer + norm + Vp * D
    flops = L * (4 * D * Dff + 4 * D * D + 2 * N * D) + 2 * D * Vp
    return {"arch": "mixer", "params": params, "embedding_params": 2 * Vp * D, "flops_per_token": flops}


def _moe_mlp(doc: Dict, config: RMTConfig, plan: Dict) -> None:
    """MoE MLPs replacing dense ones (``memory.moe_placement: mlp``): swap their counts. Their
    activations: the k routed copies of the token and each expert's GELU input and output
    (``k (D + 2F)``) and the router's logits and probabilities (``2N``), for the dense ``2 Dff``."""
    from rmt.memory.shapes import expert_hidden_size

    m, mem = config.model, config.memory
    D, Dff = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size
    n = len(plan["layers"])
    dense_params, dense_flops = n * (2 * D * Dff + Dff + D), n * 4 * D * Dff
    doc["params"] += plan["params"] - dense_params
    doc["flops_per_token"] += plan["flops_per_token"] - dense_flops
    item = f"MoE MLPs in layers {','.join(l['placement'] for l in plan['layers'])} instead of dense ones"
    doc["params_differences"].append({"item": item, "count": plan["params"] - dense_params})
    doc["flops_differences"].append({"item": item, "count": plan["flops_per_token"] - dense_flops})
    moe_act = mem.moe_topk * (D + 2 * expert_hidden_size(config)) + 2 * mem.num_experts
    doc["activation_bytes_per_token"] += n * (moe_act - 2 * Dff) * DTYPE_BYTES[config.train.precision]


def plan_model(config: RMTConfig) -> Dict:
    """Counts for ``config.model`` and its ``config.memory`` layers."""
    m = config.model
    if m.vocab_size is None:
        from rmt.data.metadata import known_vocab_size

        m.vocab_size = known_vocab_size(config)
        if m.vocab_size is None:
            raise ValueError(
                "model.vocab_size must be set to count parameters (only the byte tokenizer's "
                "vocabulary and a dataset's recorded one are known without building data)"
            )
    Vp = padded_vocab_size(config)
    dtype = DTYPE_BYTES[config.train.precision]
    learned = m.position == "learned"
    if m.arch == "transformer":
        doc = transformer_counts(
            m.num_layers,
            m.hidden_size,
            m.num_attention_heads,
            m.hidden_size // m.num_attention_heads,
            m.ffn_hidden_size or 4 * m.hidden_size,
            m.vocab_size,
            m.seq_length,
            Vp,
            m.position,
            m.normalization,
            dtype,
            fused_attention=m.attention_kernel == "sdpa",
            dropout=m.dropout > 0,
            groups=m.num_query_groups or 0,
            glu=m.gated_linear_unit,
            bias=m.add_bias_linear,
        )
        doc["embedding_params"] = 2 * Vp * m.hidden_size + (m.seq_length * m.hidden_size if learned else 0)
    elif m.arch == "rmt":
        doc = rmt_counts(
            m.num_layers,
            m.dk,
            m.dv,
            m.rank,
            m.ffn_hidden_size or 4 * m.rank * m.dv,
            m.vocab_size,
            m.seq_length,
            Vp,
            m.position,
            dtype,
            config.train.micro_batch_size,
        )
        doc["embedding_params"] = 2 * Vp * m.dv * m.rank + (m.seq_length * m.dv * m.rank if learned else 0)
    elif m.arch == "recurrent":
        doc = recurrent_counts(config, Vp)
    elif m.arch == "mixer":
        doc = mixer_counts(config, Vp)
    else:
        raise ValueError(f"model.arch '{m.arch}' has no FLOP model; valid: transformer, rmt, recurrent, mixer")
    inactive = 0
    if config.memory.type != "none":
        from rmt.planner.memory_layers import memory_plan  # imports rmt.memory (megatron-core)

        plan = doc["memory"] = memory_plan(config)
        (_moe_mlp(doc, config, plan) if plan["placement"] == "mlp" else _add_memory(doc, plan))
        inactive = plan["params"] - plan["activated_params"]
    doc["non_embedding_params"] = doc["params"] - doc["embedding_params"]
    doc["activated_non_embedding_params"] = doc["non_embedding_params"] - inactive
    if "flops_per_sequence" not in doc:
        doc["flops_per_sequence"] = doc["flops_per_token"] * m.seq_length
    if "paper_flops_per_token" in doc:
        doc["paper_flops_per_sequence"] = doc["paper_flops_per_token"] * m.seq_length
    if "activation_bytes_per_token" in doc:
        doc["recompute_granularity"] = config.train.recompute_granularity
        doc["recomputed_activation_bytes_per_token"] = recomputed_activation_bytes(doc, config)
    return doc


def recomputed_activation_bytes(doc: Dict, config: RMTConfig) -> int:
    """Activation bytes per token kept for the backward under ``train.recompute_*`` (the
    transformer's and the RMT's model above). ``selective``: every layer without its core
    attention's own state (its inputs stay, the kept tensors of the layer's other ops);
    ``full``: each recomputed span keeps its input hidden state instead of its layers'
    activations (``uniform``: all layers in ``L / n`` spans; ``block``: ``n`` single-layer spans
    per model chunk), the first span's being the first layer's input, which the count above
    may hold already. The transient of the one span recomputed at a time in the backward is not
    included."""
    t, m, p = config.train, config.model, config.parallel
    act, L = doc["activation_bytes_per_token"], m.num_layers
    if t.recompute_granularity == "none":
        return act
    if t.recompute_granularity == "selective":
        return act - L * doc["core_attention_bytes_per_token"]
    n = t.recompute_num_layers
    chunks = p.pipeline_model_parallel_size * (p.virtual_pipeline_model_parallel_size or 1)
    recomputed, spans = (L, L // n) if t.recompute_method == "uniform" else (chunks * n, chunks * n)
    spans -= doc["first_layer_input_counted"]  # the first span's input is the first layer's
    return act - recomputed * doc["layer_activation_bytes_per_token"] + spans * doc["hidden_bytes_per_token"]


def _add_memory(doc: Dict, plan: Dict) -> None:
    """Memory layers at skip placements: their counts on top of the architecture's."""
    doc["params"] += plan["params"]
    doc["flops_per_token"] += plan["flops_per_token"]
    if "params_differences" in doc:
        item = f"{plan['type']} memory layers at {'/'.join(l['placement'] for l in plan['layers'])} (not in Table 7)"
        doc["params_differences"].append({"item": item, "count": plan["params"]})
        doc["flops_differences"].append({"item": item, "count": plan["flops_per_token"]})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        help="YAML config (model.arch transformer, rmt, recurrent or mixer; memory.* layers counted)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")


def _lines(doc: Dict) -> List[str]:
    paper = "paper_params" in doc
    head = (
        f"{doc['arch']}: parameters {doc['params']:,} (without embeddings {doc['non_embedding_params']:,}; "
        f"activated per token {doc['activated_non_embedding_params']:,})"
    )
    out = [head]
    if paper:
        out.append(
            f"  Table 7 formula: {doc['paper_params']:,.0f}, exact - formula = "
            f"{doc['params'] - doc['paper_params']:+,.0f}"
        )
        out += [f"  {d['count']:+16,}  {d['item']}" for d in doc["params_differences"]]
    out.append(f"forward FLOPs per token {doc['flops_per_token']:,.0f} (per sequence {doc['flops_per_sequence']:,})")
    if paper:
        out.append(f"  Table 7 formula: {doc['paper_flops_per_token']:,.0f}")
        out += [f"  {d['count']:+16,}  {d['item']}" for d in doc["flops_differences"]]
    if "memory" in doc:
        mem = doc["memory"]
        out.append(
            f"{mem['type']} ({mem['placement']}): parameters {mem['params']:,}, activated per token "
            f"{mem['activated_params']:,}, forward FLOPs per token {mem['flops_per_token']:,}"
        )
        out += [
            f"  {l['placement']:>8}  parameters {l['params']:,}  activated {l['activated_params']:,}  "
            f"FLOPs/token {l['flops_per_token']:,}"
            for l in mem["layers"]
        ]
        if "memory_over_ffn_flops" in mem:
            out.append(f"  memory / FFN forward FLOPs per layer {mem['memory_over_ffn_flops']:.3f}")
    if "ops_per_sample" in doc:
        out += [
            f"paper accounting (§5.1): ops per sample r(4dlk + 2ld^2) = {doc['ops_per_sample']:,}; "
            f"transformer of the same shape r(l^2 d + l d^2) = {doc['transformer_ops_per_sample']:,}; "
            f"ratio {doc['ops_ratio_recurrent_over_transformer']:.3f}"
        ]
    if "activation_bytes_per_token" in doc:
        out.append(f"activation bytes per token (training, no recompute): {doc['activation_bytes_per_token']:,}")
        if doc["recompute_granularity"] != "none":
            out.append(
                f"activation bytes per token (train.recompute_granularity {doc['recompute_granularity']}): "
                f"{doc['recomputed_activation_bytes_per_token']:,}"
            )
    return out


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.overrides)
        doc = plan_model(config)
    except UserError as err:
        raise ValueError(str(err)) from None
    print("\n".join(_lines(doc)))
    if args.json:
        write_json(args.json, doc)
    return 0
