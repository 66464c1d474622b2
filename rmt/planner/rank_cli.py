"""``rmt-plan memory --config`` (the whole rank, :mod:`rmt.planner.rank`) and ``rmt-plan layouts``
(the layout search, :mod:`rmt.planner.layouts`): argument handling and the printed tables."""

from __future__ import annotations

import argparse
from typing import List, Tuple

from rmt.config import TABLE_TYPES
from rmt.machine_memory import machine_memory
from rmt.outputs import write_json
from rmt.planner import layouts, memory, rank
from rmt.planner.argtypes import positive_float, positive_int
from rmt.planner.hardware import load_profile

TERMS = (
    "params",
    "grads",
    "main_params",
    "optimizer_states",
    "activations",
    "transient",
    "build_transient",
    "checkpoint_copies",
    "heap_retained",
    "read_buffer",
    "tables",
    "framework",
    "process",
)


def load_planned(path: str, overrides: List[str], world_size: int):
    """The config of ``path`` + ``overrides``, validated for ``world_size`` ranks as ``rmt-train``
    validates it (what rmt cannot run is rejected in one sentence), with its vocabulary known."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import UserError

    try:
        config = rank.with_vocabulary(validate(load_config(path, overrides), world_size=world_size))
    except UserError as err:
        raise ValueError(str(err)) from None
    return config


def layout_line(layout: dict) -> str:
    return (
        f"TP{layout['tp']} x PP{layout['pp']}"
        + (f" (VPP {layout['vpp']})" if layout["vpp"] > 1 else "")
        + f" x DP{layout['dp']}"
        + (", SP" if layout["sequence_parallel"] else "")
        + (", distributed optimizer" if layout["distributed_optimizer"] else "")
        + (f", recompute {layout['recompute']}" if layout["recompute"] != "none" else "")
        + f", {layout['microbatches']} micro-batch(es) per step"
    )


def run_line(config, layout: dict) -> str:
    """The layout, the micro-batch and the precision of a run, as the planner's printouts head it."""
    m, t = config.model, config.train
    return f"{layout_line(layout)} of {t.micro_batch_size} x {m.seq_length} tokens, {t.precision}"


def whole_rank_lines(config, doc: dict) -> List[str]:
    lines = [
        f"whole rank on {doc['world_size']} {doc['layout']['device'].upper()} ranks: {run_line(config, doc['layout'])}"
    ]
    for stage, s in doc["stages"].items():
        c = s["components"]
        lines.append(
            f"pipeline stage {stage}: {c['dense_params']:,} dense parameters, "
            f"{c['in_flight_microbatches']} micro-batch(es) in flight"
        )
        lines.append(f"  {'bytes per rank':<20}" + "".join(f"{p:>14}" for p in rank.PHASES))
        for term in TERMS:
            values = [s["phases"][p].get(term, 0) for p in rank.PHASES]
            if any(values):
                lines.append(f"  {term:<20}" + "".join(f"{rank.human(v):>14}" for v in values))
        lines.append(f"  {'total':<20}" + "".join(f"{rank.human(s['totals'][p]):>14}" for p in rank.PHASES))
        if "host_tables" in s:
            lines.append(
                f"  {'host memory':<20}" + "".join(f"{rank.human(s['host_tables'][p]):>14}" for p in rank.PHASES)
            )
    lines.append(f"peak per rank: {rank.human(doc['peak'])}; checkpoint {rank.human(doc['checkpoint_bytes'])}")
    if "known_shortfall" in doc:
        lines.append(
            "measured above this plan in bf16 on a CPU (tools/bench_rank_memory.py, the shipped configs): "
            + ", ".join(f"{p} up to +{v:.0%}" for p, v in doc["known_shortfall"].items())
            + "; below it: "
            + ", ".join(f"{p} down to -{v:.0%}" for p, v in doc["known_overstatement"].items())
        )
    if "host_peak" in doc:
        lines.append(f"host memory per rank (tables in host memory): peak {rank.human(doc['host_peak'])}")
    if "gib" in doc:
        lines.append(
            f"{'fits' if doc['peak'] <= doc['gib'] * rank.GIB else 'does not fit'} {doc['gib']:.3g} GiB per rank"
            + (" (this machine's RAM and swap over the run's ranks)" if doc.get("gib_source") == "machine" else "")
        )
    if "host_gib" in doc:
        lines.append(
            f"{'fits' if doc['host_fits'] else 'does not fit'} {doc['host_gib']:g} GiB of host memory per rank"
        )
    return lines


def rank_gib(args: argparse.Namespace) -> Tuple[float, str]:
    """The memory per rank a whole-rank plan is held against and where it comes from: ``--gpu-mem-gib``
    ("flag"); without it an 80 GB GPU ("default"), or on a CPU this machine's RAM and swap shared by
    the run's ranks ("machine": what ``rmt-train``'s start-up check gives each rank of a run here)."""
    if args.gpu_mem_gib is not None:
        return args.gpu_mem_gib, "flag"
    if args.device == "cpu":
        return machine_memory() / args.world_size / rank.GIB, "machine"
    return memory.DEFAULT_GIB, "default"


def run_memory(args: argparse.Namespace, table_lines, check_host_flags) -> int:
    """``rmt-plan memory --config C --world-size N [overrides]``: the whole rank, after the tables'
    own lines (``table_lines(args, config)``, :func:`rmt.planner.cli.table_lines`) when it has any;
    ``check_host_flags(args, location)`` rejects host-table flags for tables on the device."""
    if args.world_size is None:
        raise ValueError("with --config give --world-size (the ranks of the run).")
    if args.window_gflops is not None:
        raise ValueError(
            "--window-gflops is for a --slots/--dim plan; with --config the window is the config's layers."
        )
    location = [f"memory.table_location={args.table_location}"] if args.table_location else []
    if args.cache_rows is not None:
        location.append(f"memory.host_cache_rows={args.cache_rows}")
    config = load_planned(args.config, list(args.overrides) + location, args.world_size)
    check_host_flags(args, config.memory.table_location if config.memory.type in TABLE_TYPES else "device")
    gib, source = rank_gib(args)
    doc = dict(rank.plan_rank(config, args.world_size, args.device, gib, host_gib=args.host_gib), gib_source=source)
    if config.memory.type in TABLE_TYPES:
        doc["tables"] = table_lines(args, config)
    tables = doc.pop("tables", {})
    if "host_link" in tables:
        doc["host_link"] = tables["host_link"]
    print("\n".join(tables.get("lines", []) + whole_rank_lines(config, doc)))
    if args.json:
        write_json(args.json, doc)
    return 0


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", required=True, help="the run's config")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument(
        "--gpus", type=positive_int, metavar="N", help="GPU count (default: the smallest that fits any layout)"
    )
    p.add_argument("--device", choices=("cpu", "gpu"), default="gpu", help="gpu (default) or cpu ranks")
    p.add_argument("--gib", type=positive_float, default=80.0, help="memory per rank in GiB (default 80)")
    p.add_argument("--top", type=positive_int, default=10, help="layouts to print (default 10)")
    p.add_argument(
        "--hardware",
        default="h100",
        metavar="NAME|FILE",
        help="the hardware profile the layouts are timed on: h100 (default), a100, or a profile file "
        "(rmt-plan calibrate --out FILE)",
    )
    p.add_argument(
        "--host-gib",
        type=positive_float,
        metavar="GIB",
        help="with memory.table_location=host: host memory per rank in GiB the tables must fit too",
    )
    p.add_argument("--max-gpus", type=positive_int, default=1 << 16, help="largest count tried (default 65536)")
    p.add_argument("--json", metavar="FILE", help="write every candidate that fits, with its cost, to FILE")


def run_layouts(args: argparse.Namespace) -> int:
    from rmt.config import load_config
    from rmt.errors import UserError

    try:
        load_config(args.config, args.overrides)  # a bad file or override: one sentence before the search
    except UserError as err:
        raise ValueError(str(err)) from None
    options = dict(profile=load_profile(args.hardware), host_gib=args.host_gib)
    if args.gpus:
        doc = layouts.search(args.config, args.overrides, args.gpus, args.gib, args.device, **options)
    else:
        doc = layouts.smallest(args.config, args.overrides, args.gib, args.device, args.max_gpus, **options)
        if doc is None:
            raise ValueError(
                f"no layout fits {args.gib:g} GiB per rank"
                + (f" and {args.host_gib:g} GiB of host memory" if args.host_gib else "")
                + f" on up to {args.max_gpus:,} ranks."
            )
    head = (
        f"{len(doc['fitting'])} layout(s) fit {doc['gib']:g} GiB per rank on {doc['gpus']} {args.device.upper()}s "
        f"({doc['too_big']} too big, {doc['rejected']} that rmt cannot run)"
        + ("" if args.gpus else f"; {doc['gpus']} is the smallest count that fits")
        + (f"; checkpoint {rank.human(doc['fitting'][0]['checkpoint_bytes'])}" if doc["fitting"] else "")
        + (
            f"; tables in {rank.human(doc['fitting'][0]['host_peak'])} of host memory per rank (of {doc['host_gib']:g} GiB)"
            if doc["fitting"] and doc["host_gib"]
            else ""
        )
    )
    lines = [
        head,
        f"ranked by the predicted step time on {doc['hardware']} (rmt-plan time --hardware): step ms, "
        "tokens per second, model TFLOP/s per GPU and MFU",
        f"  {'#':>3} {'layout':<60}{'peak':>11}{'step ms':>10}{'tokens/s':>12}{'MFU':>7}  overrides",
    ]
    for i, r in enumerate(doc["fitting"][: args.top], 1):
        short = " ".join(
            o
            for o in r["overrides"]
            if not o.endswith("=null")
            and not o.endswith("=false")
            and not o.endswith("_size=1")
            and not o.endswith("_size=0")
            and o != "train.recompute_granularity=none"
        )
        time = r["time"]
        lines.append(
            f"  {i:>3} {layout_line(r['layout'])[:60]:<60}{rank.human(r['peak']):>11}"
            f"{time['step_s'] * 1e3:>10.1f}{time['tokens_per_s']:>12,.0f}{time['mfu']:>7.1%}  {short}"
        )
    if not doc["fitting"]:
        lines.append("  none: more GPUs (leave --gpus out for the smallest count), or a larger --gib")
    print("\n".join(lines))
    if args.json:
        write_json(args.json, doc)
    return 0
