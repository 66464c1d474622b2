"""The async memory stream in a real training step on one device: the dense twin, the memory
layers run synchronously and on the async stream (``memory.async_stream``), side by side.

    python tools/bench_memory_stream.py --json out.json       # the UltraMem-151M-x12 shape
    python tools/bench_memory_stream.py --quick               # ultramem_tiny, CPU-sized

Each variant trains ``--steps`` steps (the first ``--warmup`` untimed) of one micro-batch in a
process of its own (a 2-billion-parameter model and its optimizer state fill most of a GPU, so
two must not be alive at once), on ``rmt.parallel.compat.device()``: CUDA where present, else
the CPU. Step time is the wall time between device synchronizations, so on a GPU it is device
time. Variants: ``dense`` (``memory.type=none``: the same backbone without its memory layers),
``sync`` and ``async`` with the config's value optimizer, and with ``--fused`` also
``sync_fused`` / ``async_fused`` (``memory.value_optimizer=sparse_adam`` applied inside the
lookups' backward, ``memory.fused_value_optimizer``).

With ``--host`` also the value tables in host memory (``memory.table_location: host``, rows
staged per lookup, :class:`rmt.memory.storage.HostStorage`), against the device table with the same
unfused value optimizer: ``async_sparse`` (device, ``sparse_adam``), ``sync_host``,
``async_host`` and ``async_host_cache`` (with a device cache of ``--cache-rows`` rows of each
table, ``memory.host_cache_rows``, refreshed every 10 steps). A host row adds the bytes its tables
moved over the host link per step (forward indices and rows, backward row gradients), the device
bytes the staged rows held at most, and on a GPU the bandwidth of one pinned host-to-device copy of
a step's staged rows (``link_gbps``); a cached row also the share of the staged rows the cache
served and the device bytes it holds (the hit rate on a long run: ``tools/bench_host_cache.py``).
A table several times larger than the device: ``--device-mem-gib G`` caps the device memory the
run may allocate (``torch.cuda.set_per_process_memory_fraction``), e.g. ``--device-mem-gib 12
--variants async_host memory.num_keys=1600`` (47 GB of table and Adam moments on the host).

Summary per pair: ``memory_s`` = sync - dense step time (all the memory layers add to the step:
forward, backward, their share of the optimizer step), ``hidden_fraction`` = (sync - async) /
memory_s (the part the stream took off the step; the optimizer step cannot be hidden, so this
is a lower bound on the hidden share of the layers' forward and backward), and
``async_over_sync_step_time``; for the host pair also ``host_over_device_step_time`` =
async_host / async_sparse (goal <= 1.10 where the device table fits), and
``cache_over_host_step_time`` = async_host_cache / async_host.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402

SPARSE = ["memory.value_optimizer=sparse_adam"]
FUSED = SPARSE + ["memory.fused_value_optimizer=true"]
HOST = SPARSE + ["memory.table_location=host"]
VARIANTS = {
    "dense": ["memory.type=none"],
    "sync": ["memory.async_stream=false"],
    "async": ["memory.async_stream=true"],
    "sync_fused": ["memory.async_stream=false"] + FUSED,
    "async_fused": ["memory.async_stream=true"] + FUSED,
    "async_sparse": ["memory.async_stream=true"] + SPARSE,
    "sync_host": ["memory.async_stream=false"] + HOST,
    "async_host": ["memory.async_stream=true"] + HOST,
    "async_host_cache": ["memory.async_stream=true"] + HOST,  # + memory.host_cache_rows=--cache-rows
}
PAIRS = [("sync", "async", ""), ("sync_fused", "async_fused", "_fused"), ("sync_host", "async_host", "_host")]


def base_overrides(args):
    steps = [
        f"model.seq_length={args.seq}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        "train.eval_iters=0",
        "train.progress=false",
        "model.dropout=0.0",
        f"data.max_documents={args.documents}",
    ]
    return steps + list(args.override)


def variant_overrides(args, name):
    """The config overrides of variant ``name``: the base's, the variant's and, for the cached
    host variant, its cache of ``--cache-rows`` rows (refreshed every 10 steps)."""
    cache = [f"memory.host_cache_rows={args.cache_rows}"] if name == "async_host_cache" else []
    return base_overrides(args) + VARIANTS[name] + cache


def worker(args):
    import torch

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.parallel import compat
    from rmt.training.trainer import Trainer

    config = validate(load_config(args.config, variant_overrides(args, args.variant)))
    parallel.initialize(config)
    cuda = compat.cuda_available()
    if cuda and args.device_mem_gib:
        total = torch.cuda.get_device_properties(compat.device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_mem_gib * 2**30 / total))

    def sync():
        if cuda:
            torch.cuda.synchronize()

    trainer = Trainer(config)
    for _ in range(args.warmup):
        trainer.train_step()
    tables = host_tables(trainer)
    for table in tables:
        table.wait()
        table.link.reset()
        table.reset_peak()
        if table.cache is not None:
            table.cache.pop_counts()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps - args.warmup):
        sync()
        start = time.perf_counter()
        loss = trainer.train_step()["lm loss"]
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    row = {
        "variant": args.variant,
        "step_s": sum(times) / len(times),
        "median_step_s": times[len(times) // 2],
        "loss": float(loss),
        "device": str(compat.device()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    if tables:
        row.update(host_link(tables, len(times), cuda))
    caches = [t.cache for t in tables if t.cache is not None]
    if caches:
        counts = [c.pop_counts() for c in caches]
        row["cache_hit_fraction"] = sum(c["row_hits"] for c in counts) / max(sum(c["rows"] for c in counts), 1)
        row["cache_device_bytes"] = sum(c.device_bytes for c in caches)
    if args.profile:
        row.update(profile(trainer, args.profile, cuda, sync))
    print(json.dumps(row), flush=True)
    with open(args.worker_out, "w") as f:
        json.dump(row, f)
    parallel.destroy()


def host_tables(trainer):
    from rmt.memory.host_steps import host_tables as tables

    return tables([c.module for c in trainer.chunks])


def host_link(tables, steps, cuda):
    """Per step: the bytes the host tables moved over the host link, forward and backward, the
    device bytes their staged rows held at most, and on a GPU the bandwidth of one pinned
    host-to-device copy of a step's staged rows (median of 5)."""
    import torch

    forward = sum(sum(t.link.forward.values()) for t in tables) // steps
    backward = sum(sum(t.link.backward.values()) for t in tables) // steps
    h2d = sum(t.link.forward.get("h2d_rows", 0) for t in tables) // steps
    row = {
        "link_forward_bytes": forward,
        "link_backward_bytes": backward,
        "staged_peak_bytes": sum(t.staged_peak for t in tables),
        "link_gbps": None,
    }
    if cuda and h2d:
        src = torch.empty(h2d, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(h2d, dtype=torch.uint8, device="cuda")
        seconds = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) * 1e-3)
        row["link_gbps"] = h2d / sorted(seconds)[2] / 1e9
    return row


def busy_union(intervals):
    """Total length of the union of ``(start, end)`` intervals: the time the device ran at least
    one kernel (kernels of two streams that overlap count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


#: CUDA runtime calls in which the host waits for the device (``.item()``, ``.cpu()``, events).
HOST_WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def profile(trainer, steps, cuda, sync):
    """``steps`` more steps under torch.profiler: per step, the device kernels' summed time, the
    time the device was busy (their union over all streams), the kernel launches, the host's
    waits for the device and their time, and the top kernels printed. Where the step's wall time
    is far above the busy time, the host sets the pace, which no second stream can hide: by
    issuing launches (few waits) or by waiting (each wait drains the queue, and the device
    idles while the host issues the next launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step()
        sync()
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    # the profile's own closing synchronization is not the step's
    waits = sorted((e.time_range.start, e.time_range.end, id(e), e) for e in events if e.name in HOST_WAITS)[:-1]
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=15), flush=True)
    if waits:
        print("host waits per step, by the outermost op that made them:", flush=True)
        for op, n in collections.Counter(outermost_op(e) for *_, e in waits).most_common(12):
            print(f"  {n / steps:8.1f}  {op}", flush=True)
    if not cuda:
        return audit_host_waits(trainer)
    return {
        "kernel_s": sum(b - a for a, b in kernels) * 1e-6 / steps,
        "device_busy_s": busy_union(kernels) * 1e-6 / steps,
        "launches": len(kernels) / steps,
        "host_waits": len(waits) / steps,
        "host_wait_s": sum(b - a for a, b, *_ in waits) * 1e-6 / steps,
    }


def audit_host_waits(trainer):
    """On the CPU: one more step under :class:`~rmt.training.host_syncs.HostSyncAudit`, the
    operations that would make the host wait on a GPU printed by caller (data loading left out;
    with the async stream the memory layers run on a worker thread, outside the audit)."""
    from rmt.training.host_syncs import HostSyncAudit

    with HostSyncAudit(depth=1) as audit:
        trainer.train_step()
    waits = audit.device_waits()
    print("operations that would wait for a GPU, per step, by caller:", flush=True)
    for (op, where), n in waits.most_common(12):
        print(f"  {n:4d}  {op:22s} {where}", flush=True)
    return {"host_waits_on_gpu": sum(waits.values()), "host_wait_callers_on_gpu": sorted({where for _, where in waits})}


def outermost_op(event) -> str:
    """The outermost operator above a profiler event, with the innermost one below it
    (``outer > inner``), e.g. the autograd function or module call that waited and the aten op
    that did."""
    chain = []
    while event.cpu_parent is not None:
        event = event.cpu_parent
        chain.append(event.name)
    return f"{chain[-1]} > {chain[0]}" if chain else "(top level)"


def summarize(rows):
    by = {r["variant"]: r for r in rows}
    summary = {}
    for sync_name, async_name, key in PAIRS:
        if sync_name not in by or async_name not in by:
            continue
        s, a = by[sync_name]["median_step_s"], by[async_name]["median_step_s"]
        if "dense" in by:  # the memory layers' time needs the dense twin's step
            memory = s - by["dense"]["median_step_s"]
            summary[f"memory_s{key}"] = memory
            summary[f"hidden_fraction{key}"] = (s - a) / memory if memory > 0 else None
        summary[f"async_over_sync_step_time{key}"] = a / s
    if "async_host" in by and "async_sparse" in by:
        summary["host_over_device_step_time"] = by["async_host"]["median_step_s"] / by["async_sparse"]["median_step_s"]
    if "async_host_cache" in by and "async_host" in by:
        summary["cache_over_host_step_time"] = (
            by["async_host_cache"]["median_step_s"] / by["async_host"]["median_step_s"]
        )
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="configs/ultramem_tiny.yaml at sequence 128 (CPU, seconds)")
    ap.add_argument("--config", default=None, help="default: configs/ultramem_151m_x12.yaml (--quick: ultramem_tiny)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: 2048; --quick 128)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch size (one micro-batch per step)")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant (default 30; --quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 10; --quick 2)")
    ap.add_argument("--documents", type=int, default=200, help="data.max_documents of the default corpus")
    ap.add_argument(
        "--fused", action="store_true", help="also the pair with the value optimizer fused into the backward"
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="also the value tables in host memory: async_sparse, sync_host, async_host",
    )
    ap.add_argument(
        "--cache-rows",
        type=int,
        default=None,
        help="async_host_cache: memory.host_cache_rows (default 302,500: a quarter of the 151M-x12 "
        "table's rows; --quick 256)",
    )
    ap.add_argument(
        "--device-mem-gib",
        type=float,
        default=0,
        help="cap the device memory each variant may allocate (GPU; 0: no cap)",
    )
    ap.add_argument(
        "--variants",
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: dense,sync,async "
        "and with --fused the fused pair, with --host the host variants)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS more steps per variant: kernel time, device busy time, launches, host waits, "
        "top kernels (on the CPU: top operators, and one more step's operations that would wait "
        "for a GPU)",
    )
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("override", nargs="*", help="config overrides for every variant (key=value)")
    ap.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.config = args.config or os.path.join(
        ROOT, "configs", "ultramem_tiny.yaml" if args.quick else "ultramem_151m_x12.yaml"
    )
    args.seq = args.seq or (128 if args.quick else 2048)
    args.steps = args.steps or (4 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    args.cache_rows = args.cache_rows if args.cache_rows is not None else (256 if args.quick else 302_500)
    if args.worker_out:
        return worker(args)
    check_report(args.json, "bench_memory_stream")
    names = (
        args.variants.split(",")
        if args.variants
        else (
            ["dense", "sync", "async"]
            + (["sync_fused", "async_fused"] if args.fused else [])
            + (["async_sparse", "sync_host", "async_host", "async_host_cache"] if args.host else [])
        )
    )
    if not 0 <= args.warmup < args.steps:
        return refuse("bench_memory_stream", "--warmup must be at least 0 and less than --steps")
    if not set(names) <= set(VARIANTS):
        return refuse(
            "bench_memory_stream", f"--variants takes names from {', '.join(VARIANTS)}, got '{args.variants}'"
        )
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import ConfigError

    try:
        for name in names:
            validate(load_config(args.config, variant_overrides(args, name)), world_size=1)
    except (ConfigError, FileNotFoundError) as err:
        return refuse("bench_memory_stream", str(err))
    out = os.path.abspath((args.json or "bench_memory_stream") + ".row.tmp")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for name in names:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            f"--variant={name}",
            f"--worker-out={out}",
            f"--config={args.config}",
            f"--seq={args.seq}",
            f"--batch={args.batch}",
            f"--steps={args.steps}",
            f"--warmup={args.warmup}",
            f"--documents={args.documents}",
            f"--profile={args.profile}",
            f"--device-mem-gib={args.device_mem_gib}",
            f"--cache-rows={args.cache_rows}",
            *args.override,
        ]
        print(f"bench_memory_stream: {name} ({args.steps} steps)", flush=True)
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            rows.append(json.load(f))
        os.remove(out)
    summary = summarize(rows)
    print(
        f"{'variant':<12} {'step ms':>9} {'median ms':>10} {'peak GiB':>9} {'loss':>8} {'kernel ms':>10} "
        f"{'busy ms':>8} {'launches':>9} {'waits':>6} {'wait ms':>8}"
    )
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        prof = "".join(
            f"{'-' if r.get(k) is None else format(scale * r[k], fmt):>{w}}"
            for k, scale, fmt, w in (
                ("kernel_s", 1e3, ".2f", 11),
                ("device_busy_s", 1e3, ".2f", 9),
                ("launches", 1, ".0f", 10),
                ("host_waits", 1, ".0f", 7),
                ("host_wait_s", 1e3, ".2f", 9),
            )
        )
        print(
            f"{r['variant']:<12} {1e3 * r['step_s']:9.2f} {1e3 * r['median_step_s']:10.2f} {peak:>9} {r['loss']:8.4f}"
            f"{prof}"
        )
    for r in rows:
        if "link_forward_bytes" in r:
            gbps = "-" if r["link_gbps"] is None else f"{r['link_gbps']:.1f} GB/s"
            cache = (
                f"; cache {r['cache_device_bytes'] / 2**20:.2f} MiB on the device, "
                f"{r['cache_hit_fraction']:.3f} of the staged rows found there"
                if "cache_hit_fraction" in r
                else ""
            )
            print(
                f"{r['variant']}: host link {r['link_forward_bytes'] / 2**20:.2f} MiB forward + "
                f"{r['link_backward_bytes'] / 2**20:.2f} MiB backward per step; staged rows at most "
                f"{r['staged_peak_bytes'] / 2**20:.2f} MiB on the device; pinned copy {gbps}{cache}"
            )
    print(json.dumps(summary))
    if args.json:
        import torch

        where = machine(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        write_report(
            args.json,
            "bench_memory_stream",
            rows,
            summary,
            where,
            config=args.config,
            seq=args.seq,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
        )


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    sys.exit(main())
