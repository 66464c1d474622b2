"""Train-step time and peak memory of RMT and transformer twins, side by side in one run.

Twins share L, heads = R, head size = Dv (so R*Dv = D), D_FF, sequence and batch; the RMT's
residual matrix is Dk x Dv. Both run through the same trainer (megatron-core schedule, DDP,
AdamW, clipping) on the default corpus. Steps of the two models alternate, so both see the same
machine load; the reported time is the median over the timed steps. Peak memory per step is
the persistent state (weights, gradient buffers, AdamW moments) plus the highest extra
allocation during one step (CUDA: the allocator's peak; CPU: the profiler's allocation trace),
printed beside the planner's activation bytes for the step (``rmt-plan model``).

    python tools/bench_rmt.py [--quick] [--json FILE] [overrides]  # step time and memory
    python tools/bench_rmt.py --train [--quick]           # tiny twins: validation loss, LR sweep

JSON: {"benchmark": "bench_rmt", "machine", "rows", "summary"}; summary keys
``step_time_ratio_rmt_over_transformer`` and ``peak_mem_ratio`` (largest size run); with
``--train`` instead ``val_loss_rmt`` and ``val_loss_transformer`` (each at its best LR of the
sweep) and the LRs. Dotted config overrides apply to both twins of the step-time run, e.g.
``model.attention_kernel=megatron`` times the transformer twin with megatron's unfused attention
(the RMT always uses torch's fused kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rmt import setup_process  # noqa: E402

setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt import parallel, profiling  # noqa: E402
from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.errors import ConfigError  # noqa: E402
from rmt.planner.flops import plan_model  # noqa: E402
from rmt.training.dense_state import optimizer_bytes  # noqa: E402
from rmt.training.trainer import Trainer  # noqa: E402

# name: (L, R = heads, Dv = head size, Dk, D_FF, seq, micro batch)
SIZES = {
    "tiny": (2, 4, 32, 16, 512, 128, 8),
    "small": (4, 8, 32, 32, 1024, 256, 4),
    "46M-shape": (6, 12, 32, 32, 1536, 256, 4),
}
QUICK_SIZES = ("tiny", "small")


def twin_overrides(size: str, steps: int, extra=()):
    L, R, Dv, Dk, Dff, seq, mbs = SIZES[size]
    common = [
        f"model.num_layers={L}",
        f"model.ffn_hidden_size={Dff}",
        f"model.seq_length={seq}",
        f"train.micro_batch_size={mbs}",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.z_loss=1e-4",
        "train.eval_iters=1",
        "train.eval_interval=100000",
        "train.progress=false",
    ]
    rmt = common + ["model.arch=rmt", f"model.rank={R}", f"model.dv={Dv}", f"model.dk={Dk}", "model.position=alibi"]
    transformer = common + [
        "model.arch=transformer",
        f"model.hidden_size={R * Dv}",
        f"model.num_attention_heads={R}",
        "model.position=learned",
    ]
    return {"rmt": rmt + list(extra), "transformer": transformer + list(extra)}


def persistent_bytes(trainer: Trainer) -> int:
    total = optimizer_bytes(trainer.optimizer)
    for p in trainer.params:
        total += p.numel() * p.element_size()
        total += p.main_grad.numel() * p.main_grad.element_size()
    return total


def step_peak_bytes(trainer: Trainer) -> int:
    """Highest memory in use during one train step, beyond what was allocated before it."""
    return profiling.step_peak_bytes(trainer.train_step, trainer.device)


def bench_size(size: str, steps: int, warmup: int, extra=()) -> dict:
    trainers = {
        name: Trainer(validate(load_config(None, ov), world_size=1))
        for name, ov in twin_overrides(size, steps + warmup + 2, extra).items()
    }
    times = {name: [] for name in trainers}
    for i in range(warmup + steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    row = {
        "size": size,
        "dims": dict(zip(("L", "R", "Dv", "Dk", "D_FF", "seq", "micro_batch"), SIZES[size])),
        "overrides": list(extra),
    }
    for name, trainer in trainers.items():
        persist = persistent_bytes(trainer)
        m, t = trainer.config.model, trainer.config.train
        row[name] = {
            "step_s": statistics.median(times[name]),
            "step_s_all": times[name],
            "params": sum(p.numel() for p in trainer.params),
            "peak_bytes": persist + step_peak_bytes(trainer),
            "persistent_bytes": persist,
            "planned_activation_bytes": plan_model(trainer.config)["activation_bytes_per_token"]
            * m.seq_length
            * t.micro_batch_size,
        }
    row["step_time_ratio"] = row["rmt"]["step_s"] / row["transformer"]["step_s"]
    row["peak_mem_ratio"] = row["rmt"]["peak_bytes"] / row["transformer"]["peak_bytes"]
    return row


LRS = (1e-3, 3e-3, 1e-2)


def train_twins(quick: bool) -> list:
    """Tiny twins (configs/tiny.yaml and configs/rmt_tiny.yaml) for the same tokens, each at
    the learning rates :data:`LRS` (the paper tuned each architecture's LR separately)."""
    rows = []
    for name, path in (("transformer", "configs/tiny.yaml"), ("rmt", "configs/rmt_tiny.yaml")):
        for lr in LRS:
            overrides = ["train.progress=false", "train.tensorboard_dir=null", f"train.lr={lr}"]
            if quick:
                overrides += ["train.steps=60", "train.warmup_steps=6", "train.eval_interval=30"]
            config = validate(load_config(os.path.join(ROOT, path), overrides), world_size=1)
            start = time.perf_counter()
            history = Trainer(config).train()
            vals = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
            rows.append(
                {
                    "model": name,
                    "config": path,
                    "lr": lr,
                    "steps": config.train.steps,
                    "tokens": config.train.steps * config.train.micro_batch_size * config.model.seq_length,
                    "val_loss": vals[-1][1],
                    "val_curve": vals,
                    "final_train_loss": history[-1]["lm loss"],
                    "wall_s": time.perf_counter() - start,
                }
            )
            r = rows[-1]
            print(
                f"{name:<12} {lr:>7.0e} {r['tokens']:>9} {r['val_loss']:>9.4f} "
                f"{r['final_train_loss']:>10.4f} {r['wall_s']:>7.1f}",
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes tiny and small, fewer steps")
    ap.add_argument("--steps", type=int, help="timed steps per model (default 10, quick 5)")
    ap.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        help=f"twin sizes to run (default all, quick {' '.join(QUICK_SIZES)})",
    )
    ap.add_argument(
        "--train",
        action="store_true",
        help="instead: train the tiny twins for the same tokens at LRs 1e-3, 3e-3, 1e-2 and compare validation losses",
    )
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both twins of the step-time run")
    args = ap.parse_args(argv)
    check_report(args.json, "bench_rmt")
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    if args.train and args.overrides:
        return refuse("bench_rmt", "config overrides apply to the step-time run, not to --train")
    try:
        for size in sizes:
            for overrides in twin_overrides(size, 1, args.overrides).values():
                validate(load_config(None, overrides), world_size=1)
    except ConfigError as err:
        return refuse("bench_rmt", str(err))
    parallel.initialize(validate(load_config(None, []), world_size=1))
    where = machine(torch_threads=torch.get_num_threads(), device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        if args.train:
            print(f"{'model':<12} {'lr':>7} {'tokens':>9} {'val loss':>9} {'train loss':>10} {'wall s':>7}")
            rows = train_twins(args.quick)
            best = {
                name: min((r for r in rows if r["model"] == name), key=lambda r: r["val_loss"])
                for name in ("rmt", "transformer")
            }
            summary = {
                "val_loss_rmt": best["rmt"]["val_loss"],
                "lr_rmt": best["rmt"]["lr"],
                "val_loss_transformer": best["transformer"]["val_loss"],
                "lr_transformer": best["transformer"]["lr"],
            }
        else:
            steps = args.steps or (5 if args.quick else 10)
            rows = []
            print(
                f"{'size':<10} {'rmt s/step':>10} {'tf s/step':>10} {'ratio':>6} "
                f"{'rmt MiB':>8} {'tf MiB':>8} {'mem ratio':>9} {'planned act MiB':>15} "
                f"{'rmt params':>11} {'tf params':>11}"
            )
            for size in sizes:
                r = bench_size(size, steps, warmup=2, extra=args.overrides)
                rows.append(r)
                print(
                    f"{size:<10} {r['rmt']['step_s']:>10.4f} {r['transformer']['step_s']:>10.4f} "
                    f"{r['step_time_ratio']:>6.2f} {r['rmt']['peak_bytes'] / 2**20:>8.1f} "
                    f"{r['transformer']['peak_bytes'] / 2**20:>8.1f} {r['peak_mem_ratio']:>9.2f} "
                    f"{r['rmt']['planned_activation_bytes'] / 2**20:>7.1f} /{r['transformer']['planned_activation_bytes'] / 2**20:>6.1f} "
                    f"{r['rmt']['params']:>11,} {r['transformer']['params']:>11,}",
                    flush=True,
                )
            summary = {
                "step_time_ratio_rmt_over_transformer": rows[-1]["step_time_ratio"],
                "peak_mem_ratio": rows[-1]["peak_mem_ratio"],
                "largest_size": rows[-1]["size"],
            }
        print(json.dumps(summary))
        write_report(args.json, "bench_rmt", rows, summary, where)
    finally:
        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
