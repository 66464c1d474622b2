"""``rmt-plan calibrate``: measure the present machine into a hardware profile
(:mod:`rmt.planner.hardware`) under the launcher the runs use (``torchrun``; gloo on a CPU,
NCCL on a GPU), every rank measuring at once, so that what ranks share (a CPU's cores, its memory
bandwidth, a node's links) is inside the figures rather than corrected for afterwards: calibrate
with the world size and threads of the runs the profile will predict.

Each figure is the slowest rank's median over repeats (a synchronous step waits for the slowest):

* the host's cost per operation: rmt's transformer as the trainer runs it, forward and backward
  at a width where issuing its operations is all of its time, over the aten operations it
  dispatches (:mod:`rmt.planner.issue_probe`); the model charges it per operation, so the bare
  dispatch of one operation (a one-element ``add_``) is taken off each GEMM's and memory-bound
  operation's time below;
* GEMMs per dtype over a range of sizes (``[m, k] @ [k, n]``, ``m`` tokens-like, ``n``, ``k``
  widths-like), each the median of three passes over them: the fastest rate is the profile's
  peak, each size's rate over it its efficiency;
* fused attention (``scaled_dot_product_attention`` with an explicit mask, as rmt calls it),
  forward and backward, as fractions of the GEMM peak;
* memory-bound operations: ``x += y`` over sizes from cache-resident to DRAM-sized (bytes read
  and written per second);
* the elementwise kinds priced by their elements too (the GELU, a layer norm, a softmax, a dropout; forward
  and backward, per dtype): elements per second at the size of a small model's activations;
* the lookup-reduce kernel (:func:`rmt.ops.lookup_reduce`) forward and backward at UltraMem's
  shape, bytes of value rows per second; ``torch.topk`` elements per second;
* each collective (all-reduce, all-gather, reduce-scatter, all-to-all, a point-to-point send)
  over the launched world at a small and a large size: ``alpha`` the small one's seconds,
  ``busbw`` the large one's bus bytes over its seconds beyond ``alpha``; with one rank none is
  measured (a run on one rank sends nothing; the fields hold the memory bandwidth and no latency);
* the host link (a pinned copy to the device; on a CPU the copy bandwidth) and the host's memory
  bandwidth.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from rmt.outputs import write_json

GEMM_SIDES = {"m": (256, 2048, 16384), "n": (8, 32, 128, 512, 2048), "k": (8, 32, 128, 512, 2048)}
"""The size classes of GEMMs measured: tokens-like ``m``, widths-like ``n`` and ``k`` (the RMT's
reads and writes are as narrow as 8)."""
GEMM_FLOPS_MAX = {"cpu": 2e9, "gpu": 1e13}
MEMORY_BYTES = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]


class Clock:
    """Times a callable on ``device``, waiting for a GPU's queued work at each end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], object], repeats: int, min_s: float = 0.02) -> float:
        """Median seconds of ``fn`` over ``repeats`` timings, all ranks starting together; each
        timing calls it the number of times one call's time says fills ``min_s``, the same number
        on every rank (the largest), since a collective must be called equally often by all."""
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        calls = _largest(max(1, math.ceil(min_s / max(time.perf_counter() - start, 1e-9))))
        times = []
        for _ in range(repeats):
            if dist.is_initialized():
                dist.barrier()
            self.sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            times.append((time.perf_counter() - start) / calls)
        return statistics.median(times)


def _largest(value: float) -> float:
    """The largest of the ranks' ``value``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())


def gemm_shapes(device_kind: str, quick: bool, dtype: str) -> List[tuple]:
    """The ``(m, n, k)`` measured: the grid of :data:`GEMM_SIDES` up to :data:`GEMM_FLOPS_MAX`
    (a CPU's bf16 GEMMs, which no CPU run is timed in, and ``--quick`` on a coarser grid)."""
    import itertools

    coarse = quick or (device_kind == "cpu" and dtype == "bf16")
    sides = {k: v[::2] if coarse else v for k, v in GEMM_SIDES.items()}
    if device_kind == "cpu" and dtype == "bf16":  # ~2 GFLOP/s without AMX: a few shapes
        sides = {"m": (256,), "n": (32, 512), "k": (32, 512)}
    if device_kind == "gpu":
        sides = {k: tuple(x * 4 for x in v) for k, v in sides.items()}
    limit = GEMM_FLOPS_MAX[device_kind] / (20 if device_kind == "cpu" and dtype == "bf16" else 1)
    return [s for s in itertools.product(sides["m"], sides["n"], sides["k"]) if 2 * s[0] * s[1] * s[2] <= limit]


def device_seconds(seconds: float, dispatch: float) -> float:
    """The device's part of one operation's ``seconds``: less the bare dispatch of one operation
    (:func:`measure_dispatch`), which the step-time model charges per operation as part of the
    host's issue cost (at least half the measured time stays)."""
    return max(seconds - dispatch, 0.5 * seconds)


def measure_dispatch(clock: Clock, device, repeats: int) -> float:
    """Seconds of the bare dispatch of one operation: a one-element ``add_``."""
    x = torch.zeros(1, device=device)
    return _largest(clock.seconds(lambda: x.add_(1.0), repeats))


GEMM_PASSES = 3
"""Passes over the GEMM shapes, alternating their order; each shape's rate is its median."""


def measure_gemms(
    clock: Clock, device, dtype: torch.dtype, shapes, repeats: int, dispatch: float = 0.0
) -> List[List[float]]:
    """``[[m, n, k, flop/s], ...]`` of the GEMM ``shapes`` (the bare ``dispatch`` taken off): the
    median of :data:`GEMM_PASSES` passes over them in alternating orders, since a burst of other
    work on a shared machine slows a stretch of one pass (a step's median, which the profile
    predicts, is robust to such a burst in the same way)."""
    rates = {shape: [] for shape in shapes}
    for p in range(GEMM_PASSES):
        for m, n, k in shapes if p % 2 == 0 else shapes[::-1]:
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = device_seconds(_largest(clock.seconds(lambda: torch.mm(a, b), repeats, min_s=0.005)), dispatch)
            rates[m, n, k].append(2.0 * m * n * k / seconds)
    return [[m, n, k, statistics.median(rates[m, n, k])] for m, n, k in shapes]


def measure_attention(clock: Clock, device, dtype: torch.dtype, repeats: int, shape) -> Dict[str, float]:
    """FLOP/s of masked fused attention forward and backward on ``shape`` ``(b, h, s, d)``."""
    import torch.nn.functional as F

    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    flops = 4.0 * b * h * s * s * d
    forward = _largest(clock.seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), repeats))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.autograd.grad(o, (q, k, v), grad)

    total = _largest(clock.seconds(both, repeats))
    return {"forward": flops / forward, "backward": 2.5 * flops / max(total - forward, 1e-9)}


def measure_memory(clock: Clock, device, sizes, repeats: int, dispatch: float = 0.0) -> List[List[float]]:
    """``[[bytes, bytes/s], ...]`` of ``x += y`` touching each size (two reads, a write; the bare
    ``dispatch`` taken off)."""
    out = []
    for nbytes in sizes:
        n = max(1, nbytes // 12)
        x = torch.zeros(n, device=device)
        y = torch.ones(n, device=device)
        seconds = device_seconds(_largest(clock.seconds(lambda: x.add_(y), repeats)), dispatch)
        out.append([12.0 * n, 12.0 * n / seconds])
    return out


ATTENTION_SHAPE = {"cpu": (2, 4, 128, 64), "gpu": (2, 16, 2048, 64)}
"""``(b, h, s, d)`` of the attention measurement: a small model's heads at the sequence it trains
(on a GPU 34 GFLOP forward, milliseconds of work: a shape of a few microseconds would time its
launches rather than the kernel)."""
ELEMENTWISE_ELEMENTS = {"cpu": 1 << 20, "gpu": 1 << 26}
"""Elements of the elementwise kinds' measurement (a GPU's large enough for its launch not to
count)."""
NORM_WIDTH = 1024


def measure_elementwise(clock: Clock, device, dtype: torch.dtype, repeats: int, dispatch: float = 0.0):
    """``{kind: {"forward": elements/s, "backward": elements/s}}`` of the GELU, a layer norm over
    rows of :data:`NORM_WIDTH`, a softmax over such rows and a dropout (the backward: the forward
    and the input's gradient less the forward; the bare ``dispatch`` taken off)."""
    import torch.nn.functional as F

    n = ELEMENTWISE_ELEMENTS["cpu" if device.type == "cpu" else "gpu"]
    x = torch.randn(n // NORM_WIDTH, NORM_WIDTH, device=device, dtype=dtype, requires_grad=True)
    weight = torch.ones(NORM_WIDTH, device=device, dtype=dtype)
    bias = torch.zeros(NORM_WIDTH, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    kinds = {
        "gelu": F.gelu,
        "norm": lambda t: F.layer_norm(t, (NORM_WIDTH,), weight, bias),
        "softmax": lambda t: torch.softmax(t, dim=-1),
        "dropout": lambda t: F.dropout(t, 0.1, training=True),
    }
    out = {}
    for kind, fn in kinds.items():
        forward = device_seconds(_largest(clock.seconds(lambda: fn(x), repeats)), dispatch)

        def both(fn=fn):
            torch.autograd.grad(fn(x), x, grad)

        total = device_seconds(_largest(clock.seconds(both, repeats)), dispatch)
        out[kind] = {"forward": x.numel() / forward, "backward": x.numel() / max(total - forward, 0.1 * forward)}
    return out


def measure_op_overhead(clock: Clock, device, repeats: int) -> float:
    """Seconds per dispatched aten operation of a training step's forward and backward whose
    time is all issue (:mod:`rmt.planner.issue_probe`)."""
    from rmt.planner.issue_probe import probe_step

    step, operations, close = probe_step(device)
    try:
        return _largest(clock.seconds(step, repeats)) / operations
    finally:
        close()


def measure_lookup(clock: Clock, device, repeats: int, quick: bool) -> Dict[str, float]:
    """Bytes of value rows per second of :func:`rmt.ops.lookup_reduce`, forward and backward
    (the table gradient as touched rows), at UltraMem's shape (rows of 64 fp32, top-32)."""
    from rmt.ops import lookup_reduce

    rows, dim, tokens, k = (1 << 16, 64, 1024, 32) if quick else (1 << 20, 64, 4096, 32)
    table = torch.randn(rows, dim, device=device, requires_grad=True)
    indices = torch.randint(0, rows, (tokens, k), device=device)
    scores = torch.randn(tokens, k, 1, device=device, requires_grad=True)
    nbytes = tokens * k * dim * 4
    forward = _largest(clock.seconds(lambda: lookup_reduce(table, indices, scores, sparse_grad=True), repeats))
    grad = torch.randn(tokens, 1, dim, device=device)

    def both():
        out = lookup_reduce(table, indices, scores, sparse_grad=True)
        torch.autograd.grad(out, (table, scores), grad)

    total = _largest(clock.seconds(both, repeats))
    return {"forward": nbytes / forward, "backward": nbytes / max(total - forward, 1e-9)}


def measure_topk(clock: Clock, device, repeats: int) -> float:
    """Elements per second of ``torch.topk`` over rows of 2,048 keys (k = 32)."""
    x = torch.randn(512, 2048, device=device)
    return x.numel() / _largest(clock.seconds(lambda: torch.topk(x, 32, dim=-1), repeats))


def measure_collectives(clock: Clock, device, repeats: int, quick: bool) -> Dict[str, Dict[str, float]]:
    """``{kind: {"alpha_s", "busbw"}}`` over the launched world (module docstring)."""
    from rmt.planner.hardware import bus_factor

    p = dist.get_world_size()
    small, large = 1 << 10, (1 << 22 if quick else 1 << 24)
    out = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        seconds = {}
        for nbytes in (small, large):
            n = max(p, nbytes // 4 // p * p)
            buf = torch.ones(n, device=device)
            parts = list(buf.chunk(p))
            outs = [torch.empty_like(c) for c in parts]
            rank = dist.get_rank()

            own = parts[rank].clone()

            def run(kind=kind, buf=buf, parts=parts, outs=outs, rank=rank, own=own):
                if kind == "all_reduce":
                    dist.all_reduce(buf)
                elif kind == "all_gather":
                    dist.all_gather_into_tensor(buf, own)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(outs[0], buf)
                elif kind == "all_to_all":
                    dist.all_to_all(outs, parts)
                else:  # ring of sends: each rank sends to the next and receives from the previous
                    ops = [
                        dist.P2POp(dist.isend, buf, (rank + 1) % p),
                        dist.P2POp(dist.irecv, outs[0].new_empty(buf.shape), (rank - 1) % p),
                    ]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()

            seconds[nbytes] = _largest(clock.seconds(run, repeats, min_s=0.01))
        size = {k: 4 * max(p, k // 4 // p * p) for k in (small, large)}
        alpha = seconds[small]
        beyond = max(seconds[large] - alpha, 1e-9)
        out[kind] = {"alpha_s": alpha, "busbw": bus_factor(kind, p) * size[large] / beyond}
    return out


def measure_host_link(clock: Clock, device, repeats: int) -> float:
    """Bytes/s of a pinned host-to-device copy (on a CPU: of a large copy)."""
    n = 1 << 26
    if device.type == "cuda":
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        return n / _largest(clock.seconds(lambda: dst.copy_(src, non_blocking=True), repeats))
    src = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    return n / _largest(clock.seconds(lambda: dst.copy_(src), repeats))


PEAK_MIN_FLOPS = 1e7
"""The peak is the fastest GEMM of at least this many FLOPs: a smaller one's time is mostly its
fixed costs, and its rate mostly their noise."""


def _efficiency(points: List[List[float]]):
    """The fastest rate of a GEMM of :data:`PEAK_MIN_FLOPS` or more (the peak) and each shape's
    rate over it (at most 1)."""
    large = [row for row in points if 2 * row[0] * row[1] * row[2] >= PEAK_MIN_FLOPS] or points
    peak = max(row[3] for row in large)
    return peak, [row[:3] + [min(1.0, row[3] / peak)] for row in points]


def calibrate(out: str, quick: bool = False, threads: int = 1) -> Dict:
    """Measure this rank's machine with the launched world (module docstring); rank 0 writes the
    profile to ``out`` and says so. Returns the profile."""
    from rmt.planner.hardware import profile_from_dict
    from rmt.process import setup_process

    setup_process()
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    clock = Clock(device)
    repeats = 3 if quick else 5

    def say(message: str) -> None:
        if rank == 0:
            print(f"rmt-plan calibrate: {message}", flush=True)

    say(f"measuring {'a GPU' if cuda else 'the CPU'} with {world} rank(s) of {threads} thread(s) ...")
    overhead = measure_op_overhead(clock, device, repeats)
    dispatch = min(overhead, measure_dispatch(clock, device, repeats))
    say(f"host: {overhead * 1e6:.1f} us per operation of a training step, {dispatch * 1e6:.1f} us a bare dispatch")
    gemm, peak = {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        shapes = gemm_shapes("gpu" if cuda else "cpu", quick, name)
        peak[name], gemm[name] = _efficiency(measure_gemms(clock, device, dtype, shapes, repeats, dispatch))
    say(f"GEMMs: {peak['fp32'] / 1e9:,.1f} GFLOP/s fp32, {peak['bf16'] / 1e9:,.1f} bf16 at best")
    attention = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rates = measure_attention(clock, device, dtype, repeats, ATTENTION_SHAPE["gpu" if cuda else "cpu"])
        attention[name] = {p: min(1.0, r / peak[name]) for p, r in rates.items()}
    sizes = MEMORY_BYTES if cuda else MEMORY_BYTES[:-1]
    memory = measure_memory(clock, device, sizes, repeats, dispatch)
    say(
        f"memory: {max(r for _, r in memory) / 1e9:,.1f} GB/s at best, "
        f"{memory[-1][1] / 1e9:,.1f} at {sizes[-1] >> 20} MiB"
    )
    elementwise = {
        name: measure_elementwise(clock, device, dtype, repeats, dispatch)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }
    say(
        "elementwise, fp32 forward: "
        + ", ".join(f"{k} {v['forward'] / 1e9:,.2f}" for k, v in elementwise["fp32"].items())
        + " G elements/s"
    )
    lookup = measure_lookup(clock, device, repeats, quick)
    topk = measure_topk(clock, device, repeats)
    if world > 1:
        collectives = measure_collectives(clock, device, repeats, quick)
        say(
            "collectives over "
            + f"{world} ranks: "
            + ", ".join(
                f"{k} {v['alpha_s'] * 1e6:.0f} us + {v['busbw'] / 1e9:.2f} GB/s" for k, v in collectives.items()
            )
        )
    else:
        collectives = {
            k: {"alpha_s": 0.0, "busbw": memory[-1][1]}
            for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
        }
    link = measure_host_link(clock, device, repeats)
    props = torch.cuda.get_device_properties(device) if cuda else None
    doc = {
        "name": (props.name if cuda else "CPU") + f" (calibrated, {world} rank(s) x {threads} thread(s))",
        "device": "gpu" if cuda else "cpu",
        "peak_flops": peak,
        "gemm_efficiency": gemm,
        "gemm_tile": [128, 256] if cuda else [1, 1],
        "units": props.multi_processor_count if cuda else 1,
        "attention_efficiency": attention,
        "memory_bandwidth": memory,
        "elementwise_rate": elementwise,
        "op_overhead_s": overhead,
        "async_launch": cuda,
        "lookup_bandwidth": lookup,
        "topk_rate": topk,
        "collectives": {"intra": collectives, "inter": collectives},
        "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        "host_link": link,
        "host_memory_bandwidth": memory[-1][1],
        "sources": {
            "all": f"rmt-plan calibrate on this machine, {world} rank(s) of {threads} thread(s) measuring at once; "
            "the GEMM peak is the fastest GEMM measured",
            "collectives": "measured over the launched world; across nodes taken equal to inside (one node measured)"
            if world > 1
            else "not measured (one rank sends nothing)",
        },
        "measured": {"world_size": world, "threads": threads, "quick": quick},
    }
    profile_from_dict(doc)  # what is written must load
    if rank == 0:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        write_json(out, doc)
        say(f"wrote '{out}' (rmt-plan time --hardware {out})")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return doc
