"""The step-time model (``rmt-plan time``, :mod:`rmt.planner.time`) against measured steps.

    PYTHONPATH=. python tools/bench_step_time.py [--quick] [--only NAME ...] [--json out.json]

Right before each layout it calibrates the machine under the layout's world size (``rmt-plan
calibrate`` under ``torchrun``, one thread per rank, as the runs; ``--calibrate once``: once per
world size), then trains the layout (``LAYOUTS``: data, tensor and sequence parallelism, 1F1B
and interleaved pipelines, the distributed optimizer with both overlaps, full and selective
recomputation, UltraMem tables sharded number- and dimension-wise with the async memory stream on
and off, tables in host memory, the RMT, the transformer, the recurrent transformer and the
mixer) on 1-4 gloo ranks through the real trainer, one thread per rank: ``--warmup`` steps untimed, then ``--steps`` steps, each the slowest rank's wall time (a
step ends with its losses and gradient norm read, so on a GPU it waits for the device). The
measured median step is compared with the prediction from that world size's profile:
``error = predicted / measured - 1``. Goal on a 2-core machine: median absolute error <= 10%,
every layout within +-20%.

A shared machine's speed drifts over tens of seconds, longer than a calibration: a layout counts
only when the machine held still around it, the speed of a GEMM (:func:`probe`; on a CPU one
thread's) before the calibration, between it and the run, and after the run within
:data:`STEADY` of each other; otherwise the layout is calibrated (``--calibrate once``: not again)
and run again, up to :data:`ATTEMPTS` times (``--quick``: once), and its row says how many
attempts it took and the spread of the last.

With ``--gpu``: the same on one GPU for the UltraMem-151M-x12 shape (sequence 2048, fp32) and its
dense twin, each layout against the GPU's calibrated profile (goal: within 15%).

Summary: ``median_abs_error``, ``max_abs_error``, ``within_20_percent`` (layouts), ``layouts``,
``unsteady`` (layouts whose last attempt the machine did not hold still around), and the load
average of the machine before and after (timings on a loaded machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

import bench_rank_memory as rank_memory  # noqa: E402

from rmt import quiet  # noqa: E402
from rmt.bench_report import check_report, refuse, write_report  # noqa: E402

BASE = [
    "model.num_layers=4",
    "model.hidden_size=384",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "model.dropout=0.0",
    "train.micro_batch_size=4",
    "train.warmup_steps=0",
    "train.eval_iters=0",
    "train.progress=false",
    "train.log_interval=1000",
    "train.threads=1",
    "data.max_documents=40",
]
# the RMT and the UltraMem layer of tools/bench_rank_memory.py, the layer spanning more layers
ULTRAMEM = rank_memory.ULTRAMEM + ["memory.placement='1:3'", "memory.value_optimizer=sparse_adam"]
RMT = rank_memory.RMT
PP = ["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size=2", "train.global_batch_size=8"]
FULL = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
# name, ranks, overrides
LAYOUTS = [
    ("dp1", 1, []),
    ("dp1_selective", 1, ["train.recompute_granularity=selective"]),
    ("dp1_megatron_attention", 1, ["model.attention_kernel=megatron"]),
    ("dp1_dropout", 1, ["model.dropout=0.1"]),
    ("dp2", 2, []),
    ("tp2", 2, ["parallel.tensor_model_parallel_size=2"]),
    ("tp2_sp", 2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    ("pp2_1f1b", 2, PP),
    ("pp2_vpp2", 2, PP + ["parallel.virtual_pipeline_model_parallel_size=2"]),
    (
        "dp2_distopt_overlap",
        2,
        ["train.distributed_optimizer=true", "train.overlap_grad_reduce=true", "train.overlap_param_gather=true"],
    ),
    ("dp2_recompute_full", 2, FULL),
    ("dp2_ultramem_number_async", 2, ULTRAMEM + ["memory.partition=number", "memory.async_stream=true"]),
    ("dp2_ultramem_number_sync", 2, ULTRAMEM + ["memory.partition=number", "memory.async_stream=false"]),
    ("dp2_ultramem_dimension_async", 2, ULTRAMEM + ["memory.partition=dimension", "memory.async_stream=true"]),
    ("dp1_ultramem_host", 1, ULTRAMEM + ["memory.table_location=host", "memory.async_stream=true"]),
    ("rmt_dp1", 1, RMT),
    ("rmt_tp2", 2, RMT + ["parallel.tensor_model_parallel_size=2"]),
    ("recurrent_dp1", 1, ["model.arch=recurrent", "model.block_width=32"]),
    ("mixer_dp2", 2, ["model.arch=mixer"]),
    ("tp2_dp2_distopt", 4, ["parallel.tensor_model_parallel_size=2", "train.distributed_optimizer=true"]),
]
QUICK = ["dp1", "dp2"]
GPU_CONFIG = "configs/ultramem_151m_x12.yaml"
GPU_BASE = [
    "train.global_batch_size=1",
    "train.micro_batch_size=1",
    "model.dropout=0.0",
    "train.eval_iters=0",
    "train.progress=false",
    "train.log_interval=1000",
    "data.max_documents=40",
]
FUSED = ["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"]
# --gpu: one-GPU layouts of the UltraMem-151M-x12 shape (sequence 2048, fp32) and its dense twin
GPU_LAYOUTS = [
    ("gpu_dense", 1, ["memory.type=none"]),
    ("gpu_sync_fused", 1, FUSED + ["memory.async_stream=false"]),
    ("gpu_async_fused", 1, FUSED + ["memory.async_stream=true"]),
    # the retrieval's reference path beside the fused op a GPU takes by default
    ("gpu_sync_unfused_retrieval", 1, FUSED + ["memory.async_stream=false", "memory.retrieval_kernel=unfused"]),
    ("gpu_dense_bf16", 1, ["memory.type=none", "train.precision=bf16"]),
]


STEADY = 0.10
"""The largest spread of the machine's speed around a layout for the layout to count."""
ATTEMPTS = 3
PROBE_SHAPE = (512, 1536, 384)  # [m, k] @ [k, n]: a small model's MLP GEMM


def probe(gpu: bool) -> float:
    """The machine's speed now: FLOP/s of :data:`PROBE_SHAPE`'s GEMM on the device the runs use
    (a CPU: one thread), the median of nine timings of 50 ms."""
    import torch

    from rmt.planner.calibrate import Clock

    torch.set_num_threads(1)
    device = torch.device("cuda" if gpu else "cpu")
    m, n, k = PROBE_SHAPE
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    return 2.0 * m * n * k / Clock(device).seconds(lambda: torch.mm(a, b), 9, min_s=0.05)


# -- worker (one rank) ---------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import rmt
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.training.trainer import Trainer

    rmt.setup_process()
    config = validate(load_config(args.config, json.loads(args.run_overrides)))
    parallel.initialize(config)
    trainer = Trainer(config)
    for _ in range(args.warmup):
        trainer.train_step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=trainer.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"step_s": times}, f)
    parallel.destroy()


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# -- driver --------------------------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(ranks: int, argv: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] + argv


def wait_for_quiet(max_load) -> None:
    """With ``--max-load L``: wait until the machine's 1-minute load average is at most ``L``
    (other jobs on a shared machine stretch both the calibration and the steps, differently)."""
    if max_load is None:
        return
    said = False
    while os.getloadavg()[0] > max_load:
        if not said:
            print(f"  waiting for the load average to fall to {max_load:g} ...", file=sys.stderr, flush=True)
            said = True
        time.sleep(10)


def calibrate(ranks: int, out: str, quick: bool) -> None:
    cmd = _torchrun(ranks, ["-m", "rmt.planner.cli", "calibrate", f"--out={out}"] + (["--quick"] if quick else []))
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"bench_step_time: calibrating {ranks} rank(s) failed (exit {proc.returncode})")


def measure(args, ranks: int, overrides: list) -> list:
    out = os.path.join(args.workdir, f"steps-{os.getpid()}.json")
    cmd = _torchrun(
        ranks,
        [
            os.path.abspath(__file__),
            f"--worker-out={out}",
            f"--run-overrides={json.dumps(overrides)}",
            f"--steps={args.steps}",
            f"--warmup={args.warmup}",
        ]
        + ([f"--config={args.config}"] if args.config else []),
    )
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_step_time: training {overrides} failed (exit {proc.returncode})")
    times = _read(out)["step_s"]
    os.remove(out)
    return times


def predict(config_path, overrides: list, ranks: int, profile_path: str) -> dict:
    from rmt.planner.hardware import load_profile
    from rmt.planner.rank_cli import load_planned
    from rmt.planner.time import plan_time

    return plan_time(load_planned(config_path, overrides, ranks), ranks, load_profile(profile_path))


def run_overrides(args, extra: list) -> list:
    steps = args.warmup + args.steps
    base = GPU_BASE if args.gpu else BASE
    return base + [f"train.steps={steps}", f"data.cache_dir={args.cache_dir}"] + extra + list(args.overrides)


def print_table(rows: list) -> None:
    print(f"{'layout':<30}{'ranks':>6}{'measured ms':>13}{'predicted ms':>14}{'error':>8}  {'MFU (pred.)':>11}")
    for r in rows:
        print(
            f"{r['layout']:<30}{r['ranks']:>6}{r['measured_s'] * 1e3:>13.1f}{r['predicted_s'] * 1e3:>14.1f}"
            f"{r['error']:>+8.1%}  {r['mfu']:>11.1%}"
        )


def summarize(rows: list) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "within_20_percent": sum(e <= 0.20 for e in errors),
        "layouts": len(rows),
        "unsteady": sum(r["speed_spread"] > STEADY for r in rows),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, a quick calibration, 2 steps")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these layouts: " + ", ".join(n for n, _, _ in LAYOUTS))
    ap.add_argument("--steps", type=int, default=None, help="timed steps per layout (default 6; --quick 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every layout")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument(
        "--max-load",
        type=float,
        metavar="L",
        help="before each layout wait until the 1-minute load average is at most L (a shared machine)",
    )
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, ".rmt_cache"))
    ap.add_argument(
        "--gpu",
        action="store_true",
        help=f"on a GPU: calibrate it, then the one-GPU layouts {', '.join(n for n, _, _ in GPU_LAYOUTS)} of "
        f"{GPU_CONFIG} at sequence 2048 (goal: each within 15%%)",
    )
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument(
        "--calibrate",
        choices=("each", "once"),
        default="each",
        help="calibrate right before each layout (default: the machine's load drifts on a shared "
        "machine) or once per world size",
    )
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--run-overrides", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quiet.install()  # megatron's import notices, which the predictions' imports would print
    check_report(args.json, "bench_step_time")
    if args.worker_out:
        worker(args)
        return 0
    table = GPU_LAYOUTS if args.gpu else LAYOUTS
    if args.gpu:
        args.config = args.config or GPU_CONFIG
    names = [n for n, _, _ in table]
    chosen = args.only or (QUICK if args.quick and not args.gpu else names)
    unknown = [n for n in chosen if n not in names]
    if unknown:
        return refuse("bench_step_time", f"unknown layout '{unknown[0]}'; the layouts are {', '.join(names)}.")
    if args.steps is not None and args.steps < 1 or args.warmup < 0:
        return refuse("bench_step_time", "--steps must be at least 1 and --warmup at least 0.")
    args.steps = args.steps or (2 if args.quick else 6)
    layouts = [x for x in table if x[0] in chosen]
    attempts = 1 if args.quick else ATTEMPTS
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        for ranks in sorted({r for _, r, _ in layouts}):
            profile = os.path.join(workdir, f"profile-{ranks}.json")
            for name, _, extra in (x for x in layouts if x[1] == ranks):
                overrides = run_overrides(args, extra)
                start = time.perf_counter()
                for attempt in range(1, attempts + 1):
                    wait_for_quiet(args.max_load)
                    speeds = [probe(args.gpu)]
                    if args.calibrate == "each" or not os.path.exists(profile):
                        calibrate(ranks, profile, args.quick)
                    speeds.append(probe(args.gpu))
                    times = measure(args, ranks, overrides)
                    speeds.append(probe(args.gpu))
                    spread = max(speeds) / min(speeds) - 1
                    if spread <= STEADY:
                        break
                    print(
                        f"  {name}: the machine's speed moved {spread:.0%} around it "
                        f"({', '.join(f'{x / 1e9:.0f}' for x in speeds)} GFLOP/s)"
                        + (", measuring again" if attempt < attempts else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                doc = predict(args.config, overrides, ranks, profile)
                measured = statistics.median(times)
                rows.append(
                    {
                        "layout": name,
                        "ranks": ranks,
                        "overrides": extra,
                        "step_s": times,
                        "measured_s": measured,
                        "predicted_s": doc["step_s"],
                        "error": doc["step_s"] / measured - 1,
                        "mfu": doc["mfu"],
                        "attempts": attempt,
                        "speed_spread": spread,
                        "prediction": doc,
                        "profile": _read(profile),
                    }
                )
                print(
                    f"  {name}: measured {measured * 1e3:.1f} ms, predicted {doc['step_s'] * 1e3:.1f} ms "
                    f"({time.perf_counter() - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print_table(rows)
    summary = dict(summarize(rows), load_average_before=load_before[0], load_average_after=os.getloadavg()[0])
    print(
        f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}, "
        f"{summary['within_20_percent']} of {summary['layouts']} within 20%, "
        f"{summary['unsteady']} measured while the machine's speed moved more than {STEADY:.0%} "
        f"(load average {summary['load_average_before']:.1f} before, {summary['load_average_after']:.1f} after)"
    )
    write_report(args.json, "bench_step_time", rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
