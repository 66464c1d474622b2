"""``rmt-plan``: plan communication and memory of sharded UltraMem memory tables.

Subcommands are entries of :data:`SUBCOMMANDS`; a new one (e.g. ``model`` from
``rmt.planner.flops``) is registered with one line::

    SUBCOMMANDS.append(Subcommand("model", "parameters and FLOPs", add_arguments, run))

``add_arguments(parser)`` declares its options; ``run(args) -> int`` does the work and
raises ``ValueError`` or :class:`rmt.errors.UserError` (one sentence) for impossible input,
which :func:`main` prints to stderr with exit status 2 (once, on global rank 0 under
torchrun). Argument errors (unknown flags, non-positive sizes) also exit with status 2 and one
line on stderr. Every file a subcommand writes is named by one of :data:`OUTPUT_OPTIONS` and
checked (:func:`rmt.outputs.check_output`) before its work starts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable, NamedTuple

from rmt.errors import UserError, global_rank, reader_may_leave
from rmt.memory import comm_volume
from rmt.memory.byte_sizes import DTYPE_BYTES
from rmt.outputs import check_output, write_json
from rmt.planner import comm, flops, host, memory, time_cli
from rmt.planner.argtypes import non_negative_float, non_negative_int, positive_float, positive_int
from rmt.process import setup_process


class Subcommand(NamedTuple):
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that reports errors as one line instead of usage + exit."""

    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")


def human(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``14.0 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


OUTPUT_OPTIONS = {"json": "--json", "out": "--out", "plot": "--plot"}
"""The options that name a file a subcommand writes, by their ``argparse`` destination."""


def check_outputs(args: argparse.Namespace) -> None:
    """Raise :class:`UserError` for the first output of ``args`` that cannot be written."""
    for dest, flag in OUTPUT_OPTIONS.items():
        path = getattr(args, dest, None)
        if path:
            check_output(path, flag)


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        write_json(path, doc)


COMM_EPILOG = """\
conventions:
  bytes sent = bytes one rank puts on the wire to other ranks per step; the chunk a
  collective keeps locally is excluded (all-to-all: (P-1)/P of the tensor, all-gather:
  (P-1) copies), which is how UltraMem Appendix D counts. Every rank receives what it
  sends (number-wise index/row all-to-alls: in expectation; exactly when each rank's
  rows are spread evenly over the owners). The backward sends the gradient of every
  floating-point tensor the forward received, in its dtype; indices have none.
  With no optional flag the forward totals are exactly Appendix D's formulas.
"""


def _add_comm_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = COMM_EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--tokens",
        type=positive_int,
        required=True,
        metavar="T",
        help="tokens per rank per step (batch x sequence on one rank; the paper's bs)",
    )
    p.add_argument("--topm", type=positive_int, required=True, metavar="K", help="values retrieved per token (top-m)")
    p.add_argument(
        "--v-dim", type=positive_int, required=True, metavar="D", help="value dimension of the physical memory table"
    )
    p.add_argument(
        "--group-size",
        type=positive_int,
        required=True,
        metavar="P",
        help="ranks the table is sharded over (memory-parallel group)",
    )
    p.add_argument(
        "--dedup",
        action="store_true",
        help="deduplicate indices per rank before the number-wise all-to-all (needs --slots or --unique-fraction)",
    )
    p.add_argument(
        "--slots",
        type=positive_int,
        metavar="N",
        help="table slots; with --dedup, unique rows per rank are the "
        "uniform-access expectation N(1-(1-K/N)^T); also checks K <= N",
    )
    p.add_argument(
        "--unique-fraction",
        type=positive_float,
        metavar="F",
        help="with --dedup, measured unique rows per rank / (T K), in (0, 1]",
    )
    p.add_argument(
        "--owner-reduce",
        action="store_true",
        help="number-wise: send scores to the owners, pool there, send back [T, E, D] partial sums per owner",
    )
    p.add_argument(
        "--ive",
        type=positive_int,
        default=1,
        metavar="E",
        help="implicit value expansion: virtual blocks per pooled output (default 1)",
    )
    p.add_argument(
        "--cores",
        type=positive_int,
        default=1,
        metavar="C",
        help="multi-core scoring: scores per retrieved value; must divide D (default 1)",
    )
    p.add_argument(
        "--block-id-bytes",
        type=non_negative_int,
        default=0,
        metavar="B",
        help="IVE block ids sent as a separate tensor of B-byte ints; 0 "
        "(default): derived from the sent virtual address, no bytes",
    )
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="t",
        help="tensor-parallel ranks holding the same tokens inside the group (also "
        "under sequence parallelism: memory layers gather the sequence first): each "
        "looks up T/t of them, then the pooled outputs are all-gathered (default 1)",
    )
    p.add_argument(
        "--index-bytes",
        type=positive_int,
        default=4,
        metavar="B",
        help="bytes per index (default 4, int32; 8 for tables over 2^31 addresses)",
    )
    p.add_argument(
        "--value-bytes",
        type=positive_int,
        default=2,
        metavar="B",
        help="bytes per element of the table: looked-up rows and their gradients (default 2, bf16)",
    )
    p.add_argument(
        "--activation-bytes",
        type=positive_int,
        metavar="B",
        help="bytes per score, pooled output, partial sum and their gradients: "
        "the training precision, 4 for fp32 (default: --value-bytes, Appendix D's "
        "single dtype)",
    )
    p.add_argument(
        "--phase",
        choices=comm_volume.PHASES,
        default="forward",
        help="which totals are the headline and decide the choice: forward "
        "(default, Appendix D) or forward_backward (a training step)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write {number_bytes, dimension_bytes, choice, ratio, phase, collectives} to FILE",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw the P x v_dim decision boundary (like Fig. 9) to FILE.png")
    p.add_argument(
        "--plot-p-max", type=positive_int, metavar="P", help="largest group size on the plot (default max(64, 2P))"
    )
    p.add_argument(
        "--plot-v-dim-max", type=positive_int, metavar="D", help="largest v_dim on the plot (default max(512, 2D))"
    )


def _comm_table(args, doc: dict) -> str:
    lines = [
        "bytes sent per rank per step to other ranks (received equals sent; see --help)",
        f"T={args.tokens} tokens/rank, top-m={args.topm}, v_dim={args.v_dim}, "
        f"P={args.group_size}, IVE E={args.ive}, cores C={args.cores}, "
        f"{args.index_bytes} B/index, {args.value_bytes} B/value, "
        f"{args.activation_bytes or args.value_bytes} B/score and pooled element",
    ]
    names = {
        "number": "number-wise"
        + (" (owner-reduce)" if args.owner_reduce else "")
        + (" (dedup)" if args.dedup and not args.owner_reduce else ""),
        "dimension": "dimension-wise",
    }
    for part in comm_volume.PARTITIONS:
        vol = doc["collectives"][part]
        lines += ["", names[part]]
        for phase in ("forward", "backward"):
            for name, n in vol[phase].items():
                lines.append(f"  {phase:<9} {name:<30} {n:>16,}  {human(n):>11}")
        for label, key in (("total forward", "forward_total"), ("total forward+backward", "forward_backward_total")):
            n = vol[key]
            lines.append(f"  {label:<40} {n:>16,}  {human(n):>11}")
    ratio = "n/a (P = 1)" if doc["ratio"] is None else f"{doc['ratio']:.3f}"
    lines += ["", f"choice ({doc['phase']}): {doc['choice']}-wise   number/dimension = {ratio}"]
    return "\n".join(lines)


def _run_comm(args: argparse.Namespace) -> int:
    options = dict(
        dedup=args.dedup,
        slots=args.slots,
        unique_fraction=args.unique_fraction,
        owner_reduce=args.owner_reduce,
        ive=args.ive,
        cores=args.cores,
        index_bytes=args.index_bytes,
        value_bytes=args.value_bytes,
        activation_bytes=args.activation_bytes,
        block_id_bytes=args.block_id_bytes,
        tensor_parallel=args.tensor_parallel,
    )
    doc = comm_volume.plan_comm(args.tokens, args.topm, args.v_dim, args.group_size, phase=args.phase, **options)
    print(_comm_table(args, doc))
    _write_json(args.json, doc)
    if args.plot:
        comm.plot_decision_boundary(
            args.plot,
            args.tokens,
            args.topm,
            p_max=args.plot_p_max or max(64, 2 * args.group_size),
            v_dim_max=args.plot_v_dim_max or max(512, 2 * args.v_dim),
            phase=args.phase,
            mark=(args.group_size, args.v_dim),
            **options,
        )
    return 0


def _add_memory_arguments(p: argparse.ArgumentParser) -> None:
    d = memory.TablePlan(slots=1, dim=1)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="take every table term from this UltraMem/PKM config "
        "(and the overrides after it) instead of the flags below",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (with --config)")
    p.add_argument(
        "--world-size",
        type=positive_int,
        metavar="W",
        help="with --config: ranks in all; gives the data-parallel size, the memory-parallel group "
        "(memory.group_size, or data x tensor parallel) and the micro-batches per step",
    )
    p.add_argument("--slots", type=positive_int, metavar="N", help="slots per table (num_keys^2)")
    p.add_argument("--dim", type=positive_int, metavar="D", help="value dimension")
    p.add_argument(
        "--group-size",
        type=positive_int,
        metavar="P",
        help="ranks each table is sharded over (default 1; with --config: from --world-size)",
    )
    p.add_argument(
        "--partition",
        choices=comm_volume.PARTITIONS,
        default=d.partition,
        help="number (rows split, default) or dimension (columns split)",
    )
    p.add_argument(
        "--value-optimizer",
        choices=memory.VALUE_OPTIMIZERS,
        default=d.value_optimizer,
        help="memory.value_optimizer (default adamw)",
    )
    p.add_argument(
        "--value-dtype",
        choices=sorted(DTYPE_BYTES),
        default=d.value_dtype,
        help="memory.value_dtype (default fp32)",
    )
    p.add_argument(
        "--fused-value-optimizer",
        dest="fused",
        action="store_true",
        help="memory.fused_value_optimizer: the rows are stepped in the lookups' backward (no gradient)",
    )
    p.add_argument(
        "--cores",
        type=positive_int,
        default=d.cores,
        help=f"memory.num_cores, score columns per lookup (default {d.cores})",
    )
    p.add_argument("--layers", type=positive_int, default=d.layers, help="memory layers on a rank (default 1)")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=d.tokens,
        metavar="T",
        help=f"tokens per micro-batch on a rank (default {d.tokens})",
    )
    p.add_argument("--microbatches", type=positive_int, default=d.microbatches, help="micro-batches per step")
    for name in ("heads", "topk", "key_dim", "tucker_rank", "ive_blocks"):
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=positive_int,
            default=getattr(d, name),
            help=f"memory.{name.replace('heads', 'num_heads')} (default {getattr(d, name)})",
        )
    p.add_argument("--precision", choices=memory.PRECISIONS, default=d.precision, help="train.precision")
    p.add_argument(
        "--retrieval-kernel",
        choices=memory.KERNELS,
        default=d.retrieval_kernel,
        help="memory.retrieval_kernel: auto (the fused retrieval where a backend covers the device and "
        "precision), fused or unfused (the score tensors); what the retrieval activations count",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=d.threads,
        help="train.threads of a CPU rank, each holding one tile working set of the fused retrieval "
        f"(default {d.threads})",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=d.device,
        help="where the tables live (a GPU save stages one chunk in host memory)",
    )
    p.add_argument(
        "--gpu-mem-gib",
        type=positive_float,
        metavar="GIB",
        help=f"memory per rank in GiB (default {memory.DEFAULT_GIB:g}; with --config on a CPU, this machine's RAM and "
        "swap shared by the run's ranks, as rmt-train counts it)",
    )
    p.add_argument(
        "--reserve-gib",
        type=non_negative_float,
        default=0.0,
        metavar="GIB",
        help="GiB per rank kept for what does not grow with the slots: the dense model, its "
        "optimizer and activations, the framework (default 0)",
    )
    p.add_argument(
        "--table-location",
        choices=memory.LOCATIONS,
        help="memory.table_location: device, or host (the shards, their optimizer state and gradient "
        "in host memory, the rows staged per lookup); default: the config's, else device",
    )
    p.add_argument(
        "--host-gib",
        type=positive_float,
        metavar="GIB",
        help="host memory per rank in GiB for tables in host memory: whether they fit it",
    )
    p.add_argument(
        "--unique-fraction",
        type=positive_float,
        metavar="F",
        help="host tables: the measured distinct fraction of the lookups a table stages "
        "(default: the uniform-access expectation N(1-(1-k/N)^G))",
    )
    p.add_argument(
        "--cache-rows",
        type=non_negative_int,
        metavar="C",
        help="host tables: rows of each table shard cached on the device with their optimizer state "
        "(memory.host_cache_rows; default: the config's, else 0)",
    )
    p.add_argument(
        "--cache-hit",
        type=non_negative_float,
        metavar="F",
        help="host tables with a cache: the fraction of a lookup's distinct rows the cache holds "
        "(default: uniform access, the cached share of the shard's rows)",
    )
    p.add_argument(
        "--host-link-gbps",
        type=positive_float,
        metavar="GBPS",
        help=f"host tables: GB/s per direction of the host link (default {host.HOST_LINK_GBPS:g}: "
        "PCIe 4.0 x16 as pinned copies achieve it)",
    )
    p.add_argument(
        "--tflops",
        type=positive_float,
        help=f"host tables: achieved TFLOP/s per GPU of the dense layers the transfers overlap "
        f"(default {host.TFLOPS:g}; rmt-plan time times the window on a hardware profile)",
    )
    p.add_argument(
        "--window-gflops",
        type=positive_float,
        metavar="G",
        help="host tables, without --config: forward GFLOPs per rank and micro-batch of the dense layers "
        "each lookup overlaps (with --config: from its layers)",
    )
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")


HOST_FLAGS = ("host_gib", "unique_fraction", "cache_rows", "cache_hit", "host_link_gbps", "tflops", "window_gflops")


def check_host_flags(args: argparse.Namespace, location: str) -> None:
    """One sentence for a host-table flag given to tables on the device."""
    if location == "host":
        return
    for name in HOST_FLAGS:
        if getattr(args, name, None) is not None:
            raise ValueError(
                f"--{name.replace('_', '-')} plans tables in host memory: it needs --table-location host"
                + (" (or memory.table_location=host)." if args.config is not None else ".")
            )


def _plan_from_flags(args: argparse.Namespace) -> memory.TablePlan:
    if args.slots is None or args.dim is None or args.overrides:
        raise ValueError("give --slots and --dim, or --config FILE [section.key=value ...].")
    return memory.TablePlan(
        **{
            k: getattr(args, k)
            for k in (
                "slots",
                "dim",
                "partition",
                "value_optimizer",
                "value_dtype",
                "layers",
                "tokens",
                "microbatches",
                "heads",
                "topk",
                "key_dim",
                "tucker_rank",
                "ive_blocks",
                "precision",
                "device",
                "fused",
                "cores",
                "retrieval_kernel",
                "threads",
            )
        },
        group_size=args.group_size or 1,
        location=args.table_location or "device",
        unique_fraction=args.unique_fraction,
        cache_rows=args.cache_rows or 0,
        cache_hit=args.cache_hit,
    )


def _plan_from_config(args: argparse.Namespace, config):
    """The tables' plan of a validated config at ``--world-size`` (the busiest stage's layers) and
    the placements of that stage's memory layers."""
    from rmt.planner.rank import layout_of, stage_table_plan

    layout = layout_of(config, args.world_size, args.device)
    mem = config.memory
    group = 1 if mem.partition == "local" else (mem.group_size or layout.dp * layout.tp)
    if args.group_size is not None and args.group_size != group:
        raise ValueError(
            f"--group-size {args.group_size} contradicts the config's group of {group} ranks "
            f"at world size {args.world_size}."
        )
    plans = [(stage, stage_table_plan(config, layout, stage)) for stage in range(layout.pp)]
    stage, plan = max(((s, p) for s, p in plans if p is not None), key=lambda sp: sp[1].layers)
    placements = host.stage_placements(config, layout, stage)
    return replace(plan, unique_fraction=args.unique_fraction, cache_hit=args.cache_hit), placements, layout.tp


def _human_rows(rows) -> list[str]:
    return [f"  {label:<26} {n:>22,}  {human(n):>11}" for label, n in rows]


def table_lines(args: argparse.Namespace, config=None) -> dict:
    """The tables' plan (from the flags, or from ``config``) as ``rmt-plan memory`` prints it:
    ``{"lines": [...], **plan_memory's document}``."""
    if config is None:
        plan = _plan_from_flags(args)
        check_host_flags(args, plan.location)
        gflops, async_stream = args.window_gflops, True
        windows = None if gflops is None else [gflops * 1e9] * plan.layers
    else:
        plan, placements, tp = _plan_from_config(args, config)
        windows = host.window_flops(config, placements, tp) if plan.location == "host" else None
        async_stream = config.memory.async_stream
    doc = memory.plan_memory(
        plan,
        gpu_mem_gib=args.gpu_mem_gib or memory.DEFAULT_GIB,
        reserve_gib=args.reserve_gib,
        host_gib=args.host_gib if config is None else None,
    )
    rows, cols = doc["shard_shape"]
    lines = [
        f"{plan.layers} memory table(s) of {plan.slots:,} slots ({doc['num_keys']:,}^2) x {plan.dim}, "
        f"{plan.value_dtype}, {plan.value_optimizer}, {plan.partition}-wise over P={plan.group_size}: "
        f"a {rows:,} x {cols:,} shard per rank" + (" in host memory" if plan.location == "host" else ""),
        f"each step: {plan.microbatches} micro-batch(es) of {plan.tokens:,} tokens, {plan.heads} heads x "
        f"top-{plan.topk}, keys {plan.key_dim} (rank {plan.tucker_rank}, grid side {doc['grid_side']:,}), "
        f"{plan.precision}; retrieval "
        + ("fused (streaming top-m)" if plan.fused_retrieval else "unfused (score tensors)"),
        "bytes per memory layer on a rank:",
    ]
    lines += _human_rows(doc["components_per_layer"].items())
    lines.append(
        "peak bytes per rank that grow with the slots, by phase"
        + (" (the device's: keys, activations, staged rows):" if plan.location == "host" else ":")
    )
    lines += _human_rows(doc["phases"].items())
    lines.append(
        f"checkpoint: {human(doc['checkpoint_bytes'])} of tables and optimizer states in all"
        + (f"; a GPU save stages {human(doc['host_chunk'])} of host memory" if doc["host_chunk"] else "")
    )
    if plan.location == "host":
        link = host.host_report(
            plan,
            windows,
            link_gbps=args.host_link_gbps or host.HOST_LINK_GBPS,
            tflops=args.tflops or host.TFLOPS,
            async_stream=async_stream,
        )
        doc["host_link"] = link
        lines += _host_lines(plan, doc, link, placements=None if config is None else placements)
    if config is None:
        lines.append(
            f"budget per rank: {args.gpu_mem_gib or memory.DEFAULT_GIB:g} GiB - {args.reserve_gib:g} GiB reserve -> "
            f"{'fits' if doc['fits'] else 'does not fit'} at P={plan.group_size} "
            f"(peak {human(doc['peak'])})"
        )
        if doc["min_group_size"] is None:
            lines.append("no group size rmt can run fits this budget")
        else:
            lines.append(
                f"smallest group that fits: P={doc['min_group_size']} "
                f"(peak {human(max(doc['min_group_phases'].values()))} per rank)"
            )
    return dict(doc, lines=lines)


def _host_lines(plan: memory.TablePlan, doc: dict, link: dict, placements=None) -> list[str]:
    """The host tables' part of ``rmt-plan memory``'s printout."""
    how = "measured fraction" if plan.unique_fraction is not None else "uniform access"
    lines = [
        f"tables in host memory: {link['staged_rows']:,.0f} distinct rows staged per lookup of "
        f"{link['lookups_staged']:,} ({link['unique_fraction']:.3f}, {how})",
        "host memory per rank (shards, optimizer states, gradients, pinned staging), by phase:",
    ]
    lines += _human_rows(doc["host_phases"].items())
    if doc.get("host_gib") is not None:
        lines.append(
            f"host budget per rank: {doc['host_gib']:g} GiB -> {'fits' if doc['host_fits'] else 'does not fit'} "
            f"(peak {human(doc['host_peak'])})"
        )
    lines.append(
        f"host link per step ({plan.layers} layer(s) x {plan.microbatches} micro-batch(es), "
        f"{link['link_gbps']:g} GB/s per direction):"
    )
    for phase, names in link["per_step"].items():
        lines += [f"  {phase:<9} {name:<21} {n:>18,}  {human(n):>11}" for name, n in names.items()]
    cache = link["cache"]
    if cache is not None:
        how = "as given" if cache["hit_fraction_given"] else "uniform access"
        refresh = sum(cache["refresh_bytes_max"].values())
        lines.append(
            f"device cache: {cache['rows']:,} rows of each shard with their optimizer state, "
            f"{human(cache['device_bytes'])} per rank; {cache['hit_fraction']:.3f} of the staged rows "
            f"found there ({how}); a refresh moves at most {human(refresh)}"
        )
    opt = link["optimizer"]
    lines.append(
        f"host optimizer per step: {opt['touched_rows']:,} rows, {opt['elements']:,} elements, "
        f"{human(opt['bytes'])} read and written"
    )
    lines.append(
        f"per lookup: forward {link['forward_s_per_lookup'] * 1e3:.3f} ms, "
        f"backward {link['backward_s_per_lookup'] * 1e3:.3f} ms over the link"
    )
    over = link["overlap"]
    if over is None:
        lines.append("overlap window: give --window-gflops (forward GFLOPs of the layers a lookup runs beside)")
        return lines
    names = [f"{i}:{j}" for i, j in placements] if placements else [str(k + 1) for k in range(len(over["layers"]))]
    stream = "" if link["async_stream"] else " (memory.async_stream off: nothing overlaps)"
    lines.append(f"overlap window at {link['tflops']:g} TFLOP/s{stream}:")
    for name, r in zip(names, over["layers"]):
        lines.append(
            f"  layer {name:<8} forward {r['forward_s'] * 1e3:.3f} / {r['forward_window_s'] * 1e3:.3f} ms, "
            f"backward {r['backward_s'] * 1e3:.3f} / {r['backward_window_s'] * 1e3:.3f} ms -> "
            f"{'hidden' if r['fits'] else 'exposed'}"
        )
    lines.append(f"exposed per step: {over['exposed_s_per_step'] * 1e3:.3f} ms")
    return lines


def _run_memory(args: argparse.Namespace) -> int:
    if args.config is not None:
        if args.slots is not None or args.dim is not None:
            raise ValueError(
                "--slots and --dim come from the config with --config; change them there (memory.num_keys=K) instead."
            )
        if args.reserve_gib:
            raise ValueError(
                "--reserve-gib sets aside the rest of a rank for a --slots/--dim plan; with --config "
                "every byte of the rank is counted."
            )
        from rmt.planner.rank_cli import run_memory

        return run_memory(args, table_lines, check_host_flags)
    doc = table_lines(args)
    print("\n".join(doc.pop("lines")))
    _write_json(args.json, doc)
    return 0


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    from rmt.planner.rank_cli import add_layout_arguments

    add_layout_arguments(p)


def _run_layouts(args: argparse.Namespace) -> int:
    from rmt.planner.rank_cli import run_layouts

    return run_layouts(args)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand(
        "comm",
        "bytes per collective per step for number- and dimension-wise "
        "partitions (UltraMem Appendix D) and the cheaper choice",
        _add_comm_arguments,
        _run_comm,
    ),
    Subcommand(
        "memory",
        "peak bytes per rank in each phase (init, step, save, load): of a whole run "
        "with --config, or of sharded memory tables alone from their terms",
        _add_memory_arguments,
        _run_memory,
    ),
]
SUBCOMMANDS.append(
    Subcommand(
        "layouts",
        "the layouts (TP, PP, VPP, DP, distributed optimizer, recomputation, "
        "table partition) of a config that fit a GPU count, ranked by predicted step time, and the "
        "smallest count that fits",
        _layout_arguments,
        _run_layouts,
    )
)
SUBCOMMANDS.append(
    Subcommand(
        "model",
        "parameters (total, without embeddings, activated per token), "
        "forward FLOPs and activation bytes per token of any architecture with "
        "its memory layers (exact; transformer and RMT also paper Table 7)",
        flops.add_arguments,
        flops.run,
    )
)

SUBCOMMANDS.append(
    Subcommand(
        "time",
        "the predicted step time of a run on a hardware profile: compute, collectives, overlaps and the "
        "pipeline bubble per stage, tokens per second, TFLOP/s per GPU and MFU",
        time_cli.add_time_arguments,
        time_cli.run_time,
    )
)
SUBCOMMANDS.append(
    Subcommand(
        "calibrate",
        "measure this machine (GEMMs, attention, memory bandwidth, the lookup kernels, collectives) under "
        "torchrun into a hardware profile that --hardware FILE reads",
        time_cli.add_calibrate_arguments,
        time_cli.run_calibrate,
    )
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rmt-plan", description="Plan communication and memory of sharded UltraMem memory tables.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``rmt-plan``; returns the exit status (0 ok, 2 bad input)."""
    setup_process()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        check_outputs(args)
        with reader_may_leave():
            return args.run(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    except (_UsageError, UserError, ValueError, OSError) as exc:
        message = str(exc)
        if not isinstance(exc, _UsageError):
            message = f"{parser.prog} {getattr(args, 'command', '')}: error: {message}"
        if global_rank() == 0:
            print(message, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
