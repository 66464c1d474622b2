"""Per-rank memory of sharded memory tables as the table grows, measured against ``rmt-plan memory``.

    PYTHONPATH=. python tools/bench_memory_scale.py --quick --json out.json
    PYTHONPATH=. python tools/bench_memory_scale.py --demo --json demo.json

Each run launches ``P`` gloo ranks (torchrun) training a small transformer with one UltraMem
layer whose value table has ``--sizes`` MiB in all (fp32 or bf16, number- or dimension-wise over
the ``P`` ranks), through the real trainer, in four phases: build and initialise (``init``), the
first training steps (``step``), a checkpoint save (``save``), and, in fresh processes, a load
of that checkpoint (``load``; with ``--reshard`` under the other partition too). Per phase each
rank measures its peak resident set (VmHWM, reset through /proc/self/clear_refs at the phase's
start) and its time; rank 0 also reports the time from process start to the end of the first
step and the table's init rate per rank. ``rmt-plan memory`` predicts the bytes of each phase
that grow with the table; a run with the smallest table (``--base-mib``) gives the bytes that do
not. A phase's peak is taken above the resident set its process held when its first phase began
(``above_start``; the absolute VmHWM is kept as ``peak``), since that varies by a few MiB from
one launch to the next. ``measured = above_start(size) - above_start(base)`` is compared with
``predicted = plan(size) - plan(base)`` (``error`` = measured / predicted - 1; goal within +-15%).

Summary: ``max_abs_phase_error`` over every phase and run; ``peak_falls_as_1_over_P`` (per-rank
step peak at the largest table times P, relative spread over the P runs), and
``rowwise_adagrad_mib_per_mib_at_P4``: the per-rank peak's growth per MiB of whole table at P = 4
(goal <= 0.35; ideal 0.25).

With ``--json FILE`` every measured run is appended to ``FILE.partial`` at once; the same command
run again after an interruption reuses those runs and measures only the rest (the file is removed
once ``FILE`` is written).

``--demo``: 4 ranks, each capped by the kernel (``setrlimit``: RLIMIT_DATA, or RLIMIT_AS with
``--cap-kind as``) at ``--cap-gib`` (4), train a few steps, save and reload a table
``--cap-fraction`` (2.5) times the cap with row-wise Adagrad (with SparseAdam the table plus its
moments is: each rank holds three shard-sized tensors), and one capped rank alone cannot build
it: no rank ever needs more than its shard. A rank's own data without any table (~1.3 GiB of
VmData here: heaps, gloo's thread stacks) shares the cap, so the fraction can be at most about
``P x (cap - 1.3 GiB) / cap`` (3 GiB caps fail at 2.5x; 4 GiB caps pass).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rmt.bench_report import check_report, write_report  # noqa: E402

MIB = 1 << 20
PHASES = ("init", "step", "save", "load")
# RLIMIT_DATA (Linux >= 4.7) caps the heap and private writable mappings, where tensors live;
# RLIMIT_AS also counts the libraries mapped and the stacks and malloc arenas reserved but never
# touched (2.4 GiB of a rank's 2.5 GiB VmPeak on a 0.5 GiB resident set here: gloo starts three
# threads with 8 MiB stacks per process group, and megatron creates ~20 groups).
CAP_LIMITS = {"data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS}
HIDDEN, VALUE_DIM = 128, 64  # value dim = hidden / 2 (UltraMem's halved value dimension)


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmHWM, VmRSS, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """Start a new VmHWM window at the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def num_keys_for(mib: float, dtype_bytes: int) -> int:
    """Keys per side whose num_keys^2 x VALUE_DIM table is closest to ``mib`` MiB (a multiple of 8)."""
    slots = mib * MIB / (VALUE_DIM * dtype_bytes)
    return max(8, int(round(slots**0.5 / 8)) * 8)


def overrides(run: dict, documents: int) -> list:
    return [
        f"data.max_documents={documents}",
        "model.num_layers=2",
        f"model.hidden_size={HIDDEN}",
        "model.num_attention_heads=4",
        "model.seq_length=64",
        f"train.steps={run['steps']}",
        "train.warmup_steps=0",
        "train.micro_batch_size=2",
        f"train.global_batch_size={2 * run['P']}",
        "train.eval_iters=0",
        "train.progress=false",
        "train.log_interval=1000",
        "memory.type=ultramem",
        "memory.placement='1:2'",
        f"memory.num_keys={run['num_keys']}",
        "memory.topk=8",
        "memory.key_dim=32",
        "memory.num_heads=2",
        f"memory.partition={run['partition']}",
        f"memory.value_optimizer={run['optimizer']}",
        f"memory.value_dtype={run['dtype']}",
        # freed memory goes back to the OS at once (as MALLOC_MMAP_THRESHOLD_ in launch() asks;
        # the trainer's default keeps up to 256 MiB of it for the next step)
        "train.host_heap_retain_mib=0",
    ]


# -- worker (one rank) ---------------------------------------------------------------------------
def _measure(name: str, fn, record: dict):
    gc.collect()
    _reset_peak()
    start_rss, start = _status("VmRSS"), time.perf_counter()
    out = fn()
    record[name] = {"peak": _status("VmHWM"), "start": start_rss, "s": time.perf_counter() - start}
    return out


def worker(args) -> None:
    if args.cap_gib:
        cap = int(args.cap_gib * (1 << 30))
        resource.setrlimit(CAP_LIMITS[args.cap_kind], (cap, cap))
    import torch.distributed as dist

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.training.trainer import Trainer

    run = json.loads(args.run_spec)
    base = overrides(run, args.documents) + [f"data.cache_dir={args.cache_dir}", f"train.save={args.ckpt}"]
    record = {"fill_s": 0.0}
    from rmt.memory import table as table_module

    fill = table_module.fill_normal_

    def timed_fill(*a, **k):  # the table's own init time, inside the trainer's construction
        start = time.perf_counter()
        out = fill(*a, **k)
        record["fill_s"] += time.perf_counter() - start
        return out

    table_module.fill_normal_ = timed_fill
    from rmt.ops.counter_normal import extension

    extension()  # built and loaded before the timed init: the rate is the fill's
    if args.phase == "train":
        config = validate(load_config(None, base))
        parallel.initialize(config)
        trainer = _measure("init", lambda: Trainer(config), record)
        _measure("step", lambda: [trainer.train_step() for _ in range(run["steps"])], record)
        record["first_step_end_s"] = time.time() - args.t0  # after the steps: an upper bound of the first
        shard = trainer.chunks[0].module.memory[0].values.weight
        record["shard_bytes"] = shard.numel() * shard.element_size()
        _measure("save", trainer.save, record)
    else:
        config = validate(
            load_config(None, base + [f"train.load={args.ckpt}", f"memory.partition={args.load_partition}"])
        )
        parallel.initialize(config)
        trainer = _measure("load", lambda: Trainer(config), record)
        record["loaded_iteration"] = trainer.iteration
    record["vm_peak"] = _status("VmPeak")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(every, f)
    parallel.destroy()


# -- driver --------------------------------------------------------------------------------------
def launch(
    args, run: dict, phase: str, load_partition: str = "", cap_gib: float = 0.0, tries: int = 2, quiet: bool = False
) -> list:
    """Run one phase on ``run["P"]`` ranks (torchrun --standalone: its rendezvous takes a free port
    from the OS, so concurrent jobs cannot race for one); one retry of a failed launch; ``quiet``:
    a failure is expected, print nothing of it."""
    out = os.path.join(args.workdir, f"worker-{os.getpid()}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={run['P']}",
        os.path.abspath(__file__),
        f"--worker-out={out}",
        f"--run-spec={json.dumps(run)}",
        f"--phase={phase}",
        f"--ckpt={os.path.join(args.workdir, 'ckpt')}",
        f"--cache-dir={args.cache_dir}",
        f"--documents={args.documents}",
        f"--load-partition={load_partition or run['partition']}",
        f"--cap-gib={cap_gib}",
        f"--cap-kind={args.cap_kind}",
        f"--t0={time.time()}",
    ]
    # Freed tensors go back to the OS at once, so that a phase's resident peak shows the live bytes
    # (glibc keeps freed blocks below its dynamic mmap threshold, up to 32 MiB, resident: the
    # previous phase's activations would count in the next phase's window).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for attempt in range(tries):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if not quiet:
            print(
                f"bench_memory_scale: {phase} run {run} failed (exit {proc.returncode})"
                + ("; retrying" if attempt + 1 < tries else ""),
                file=sys.stderr,
                flush=True,
            )
    else:
        if not quiet:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"bench_memory_scale: {phase} run {run} failed twice")
    with open(out) as f:
        ranks = json.load(f)
    os.remove(out)
    return ranks


def predict(run: dict) -> dict:
    """``rmt-plan memory``'s phases for the run's config (rmt.planner.memory.plan_from_config);
    ``load_resharded`` is the load of this run's checkpoint under the other partition."""
    from rmt.config import load_config
    from rmt.planner.memory import phases, plan_from_config

    def plan(partition):
        config = load_config(None, overrides(dict(run, partition=partition), 1))
        return phases(plan_from_config(config, run["P"], layers=1, microbatches=1))

    out = plan(run["partition"])
    other = "dimension" if run["partition"] == "number" else "number"
    if run["optimizer"] != "rowwise_adagrad":  # its resharded load (into the other partition) is that plan's
        out["load_resharded"] = plan(other)["load_resharded"]
    return out


def measure_run(args, run: dict) -> dict:
    import shutil

    shutil.rmtree(os.path.join(args.workdir, "ckpt"), ignore_errors=True)
    train = launch(args, run, "train", cap_gib=args.cap_gib)
    load = launch(args, run, "load", cap_gib=args.cap_gib)
    peak = {name: max(r[name]["peak"] for r in train) for name in ("init", "step", "save")}
    peak["load"] = max(r["load"]["peak"] for r in load)
    above = {name: _above_start(train, "init", name) for name in ("init", "step", "save")}
    above["load"] = _above_start(load, "load", "load")
    out = dict(
        run,
        peak=peak,
        above_start=above,
        seconds={name: max(r[name]["s"] for r in (load if name == "load" else train)) for name in PHASES},
        first_step_end_s=train[0]["first_step_end_s"],
        shard_bytes=train[0]["shard_bytes"],
        whole_bytes=train[0]["shard_bytes"] * run["P"],
        init_gbps=train[0]["shard_bytes"] / max(r["fill_s"] for r in train) / 1e9,
        vm_peak=max(r["vm_peak"] for r in train + load),
        loaded_iteration=load[0]["loaded_iteration"],
        predicted=predict(run),
    )
    if reshards(args, run):
        other = "dimension" if run["partition"] == "number" else "number"
        resharded = launch(args, run, "load", load_partition=other, cap_gib=args.cap_gib)
        out["peak"]["load_resharded"] = max(r["load"]["peak"] for r in resharded)
        out["above_start"]["load_resharded"] = _above_start(resharded, "load", "load")
    return out


def _grown(row: dict) -> dict:
    """The per-phase bytes compared between runs: ``above_start``, or for rows of a ``--json``
    file written before it existed (``--repredict``), the absolute ``peak``."""
    return row.get("above_start", row["peak"])


def _above_start(ranks: list, first: str, phase: str) -> int:
    """The largest rank's peak of ``phase`` above its process's resident set at the start of its
    first measured phase ``first``. What a process holds before that (libraries, heaps, gloo's
    threads; nothing that grows with the table) varies by up to ~5 MiB from one launch to the next,
    which is the whole growth of a small table; subtracting it leaves the bytes the phases added."""
    return max(r[phase]["peak"] - r[first]["start"] for r in ranks)


def reshards(args, run: dict) -> bool:
    """Whether ``run``'s checkpoint is also loaded under the other partition (row-wise Adagrad
    cannot run dimension-wise)."""
    return args.reshard and run["P"] > 1 and (run["optimizer"] != "rowwise_adagrad" or run["partition"] == "dimension")


def compare(rows: list) -> None:
    """``measured`` and ``predicted`` bytes growing with the table (against the base run of the same
    layout) and their ``error`` per phase, in place."""
    for r in rows:
        base = next(
            b for b in rows if b["base"] and all(b[k] == r[k] for k in ("P", "partition", "optimizer", "dtype"))
        )
        r["growth"] = {}
        for phase in _grown(r):
            if r["base"] or phase not in _grown(base):
                continue
            measured = _grown(r)[phase] - _grown(base)[phase]
            predicted = r["predicted"][phase] - base["predicted"][phase]
            r["growth"][phase] = {"measured": measured, "predicted": predicted, "error": measured / predicted - 1}


def summarize(rows: list) -> dict:
    errors = [g["error"] for r in rows for g in r["growth"].values()]
    summary = {"max_abs_phase_error": max((abs(e) for e in errors), default=None)}
    biggest = max((r["whole_bytes"] for r in rows if not r["base"]), default=0)
    at_size = [r for r in rows if r["whole_bytes"] == biggest and r["partition"] == "number" and not r["base"]]
    for opt in sorted({r["optimizer"] for r in at_size}):
        over_p = [r["growth"]["step"]["measured"] * r["P"] for r in at_size if r["optimizer"] == opt]
        if len({r["P"] for r in at_size if r["optimizer"] == opt}) > 1:
            summary[f"peak_times_P_spread_{opt}"] = (max(over_p) - min(over_p)) / max(over_p)
    ada = sorted(
        (
            r
            for r in rows
            if r["P"] == 4
            and r["optimizer"] == "rowwise_adagrad"
            and r["partition"] == "number"
            and r["dtype"] == "fp32"
        ),
        key=lambda r: r["whole_bytes"],
    )
    if len(ada) >= 2:
        a, b = ada[-2], ada[-1]
        summary["rowwise_adagrad_mib_per_mib_at_P4"] = (max(_grown(b).values()) - max(_grown(a).values())) / (
            b["whole_bytes"] - a["whole_bytes"]
        )
    return summary


def print_table(rows: list) -> None:
    print(
        f"{'partition':<9} {'optimizer':<15} {'dtype':<5} {'P':>2} {'whole MiB':>9} {'shard MiB':>9}  "
        + "  ".join(f"{p + ' meas/pred MiB (err)':>30}" for p in PHASES + ("load_resharded",))
        + f" {'init GB/s':>9} {'1st step s':>10}"
    )
    for r in rows:
        cells = []
        for phase in PHASES + ("load_resharded",):
            g = r["growth"].get(phase)
            cells.append(
                f"{'base' if r['base'] and phase in r['peak'] else '-':>30}"
                if g is None
                else f"{g['measured'] / MIB:>11.1f} / {g['predicted'] / MIB:>8.1f} ({g['error']:+6.1%})"
            )
        print(
            f"{r['partition']:<9} {r['optimizer']:<15} {r['dtype']:<5} {r['P']:>2} {r['whole_bytes'] / MIB:>9.1f} "
            f"{r['shard_bytes'] / MIB:>9.1f}  "
            + "  ".join(cells)
            + f" {r['init_gbps']:>9.2f} {r['first_step_end_s']:>10.1f}"
        )


def runs(args) -> list:
    """(run, is_base) for every measurement asked for."""
    out = []
    for dtype in args.dtypes:
        b = 4 if dtype == "fp32" else 2
        for P in args.ranks:
            for partition in args.partitions:
                for opt in args.optimizers:
                    if opt == "rowwise_adagrad" and partition == "dimension":
                        continue
                    sizes = [args.base_mib] + [m for m in args.sizes if (P, m) in args.grid]
                    if len(sizes) < 2:
                        continue
                    for mib in sizes:
                        out.append(
                            (
                                dict(
                                    P=P,
                                    partition=partition,
                                    optimizer=opt,
                                    dtype=dtype,
                                    steps=args.steps,
                                    num_keys=num_keys_for(mib, b),
                                ),
                                mib == args.base_mib,
                            )
                        )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two table sizes at P=2, one optimizer (~3 min)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--sizes", type=float, nargs="+", help="whole-table sizes in MiB")
    ap.add_argument("--base-mib", type=float, default=4.0, help="the smallest table, for the fixed bytes")
    ap.add_argument("--ranks", type=int, nargs="+", help="group sizes P (one memory-parallel group of all ranks)")
    ap.add_argument("--partitions", nargs="+", default=None, choices=("number", "dimension"))
    ap.add_argument("--optimizers", nargs="+", default=None, choices=("adamw", "sparse_adam", "rowwise_adagrad"))
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=("fp32", "bf16"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reshard", action="store_true", help="also load each checkpoint under the other partition")
    ap.add_argument(
        "--repredict",
        metavar="JSON",
        help="measure nothing: compare the rows of an earlier --json "
        "file with the planner as it is now, print the table (and write --json)",
    )
    ap.add_argument("--demo", action="store_true", help="the RLIMIT_AS-capped demonstration (see above)")
    ap.add_argument("--cap-gib", type=float, default=0.0, help="--demo: the per-rank cap in GiB (default 4)")
    ap.add_argument(
        "--cap-kind",
        choices=sorted(CAP_LIMITS),
        default="data",
        help="--demo: RLIMIT_DATA (default) or RLIMIT_AS; see CAP_LIMITS",
    )
    ap.add_argument("--documents", type=int, default=20)
    ap.add_argument("--cache-dir", default=os.path.join(ROOT, ".rmt_cache"))
    ap.add_argument("--workdir", default=None, help="scratch directory for checkpoints (default: a temp dir)")
    ap.add_argument("--cap-fraction", type=float, default=2.5, help="--demo: whole table / per-rank cap")
    # worker-only
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--run-spec", help=argparse.SUPPRESS)
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--load-partition", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.worker_out:
        check_report(args.json, "bench_memory_scale")
    if args.repredict:
        with open(args.repredict) as f:
            doc = json.load(f)
        for row in doc["rows"]:
            row["predicted"] = predict(row)
        return report(args, doc["rows"], doc["benchmark"], where=doc["machine"])
    if args.workdir is None and not args.worker_out:
        import tempfile

        args.workdir = tempfile.mkdtemp(prefix="bench_memory_scale.")
    if not args.worker_out:
        os.makedirs(args.workdir, exist_ok=True)
    if args.worker_out:
        return worker(args)
    if args.demo:
        return demo(args)
    if args.quick:
        args.sizes, args.ranks = args.sizes or [64.0], args.ranks or [2]
        args.partitions, args.optimizers = args.partitions or ["number"], args.optimizers or ["rowwise_adagrad"]
        args.grid = {(P, m) for P in args.ranks for m in args.sizes}
    else:
        # table growth at P = 4; 1/P at the largest table
        args.sizes, args.ranks = args.sizes or [64.0, 256.0, 1024.0], args.ranks or [1, 2, 4]
        args.partitions = args.partitions or ["number", "dimension"]
        args.optimizers = args.optimizers or ["adamw", "sparse_adam", "rowwise_adagrad"]
        args.grid = {(4, m) for m in args.sizes} | {(P, max(args.sizes)) for P in args.ranks}
    args.cap_gib = 0.0
    done = measured_before(args)
    rows = []
    for run, base in runs(args):
        key = json.dumps(run, sort_keys=True)
        if key in done:
            rows.append(done[key])
            continue
        rows.append(dict(run, base=base, **measure_in(args, run)))
        if args.json:  # a run that dies later keeps what was measured
            with open(args.json + ".partial", "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    return report(args, rows, "bench_memory_scale")


def measured_before(args) -> dict:
    """Rows of ``--json``'s ``.partial`` file left by an interrupted run of the same command, by run.

    A row measured without the resharded load is not reused when ``--reshard`` asks for one."""
    path = (args.json or "") + ".partial"
    if not args.json or not os.path.exists(path):
        return {}
    done = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            run = {k: row[k] for k in ("P", "partition", "optimizer", "dtype", "steps", "num_keys")}
            if reshards(args, row) and "load_resharded" not in row["peak"]:
                continue
            done[json.dumps(run, sort_keys=True)] = row
    print(f"reusing {len(done)} runs measured before, from {path}", file=sys.stderr, flush=True)
    return done


def measure_in(args, run: dict) -> dict:
    print(
        f"measuring {run['partition']}-wise {run['optimizer']} {run['dtype']} P={run['P']} "
        f"num_keys={run['num_keys']} ...",
        file=sys.stderr,
        flush=True,
    )
    out = measure_run(args, run)
    return {k: v for k, v in out.items() if k not in run}


def demo(args) -> int:
    """4 capped ranks train, save and reload a table whose whole size (with SparseAdam: with its
    moments) is ``--cap-fraction`` x the cap; one capped rank alone cannot even build it."""
    cap = args.cap_gib or 4.0
    rows = []
    for opt, per_byte in (("rowwise_adagrad", 1), ("sparse_adam", 3)):  # bytes counted per table byte
        whole_mib = args.cap_fraction * cap * 1024 / per_byte
        run = dict(
            P=4,
            partition="number",
            optimizer=opt,
            dtype="fp32",
            steps=args.steps,
            num_keys=num_keys_for(whole_mib, 4) + 8,
        )
        args.cap_gib = cap
        r = dict(run, base=False, **measure_in(args, run))
        r.update(
            cap_bytes=int(cap * (1 << 30)),
            counted_bytes=r["whole_bytes"] * per_byte,
            counted_over_cap=r["whole_bytes"] * per_byte / (cap * (1 << 30)),
            growth={},
        )
        alone = dict(run, P=1)
        try:
            launch(args, alone, "train", cap_gib=cap, tries=1, quiet=True)  # expected to fail
            r["one_rank_alone"] = "ran"
        except SystemExit:
            r["one_rank_alone"] = "failed under the cap"
        rows.append(r)
        print(
            f"{opt}: cap {cap:g} GiB per rank; whole table {r['whole_bytes'] / (1 << 30):.2f} GiB"
            f"{' (+ moments: ' + format(r['counted_bytes'] / (1 << 30), '.2f') + ' GiB)' if per_byte > 1 else ''}"
            f" = {r['counted_over_cap']:.2f}x the cap; per-rank peak RSS by phase (GiB): "
            + ", ".join(f"{k} {v / (1 << 30):.2f}" for k, v in r["peak"].items())
            + f"; VmPeak {r['vm_peak'] / (1 << 30):.2f}; resumed at iteration {r['loaded_iteration']}; "
            f"one rank alone under the cap: {r['one_rank_alone']}",
            flush=True,
        )
    summary = {
        "min_counted_over_cap": min(r["counted_over_cap"] for r in rows),
        "all_resumed": all(r["loaded_iteration"] == args.steps for r in rows),
        "one_rank_alone_failed": all(r["one_rank_alone"] != "ran" for r in rows),
    }
    print(json.dumps(summary))
    write_report(args.json, "bench_memory_scale_demo", rows, summary)
    return 0


def report(args, rows: list, name: str, where: dict | None = None) -> int:
    """Print and (``--json``) write ``rows``; ``where`` they were measured (default: here)."""
    compare(rows)
    print_table(rows)
    summary = summarize(rows)
    print(json.dumps(summary))
    if args.json:
        write_report(args.json, name, rows, summary, where)
        if os.path.exists(args.json + ".partial"):  # complete now: a rerun measures afresh
            os.remove(args.json + ".partial")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    main()
