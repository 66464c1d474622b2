"""The dense model's megatron-core switches, one at a time and together: step time, the step's
peak memory (``torch.cuda.max_memory_allocated`` on a GPU, the profiler's allocations on a CPU)
and the bytes a rank keeps between steps (parameters, gradient buffers, optimizer states and main
copies), against the fp32 baseline, in one process on one device.

    python tools/bench_dense_switches.py [--config C] [--steps N] [--warmup N] [--json F] [overrides]

Variants: ``fp32`` (the baseline), ``bf16`` (megatron's bf16: bf16 parameters, fp32 main copies),
``distributed_optimizer`` (on one rank it shards over a data-parallel group of one: the same
bytes, megatron's code path), ``recompute_selective``, ``recompute_full`` (full, uniform, one
layer per checkpoint), and ``all`` (bf16, distributed optimizer, full recomputation), after one
throwaway run that takes the process's one-time costs. ``--quick``: the tiny UltraMem config, 5
steps after 2 of warm-up. JSON: ``{"benchmark": "bench_dense_switches", "machine",
"rows", "summary"}``; summary: ``bf16_over_fp32_step_time``, ``bf16_over_fp32_peak``,
``recompute_full_over_none_peak``, ``all_over_fp32_peak``, ``all_over_fp32_step_time``.

``--loss-band configs/tiny.yaml,...``: each config trained to its end in fp32 for every seed
(``--seeds``) and in bf16 for the first; bf16's final validation loss against the fp32 seeds'
range (JSON ``bench_dense_switches_loss_band``; summary ``bf16_in_band_fraction``,
``max_abs_bf16_minus_fp32``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rmt import setup_process  # noqa: E402

setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt import parallel, profiling  # noqa: E402
from rmt.bench_report import check_report, machine, write_report  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.training.dense_state import optimizer_bytes  # noqa: E402
from rmt.training.trainer import Trainer  # noqa: E402

RECOMPUTE_FULL = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
VARIANTS = {
    "fp32": [],
    "bf16": ["train.precision=bf16"],
    "distributed_optimizer": ["train.distributed_optimizer=true"],
    "recompute_selective": ["train.recompute_granularity=selective"],
    "recompute_full": RECOMPUTE_FULL,
    "all": ["train.precision=bf16", "train.distributed_optimizer=true"] + RECOMPUTE_FULL,
}
QUICK = ["train.micro_batch_size=2", "model.seq_length=64"]


def kept_bytes(trainer: Trainer) -> int:
    """Parameters, gradient buffers and optimizer state a rank keeps between steps."""
    total = optimizer_bytes(trainer.optimizer)
    for chunk in trainer.chunks:
        total += sum(p.numel() * p.element_size() for p in chunk.parameters())
        total += sum(b.grad_data.numel() * b.grad_data.element_size() for b in chunk.buffers)
    return total


def run_variant(config_path: str, overrides, steps: int, warmup: int) -> dict:
    config = validate(
        load_config(
            config_path,
            list(overrides)
            + [
                f"train.steps={steps + warmup + 1}",
                "train.eval_iters=0",
                "train.progress=false",
                "train.save=null",
                "train.tensorboard_dir=null",
                "train.log_interval=1000000",
            ],
        ),
        world_size=1,
    )
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            trainer.train_step()
            if trainer.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        peak = profiling.step_peak_bytes(trainer.train_step, trainer.device)
        kept = kept_bytes(trainer)
        return {
            "step_s": statistics.median(times),
            "step_s_all": times,
            "kept_bytes": kept,
            "peak_bytes": kept + peak,
            "step_peak_bytes": peak,
            "params": sum(p.numel() for c in trainer.chunks for p in c.parameters()),
        }
    finally:
        parallel.destroy()


def final_val_loss(config_path: str, overrides) -> float:
    """Train ``config_path`` to its end and return its last validation loss."""
    config = validate(
        load_config(
            config_path, list(overrides) + ["train.progress=false", "train.save=null", "train.tensorboard_dir=null"]
        ),
        world_size=1,
    )
    parallel.initialize(config)
    try:
        history = Trainer(config).train()
        return [m["val_loss"] for m in history if "val_loss" in m][-1]
    finally:
        parallel.destroy()


def loss_band(config_path: str, overrides, seeds) -> dict:
    """bf16 against fp32 over a whole run: fp32's final validation loss for each seed (their range
    is the band: a change of precision is judged against the seed-to-seed spread it cannot be
    told from), bf16's for the first seed."""
    fp32 = [final_val_loss(config_path, list(overrides) + [f"train.seed={s}"]) for s in seeds]
    bf16 = final_val_loss(config_path, list(overrides) + [f"train.seed={seeds[0]}", "train.precision=bf16"])
    return {
        "config": config_path,
        "seeds": list(seeds),
        "fp32_val_loss": fp32,
        "bf16_val_loss": bf16,
        "band": [min(fp32), max(fp32)],
        "bf16_in_band": min(fp32) <= bf16 <= max(fp32),
        "bf16_minus_fp32_same_seed": bf16 - fp32[0],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/ultramem_151m_x12.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--quick", action="store_true", help="configs/ultramem_tiny.yaml, 5 steps")
    parser.add_argument(
        "--loss-band",
        metavar="CONFIGS",
        default=None,
        help="instead: train each of these comma-separated configs to the end in fp32 for every "
        "--seeds and in bf16 for the first, and report bf16's final validation loss against "
        "fp32's seed range",
    )
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides for every variant")
    args = parser.parse_args(argv)
    check_report(args.json, "bench_dense_switches")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    config, overrides = args.config, list(args.overrides)
    if args.loss_band:
        seeds = [int(x) for x in args.seeds.split(",")]
        rows = []
        print(f"{'config':32s} {'fp32 val loss by seed':>28s} {'bf16':>8s} {'in band':>8s}", flush=True)
        for path in args.loss_band.split(","):
            row = loss_band(path, overrides, seeds)
            rows.append(row)
            print(
                f"{path:32s} {' '.join(f'{v:.4f}' for v in row['fp32_val_loss']):>28s} "
                f"{row['bf16_val_loss']:8.4f} {str(row['bf16_in_band']):>8s}",
                flush=True,
            )
        summary = {
            "bf16_in_band_fraction": sum(r["bf16_in_band"] for r in rows) / len(rows),
            "max_abs_bf16_minus_fp32": max(abs(r["bf16_minus_fp32_same_seed"]) for r in rows),
        }
        _write(args.json, "bench_dense_switches_loss_band", rows, summary, config, overrides)
        return
    if args.quick:
        config, overrides, args.steps, args.warmup = "configs/ultramem_tiny.yaml", QUICK + overrides, 5, 2
    rows = []
    # the process's one-time costs (first kernel calls, lazily built state) on a throwaway run
    run_variant(config, overrides + VARIANTS[names[0]], 1, 1)
    print(f"{'variant':24s} {'step ms':>9s} {'peak MiB':>10s} {'kept MiB':>10s}", flush=True)
    for name in names:
        row = {
            "variant": name,
            "overrides": VARIANTS[name],
            **run_variant(config, overrides + VARIANTS[name], args.steps, args.warmup),
        }
        rows.append(row)
        print(
            f"{name:24s} {row['step_s'] * 1e3:9.1f} {row['peak_bytes'] / 2**20:10.1f} "
            f"{row['kept_bytes'] / 2**20:10.1f}",
            flush=True,
        )
    by = {r["variant"]: r for r in rows}
    summary = {}
    for key, (a, b, what) in {
        "bf16_over_fp32_step_time": ("bf16", "fp32", "step_s"),
        "bf16_over_fp32_peak": ("bf16", "fp32", "peak_bytes"),
        "recompute_full_over_none_peak": ("recompute_full", "fp32", "peak_bytes"),
        "all_over_fp32_peak": ("all", "fp32", "peak_bytes"),
        "all_over_fp32_step_time": ("all", "fp32", "step_s"),
    }.items():
        if a in by and b in by:
            summary[key] = by[a][what] / by[b][what]
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    _write(args.json, "bench_dense_switches", rows, summary, config, overrides)


def _write(path, name: str, rows, summary, config, overrides) -> None:
    if path:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
        where = machine(device=device, threads=torch.get_num_threads())
        write_report(path, name, rows, summary, where, config=config, overrides=overrides)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
