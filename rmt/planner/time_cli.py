"""``rmt-plan time`` (:mod:`rmt.planner.time`) and ``rmt-plan calibrate``
(:mod:`rmt.planner.calibrate`): their options and printouts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Dict, List

from rmt.outputs import write_json
from rmt.planner.argtypes import positive_int
from rmt.planner.hardware import default_profile_path, load_profile


def add_time_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", required=True, help="the run's config")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--world-size", type=positive_int, required=True, metavar="N", help="ranks of the run")
    p.add_argument(
        "--hardware",
        default="h100",
        metavar="NAME|FILE",
        help="hardware profile: h100 (default), a100, or a profile file written by rmt-plan calibrate --out FILE",
    )
    p.add_argument("--json", metavar="FILE", help="write every term of the prediction to FILE")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def time_lines(config, doc: Dict) -> List[str]:
    """``rmt-plan time``'s printout of a :func:`rmt.planner.time.plan_time` document."""
    from rmt.planner.rank_cli import run_line

    lines = [f"step time on {doc['world_size']} x {doc['hardware']}: {run_line(config, doc['layout'])}"]
    for stage, s in doc["stages"].items():
        parts = [
            f"forward {_ms(s['forward_s'])}",
            f"backward {_ms(s['backward_s'])}",
        ]
        if s["recompute_s"]:
            parts.append(f"recompute {_ms(s['recompute_s'])}")
        if s["tensor_parallel_s"]:
            parts.append(f"tensor-parallel collectives {_ms(s['tensor_parallel_s'])}")
        if s["memory"]:
            parts.append(f"memory layers {_ms(s['memory_s'])}")
        lines.append(f"  stage {stage}, one micro-batch {_ms(s['microbatch_s'])}: " + ", ".join(parts))
        w = s["work"]
        device = w["gemm"] + w["attention"] + w["memory"]
        lines.append(
            f"    dense layers: GEMMs {_ms(w['gemm'])}, attention {_ms(w['attention'])}, memory-bound "
            f"{_ms(w['memory'])}; the host issues their operations in {_ms(w['issue'])}"
            + (" (host-bound)" if w["issue"] > device else "")
        )
        for r in s["memory"]:
            waits = r["collectives_s"] + r["host_link_s"]
            lines.append(
                f"    memory layer {r['placement']:<7} forward {_ms(r['forward_s'])}, backward {_ms(r['backward_s'])}"
                + (f", collectives and host link {_ms(waits)} ({_ms(r['exposed_s'])} exposed)" if waits else "")
            )
        d, o = s["data_parallel"], s["optimizer"]
        if d["reduce_s"]:
            lines.append(
                f"    data parallel: gradient reduction {_ms(d['reduce_s'])} ({_ms(d['exposed_reduce_s'])} exposed)"
                + (
                    f", parameter all-gather {_ms(d['gather_s'])} ({_ms(d['exposed_gather_s'])} exposed)"
                    if d["gather_s"]
                    else ""
                )
            )
        lines.append(
            f"    optimizer step {_ms(o['total_s'])} (dense {_ms(o['dense_s'])}"
            + (f", tables {_ms(o['tables_s'])}" if o["tables_s"] else "")
            + (f", host tables {_ms(o['host_s'])}" if o["host_s"] else "")
            + ")"
        )
    m_ = doc["layout"]["microbatches"]
    lines.append(
        f"  pipeline: {m_} micro-batch(es) {_ms(doc['pipeline_s'])}"
        + (f", bubble {_ms(doc['bubble_s'])}, stage sends {_ms(doc['pipeline_sends_s'])}" if doc["bubble_s"] else "")
        + f"; after the last backward {_ms(doc['after_backward_s'])} (slowest stage {doc['slowest_stage']})"
    )
    lines.append(
        f"step {_ms(doc['step_s'])}: {doc['tokens_per_s']:,.0f} tokens/s, {doc['tflops_per_gpu']:.1f} TFLOP/s "
        f"per GPU (MFU {doc['mfu']:.1%} of {doc['peak_tflops']:,.1f}), {doc['hardware_tflops_per_gpu']:.1f} with "
        "recomputation"
    )
    return lines


def run_time(args: argparse.Namespace) -> int:
    from rmt.planner.rank_cli import load_planned
    from rmt.planner.time import plan_time

    profile = load_profile(args.hardware)
    config = load_planned(args.config, args.overrides, args.world_size)
    doc = plan_time(config, args.world_size, profile)
    print("\n".join(time_lines(config, doc)))
    if args.json:
        write_json(args.json, doc)
    return 0


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    out = default_profile_path()
    p.add_argument(
        "--out",
        metavar="FILE",
        default=out,
        help=f"where to write the profile (default {out}, which rmt-train reads on a CPU)",
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks to launch under torchrun when not launched by it (default 1): measure under the "
        "world size of the runs the profile will predict",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (seconds; a rougher profile)")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="threads per rank (default 1): the train.threads of the runs the profile will predict",
    )


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine: under torchrun already, every rank measures; otherwise launch
    ``--nproc`` ranks under torchrun (the launcher the runs use) and let them."""
    from rmt.planner.calibrate import calibrate

    if "LOCAL_RANK" in os.environ:
        calibrate(args.out, quick=args.quick, threads=args.threads)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc or 1}",
        "-m",
        "rmt.planner.cli",
        "calibrate",
        f"--out={args.out}",
        f"--threads={args.threads}",
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    return subprocess.call(cmd, env=env)
