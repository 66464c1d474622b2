"""``rmt-plan``: plan communication and memory of sharded UltraMem memory tables.

Subcommands are entries of :data:`SUBCOMMANDS`; a new one (e.g. ``model`` from
``rmt.planner.flops``) is registered with one line::

    SUBCOMMANDS.append(Subcommand("model", "parameters and FLOPs", add_arguments, run))

``add_arguments(parser)`` declares its options; ``run(args) -> int`` does the work and
raises ``ValueError`` (one sentence) for impossible input, which :func:`main` prints to
stderr with exit status 2. Argument errors (unknown flags, non-positive sizes) also exit
with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NamedTuple

from rmt.planner import comm, flops, memory


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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def human(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``14.0 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


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
    p.add_argument("--tokens", type=positive_int, required=True, metavar="T",
                   help="tokens per rank per step (batch x sequence on one rank; the "
                        "paper's bs)")
    p.add_argument("--topm", type=positive_int, required=True, metavar="K",
                   help="values retrieved per token (top-m)")
    p.add_argument("--v-dim", type=positive_int, required=True, metavar="D",
                   help="value dimension of the physical memory table")
    p.add_argument("--group-size", type=positive_int, required=True, metavar="P",
                   help="ranks the table is sharded over (memory-parallel group)")
    p.add_argument("--dedup", action="store_true",
                   help="deduplicate indices per rank before the number-wise all-to-all "
                        "(needs --slots or --unique-fraction)")
    p.add_argument("--slots", type=positive_int, metavar="N",
                   help="table slots; with --dedup, unique rows per rank are the "
                        "uniform-access expectation N(1-(1-K/N)^T); also checks K <= N")
    p.add_argument("--unique-fraction", type=positive_float, metavar="F",
                   help="with --dedup, measured unique rows per rank / (T K), in (0, 1]")
    p.add_argument("--owner-reduce", action="store_true",
                   help="number-wise: send scores to the owners, pool there, send back "
                        "[T, E, D] partial sums per owner")
    p.add_argument("--ive", type=positive_int, default=1, metavar="E",
                   help="implicit value expansion: virtual blocks per pooled output "
                        "(default 1)")
    p.add_argument("--cores", type=positive_int, default=1, metavar="C",
                   help="multi-core scoring: scores per retrieved value; must divide D "
                        "(default 1)")
    p.add_argument("--block-id-bytes", type=non_negative_int, default=0, metavar="B",
                   help="IVE block ids sent as a separate tensor of B-byte ints; 0 "
                        "(default): derived from the sent virtual address, no bytes")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="t",
                   help="tensor-parallel ranks holding the same tokens inside the group: each "
                        "looks up T/t of them, then the pooled outputs are all-gathered (default 1)")
    p.add_argument("--index-bytes", type=positive_int, default=4, metavar="B",
                   help="bytes per index (default 4, int32; 8 for tables over 2^31 "
                        "addresses)")
    p.add_argument("--value-bytes", type=positive_int, default=2, metavar="B",
                   help="bytes per value, score and gradient element (default 2, bf16)")
    p.add_argument("--phase", choices=comm.PHASES, default="forward",
                   help="which totals are the headline and decide the choice: forward "
                        "(default, Appendix D) or forward_backward (a training step)")
    p.add_argument("--json", metavar="FILE",
                   help="write {number_bytes, dimension_bytes, choice, ratio, phase, "
                        "collectives} to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the P x v_dim decision boundary (like Fig. 9) to FILE.png")
    p.add_argument("--plot-p-max", type=positive_int, metavar="P",
                   help="largest group size on the plot (default max(64, 2P))")
    p.add_argument("--plot-v-dim-max", type=positive_int, metavar="D",
                   help="largest v_dim on the plot (default max(512, 2D))")


def _comm_table(args, doc: dict) -> str:
    lines = [
        "bytes sent per rank per step to other ranks (received equals sent; see --help)",
        f"T={args.tokens} tokens/rank, top-m={args.topm}, v_dim={args.v_dim}, "
        f"P={args.group_size}, IVE E={args.ive}, cores C={args.cores}, "
        f"{args.index_bytes} B/index, {args.value_bytes} B/value",
    ]
    names = {"number": "number-wise" + (" (owner-reduce)" if args.owner_reduce else "")
             + (" (dedup)" if args.dedup and not args.owner_reduce else ""),
             "dimension": "dimension-wise"}
    for part in comm.PARTITIONS:
        vol = doc["collectives"][part]
        lines += ["", names[part]]
        for phase in ("forward", "backward"):
            for name, n in vol[phase].items():
                lines.append(f"  {phase:<9} {name:<30} {n:>16,}  {human(n):>11}")
        for label, key in (("total forward", "forward_total"),
                           ("total forward+backward", "forward_backward_total")):
            n = vol[key]
            lines.append(f"  {label:<40} {n:>16,}  {human(n):>11}")
    ratio = "n/a (P = 1)" if doc["ratio"] is None else f"{doc['ratio']:.3f}"
    lines += ["", f"choice ({doc['phase']}): {doc['choice']}-wise   "
                  f"number/dimension = {ratio}"]
    return "\n".join(lines)


def _run_comm(args: argparse.Namespace) -> int:
    options = dict(dedup=args.dedup, slots=args.slots,
                   unique_fraction=args.unique_fraction, owner_reduce=args.owner_reduce,
                   ive=args.ive, cores=args.cores, index_bytes=args.index_bytes,
                   value_bytes=args.value_bytes, block_id_bytes=args.block_id_bytes,
                   tensor_parallel=args.tensor_parallel)
    doc = comm.plan_comm(args.tokens, args.topm, args.v_dim, args.group_size,
                         phase=args.phase, **options)
    print(_comm_table(args, doc))
    _write_json(args.json, doc)
    if args.plot:
        comm.plot_decision_boundary(
            args.plot, args.tokens, args.topm,
            p_max=args.plot_p_max or max(64, 2 * args.group_size),
            v_dim_max=args.plot_v_dim_max or max(512, 2 * args.v_dim),
            phase=args.phase, mark=(args.group_size, args.v_dim), **options)
    return 0


def _add_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slots", type=positive_int, required=True, metavar="N",
                   help="memory table slots (rows)")
    p.add_argument("--dim", type=positive_int, required=True, metavar="D",
                   help="value dimension (columns)")
    p.add_argument("--group-size", type=positive_int, default=1, metavar="P",
                   help="ranks the table is sharded over (default 1)")
    p.add_argument("--dtype", choices=sorted(memory.DTYPE_BYTES), default="bf16",
                   help="table dtype (default bf16)")
    p.add_argument("--optimizer", choices=sorted(memory.OPTIMIZER_STATES),
                   default="adam",
                   help="adam: 2 states/element, adagrad: 1, sgd: 0, rowwise_adagrad: one fp32 "
                        "per row (default adam)")
    p.add_argument("--master-fp32", action="store_true",
                   help="keep an fp32 master copy; gradients and optimizer states fp32")
    p.add_argument("--grad", choices=memory.GRAD_MODES, default="dense",
                   help="dense: table-shard-sized gradient (default); sparse: touched "
                        "rows as (int64 index, row) pairs, needs --tokens and --topm")
    p.add_argument("--tokens", type=positive_int, metavar="T",
                   help="tokens per rank per step (for sparse gradients)")
    p.add_argument("--topm", type=positive_int, metavar="K",
                   help="values retrieved per token (for sparse gradients)")
    p.add_argument("--partition", choices=memory.PARTITIONS, default="number",
                   help="number: rows split (default); dimension: columns split")
    p.add_argument("--gpu-mem-gib", type=positive_float, default=80.0, metavar="GIB",
                   help="memory per GPU in GiB (default 80)")
    p.add_argument("--reserve-gib", type=non_negative_float, default=0.0, metavar="GIB",
                   help="GiB per GPU kept for the dense model, activations and workspace "
                        "(default 0)")
    p.add_argument("--json", metavar="FILE", help="write the numbers to FILE")


def _memory_breakdown(per_rank: dict) -> list[str]:
    rows = [("table shard", per_rank["table"]), ("gradients", per_rank["gradients"]),
            ("master weights (fp32)", per_rank["master_weights"]),
            ("optimizer states", per_rank["optimizer_states"]),
            ("total", per_rank["total"])]
    return [f"  {label:<24} {n:>22,}  {human(n):>11}" for label, n in rows]


def _run_memory(args: argparse.Namespace) -> int:
    doc = memory.plan_memory(
        args.slots, args.dim, args.group_size, gpu_mem_gib=args.gpu_mem_gib,
        reserve_gib=args.reserve_gib, dtype=args.dtype, optimizer=args.optimizer,
        master_fp32=args.master_fp32, grad=args.grad, tokens=args.tokens,
        topm=args.topm, partition=args.partition)
    lines = [f"memory table {args.slots:,} slots x {args.dim}, {args.dtype}, "
             f"{args.optimizer}{' + fp32 master' if args.master_fp32 else ''}, "
             f"{args.grad} gradients, {args.partition}-wise",
             f"bytes per rank at P={args.group_size}:"]
    lines += _memory_breakdown(doc["bytes_per_rank"])
    lines.append(f"budget per rank: {args.gpu_mem_gib:g} GiB - {args.reserve_gib:g} GiB "
                 f"reserve = {doc['budget_bytes']:,} bytes -> "
                 f"{'fits' if doc['fits'] else 'does not fit'} at P={args.group_size}")
    if doc["min_group_size"] is None:
        lines.append("no group size fits this budget")
    else:
        lines.append(f"minimal group size: {doc['min_group_size']} GPUs of "
                     f"{args.gpu_mem_gib:g} GiB")
        lines += _memory_breakdown(doc["min_group_bytes_per_rank"])
    print("\n".join(lines))
    _write_json(args.json, doc)
    return 0


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("comm", "bytes per collective per step for number- and dimension-wise "
               "partitions (UltraMem Appendix D) and the cheaper choice",
               _add_comm_arguments, _run_comm),
    Subcommand("memory", "bytes per rank of table, gradients and optimizer states; "
               "minimal group size for a GPU memory", _add_memory_arguments, _run_memory),
]
SUBCOMMANDS.append(Subcommand("model", "parameters (total, without embeddings, activated per token), "
                              "forward FLOPs and activation bytes per token of any architecture with "
                              "its memory layers (exact; transformer and RMT also paper Table 7)",
                              flops.add_arguments, flops.run))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rmt-plan", description="Plan communication and memory of "
                     "sharded UltraMem memory tables.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``rmt-plan``; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    except (_UsageError, ValueError, OSError) as exc:
        message = str(exc)
        if not isinstance(exc, _UsageError):
            message = f"{parser.prog} {getattr(args, 'command', '')}: error: {message}"
        print(message, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
