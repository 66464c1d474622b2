"""Memory-parallel step time under torchrun (gloo, CPU): local vs number-wise vs
number-wise with owner reduce vs dimension-wise tables (UltraMem Appendix C/D), each
synchronous and with the async memory stream, side by side in one run.

    PYTHONPATH=. python tools/bench_memory_parallel.py --quick --json out.json

Launches itself on ``--nproc`` ranks (data parallel, one memory-parallel group of all of
them). Per variant: mean step time over the timed steps, the memory layers' forward time
per step and the part of it the dense path waited for. ``hidden_fraction`` = 1 - waited /
memory forward time (async rows; 0 for sync: its memory forward is all on the dense path),
at least 0: the dense path can wait longer than the memory work took, when the job queues
behind the worker's previous one or the thread starts late on a loaded machine;
async rows also give the same for the memory layers' backward, which the stream runs beside
the dense backward (sync rows run it inside the autograd engine, not timed apart).
Summary: ``async_over_sync_step_time`` (mean over sharded partitions of async / sync step
time), ``hidden_fraction`` and ``hidden_backward_fraction`` (means over the async sharded rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rmt.bench_report import check_report, machine, write_report  # noqa: E402

VARIANTS = [
    ("local", False, False),
    ("number", False, False),
    ("number", False, True),
    ("number", True, False),
    ("number", True, True),
    ("dimension", False, False),
    ("dimension", False, True),
]


def overrides(args):
    return [
        f"data.max_documents={args.documents}",
        "model.num_layers=4",
        f"model.hidden_size={args.hidden}",
        "model.num_attention_heads=4",
        f"model.seq_length={args.seq}",
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        f"train.micro_batch_size={args.batch}",
        "train.eval_iters=0",
        "train.progress=false",
        "memory.type=ultramem",
        "memory.placement='1:4'",
        f"memory.num_keys={args.keys}",
        "memory.topk=8",
        "memory.key_dim=32",
    ]


def _hidden(busy: float, waited: float) -> float:
    """Fraction of the memory work the dense path did not wait for, in [0, 1]."""
    return max(0.0, 1.0 - waited / busy) if busy else 0.0


def worker(args):
    import torch.distributed as dist

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.training.trainer import Trainer

    base = overrides(args)
    parallel.initialize(validate(load_config(None, base)))
    rows = []
    for partition, owner_reduce, async_stream in VARIANTS:
        config = validate(
            load_config(
                None,
                base
                + [
                    f"memory.partition={partition}",
                    f"memory.owner_reduce={str(owner_reduce).lower()}",
                    f"memory.async_stream={str(async_stream).lower()}",
                ],
            )
        )
        trainer = Trainer(config)
        wiring = trainer.chunks[0].module.memory_wiring
        for _ in range(args.warmup):
            trainer.train_step()
        if wiring.stream is not None:
            wiring.stream.reset_timers()
        wiring.sync_s = 0.0
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps - args.warmup):
            trainer.train_step()
        dist.barrier()
        timed = args.steps - args.warmup
        step_s = (time.perf_counter() - start) / timed
        stream = wiring.stream
        back = back_waited = back_hidden = None
        if stream is not None:
            busy, waited = stream.busy_s / timed, stream.exposed_s / timed
            back, back_waited = stream.busy_backward_s / timed, stream.exposed_backward_s / timed
            back_hidden = _hidden(back, back_waited)
        else:
            busy = waited = wiring.sync_s / timed
        rows.append(
            {
                "partition": partition,
                "owner_reduce": owner_reduce,
                "async": async_stream,
                "step_s": step_s,
                "memory_forward_s": busy,
                "memory_waited_s": waited,
                "hidden_fraction": _hidden(busy, waited),
                "memory_backward_s": back,
                "memory_backward_waited_s": back_waited,
                "hidden_backward_fraction": back_hidden,
            }
        )
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(rows, f)
    parallel.destroy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (~3 min on 2 cores)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--documents", type=int, default=50)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.steps = args.steps or (6 if args.quick else 20)
    args.warmup = 2
    if args.worker_out:
        return worker(args)
    check_report(args.json, "bench_memory_parallel")
    out = os.path.abspath((args.json or "bench_memory_parallel") + ".rows.tmp")
    # --standalone: torchrun's store binds a free port itself and the workers join it (no port
    # picked here that another process could take first)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        os.path.abspath(__file__),
        f"--worker-out={out}",
        f"--steps={args.steps}",
        f"--hidden={args.hidden}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--keys={args.keys}",
        f"--documents={args.documents}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get("PYTHONPATH", "")
    )
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    ratios, hidden, hidden_back = [], [], []
    for r in rows:
        if r["async"] and r["partition"] != "local":
            sync = next(
                s
                for s in rows
                if not s["async"] and s["partition"] == r["partition"] and s["owner_reduce"] == r["owner_reduce"]
            )
            r["async_over_sync_step_time"] = r["step_s"] / sync["step_s"]
            ratios.append(r["async_over_sync_step_time"])
            hidden.append(r["hidden_fraction"])
            hidden_back.append(r["hidden_backward_fraction"])
    summary = {
        "async_over_sync_step_time": sum(ratios) / len(ratios),
        "hidden_fraction": sum(hidden) / len(hidden),
        "hidden_backward_fraction": sum(hidden_back) / len(hidden_back),
    }
    print(
        f"{'partition':<10} {'owner':<6} {'async':<6} {'step ms':>8} {'mem fwd ms':>10} {'waited ms':>9} {'hidden':>7} "
        f"{'mem bwd ms':>10} {'waited ms':>9} {'hidden':>7}"
    )
    for r in rows:
        backward = "".join(
            f"{'-' if r[k] is None else format(scale * r[k], fmt):>{width}}"
            for k, scale, fmt, width in (
                ("memory_backward_s", 1e3, ".1f", 11),
                ("memory_backward_waited_s", 1e3, ".1f", 10),
                ("hidden_backward_fraction", 1, ".2f", 8),
            )
        )
        print(
            f"{r['partition']:<10} {str(r['owner_reduce']):<6} {str(r['async']):<6} {1e3 * r['step_s']:8.1f} "
            f"{1e3 * r['memory_forward_s']:10.1f} {1e3 * r['memory_waited_s']:9.1f} {r['hidden_fraction']:7.2f}"
            f"{backward}"
        )
    print(json.dumps(summary))
    write_report(args.json, "bench_memory_parallel", rows, summary, machine(nproc=args.nproc))


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    main()
