"""Whole-rank memory per phase, measured against ``rmt-plan memory --config`` (rmt.planner.rank).

    PYTHONPATH=. python tools/bench_rank_memory.py [--quick] [--only NAME ...] [--json out.json]
    python tools/bench_rank_memory.py --device gpu --config configs/ultramem_151m_x12.yaml \
        train.global_batch_size=null --only dp1 dp1_bf16_distopt dp1_recompute_full

Each layout (``LAYOUTS``: DP, TP, PP with 1F1B and interleaved, the distributed optimizer on
and off, recomputation, sequence parallelism, sharded UltraMem tables; the transformer and the
RMT) trains a model of a few tens of MiB of state per rank on 1-4 gloo ranks through the real
trainer, and so does each shipped config a 24 GiB CPU machine can run on 2 ranks at its own
settings (``SHIPPED``: its precision, micro-batches, z-loss and heap retention): build (``init``), ``--steps`` steps (``step``), a save (``save``), then, in fresh
processes, a load of that checkpoint (``load``). Per phase each rank measures its peak resident
set (VmHWM, reset at the phase's start, as ``tools/bench_memory_scale.py`` does) above its
resident set before the model was built (``start``: the process, which the planner states as
``CPU_PROCESS_BYTES``; on a GPU, ``--device gpu``, the peak of ``torch.cuda.max_memory_allocated``
instead). Every rank is compared with the planner's prediction for its pipeline stage and
data-parallel rank (rank 0 writes the replicated parameters of a checkpoint): ``error = measured / predicted - 1`` per phase (goal within +-10%), the planner's fixed
process bytes left out of both. Each rank also reports its dense parameter elements, which must
equal the planner's exactly.

Summary: ``max_abs_error`` over every phase of every rank and how many rank-phases are within
10%; ``largest_overestimate``, the most the plan exceeded a measurement (``rmt-train`` refuses a
run only when its plan exceeds a rank's memory by more, ``rmt.training.fit.PLAN_ERROR``); ``params_exact``; ``start_mib`` (the process's own resident set, median);
``optimizer_bytes_per_param_times_dp`` and ``optimizer_bytes_exact`` (:func:`summarize`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

from bench_memory_scale import _measure, _status  # noqa: E402

from rmt.bench_report import check_report, refuse, write_report  # noqa: E402

MIB = 1 << 20
PHASES = ("init", "step", "save", "load")
BASE = [
    "model.num_layers=4",
    "model.hidden_size=384",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "train.micro_batch_size=4",
    "train.warmup_steps=0",
    "train.eval_iters=0",
    "train.progress=false",
    "train.log_interval=1000",
    "train.host_heap_retain_mib=0",
    "data.max_documents=40",
]
RMT = [
    "model.arch=rmt",
    "model.dk=32",
    "model.dv=32",
    "model.rank=8",
    "model.position=alibi",
    "model.ffn_hidden_size=512",
]
ULTRAMEM = [
    "memory.type=ultramem",
    "memory.placement='2:3'",
    "memory.num_keys=256",
    "memory.topk=8",
    "memory.key_dim=32",
    "memory.num_heads=2",
    "memory.partition=number",
]
# name, ranks, overrides
LAYOUTS = [
    ("dp1", 1, []),
    ("tiny", 1, ["model.num_layers=1", "model.hidden_size=64"]),
    ("dp1_bf16_distopt", 1, ["train.precision=bf16", "train.distributed_optimizer=true"]),
    (
        "dp1_recompute_full",
        1,
        ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
    ),
    ("dp2", 2, []),
    ("dp2_distopt_bf16", 2, ["train.distributed_optimizer=true", "train.precision=bf16"]),
    ("dp4_distopt", 4, ["train.distributed_optimizer=true", "train.micro_batch_size=2"]),
    ("tp2", 2, ["parallel.tensor_model_parallel_size=2"]),
    ("tp2_sp", 2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    (
        "pp2_1f1b",
        2,
        ["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size=2", "train.global_batch_size=8"],
    ),
    (
        "pp2_vpp2",
        2,
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
        ],
    ),
    (
        "dp2_recompute_full",
        2,
        ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
    ),
    ("dp2_ultramem", 2, ULTRAMEM),
    ("rmt_dp2", 2, RMT),
    (
        "rmt_tp2_ultramem_distopt",
        4,
        RMT + ULTRAMEM + ["parallel.tensor_model_parallel_size=2", "train.distributed_optimizer=true"],
    ),
]
QUICK = ["tiny"]
# name, ranks, config: shipped configs at their own settings (precision, micro-batches, z-loss,
# heap retention) that a 24 GiB CPU machine can run on 2 gloo ranks
SHIPPED = [
    ("transformer_49m", 2, [], "configs/transformer_49m.yaml"),
    ("transformer_49m_distopt", 2, ["train.distributed_optimizer=true"], "configs/transformer_49m.yaml"),
    ("rmt_46m", 2, [], "configs/rmt_46m.yaml"),
]


def overrides(extra: list, steps: int, cache: str, config: str | None = None) -> list:
    """The run's overrides: the CPU shape (``BASE``), or with ``config`` only the run length."""
    return (
        ([] if config else BASE)
        + [
            f"train.steps={steps}",
            f"data.cache_dir={cache}",
            "train.eval_iters=0",
            "train.progress=false",
            "train.log_interval=1000",
        ]
        + extra
    )


class _Peak:
    """One phase's peak: the resident set (VmHWM, reset at the start) on a CPU, or
    ``torch.cuda.max_memory_allocated`` (its peak statistic reset) on a GPU."""

    def __init__(self, device: str):
        self.gpu = device == "gpu"

    def measure(self, name: str, fn, record: dict):
        if not self.gpu:
            return _measure(name, fn, record)
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        record[name] = {"peak": torch.cuda.max_memory_allocated(), "start": start, "s": 0.0}
        return out


# -- worker (one rank) ---------------------------------------------------------------------------
def worker(args) -> None:
    import torch.distributed as dist

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.training.optimizer import is_table
    from rmt.training.trainer import Trainer

    extra = json.loads(args.run_overrides) + [f"train.save={args.ckpt}"]
    record, peak = {}, _Peak(args.device)
    if args.phase == "train":
        config = validate(load_config(args.config, extra))
        parallel.initialize(config)
        trainer = peak.measure("init", lambda: Trainer(config), record)
        peak.measure("step", lambda: [trainer.train_step() for _ in range(args.steps)], record)
        peak.measure("save", trainer.save, record)
    else:
        config = validate(load_config(args.config, extra + [f"train.load={args.ckpt}"]))
        parallel.initialize(config)
        trainer = peak.measure("load", lambda: Trainer(config), record)
    from megatron.core import parallel_state as ps

    record["stage"] = ps.get_pipeline_model_parallel_rank()
    record["dp_rank"] = ps.get_data_parallel_rank()
    record["dense_params"] = sum(p.numel() for c in trainer.chunks for p in c.parameters() if not is_table(p))
    if args.phase == "train":  # the optimizers' states and main copies, as they hold them after the steps
        from rmt.training.dense_state import optimizer_bytes

        record["optimizer_bytes"] = optimizer_bytes(trainer.optimizer)
    record["vm_rss_end"] = _status("VmRSS")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(every, f)
    parallel.destroy()


# -- driver --------------------------------------------------------------------------------------
def launch(args, ranks: int, extra: list, phase: str, config: str | None) -> list:
    out = os.path.join(args.workdir, f"worker-{os.getpid()}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        os.path.abspath(__file__),
        f"--worker-out={out}",
        f"--run-overrides={json.dumps(extra)}",
        f"--phase={phase}",
        f"--ckpt={os.path.join(args.workdir, 'ckpt')}",
        f"--steps={args.steps}",
        f"--device={args.device}",
    ] + ([f"--config={config}"] if config else [])
    # freed tensors go back to the OS at once (see bench_memory_scale.launch)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_rank_memory: {phase} of {extra} failed (exit {proc.returncode})")
    with open(out) as f:
        every = json.load(f)
    os.remove(out)
    return every


def predict(
    extra: list, ranks: int, steps: int, cache: str, config_path: str | None = None, device: str = "cpu"
) -> dict:
    """The planner's terms and phases per (pipeline stage, whether data-parallel rank 0)."""
    from rmt.config import load_config
    from rmt.planner.rank import layout_of, rank_phases, stage_params, with_vocabulary

    config = with_vocabulary(load_config(config_path, overrides(extra, steps, cache, config_path)))
    layout = layout_of(config, ranks, device)
    out = {}
    for s in range(layout.pp):
        for writer in (True, False):
            ph = rank_phases(config, layout, s, writer)
            out[s, writer] = {
                "params": stage_params(config, layout, s),
                "terms": ph,
                "phases": {p: sum(v for k, v in t.items() if k != "process") for p, t in ph.items()},
            }
    return out


def measure(args, name: str, ranks: int, extra: list, config: str | None) -> dict:
    shutil.rmtree(os.path.join(args.workdir, "ckpt"), ignore_errors=True)
    full = overrides(extra, args.steps, args.cache_dir, config)
    print(f"measuring {name} on {ranks} rank(s) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    train = launch(args, ranks, full, "train", config)
    load = launch(args, ranks, full, "load", config)
    pred = predict(extra, ranks, args.steps, args.cache_dir, config, args.device)
    rows = []
    for r, (tr, ld) in enumerate(zip(train, load)):
        stage, key = tr["stage"], (tr["stage"], tr["dp_rank"] == 0)
        above = {p: tr[p]["peak"] - tr["init"]["start"] for p in ("init", "step", "save")}
        above["load"] = ld["load"]["peak"] - ld["load"]["start"]
        predicted = pred[key]["phases"]
        rows.append(
            {
                "layout": name,
                "rank": r,
                "stage": stage,
                "start": tr["init"]["start"],
                "measured": above,
                "predicted": predicted,
                "error": {p: above[p] / predicted[p] - 1 for p in PHASES},
                "params": tr["dense_params"],
                "predicted_params": pred[key]["params"],
                "optimizer_bytes": tr["optimizer_bytes"],
                "terms": pred[key]["terms"],
            }
        )
    print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def print_table(rows: list) -> None:
    print(
        f"{'layout':<26}{'rank':>4}{'stage':>6}  "
        + "  ".join(f"{p + ' MiB meas/pred':>22}" for p in PHASES)
        + f"{'max err':>9}{'params':>8}"
    )
    for r in rows:
        cells = "  ".join(
            f"{r['measured'][p] / MIB:>8.1f} /{r['predicted'][p] / MIB:>7.1f} {r['error'][p]:>+5.0%}" for p in PHASES
        )
        worst = max(abs(e) for e in r["error"].values())
        print(
            f"{r['layout']:<26}{r['rank']:>4}{r['stage']:>6}  {cells}{worst:>9.1%}"
            f"{'exact' if r['params'] == r['predicted_params'] else 'DIFF':>8}"
        )


def summarize(rows: list) -> dict:
    """``optimizer_bytes_per_param_times_dp``: each distributed-optimizer layout without tables,
    its dense optimizer bytes (moments and main copies, as the optimizer holds them) per rank per
    parameter times DP, which stays constant when they fall as 1/DP; ``optimizer_bytes_exact``:
    those bytes equal the plan's on every rank."""
    distopt, exact = {}, True
    for r in rows:
        if "distopt" in r["layout"] and "ultramem" not in r["layout"] and r["layout"] not in {n for n, *_ in SHIPPED}:
            dp = int(r["layout"][2]) if r["layout"].startswith("dp") else 1
            distopt[r["layout"]] = r["optimizer_bytes"] * dp / r["params"]
            planned = r["terms"]["step"]["optimizer_states"] + r["terms"]["step"]["main_params"]
            exact &= r["optimizer_bytes"] == planned
    return {
        "max_abs_error": max(abs(e) for r in rows for e in r["error"].values()),
        # the most the plan overstated a measured phase: rmt-train's margin (rmt.training.fit.PLAN_ERROR)
        "largest_overestimate": max(0.0, -min(e for r in rows for e in r["error"].values())),
        "within_10_percent": sum(abs(e) <= 0.10 for r in rows for e in r["error"].values()),
        "rank_phases": sum(len(r["error"]) for r in rows),
        "params_exact": all(r["params"] == r["predicted_params"] for r in rows),
        "start_mib": statistics.median(r["start"] for r in rows) / MIB,
        "optimizer_bytes_per_param_times_dp": distopt,
        "optimizer_bytes_exact": exact,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (seconds)")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="these layouts: " + ", ".join(n for n, _, _ in LAYOUTS) + ", " + ", ".join(n for n, _, _, _ in SHIPPED),
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every layout")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, ".rmt_cache"))
    ap.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: one rank per GPU, torch.cuda.max_memory_allocated per phase (the planner's fixed "
        "process bytes, the CUDA context, left out)",
    )
    ap.add_argument(
        "--config",
        help="train this config (with the layouts' overrides) instead of the CPU shape, "
        "e.g. configs/ultramem_151m_x12.yaml on a GPU",
    )
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--run-overrides", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    check_report(args.json, "bench_rank_memory")
    every = [(n, r, e, args.config) for n, r, e in LAYOUTS] + SHIPPED
    names = QUICK if args.quick else (args.only or [n for n, _, _, _ in every])
    unknown = sorted(set(names) - {n for n, _, _, _ in every})
    if unknown:
        return refuse("bench_rank_memory", f"unknown layout(s) {', '.join(unknown)}")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench_rank_memory.")
    rows = []
    for name, ranks, extra, config in every:
        if name in names:
            rows += measure(args, name, ranks, extra + args.overrides, config)
    print_table(rows)
    summary = summarize(rows)
    print(json.dumps(summary))
    write_report(args.json, "bench_rank_memory", rows, summary)
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    sys.exit(main())
