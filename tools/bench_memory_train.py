"""Quality of the memory layers side by side (UltraMem arXiv 2411.12364, Table 1 in miniature):
one dense backbone (``configs/tiny.yaml``: hidden 128, 2 layers, 4 heads, sequence 128) trained
alone and with each sparse module of ``configs/{pkm,moe,ultramem}_tiny.yaml`` at the same
placement (input after layer 1, output added after layer 2), and with UltraMemV2
(``configs/ultramem_v2_tiny.yaml``, arXiv 2508.18756: a memory beside the FFN of both layers,
its value and pre-value tables as many parameters as UltraMem's table). As in the paper the
three sparse modules of Table 1 have matched total parameters and activated FLOPs per token
(measured here, printed in the table); each memory variant trains at its own tuned value learning rate (a sweep of
``memory.value_lr_mult`` on a tuning seed not used for the reported runs), then every variant
trains on several seeds. The table gives validation loss (mean, spread over seeds) against
parameters and activated FLOPs, and two verdicts per pair of variants: unpaired, when the seeds'
ranges do not overlap, and paired, when the 95% confidence interval of the per-seed differences
(same seed, same data order and backbone initialisation) excludes 0.

    python tools/bench_memory_train.py                       # the full comparison (~1 h of CPU)
    python tools/bench_memory_train.py --quick --json out.json   # smoke run, no conclusion
    python tools/bench_memory_train.py --plot docs/figures/bench_memory_train.png
    python tools/bench_memory_train.py --steps 1000 --seeds 1 --variants ultramem --value-lr-mults none \
        memory.value_init_std=null                           # one ablation run, no dense, no sweep
    python tools/bench_memory_train.py --steps 2000 --value-lr-mults pkm=10,ultramem=30   # fixed value LRs
    python tools/bench_memory_train.py --steps 3000 --seeds 1,2,3 --json v2.json   # with UltraMemV2

Summary keys: ``<variant>_val_loss`` (mean over seeds), ``<variant>_val_loss_spread`` (max - min),
``ultramem_minus_dense_val_loss``, ``ultramem_v2_minus_dense_val_loss``, ``orderings`` and
``paired_orderings`` (each pair's verdict),
``tuned_value_lr_mult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rmt import setup_process  # noqa: E402

setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.errors import ConfigError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "dense": "configs/tiny.yaml",
    "pkm": "configs/pkm_tiny.yaml",
    "moe": "configs/moe_tiny.yaml",
    "ultramem": "configs/ultramem_tiny.yaml",
    "ultramem_v2": "configs/ultramem_v2_tiny.yaml",
}
TUNED = ("pkm", "ultramem", "ultramem_v2")  # variants with value tables
# Table 1 of the paper, 151M activated parameters (C4 validation loss): the orderings to compare.
PAPER = {"dense": 2.96, "pkm": 2.76, "moe": 2.63, "ultramem": 2.67}
# UltraMemV2's claims (its abstract): better than UltraMem, parity with MoE (no order claimed).
PAPER_V2 = {("ultramem_v2", "dense"): "ultramem_v2 < dense", ("ultramem_v2", "ultramem"): "ultramem_v2 < ultramem"}
PAIRS = [
    ("ultramem", "dense"),
    ("pkm", "dense"),
    ("moe", "dense"),
    ("ultramem", "pkm"),
    ("moe", "ultramem"),
    ("moe", "pkm"),
    ("ultramem_v2", "dense"),
    ("ultramem_v2", "ultramem"),
    ("ultramem_v2", "moe"),
]


def variant_config(
    kind: str,
    steps: int,
    seed: int,
    eval_iters: int,
    overrides: List[str],
    value_lr_mult: Optional[float] = None,
    threads: int = 1,
):
    base = [
        "train.tensorboard_dir=null",
        "train.progress=false",
        f"train.steps={steps}",
        f"train.warmup_steps={max(1, steps // 20)}",
        f"train.eval_interval={max(1, steps // 10)}",
        f"train.eval_iters={eval_iters}",
        f"train.seed={seed}",
        f"train.threads={threads}",
        f"train.log_interval={steps}",
    ]
    if value_lr_mult is not None:
        base.append(f"memory.value_lr_mult={value_lr_mult}")
    return validate(load_config(os.path.join(ROOT, VARIANTS[kind]), base + overrides), world_size=1)


def check_backbone(configs: Dict[str, object]) -> None:
    """Every variant must share the dense model and the training recipe; only ``memory.*`` differs."""
    ref = configs["dense"]
    for kind, cfg in configs.items():
        for section in ("model", "train", "data"):
            a, b = dataclasses.asdict(getattr(ref, section)), dataclasses.asdict(getattr(cfg, section))
            diff = sorted(k for k in a if a[k] != b[k])
            if diff:
                raise ConfigError(
                    f"variant '{kind}' ({VARIANTS[kind]}) differs from the dense backbone in "
                    f"{', '.join(f'{section}.{k}' for k in diff)}; only memory.* may differ"
                )


def activated_flops_per_token(chunk: torch.nn.Module, config) -> float:
    """Forward FLOPs per token of one microbatch as torch's FlopCounterMode counts them (the matmuls
    that run: for MoE only the routed experts), plus the score-weighted sums of the memory
    lookups (2 x retrieved values x value dim per token, and UltraMemV2's pre-value dot
    products), which run in rmt's own op. The retrieval runs its torch reference here (one
    einsum per key tile): the counter cannot see inside the C++ selection."""
    from unittest import mock

    from torch.utils.flop_counter import FlopCounterMode

    from rmt.memory.layer import MemoryLayer
    from rmt.models.documents import causal_mask
    from rmt.ops.dispatch import ENV_RETRIEVAL_BACKEND

    b, s = config.train.micro_batch_size, config.model.seq_length
    ids = torch.randint(0, config.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    was_training = chunk.training
    chunk.eval()  # no BatchNorm statistics or slot counters recorded
    reference = mock.patch.dict(os.environ, {ENV_RETRIEVAL_BACKEND: "reference"})
    with reference, FlopCounterMode(display=False) as counter, torch.no_grad():
        chunk(ids, torch.arange(s).expand(b, s), causal_mask(s, ids.device))
    chunk.train(was_training)
    lookups = sum(
        2 * m.spec.num_heads * m.spec.topk * (m.spec.value_dim + m.spec.pre_value_dim)
        for m in chunk.modules()
        if isinstance(m, MemoryLayer)
    )
    return counter.get_total_flops() / (b * s) + lookups


def train_once(kind: str, config) -> Dict:
    from rmt.training.trainer import Trainer

    torch.manual_seed(config.train.seed)
    start, cpu = time.perf_counter(), time.process_time()
    trainer = Trainer(config)
    history = trainer.train()
    module = trainer.chunks[0].module
    return {
        "model": kind,
        "seed": config.train.seed,
        "value_lr_mult": config.memory.value_lr_mult if kind in TUNED else None,
        "params": sum(p.numel() for p in module.parameters()),
        "flops_per_token": activated_flops_per_token(module, config),
        "tokens": config.train.steps * trainer.global_batch * config.model.seq_length,
        "curve": [(m["step"], m["val_loss"]) for m in history if "val_loss" in m],
        "train_loss": history[-1]["lm loss"],
        "val_loss": history[-1]["val_loss"],
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
    }


def spread(values: List[float]) -> float:
    return max(values) - min(values)


def parse_value_lr_mults(arg: str) -> Tuple[List[float], Dict[str, float]]:
    """``--value-lr-mults``: (values to sweep, fixed value per variant); 'none' gives neither."""
    try:
        if arg == "none":
            return [], {}
        if "=" not in arg:
            return [float(x) for x in arg.split(",") if x], {}
        fixed = {kind: float(mult) for kind, mult in (pair.split("=") for pair in arg.split(",") if pair)}
    except ValueError:
        raise ValueError(
            f"--value-lr-mults takes numbers (1,3,10), KIND=MULT pairs (pkm=10,ultramem=30) or 'none'; got {arg!r}"
        ) from None
    if set(fixed) - set(TUNED):
        raise ValueError(
            f"--value-lr-mults: only {', '.join(TUNED[:-1])} and {TUNED[-1]} have value tables; got {arg!r}"
        )
    return [], fixed


def paired_interval(diffs: List[float]) -> Tuple[float, float]:
    """The 95% confidence interval of the mean of paired differences (Student's t, n - 1 degrees
    of freedom; n >= 2)."""
    from scipy.stats import ttest_1samp

    interval = ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    return float(interval.low), float(interval.high)


def orderings(final: Dict[str, List[float]], quick: bool = False) -> List[Dict]:
    """Each pair, two verdicts; nothing is claimed from one seed or from a ``--quick`` run.

    ``verdict`` (unpaired): 'a < b' when every seed of a is below every seed of b (and the
    reverse), else not separated. ``paired_verdict``: the variants of one seed share the data
    order and the backbone's initial weights, so a seed's effect, often larger than the
    variants', cancels in the differences a - b seed by seed (``per_seed``); 'a < b' when the 95%
    confidence interval of their mean (``paired_ci95``, Student's t) lies below 0 (and the
    reverse), else not separated. Three seeds make the interval 4.3 standard errors wide each
    side, two 12.7."""
    out = []
    for a, b in PAIRS:
        if a not in final or b not in final:
            continue
        va, vb = final[a], final[b]
        per_seed = [x - y for x, y in zip(va, vb)]
        interval = None
        if quick:
            verdict = paired = "not claimed (quick run)"
        elif min(len(va), len(vb)) < 2:
            verdict = paired = "not claimed (one seed)"
        else:
            verdict = f"{a} < {b}" if max(va) < min(vb) else f"{b} < {a}" if max(vb) < min(va) else "not separated"
            interval = paired_interval(per_seed)
            paired = f"{a} < {b}" if interval[1] < 0 else f"{b} < {a}" if interval[0] > 0 else "not separated"
        if a in PAPER and b in PAPER:
            paper = f"{a} < {b}" if PAPER[a] < PAPER[b] else f"{b} < {a}"
        else:
            paper = PAPER_V2.get((a, b))
        out.append(
            {
                "pair": f"{a} vs {b}",
                "difference": sum(va) / len(va) - sum(vb) / len(vb),
                "per_seed": per_seed,
                "paired_ci95": interval,
                "verdict": verdict,
                "paired_verdict": paired,
                "paper": paper,
                "agrees": None if verdict.startswith("not") or paper is None else verdict == paper,
                "paired_agrees": None if paired.startswith("not") or paper is None else paired == paper,
            }
        )
    return out


def plot(path: str, final_rows: List[Dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = [k for k in VARIANTS if any(r["model"] == k for r in final_rows)]
    for kind in kinds:
        runs = [r for r in final_rows if r["model"] == kind]
        steps = [s for s, _ in runs[0]["curve"]]
        curves = torch.tensor([[v for _, v in r["curve"]] for r in runs])
        (line,) = ax1.plot(steps, curves.mean(0), label=kind)
        ax1.fill_between(steps, curves.min(0).values, curves.max(0).values, color=line.get_color(), alpha=0.25)
        finals = [r["val_loss"] for r in runs]
        ax2.errorbar(
            runs[0]["flops_per_token"] / 1e6,
            sum(finals) / len(finals),
            yerr=[[sum(finals) / len(finals) - min(finals)], [max(finals) - sum(finals) / len(finals)]],
            fmt="o",
            color=line.get_color(),
            capsize=4,
        )
        ax2.annotate(
            f"{kind} {runs[0]['params'] / 1e6:.2f}M",
            (runs[0]["flops_per_token"] / 1e6, min(finals)),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax1.set(xlabel="step", ylabel="validation loss", title="validation loss (mean, seed range)")
    curves = [v for r in final_rows for _, v in r["curve"][len(r["curve"]) // 5 :]]
    ax1.set_ylim(min(curves) - 0.02, max(curves) + 0.02)  # the first fifth (warmup) off the scale
    ax1.legend()
    ax2.set(
        xlabel="activated MFLOPs per token",
        ylabel="final validation loss",
        title="final loss vs activated compute (label: parameters)",
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 60 steps, one seed, no LR sweep, no conclusion")
    ap.add_argument("--steps", type=int, help="training steps per run (default 1500; quick 60)")
    ap.add_argument("--seeds", help="comma-separated seeds of the reported runs (default 1,2,3; quick 1)")
    ap.add_argument("--tune-seed", type=int, default=0, help="seed of the value-LR sweep runs (default 0)")
    ap.add_argument(
        "--value-lr-mults",
        help="memory.value_lr_mult values swept for PKM and UltraMem "
        "(default 1,3,10,30); 'none' (quick's default): no sweep, the configs' own after the "
        "overrides; KIND=MULT pairs (e.g. pkm=10,ultramem=30): no sweep, these values",
    )
    ap.add_argument("--eval-iters", type=int, help="validation batches per evaluation (default 16; quick 2)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--plot", help="write validation curves and loss vs activated FLOPs as a PNG here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every variant")
    args = ap.parse_args(argv)
    check_report(args.json, "bench_memory_train")
    q = args.quick
    steps = args.steps or (60 if q else 1500)
    seeds = [int(s) for s in (args.seeds or ("1" if q else "1,2,3")).split(",")]
    try:
        mults, fixed = parse_value_lr_mults(args.value_lr_mults or ("none" if q else "1,3,10,30"))
    except ValueError as err:
        return refuse("bench_memory_train", str(err))
    eval_iters = args.eval_iters or (2 if q else 16)
    kinds = [k for k in args.variants.split(",") if k]
    unknown = [k for k in kinds if k not in VARIANTS]
    if unknown or not kinds:
        return refuse("bench_memory_train", f"--variants must name some of {', '.join(VARIANTS)}; got {args.variants}")
    try:
        configs = {
            k: variant_config(k, steps, seeds[0], eval_iters, args.overrides, threads=args.threads)
            for k in ["dense"] + [k for k in kinds if k != "dense"]
        }  # dense: the backbone to check
        check_backbone(configs)
    except ConfigError as err:
        return refuse("bench_memory_train", str(err))
    from rmt.parallel import destroy, initialize

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    rows: List[Dict] = []
    initialize(configs["dense"])
    try:
        tuned = {}
        for kind in [k for k in kinds if k in TUNED]:
            if not mults:
                tuned[kind] = fixed.get(kind, configs[kind].memory.value_lr_mult)
                continue
            sweep = []
            for mult in mults:
                row = train_once(
                    kind, variant_config(kind, steps, args.tune_seed, eval_iters, args.overrides, mult, args.threads)
                )
                rows.append(dict(row, phase="tune"))
                sweep.append((row["val_loss"], mult))
                print(
                    f"tune {kind} value_lr_mult {mult:g}: val_loss {row['val_loss']:.4f} "
                    f"({row['cpu_seconds']:.0f} CPU s)",
                    flush=True,
                )
            tuned[kind] = min(sweep)[1]
        final: Dict[str, List[float]] = {}
        for kind in kinds:
            for seed in seeds:
                row = train_once(
                    kind, variant_config(kind, steps, seed, eval_iters, args.overrides, tuned.get(kind), args.threads)
                )
                rows.append(dict(row, phase="final"))
                final.setdefault(kind, []).append(row["val_loss"])
                print(
                    f"{kind} seed {seed}: val_loss {row['val_loss']:.4f} ({row['cpu_seconds']:.0f} CPU s)", flush=True
                )
    finally:
        destroy()
    final_rows = [r for r in rows if r["phase"] == "final"]
    dense = sum(final["dense"]) / len(final["dense"]) if "dense" in final else None
    sweep = (
        f"value LR mult tuned on seed {args.tune_seed} over {','.join(f'{m:g}' for m in mults)}"
        if mults
        else "value LR mult: " + ", ".join(f"{k} {v:g}x" for k, v in fixed.items()) + " (no sweep)"
        if fixed
        else "value LR mult: the configs' own (no sweep)"
    )
    print(f"\n{steps} steps x {final_rows[0]['tokens'] // steps} tokens, seeds {','.join(map(str, seeds))}; {sweep}")
    print(
        f"{'model':<9} {'params':>9} {'MFLOP/tok':>9} {'value LR':>8} {'val loss':>9} {'spread':>7} "
        f"{'vs dense':>8} {'paper':>6}"
    )
    for kind in kinds:
        r = next(x for x in final_rows if x["model"] == kind)
        mean = sum(final[kind]) / len(final[kind])
        mult = f"{tuned[kind]:g}x" if kind in tuned else "-"
        print(
            f"{kind:<9} {r['params']:>9,} {r['flops_per_token'] / 1e6:>9.3f} {mult:>8} {mean:>9.4f} "
            f"{spread(final[kind]):>7.4f} {'-' if dense is None else f'{mean - dense:+.4f}':>8} "
            f"{PAPER[kind] if kind in PAPER else '-':>6}"
        )
    pairs = orderings(final, quick=q)
    if q:
        print(
            f"\nNo ordering is claimed: a --quick run ({steps} steps, no value-LR sweep) is too short to "
            "separate the variants."
        )
    elif len(seeds) < 2:
        print("\nNo ordering is claimed: one seed cannot separate the variants.")
    else:
        agree = {None: "", True: " (as the paper)", False: " (the paper has the reverse)"}
        print(
            "\nOrderings (paper: Table 1 at 151M). Unpaired: stated when the seeds' ranges do not overlap;"
            "\npaired: when the 95% interval of the per-seed differences excludes 0."
        )
        for p in pairs:
            per_seed = ", ".join(f"{d:+.3f}" for d in p["per_seed"])
            lo, hi = p["paired_ci95"]
            print(
                f"  {p['pair']:<20} unpaired: {p['verdict'] + agree[p['agrees']]:<40} "
                f"paired: {p['paired_verdict'] + agree[p['paired_agrees']]:<40} mean difference "
                f"{p['difference']:+.4f}, per seed {per_seed}, 95% interval [{lo:+.4f}, {hi:+.4f}]"
            )
    summary = {f"{k}_val_loss": sum(v) / len(v) for k, v in final.items()}
    summary.update({f"{k}_val_loss_spread": spread(v) for k, v in final.items()})
    for kind in ("ultramem", "ultramem_v2"):
        if kind in final and dense is not None:
            summary[f"{kind}_minus_dense_val_loss"] = summary[f"{kind}_val_loss"] - dense
    summary["orderings"] = {p["pair"]: p["verdict"] for p in pairs}
    summary["paired_orderings"] = {p["pair"]: p["paired_verdict"] for p in pairs}
    summary["tuned_value_lr_mult"] = tuned
    if args.plot:
        plot(args.plot, final_rows)
        print(f"figure: {args.plot}")
    if args.json:
        where = machine(threads=args.threads, quick=q, steps=steps, seeds=seeds)
        write_report(args.json, "bench_memory_train", rows, summary, where)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
