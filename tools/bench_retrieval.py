"""The fused retrieval op (``rmt.ops.fused_retrieval``) against the unfused path: peak bytes and
time of one forward plus backward of a memory layer's key retrieval, as the key grid grows.

    python tools/bench_retrieval.py --json out.json    # 4,096 tokens; 1,024 to 200,000 keys per side
    python tools/bench_retrieval.py --quick            # seconds
    python tools/bench_retrieval.py --device gpu --backend triton --quick   # on a CUDA GPU

Each row retrieves the top-m of ``--tokens`` tokens and ``--heads`` heads from a grid of
``--keys`` keys per side (TDQKR at Tucker rank ``--rank`` with ``--cores`` multi-core scores, or
product keys at rank 1), key width ``--width``, and backpropagates a random gradient of the
scores to the queries, the keys and the cores. ``unfused`` is the memory layers' reference path
(the side scores ``[T, H, r, n]`` as tensors, ``rmt.memory.retrieval``), ``fused`` the op on its
default backend (CPU: the C++/OpenMP kernel; GPU: CUDA, then Triton) or on ``--backend``. The
unfused path is skipped where its score tensors (about 3.5 x ``T H 2 r n`` x 4 bytes at their
peak) would not fit in 80% of the available memory.

``--device gpu``: the tensors on the current CUDA device; ``time_s`` is then the median wall time
of a step ended by a device synchronization, and ``peak_bytes`` the step's growth of
``torch.cuda.max_memory_allocated`` over the memory allocated at its start (in this process: the
allocator's count needs no fresh one).

Per row: ``time_s``, the median wall time of ``--reps`` steps after one warm-up (``cpu_s``: the
process's CPU time, the figure that stays put on a shared machine); ``peak_bytes``, the growth of
the resident set over one step (VmHWM, reset at the step's start through /proc/self/clear_refs,
less the resident set then) in a fresh process that holds the inputs and has run the method once
on a tiny grid (the extension and MKL loaded): everything the step touches, torch's allocations,
the kernels' buffer pools and their first touch; and ``peak_beyond_key_grad``, the same less the
keys' gradient, a tensor the size of the keys that both paths produce (a per-step cost over the
keys, like their norm).
Summary, the goals of the op on CPU: ``fused_peak_over_unfused`` at each measured size, beyond
the key gradient (goal <= 1/50 from 16,384 keys per side; ``fused_total_peak_over_unfused`` with
it), ``fused_time_over_unfused`` (goal <= 1.0 from 16,384, <= 1.2 at
1,024), and ``fused_peak_growth`` (the fused peak beyond the key gradient at the most keys over
the fewest: flat means it does not grow with the keys).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import rmt  # noqa: E402
from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402
from rmt.machine_memory import meminfo_bytes  # noqa: E402

rmt.setup_process()


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    return meminfo_bytes("MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def inputs(args, n, seed=0):
    """Leaves with gradients: queries ``[T, H, 2, r, D]``, keys ``[H, 2, r, n, D]``, cores (or
    None); the selector; the scores' gradient."""
    import torch

    from rmt.memory.retrieval import rank1_selector

    gen = torch.Generator().manual_seed(seed)
    T, H, r, D = args.tokens, args.heads, args.rank, args.width
    q = torch.randn(T, H, 2, r, D, generator=gen).to(args.torch_dtype).requires_grad_()
    keys = (torch.randn(H, 2, r, n, D, generator=gen) / D**0.5).to(args.torch_dtype).requires_grad_()
    cores = None
    if r > 1:
        cores = (torch.randn(H, args.cores, r, r, generator=gen) / r).to(args.torch_dtype).requires_grad_()
    grad = torch.randn(T, H, args.topm, args.cores if r > 1 else 1, generator=gen).to(args.torch_dtype)
    device = "cuda" if args.device == "gpu" else "cpu"
    q, keys, grad = (x.detach().to(device).requires_grad_(x.requires_grad) for x in (q, keys, grad))
    if cores is not None:
        cores = cores.detach().to(device).requires_grad_()
    return q, keys, cores, None if cores is None else rank1_selector(cores), grad


def step(method, q, keys, cores, selector, grad, m, backend=None):
    """One forward and backward of the retrieval ``method`` (the fused op on ``backend``, None: its
    default); returns the addresses."""
    import torch

    from rmt.memory.retrieval import product_topk, tucker_topk
    from rmt.ops.fused_retrieval import fused_retrieval

    for leaf in (q, keys, cores):
        if leaf is not None:
            leaf.grad = None
    if method == "fused":
        addr, scores = fused_retrieval(q[:, :, 0], q[:, :, 1], keys, m, cores, selector, backend=backend)
    else:
        s_row = torch.einsum("thrd,hrnd->thrn", q[:, :, 0], keys[:, 0])
        s_col = torch.einsum("thrd,hrnd->thrn", q[:, :, 1], keys[:, 1])
        if cores is None:
            addr, scores = product_topk(s_row, s_col, m)
        else:
            addr, scores = tucker_topk(s_row, s_col, cores, m, selector)
    scores.backward(grad)
    if keys.is_cuda:
        torch.cuda.synchronize()
    return addr


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_child(args, method, n) -> int:
    """In this (fresh) process: the resident-set growth of one step (module docstring)."""
    small = inputs(args, max(args.topm, 64), seed=1)
    step(method, *small[:4], small[4], args.topm)
    tensors = inputs(args, n)
    start = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(method, *tensors[:4], tensors[4], args.topm)
    return _status("VmHWM") - start


def peak_gpu(args, method, tensors) -> int:
    """The growth of ``torch.cuda.max_memory_allocated`` over one step (module docstring)."""
    import torch

    q, keys, cores, selector, grad = tensors
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(method, q, keys, cores, selector, grad, args.topm, args.backend)
    return torch.cuda.max_memory_allocated() - start


def measure(args, method, n, tensors):
    import subprocess

    q, keys, cores, selector, grad = tensors
    addr = step(method, q, keys, cores, selector, grad, args.topm, args.backend)  # warm-up (extension load, pools)
    walls, cpus = [], []
    for _ in range(args.reps):
        w0, c0 = time.perf_counter(), time.process_time()
        step(method, q, keys, cores, selector, grad, args.topm, args.backend)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    for leaf in (q, keys, cores):
        if leaf is not None:
            leaf.grad = None
    if args.device == "gpu":
        peak = peak_gpu(args, method, tensors)
    else:
        child = [sys.executable, os.path.abspath(__file__), "--peak-child", method, str(n)] + args.passed
        peak = int(subprocess.run(child, check=True, capture_output=True, text=True).stdout.split()[-1])
    key_grad = keys.numel() * keys.element_size()
    return addr, {
        "keys_per_side": n,
        "method": method,
        "time_s": statistics.median(walls),
        "time_min_s": min(walls),
        "cpu_s": statistics.median(cpus),
        "peak_bytes": peak,
        "peak_beyond_key_grad": peak - key_grad,
        "unfused_score_bytes": args.tokens * args.heads * 2 * args.rank * n * keys.element_size(),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 tokens, 1,024 and 16,384 keys per side (seconds)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default 4096; --quick 512)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=2, help="Tucker rank (1: product keys)")
    ap.add_argument("--cores", type=int, default=2, help="multi-core scores (TDQKR)")
    ap.add_argument("--width", type=int, default=128, help="key width D")
    ap.add_argument("--topm", type=int, default=16)
    ap.add_argument("--keys", default=None, help="keys per side, comma-separated (default 1024,16384,100000,200000)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the tensors live")
    ap.add_argument("--backend", default=None, help="the fused op's backend (default: the device's first)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per row after one warm-up (median)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("--peak-child", nargs=2, metavar=("METHOD", "KEYS"), help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    check_report(args.json, "bench_retrieval")
    args.passed = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
    try:
        keys = [int(k) for k in (args.keys or ("1024,16384" if args.quick else "1024,16384,100000,200000")).split(",")]
    except ValueError:
        return refuse("bench_retrieval", f"--keys takes comma-separated integers; got {args.keys!r}")
    if args.tokens is None:
        args.tokens = 512 if args.quick else 4096
    for name in ("tokens", "heads", "rank", "cores", "width", "topm", "reps"):
        if getattr(args, name) < 1:
            return refuse("bench_retrieval", f"--{name} must be at least 1; got {getattr(args, name)}")
    if min(keys) < args.topm:
        return refuse("bench_retrieval", f"--keys must all be at least --topm ({args.topm}); got {min(keys)}")
    if args.rank == 1 and args.cores != 1:
        args.cores = 1  # product keys score one column
    import torch

    if args.device == "gpu" and not torch.cuda.is_available():
        return refuse("bench_retrieval", "--device gpu needs a CUDA GPU; none is visible")
    args.torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.backend is not None:
        from rmt.ops.dispatch import select_retrieval_backend

        try:
            select_retrieval_backend("cuda" if args.device == "gpu" else "cpu", args.torch_dtype, args.backend)
        except ValueError as exc:
            return refuse("bench_retrieval", str(exc).removeprefix("fused_retrieval: "))
    if args.peak_child:
        print(peak_child(args, args.peak_child[0], int(args.peak_child[1])))
        return 0
    rows = []
    print(f"{'keys/side':>9} {'method':>8} {'time s':>8} {'cpu s':>8} {'peak MiB':>10} {'w/o dkeys MiB':>14}")
    for n in keys:
        tensors = inputs(args, n)
        free = torch.cuda.mem_get_info()[0] if args.device == "gpu" else available_bytes()
        fits = 3.5 * args.tokens * args.heads * 2 * args.rank * n * 4 < 0.8 * free
        picked = {}
        for method in ("unfused", "fused") if fits else ("fused",):
            addr, row = measure(args, method, n, tensors)
            picked[method] = addr
            rows.append(row)
            print(
                f"{n:>9} {method:>8} {row['time_s']:>8.3f} {row['cpu_s']:>8.3f} "
                f"{row['peak_bytes'] / 2**20:>10.1f} {row['peak_beyond_key_grad'] / 2**20:>14.1f}",
                flush=True,
            )
        if not fits:
            print(f"{n:>9} {'unfused':>8}  (its score tensors would not fit in this machine's memory)", flush=True)
        if len(picked) == 2:
            same = (picked["fused"] == picked["unfused"]).all(-1).float().mean().item()
            rows[-1]["same_addresses"] = rows[-2]["same_addresses"] = same
        del tensors
    by = {(r["keys_per_side"], r["method"]): r for r in rows}
    summary = {}
    for n in keys:
        if (n, "unfused") in by:
            summary[f"fused_peak_over_unfused_{n}"] = (
                by[n, "fused"]["peak_beyond_key_grad"] / by[n, "unfused"]["peak_beyond_key_grad"]
            )
            summary[f"fused_total_peak_over_unfused_{n}"] = (
                by[n, "fused"]["peak_bytes"] / by[n, "unfused"]["peak_bytes"]
            )
            summary[f"fused_time_over_unfused_{n}"] = by[n, "fused"]["time_s"] / by[n, "unfused"]["time_s"]
            summary[f"fused_cpu_over_unfused_{n}"] = by[n, "fused"]["cpu_s"] / by[n, "unfused"]["cpu_s"]
    summary["fused_peak_growth"] = (
        by[max(keys), "fused"]["peak_beyond_key_grad"] / by[min(keys), "fused"]["peak_beyond_key_grad"]
    )
    print(json.dumps(summary))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("torch_dtype", "passed", "peak_child")}
        where = machine(threads=torch.get_num_threads(), load_average=os.getloadavg())
        if args.device == "gpu":
            where["gpu"] = torch.cuda.get_device_name()
        write_report(args.json, "bench_retrieval", rows, summary, where, config=config)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
