"""Decode latency and weight bytes touched per step: dense vs MoE vs UltraMem vs UltraMemV2
(UltraMem arXiv 2411.12364, Fig. 1b/1c, Fig. 6c, Fig. 7; UltraMemV2 arXiv 2508.18756).

One decode step = sequence length 1 against a static KV cache of ``--kv-len`` tokens, through L
pre-LN layers (attention + GELU FFN). Models, side by side in one run:

* dense: the layers alone;
* ultramem: dense + UltraMem layers (``rmt.memory.MemoryLayer``, every §3.2 improvement on) at
  skip placements, sparse parameters ``--expansion`` x the dense ones (same activated compute as
  dense plus the small memory query/retrieval);
* moe: every FFN replaced by megatron-core's MoE (``rmt.memory.SkipMoE``: LayerNorm, top-k
  router, experts; one process, no expert parallelism): top-2 of N experts (granularity 2) whose
  inner width is widened
  from 2D so that MoE's activated compute equals UltraMem's (dense + memory layers, counted by
  :func:`ultramem_macs`), N chosen so total parameters equal UltraMem's: the paper's setting
  (§5.1 "we slightly increased the width of MoE's experts to match UltraMem's computational and
  parameter costs"; Table 9: MoE-1.6B-2in34 3.52 GFLOPs vs UltraMem-1.6B-x12 3.50);
* ultramem_tenth: UltraMem with a tenth of the slots at the same top-m; ``ultramem`` over it is
  the latency growth for 10x slots (Fig. 6c; growing downwards keeps the default size in RAM).
* ultramem_v2: dense + an UltraMemV2 layer (``rmt.memory.layer_v2.UltraMemV2Layer``) beside the
  FFN of every layer, reading the FFN's normed input, at the authors' README proportions (one
  head, key dim, value dim and pre-value dim D/4, no key expansion; their 227M/1.2B run): top-m
  32 = UltraMem's 2 heads x 16 retrieved rows, and slots per layer so that its value and
  pre-value tables hold as many parameters as UltraMem's tables (same total sparse parameters).
  The dense layers are UltraMem's (the authors' smaller FFN is not applied), so its latency over
  UltraMem's is the memory layers' alone.

Sizes: the default is the width of the paper's smallest models (Table 6/9, 151M class: hidden
1024, 16 heads, inner 4096, UltraMem top-16 x 2 heads, key dim 256), with 4 layers instead of 12
to fit 24 GB and a few minutes; ``--quick`` is hidden 256, 8 heads. At hidden 256 retrieval's
per-token work (key scores over sqrt(N) keys, candidate selection) is large next to the dense
layers; at LLM widths the dense weights dominate a decode step, as in the paper.

Bytes touched = dense weights + the experts / value rows the step's routing actually selected
(fp32). Latency = median over ``--reps`` decode steps on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import rmt

rmt.setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402
from rmt.memory import MemoryLayer, MemorySpec, SkipMoE  # noqa: E402
from rmt.memory.layer_v2 import UltraMemV2Layer  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, cache):
        """x [1, b, d]; cache = (k, v) [b, heads, kv + 1, hd], a static (preallocated) KV cache:
        this step's key and value are written in place at the last position, then attended to
        with the kv before them."""
        b, d = x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.norm(x[0])).view(b, 3, self.heads, d // self.heads).unbind(1)
        cache[0][:, :, -1] = k
        cache[1][:, :, -1] = v
        o = F.scaled_dot_product_attention(q.unsqueeze(2), cache[0], cache[1])
        return self.out(o.reshape(b, d)).unsqueeze(0)


class DenseFFN(torch.nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, inner, bias=False)
        self.fc2 = torch.nn.Linear(inner, d, bias=False)

    def forward(self, x, state=None):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class DecodeModel(torch.nn.Module):
    """L layers of attention + FFN (dense or MoE) with memory modules at skip ``placement``s, or
    with ``beside_ffn`` one memory per layer reading the FFN's normed input (UltraMemV2)."""

    def __init__(self, d, heads, layers, ffn_factory, memory=None, placement=(), beside_ffn=False):
        super().__init__()
        self.attn = torch.nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.ffn = torch.nn.ModuleList(ffn_factory() for _ in range(layers))
        self.memory = torch.nn.ModuleList(memory or [])
        self.placement = list(placement)
        self.beside_ffn = beside_ffn

    @torch.no_grad()
    def step(self, x, caches, states):
        kept = {}
        for n, (attn, ffn) in enumerate(zip(self.attn, self.ffn), start=1):
            x = x + attn(x, caches[n - 1])
            if self.beside_ffn:
                x = x + ffn(x) + self.memory[n - 1](ffn.norm(x), states[n - 1])
                continue
            x = x + ffn(x)
            for k, (i, j) in enumerate(self.placement):
                if i == n:
                    kept[k] = x
            for k, (i, j) in enumerate(self.placement):
                if j == n:
                    x = x + self.memory[k](kept.pop(k), states[k])
        return x


def _config(d, heads, layers, memory, seed=None):
    """A validated one-process config of the decode model's width, attention heads and layers
    with ``memory``, its ``memory.*`` overrides, and ``train.seed`` ``seed`` where given (memory
    layer k's seed is ``seed * 1000 + k``)."""
    from rmt.config import load_config
    from rmt.config_checks import validate

    model = [f"model.hidden_size={d}", f"model.num_attention_heads={heads}", f"model.num_layers={layers}"]
    train = [] if seed is None else [f"train.seed={seed}"]
    overrides = model + ["model.vocab_size=256"] + train + [f"memory.{o}" for o in memory]
    return validate(load_config(None, overrides), world_size=1)


def _ultramem(d, heads, layers, placement, num_keys, topk, seed):
    """UltraMem layers at ``placement`` with every §3.2 improvement on: 2 heads, key dim d/4,
    TDQKR rank 2, 2 cores, IVE E = 4."""
    where = "/".join(f"{i}:{j}" for i, j in placement)
    memory = ["type=ultramem", f"placement='{where}'", "num_heads=2", f"topk={topk}", f"key_dim={d // 4}"]
    memory += [f"num_keys={num_keys}", "tucker_rank=2", "num_cores=2", "ive_blocks=4", "init_samples=1"]
    config = _config(d, heads, layers, memory, seed)
    return [MemoryLayer(MemorySpec.from_config(config, k)).eval() for k in range(len(placement))]


def _ultramem_v2(d, heads, layers, num_keys, topk, seed):
    """An UltraMemV2 layer beside every FFN: one head, key, value and pre-value dims d/4, TDQKR
    rank 2, 2 cores, no key expansion."""
    memory = ["type=ultramem_v2", "num_heads=1", f"topk={topk}", f"key_dim={d // 4}", f"num_keys={num_keys}"]
    memory += ["tucker_rank=2", "num_cores=2", "ive_blocks=1", f"value_dim={d // 4}", f"pre_value_dim={d // 4}"]
    config = _config(d, heads, layers, memory, seed)
    return [UltraMemV2Layer(MemorySpec.from_config(config, k)).eval() for k in range(layers)]


def ultramem_macs(spec: MemorySpec) -> int:
    """Multiply-adds per token of one UltraMem layer: causal conv, query projection, row and
    column key scores (Eq. 4), phase-2 grid scores of the 2m x 2m candidates per core (Eq. 10,
    16), weighted pooling of the H*m values and the E per-block projectors (Eq. 15)."""
    s = spec
    n, sides = s.grid, 1 if s.share_query else 2
    return (
        s.hidden_size * s.conv_kernel
        + s.hidden_size * s.num_heads * sides * s.side_dim
        + s.num_heads * 2 * n * s.side_dim
        + s.num_heads * s.num_cores * s.tucker_rank * (2 * s.topk) * (2 * s.topk + s.tucker_rank)
        + s.num_heads * s.topk * s.value_dim
        + s.ive_blocks * s.value_dim * s.hidden_size
    )


def megatron_moe(d, heads, layers, experts, inner):
    """megatron-core's MoE behind a LayerNorm (rmt's skip-placed MoE module), top-2, in a
    single-process parallel state."""
    from megatron.core import parallel_state

    from rmt import parallel
    from rmt.models.megatron_config import transformer_config

    memory = ["type=moe", "placement='1:1'", f"num_experts={experts}", "moe_topk=2", f"expert_hidden_size={inner}"]
    cfg = _config(d, heads, layers, memory)
    if not parallel_state.model_parallel_is_initialized():
        parallel.initialize(cfg)
    return SkipMoE(cfg, transformer_config(cfg)).eval()


def build_models(d, heads, layers, expansion, topk, seed=0):
    torch.manual_seed(seed)
    inner = 4 * d
    dense = DecodeModel(d, heads, layers, lambda: DenseFFN(d, inner))
    dense_params = sum(p.numel() for p in dense.parameters())
    placement = [(i, min(i + 1, layers)) for i in range(1, layers + 1, 2)]
    value_dim = d // 2
    num_keys = round(math.sqrt(expansion * dense_params / (len(placement) * value_dim)))

    def ultramem(keys):
        m = DecodeModel(
            d,
            heads,
            layers,
            lambda: DenseFFN(d, inner),
            _ultramem(d, heads, layers, placement, keys, topk, seed),
            placement,
        )
        m.load_state_dict(dense.state_dict(), strict=False)
        return m

    um = ultramem(num_keys)
    um_params = sum(p.numel() for p in um.parameters())
    memory_macs = sum(ultramem_macs(m.spec) for m in um.memory)
    # Top-2 experts of inner e: 2 * 2 d e multiply-adds = the dense FFN's 2 d 4d + memory's share.
    expert_inner = round((2 * d * inner + memory_macs / layers) / (4 * d))
    expert_params = 2 * d * expert_inner
    attn_params = sum(p.numel() for p in dense.attn.parameters())
    experts = max(2, round((um_params - attn_params) / layers / expert_params))
    moe = DecodeModel(d, heads, layers, lambda: megatron_moe(d, heads, layers, experts, expert_inner))
    tenth_keys = round(num_keys / math.sqrt(10))
    v2_dims = 2 * (d // 4)  # value + pre-value rows
    v2_keys = round(math.sqrt(len(placement) * num_keys**2 * value_dim / (layers * v2_dims)))
    v2 = DecodeModel(
        d,
        heads,
        layers,
        lambda: DenseFFN(d, inner),
        _ultramem_v2(d, heads, layers, v2_keys, 2 * topk, seed),
        beside_ffn=True,
    )
    v2.load_state_dict(dense.state_dict(), strict=False)
    return {"dense": dense, "moe": moe, "ultramem": um, "ultramem_tenth": ultramem(tenth_keys), "ultramem_v2": v2}, {
        "hidden": d,
        "layers": layers,
        "dense_params": dense_params,
        "ultramem_params": um_params,
        "moe_params": sum(p.numel() for p in moe.parameters()),
        "moe_experts": experts,
        "moe_expert_inner": expert_inner,
        "ultramem_memory_macs_per_token": memory_macs,
        "dense_ffn_macs_per_token": layers * 2 * d * inner,
        "ultramem_num_keys": num_keys,
        "ultramem_slots_per_layer": num_keys**2,
        "ultramem_topk": topk,
        "ultramem_tenth_slots_per_layer": tenth_keys**2,
        "placement": placement,
        "ultramem_v2_params": sum(p.numel() for p in v2.parameters()),
        "ultramem_v2_slots_per_layer": v2_keys**2,
        "ultramem_v2_topk": 2 * topk,
    }


def _tables(layer):
    """The value tables of a memory layer (UltraMemV2: values and pre-values)."""
    return [t for t in (layer.values, getattr(layer, "pre_values", None)) if t is not None]


def _sparse_tensors(model):
    out = set()
    for m in model.modules():
        if isinstance(m, MemoryLayer):
            out.update(t.weight for t in _tables(m))
        if isinstance(m, SkipMoE):
            out.update(m.moe.experts.parameters())
    return out


def bytes_touched(model, x, caches, states):
    """Dense weight bytes plus the sparse rows / experts one step's routing selects."""
    sparse = _sparse_tensors(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p not in sparse)
    touched = []
    hooks = []
    for m in model.modules():
        for table in _tables(m) if isinstance(m, MemoryLayer) else []:
            orig = table.lookup_reduce

            def counting(indices, scores, block_ids, num_blocks, _orig=orig, _t=table, **kwargs):
                touched.append(indices.unique().numel() * _t.dim * _t.weight.element_size())
                return _orig(indices, scores, block_ids, num_blocks, **kwargs)

            table.lookup_reduce = counting
            hooks.append((table, orig))
        if isinstance(m, SkipMoE):

            def route(mod, args, out, _m=m):
                expert = list(_m.moe.experts.local_experts[0].parameters())
                used = int(out[1].any(0).sum())  # routing map [tokens, experts]
                touched.append(used * sum(p.numel() * p.element_size() for p in expert))

            hooks.append(m.moe.router.register_forward_hook(route))
    model.step(x, caches, states)
    for h in hooks:
        if isinstance(h, tuple):
            h[0].lookup_reduce = h[1]
        else:
            h.remove()
    return total + sum(touched)


def measure(models, batch, d, heads, layers, kv_len, reps):
    """Per model: (median step latency, bytes touched). Models are timed round-robin, one step
    each per round, so load changes on a shared machine hit them alike."""
    gen = torch.Generator().manual_seed(batch)
    hd = d // heads
    caches = [tuple(torch.randn(batch, heads, kv_len + 1, hd, generator=gen) for _ in range(2)) for _ in range(layers)]
    states = {name: [{} for _ in m.memory] for name, m in models.items()}
    x = torch.randn(1, batch, d, generator=gen)
    nbytes = {name: bytes_touched(m, x, caches, states[name]) for name, m in models.items()}
    times = {name: [] for name in models}
    for r in range(reps + 2):
        x = torch.randn(1, batch, d, generator=gen)
        for name, model in models.items():
            t0 = time.perf_counter()
            model.step(x, caches, states[name])
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), nbytes[name]) for name in models}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model and batch list (~3 min on 2 cores)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--hidden", type=int, help="model width (default 1024, quick 256)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, help="attention heads (default 16, quick 8)")
    ap.add_argument("--kv-len", type=int, help="KV cache length (default 256, quick 64)")
    ap.add_argument("--expansion", type=float, default=12.0, help="UltraMem sparse params / dense params")
    ap.add_argument("--topk", type=int, default=16, help="UltraMem top-m per head (2 heads)")
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,4,16,64,256,512; quick 1,16,64,256)")
    ap.add_argument("--reps", type=int, help="timed decode steps per point (default 20, quick 8)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    check_report(args.json, "bench_memory_inference")
    torch.set_num_threads(args.threads)
    d = args.hidden or (256 if args.quick else 1024)
    heads = args.heads or (8 if args.quick else 16)
    kv = args.kv_len or (64 if args.quick else 256)
    reps = args.reps or (8 if args.quick else 20)
    batches = [int(b) for b in (args.batches or ("1,16,64,256" if args.quick else "1,4,16,64,256,512")).split(",")]
    from rmt.errors import ConfigError

    try:
        models, shapes = build_models(d, heads, args.layers, args.expansion, args.topk)
    except ConfigError as err:  # the memory layers' settings, checked as rmt-train checks them
        return refuse("bench_memory_inference", str(err))
    rows = []
    print(f"{'batch':>6} " + " ".join(f"{n + ' ms':>15} {n + ' MB':>15}" for n in models))
    for b in batches:
        row = {"batch": b}
        for name, (lat, nbytes) in measure(models, b, d, heads, args.layers, kv, reps).items():
            row[f"{name}_latency_ms"] = lat * 1e3
            row[f"{name}_bytes"] = nbytes
        rows.append(row)
        print(
            f"{b:>6} " + " ".join(f"{row[n + '_latency_ms']:>15.2f} {row[n + '_bytes'] / 1e6:>15.1f}" for n in models),
            flush=True,
        )
    ref = next((r for r in rows if r["batch"] == 64), rows[-1])
    summary = {
        "ultramem_over_dense_latency_b64": ref["ultramem_latency_ms"] / ref["dense_latency_ms"],
        "moe_over_ultramem_latency_b64": ref["moe_latency_ms"] / ref["ultramem_latency_ms"],
        "ultramem_latency_growth_10x_slots": statistics.median(
            r["ultramem_latency_ms"] / r["ultramem_tenth_latency_ms"] for r in rows
        ),
        "ultramem_v2_over_dense_latency_b64": ref["ultramem_v2_latency_ms"] / ref["dense_latency_ms"],
        "ultramem_v2_over_ultramem_latency_b64": ref["ultramem_v2_latency_ms"] / ref["ultramem_latency_ms"],
        "moe_over_ultramem_v2_latency_b64": ref["moe_latency_ms"] / ref["ultramem_v2_latency_ms"],
        "summary_batch": ref["batch"],
    }
    print(json.dumps({"shapes": shapes, "summary": summary}, indent=1))
    write_report(
        args.json,
        "bench_memory_inference",
        rows,
        summary,
        machine(threads=args.threads),
        config={**shapes, "kv_len": kv, "reps": reps, "expansion": args.expansion},
    )


if __name__ == "__main__":
    main()
