"""The device cache of host-memory tables (``memory.host_cache_rows``): its hit rate on a training
run's real access pattern, for several cache sizes and refresh intervals, against uniform access.

    python tools/bench_host_cache.py --json out.json    # 300 steps, 65,536-slot table, CPU
    python tools/bench_host_cache.py --quick            # seconds

One run trains ``--config`` (default ``configs/ultramem_tiny.yaml`` at ``memory.num_keys=256``:
65,536 slots, of which a micro-batch of 2 x 128 tokens x 2 heads x top-8 looks up about 6%, the
share of UltraMem-151M-x12's 1.21M slots that a micro-batch of 2,048 tokens looks up) with its
value tables in host memory and a cache of the first size, and records each training lookup's
distinct rows per table: the rows that cross the host link without a cache. The pattern is the
same whatever the cache holds (a cached run equals the uncached one bit for bit), so the recorded
lookups are then replayed through the cache's own policy (:class:`rmt.memory.host_cache.HotRows`)
for every size and refresh interval. The replay of the run's own cache must give the run's
counters (``replay_matches_run``).

A row per table, cache size and refresh interval: ``hit_fraction``, the share of the lookups'
distinct rows the cache served from its first refresh on (the rows that do not cross), against
``uniform``, the cached share of the shard's rows (the planner's default,
``rmt-plan memory --cache-rows``). Summary: ``hit_over_uniform`` at each size (refresh
``--refresh``'s first value).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from rmt.bench_report import check_report, refuse, write_report  # noqa: E402


def overrides(args, cache_rows: int):
    return [
        f"train.steps={args.steps}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        "train.warmup_steps=10",
        "train.eval_iters=0",
        "train.progress=false",
        f"train.log_interval={args.steps}",
        f"data.max_documents={args.documents}",
        "memory.table_location=host",
        "memory.value_optimizer=sparse_adam",
        f"memory.host_cache_rows={cache_rows}",
        f"memory.host_cache_refresh={args.refresh[0]}",
    ] + list(args.override)


def record(args, cache_rows: int):
    """Train once with a cache of ``cache_rows`` rows; every host table's lookups (the distinct
    rows of each training lookup, per step), its shard's rows and its cache's counters."""
    import torch

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.memory.host_cache import HostCache
    from rmt.memory.host_steps import host_tables
    from rmt.training.trainer import Trainer

    config = validate(load_config(args.config, overrides(args, cache_rows)))
    parallel.initialize(config)
    lookups = {}
    step = [0]
    recorded = HostCache.record

    def record_lookup(self, hits, missed_rows, inverse):
        if torch.is_grad_enabled():
            rows = torch.cat([hits.rows.cpu(), missed_rows]).sort().values
            lookups.setdefault(id(self), []).append((step[0], rows))
        return recorded(self, hits, missed_rows, inverse)

    HostCache.record = record_lookup
    try:
        trainer = Trainer(config)
        tables = host_tables([c.module for c in trainer.chunks])
        for step[0] in range(args.steps):
            trainer.train_step()
        trainer.gather_weights()
    finally:
        HostCache.record = recorded
        parallel.destroy()
    return [
        {
            "lookups": lookups.get(id(t.cache), []),
            "shard_rows": t.weight.shape[0],
            "counts": t.cache.pop_counts(),
        }
        for t in tables
    ]


def replay(lookups, shard_rows: int, capacity: int, refresh: int, steps: int):
    """Hits and distinct rows of the recorded ``lookups`` through a cache of ``capacity`` rows
    refreshed every ``refresh`` steps (at the start of steps refresh, 2 refresh, ...), as
    :class:`rmt.memory.host_cache.HostCache` does: ``{"hits", "rows"}`` over all steps and
    ``{"warm_hits", "warm_rows"}`` from the first refresh on."""
    from rmt.memory.host_cache import HotRows

    hot = HotRows(min(capacity, shard_rows), "cpu")
    out = dict(hits=0, rows=0, warm_hits=0, warm_rows=0)
    i = 0
    for step in range(steps):
        if step and step % refresh == 0:
            hot.assign(hot.choose())
        while i < len(lookups) and lookups[i][0] == step:
            rows = lookups[i][1]
            cached, slots = hot.find(rows)
            hot.record(slots[cached], rows[~cached])
            n = int(cached.sum())
            out["hits"] += n
            out["rows"] += rows.numel()
            if step >= refresh:
                out["warm_hits"] += n
                out["warm_rows"] += rows.numel()
            i += 1
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 steps, 2 cache sizes (seconds)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "ultramem_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 300; --quick 20)")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch size, one micro-batch a step (default 2)")
    ap.add_argument("--documents", type=int, default=2000, help="data.max_documents of the default corpus")
    ap.add_argument(
        "--fractions",
        default=None,
        help="cache sizes as fractions of the shard's rows, comma-separated (default 1/64,1/16,1/4; --quick 1/16,1/4)",
    )
    ap.add_argument(
        "--refresh",
        default=None,
        help="refresh intervals in steps, comma-separated; the first is the run's (default 10,1,50; --quick 5,1)",
    )
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument(
        "override", nargs="*", help="config overrides (key=value; default memory.num_keys=256 model.seq_length=128)"
    )
    args = ap.parse_args(argv)
    check_report(args.json, "bench_host_cache")
    args.steps = args.steps or (20 if args.quick else 300)
    fractions = args.fractions or ("1/16,1/4" if args.quick else "1/64,1/16,1/4")
    refresh = args.refresh or ("5,1" if args.quick else "10,1,50")
    try:
        args.fractions = [_fraction(f) for f in fractions.split(",")]
        args.refresh = [int(r) for r in refresh.split(",")]
    except ValueError:
        return refuse(
            "bench_host_cache",
            f"--fractions takes fractions in (0, 1] and --refresh positive steps, got '{fractions}', '{refresh}'",
        )
    if not all(0 < f <= 1 for f in args.fractions) or not all(r > 0 for r in args.refresh):
        return refuse(
            "bench_host_cache",
            f"--fractions takes fractions in (0, 1] and --refresh positive steps, got '{fractions}', '{refresh}'",
        )
    if args.steps <= max(args.refresh):
        return refuse(
            "bench_host_cache", f"--steps ({args.steps}) must exceed every refresh interval ({max(args.refresh)})"
        )
    if not any(o.startswith("memory.num_keys=") for o in args.override):
        args.override = ["memory.num_keys=256", "model.seq_length=128"] + list(args.override)
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import ConfigError

    try:
        config = validate(load_config(args.config, overrides(args, 1)), world_size=1)
    except (ConfigError, FileNotFoundError) as err:
        return refuse("bench_host_cache", str(err))
    shard = config.memory.num_keys**2
    sizes = [max(1, round(f * shard)) for f in args.fractions]
    tables = record(args, sizes[0])
    rows, summary = [], {}
    for k, table in enumerate(tables):
        own = replay(table["lookups"], table["shard_rows"], sizes[0], args.refresh[0], args.steps)
        matches = own["hits"] == table["counts"]["row_hits"] and own["rows"] == table["counts"]["rows"]
        summary[f"replay_matches_run_table{k}"] = matches
        for fraction, capacity in zip(args.fractions, sizes):
            for refresh in args.refresh:
                got = replay(table["lookups"], table["shard_rows"], capacity, refresh, args.steps)
                hit = got["warm_hits"] / max(got["warm_rows"], 1)
                uniform = min(capacity, table["shard_rows"]) / table["shard_rows"]
                rows.append(
                    {
                        "table": k,
                        "cache_rows": capacity,
                        "cache_fraction": fraction,
                        "refresh": refresh,
                        "hit_fraction": hit,
                        "uniform": uniform,
                        "hit_over_uniform": hit / uniform,
                        "distinct_rows_per_lookup": got["rows"] / max(len(table["lookups"]), 1),
                    }
                )
                if refresh == args.refresh[0]:
                    summary[f"hit_over_uniform_table{k}_{fraction:g}"] = hit / uniform
    summary["replay_matches_run"] = all(v for key, v in summary.items() if key.startswith("replay_matches_run_"))
    print(f"{'table':>5} {'cache rows':>10} {'share':>7} {'refresh':>7} {'hit':>7} {'uniform':>8} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['table']:>5} {r['cache_rows']:>10,} {r['cache_fraction']:>7.4f} {r['refresh']:>7} "
            f"{r['hit_fraction']:>7.3f} {r['uniform']:>8.4f} {r['hit_over_uniform']:>6.2f}"
        )
    print(json.dumps(summary))
    write_report(
        args.json,
        "bench_host_cache",
        rows,
        summary,
        config=args.config,
        overrides=args.override,
        steps=args.steps,
        batch=args.batch,
    )
    return 0 if summary["replay_matches_run"] else 1


def _fraction(text: str) -> float:
    num, _, den = text.partition("/")
    return float(num) / float(den) if den else float(num)


if __name__ == "__main__":
    from rmt import setup_process

    setup_process()
    sys.exit(main())
