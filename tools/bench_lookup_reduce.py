"""Benchmark the fused lookup-reduce against torch's embedding_bag and a naive gather+sum.

UltraMem-like shapes: a [N, 64] value table, T=4096 tokens, K lookups per token, C score
columns (multi-core scoring) and E virtual blocks (IVE). For every method it reports forward,
backward and fwd+bwd medians and effective GB/s, where the byte count is the minimum the op must
move (the same for every method):

    forward:  K*T looked-up rows + indices/scores/block ids + the [T, E, D] output
    backward: the [T, E, D] output gradient + each touched row read once (score gradients)
              + each touched row's gradient written once + indices/scores/score gradients

and compares it with the memory bandwidth of a large copy measured in the same run. The summary
also models the ideal implementation on this machine (``best_case_*``): the fastest forward
measured (every forward is the same gather of random rows), the touched rows read once more at
that gather rate and their gradients written at copy bandwidth, with the sort free; the
speedups over embedding_bag that this ideal would reach are about the most any kernel could show here,
and ``fwd_bwd_fraction_of_best_case`` is the ideal's time over lookup_reduce's (sparse gradient).

A second table times a whole training step of the table at the headline shape, fwd + bwd + the
optimizer step, which is where a table-sized gradient costs most: dense gradients with AdamW
(what the trainer does with ``memory.value_optimizer: adamw``) against touched-row gradients
with SparseAdam or row-wise Adagrad (``sparse_adam`` / ``rowwise_adagrad``), for lookup_reduce
and for embedding_bag, and rmt's optimizers fused into the backward (``FusedValueUpdate``,
``memory.fused_value_optimizer``). Each method trains its own copy of the table (own optimizer state).

A third table puts rmt's row-wise Adagrad step beside the peer that users of sharded embedding
tables run, FBGEMM's table-batched embedding bag (TBE) with EXACT_ROWWISE_ADAGRAD applied in its
backward (the ``bench`` extra, ``fbgemm-gpu-cpu==1.8.0``; skipped with a note where it does not
import): rmt fused, rmt unfused (sparse gradient, then ``RowWiseAdagrad.step``) and FBGEMM, at
the headline shape and at K=128, on each of ``--threads`` (default 1 and 2), interleaved, the
scores as per-sample weights with gradients; the summary adds the ideal step of the
``best_case_*`` model above (``fused_step_fraction_of_best_case_t*``, and
``best_case_step_over_fbgemm_step_t*``: about the lowest ratio to FBGEMM this machine allows).
Forward and backward + optimizer are timed apart;
after the first step each method's output, score gradients and updated table are compared with
rmt's fused one (``max_diff_*``). ``--load N`` runs N competing busy processes for the whole
benchmark: a machine shared with other jobs, where a 2-thread kernel that waits for a
descheduled thread falls behind the 1-thread one.

Transparent huge pages: with 4 KB pages a random row of a 256 MB table costs a TLB miss and a
page walk per lookup. ``--huge-pages on`` (the default) sets torch's ``THP_MEM_ALLOC_ENABLE=1``
before any tensor is allocated, so every large buffer of the run (the one table all methods
share, the bandwidth probe's buffers, gradients) is madvised for 2 MB pages; ``off`` sets it
to 0. It is a deployment setting, recommended for memory tables, not a change to any method.

Every timed phase (forward, backward) starts with a cold cache by default: a buffer of twice the
last-level cache is written first, outside the timing, as in training, where the other layers
run between a memory layer's forward and its backward. Without it the method timed first in a
round would pay for the cache misses that the ones after it skip (they look up the same rows).
``--cache warm`` skips the flush.

``--table-dtype bf16`` stores the value table (and so its gradient) in bf16 for every method,
scores and outputs staying fp32 (``memory.value_dtype: bf16``; the byte counts use 2-byte table
rows): lookup_reduce and the naive gather take the table as it is, embedding_bag needs its
per-sample weights in the table's dtype and returns bf16 (torch's bf16 table). The optimizers
keep their own state dtypes: rmt's SparseAdam and RowWiseAdagrad fp32, torch's SparseAdam and
AdamW the table's (bf16).

On a shared machine elapsed times mostly measure the other jobs; ``--clock thread`` with
``OMP_NUM_THREADS=1`` times the CPU time of the calling thread instead (torch runs CPU autograd on
the calling thread, so forward and backward are both covered), which is stable to a few percent.

On a GPU (``--device cuda``, the default where torch sees one) every method runs on CUDA tensors,
the cold cache is a write of twice the L2 cache, the bandwidth probe is a device-to-device copy,
and both GPU backends (``cuda`` and ``triton``) are timed (the summary is the first one's). Each
phase is timed with CUDA events. ``--clock device`` (the default there) first holds the device
in a spin kernel while the host issues the phase, so the events time the device's work, as in a
training step whose host runs ahead (work a method puts on a side stream, the CUDA backend's
sort, overlaps as it would there). ``--clock events`` times an isolated call: the device idles
while the host issues the phase (Python, autograd, kernel launches), and that counts. ``--clock
wall`` syncs the device at both ends and reads the host clock. ``--profile`` adds each method's
summed kernel time (every stream, side streams included) from torch.profiler.

    PYTHONPATH=. python tools/bench_lookup_reduce.py [--quick] [--json FILE] [--device cpu|cuda]
        [--huge-pages on|off] [--clock wall|thread|events|device] [--cache cold|warm] [--repeats R]
        [--backend NAME] [--profile] [--table-dtype fp32|bf16] [--threads 1,2] [--load N] [--rows N]
"""

import argparse
import glob
import os
import statistics
import time

import rmt

rmt.setup_process()  # before torch: rmt's OpenMP wait policy, as in training
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rmt.bench_report import check_report, machine, write_report  # noqa: E402
from rmt.ops import available_backends, cpu_backend, lookup_reduce, select_backend  # noqa: E402
from rmt.ops.fused_update import FusedValueUpdate  # noqa: E402
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam  # noqa: E402

HEADLINE = dict(N=1 << 20, D=64, T=4096, K=32, C=1, E=1)
TABLE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


class ClockTimer:
    """Seconds of ``clock`` over a phase. On a GPU the clock is read after a device sync at both
    ends, so the phase's time is the host's time to issue it plus the device's time to run it."""

    def __init__(self, clock, device):
        self.clock, self.device = clock, device

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()

    def start(self):
        self.t0 = self._now()

    def stop(self):
        return self._now() - self.t0


class EventTimer:
    """Seconds between CUDA events recorded around a phase: from the device reaching the phase's
    first work to it finishing the last, idle gaps while the host still issues work included.
    The host issues each phase while the device runs the cache flush queued before it, as it
    issues a layer while the device runs the previous ones in training."""

    def start(self):
        self.begin = torch.cuda.Event(enable_timing=True)
        self.begin.record()

    def stop(self):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.begin.elapsed_time(end) / 1e3


class DeviceTimer(EventTimer):
    """CUDA events with the host ahead of the device: each phase is preceded by a spin kernel
    (``torch.cuda._sleep``) long enough for the host to issue the whole phase behind it, so the
    events time the device's work alone, as in a training step whose host runs ahead. A host
    sync inside the phase (a ``.item()``) still costs what it costs: the device drains and then
    idles while the host issues the rest."""

    def __init__(self, cycles=1 << 23):
        self.cycles = cycles

    def start(self):
        torch.cuda._sleep(self.cycles)
        super().start()


def make_timer(clock, device):
    if clock == "device":
        return DeviceTimer()
    return EventTimer() if clock == "events" else ClockTimer(CLOCKS[clock], device)


def measure_bandwidth(mib, repeats, timer, device=torch.device("cpu")):
    """GB/s of ``dst.copy_(src)`` on a buffer of ``mib`` MiB (bytes read + bytes written)."""
    src = torch.randn(mib << 18, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        timer.start()
        dst.copy_(src)
        times.append(timer.stop())
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def last_level_cache_bytes(device=torch.device("cpu"), default=64 << 20):
    """Size of the largest cache: the GPU's L2, or the CPU's (Linux sysfs; ``default`` where
    sysfs does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=default)


class CacheFlusher:
    """Evicts the caches by writing a buffer of twice the last-level cache; a no-op when disabled."""

    def __init__(self, enabled, device=torch.device("cpu")):
        self.buffer = torch.empty(2 * last_level_cache_bytes(device) // 4, device=device) if enabled else None

    def __call__(self):
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def bytes_touched(N, D, T, K, C, E, unique, elem=4, table_elem=4):
    """(forward, backward) bytes: table rows and row gradients of ``table_elem`` bytes per value,
    scores, outputs and their gradients of ``elem``."""
    index_bytes = T * K * (8 + C * elem + (8 if E > 1 else 0))
    fwd = T * K * D * table_elem + index_bytes + T * E * D * elem
    bwd = T * E * D * elem + 2 * unique * D * table_elem + index_bytes + T * K * C * elem
    return fwd, bwd


def methods(shape, backends):
    """name -> callable(table, indices, scores, block_ids) -> output, for the shape's C and E."""
    C, E = shape["C"], shape["E"]
    out = {}
    for backend in backends:
        for kind, sparse in (("sparse", True), ("dense", False)):
            out[f"lookup_reduce[{backend}] {kind} grad"] = lambda t, i, s, b, backend=backend, sparse=sparse: (
                lookup_reduce(t, i, s, b, E, backend=backend, sparse_grad=sparse, validate=False)
            )
    if C == 1 and E == 1:  # embedding_bag's per-sample weights must have the table's dtype
        out["embedding_bag dense"] = lambda t, i, s, b: F.embedding_bag(
            i, t, per_sample_weights=s[..., 0].to(t.dtype), mode="sum"
        ).unsqueeze(1)
        out["embedding_bag sparse"] = lambda t, i, s, b: F.embedding_bag(
            i, t, per_sample_weights=s[..., 0].to(t.dtype), mode="sum", sparse=True
        ).unsqueeze(1)
        out["naive gather+sum"] = lambda t, i, s, b: (t[i] * s).sum(1, keepdim=True)
    return out


def time_method(fn, table, indices, scores, block_ids, grad_out, timer, flush=lambda: None):
    flush()
    timer.start()
    out = fn(table, indices, scores, block_ids)
    fwd = timer.stop()
    grad_out = grad_out.to(out.dtype)  # embedding_bag on a bf16 table returns bf16
    flush()
    timer.start()
    torch.autograd.grad(out, [table, scores], grad_out)
    return fwd, timer.stop()


def make_inputs(shape, seed, device, table_dtype=torch.float32):
    """Seeded (table, indices, scores, block ids or None, output gradient) of one shape on ``device``;
    the table (of ``table_dtype``) and the scores (fp32) require gradients."""
    N, D, T, K, C, E = (shape[k] for k in ("N", "D", "T", "K", "C", "E"))
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(N, D, generator=gen).to(device, table_dtype).requires_grad_(True)
    indices = torch.randint(0, N, (T, K), generator=gen).to(device)
    scores = torch.randn(T, K, C, generator=gen).to(device).requires_grad_(True)
    block_ids = torch.randint(0, E, (T, K), generator=gen).to(device) if E > 1 else None
    grad_out = torch.randn(T, E, D, generator=gen).to(device)
    return table, indices, scores, block_ids, grad_out


def bench_shape(
    shape, repeats, backends, timer, seed=0, flush=lambda: None, device=torch.device("cpu"), table_dtype=torch.float32
):
    N, D, T, K, C, E = (shape[k] for k in ("N", "D", "T", "K", "C", "E"))
    table, indices, scores, block_ids, grad_out = make_inputs(shape, seed, device, table_dtype)
    unique = torch.unique(indices).numel()
    fwd_bytes, bwd_bytes = bytes_touched(N, D, T, K, C, E, unique, table_elem=table.element_size())
    fns = methods(shape, backends)
    samples = {name: [] for name in fns}
    for rep in range(repeats + 1):  # the first round warms up (JIT build, allocator) and is dropped
        for name, fn in fns.items():
            sample = time_method(fn, table, indices, scores, block_ids, grad_out, timer, flush)
            if rep:
                samples[name].append(sample)
    rows = []
    for name, s in samples.items():
        fwd = statistics.median(x[0] for x in s)
        bwd = statistics.median(x[1] for x in s)
        total = statistics.median(x[0] + x[1] for x in s)
        rows.append(
            dict(
                shape,
                method=name,
                unique_rows=unique,
                fwd_s=fwd,
                bwd_s=bwd,
                fwd_bwd_s=total,
                fwd_gbps=fwd_bytes / fwd / 1e9,
                bwd_gbps=bwd_bytes / bwd / 1e9,
                fwd_bwd_gbps=(fwd_bytes + bwd_bytes) / total / 1e9,
            )
        )
    return rows


def step_methods(backend):
    """name -> (forward(table, indices, scores, update) -> [T, 1, D], optimizer class, fused) at
    C = E = 1; a fused method steps the table in its backward (rmt.ops.fused_update)."""

    def ours(sparse):
        return lambda t, i, s, u=None: lookup_reduce(
            t, i, s, None, 1, backend=backend, sparse_grad=sparse, validate=False, update=u
        )

    def bag(sparse):
        return lambda t, i, s: F.embedding_bag(
            i, t, per_sample_weights=s[..., 0].to(t.dtype), mode="sum", sparse=sparse
        ).unsqueeze(1)

    return {
        f"lookup_reduce[{backend}] fused SparseAdam": (ours(True), SparseAdam, True),
        f"lookup_reduce[{backend}] fused RowWiseAdagrad": (ours(True), RowWiseAdagrad, True),
        f"lookup_reduce[{backend}] sparse + rmt SparseAdam": (ours(True), SparseAdam, False),
        f"lookup_reduce[{backend}] sparse + RowWiseAdagrad": (ours(True), RowWiseAdagrad, False),
        f"lookup_reduce[{backend}] dense + AdamW": (ours(False), torch.optim.AdamW, False),
        "embedding_bag sparse + torch SparseAdam": (bag(True), torch.optim.SparseAdam, False),
        "embedding_bag dense + AdamW": (bag(False), torch.optim.AdamW, False),
    }


def bench_step(
    shape, repeats, backend, timer, seed=0, flush=lambda: None, device=torch.device("cpu"), table_dtype=torch.float32
):
    """Medians of one training step (fwd + bwd + optimizer step; zero_grad untimed) per method."""
    N, D, T, K = (shape[k] for k in ("N", "D", "T", "K"))
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(N, D, generator=gen).to(device, table_dtype)
    batches = [
        (torch.randint(0, N, (T, K), generator=gen).to(device), torch.randn(T, K, 1, generator=gen).to(device))
        for _ in range(repeats + 1)
    ]
    grad_out = torch.randn(T, 1, D, generator=gen).to(device)
    rows = []
    for name, (forward, optimizer_class, fused) in step_methods(backend).items():
        table = torch.nn.Parameter(init.clone())
        optimizer = optimizer_class([table], lr=1e-3)
        update = FusedValueUpdate(table, optimizer) if fused else None
        times = []
        for indices, scores in batches:  # the first step warms up (optimizer state, allocator)
            optimizer.zero_grad(set_to_none=True)
            flush()
            timer.start()
            out = forward(table, indices, scores, update) if fused else forward(table, indices, scores)
            out.backward(grad_out.to(out.dtype))
            if not fused:
                optimizer.step()
            times.append(timer.stop())
        rows.append(dict(shape, method=name, step_s=statistics.median(times[1:])))
        del table, optimizer
    return rows


ROWWISE_LR, ROWWISE_EPS = 1e-2, 1e-8


def fbgemm_missing():
    """None when fbgemm_gpu's table-batched embeddings import (the ``bench`` extra,
    ``fbgemm-gpu-cpu==1.8.0``, built for torch 2.13), else why not."""
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except (ImportError, OSError) as exc:  # OSError: a build for another torch (undefined symbol)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


class RmtRowwiseStep:
    """One row-wise Adagrad training step of rmt's table: ``lookup_reduce`` with the optimizer
    fused into its backward, or (``fused=False``) the sparse gradient then ``RowWiseAdagrad.step``."""

    def __init__(self, init, backend, fused):
        self.table = torch.nn.Parameter(init.clone())
        self.optimizer = RowWiseAdagrad([self.table], lr=ROWWISE_LR, eps=ROWWISE_EPS)
        self.update = FusedValueUpdate(self.table, self.optimizer) if fused else None
        self.backend = backend

    def forward(self, indices, scores):
        self.scores = scores.clone().requires_grad_(True)
        return lookup_reduce(
            self.table,
            indices,
            self.scores,
            None,
            1,
            backend=self.backend,
            sparse_grad=True,
            validate=False,
            update=self.update,
        )

    def backward_step(self, out, grad_out):
        out.backward(grad_out)
        if self.update is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def weights(self):
        return self.table.detach()

    def score_grad(self):
        return self.scores.grad[..., 0]


class FbgemmRowwiseStep:
    """The same step with FBGEMM's table-batched embedding bag (one table, SUM pooling, the scores
    as per-sample weights), EXACT_ROWWISE_ADAGRAD applied in its backward."""

    def __init__(self, init, backend=None, fused=True):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        N, D = init.shape
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(N, D, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=ROWWISE_LR,
            eps=ROWWISE_EPS,
            pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32,
            stochastic_rounding=False,
        )
        with torch.no_grad():
            self.tbe.split_embedding_weights()[0].copy_(init)

    def forward(self, indices, scores):
        T, K = indices.shape
        self.weights_in = scores[..., 0].reshape(-1).clone().requires_grad_(True)
        offsets = torch.arange(0, T * K + 1, K, dtype=torch.int64)
        return self.tbe(indices.reshape(-1), offsets, self.weights_in).view(T, 1, -1)

    def backward_step(self, out, grad_out):
        out.backward(grad_out)

    def weights(self):
        return self.tbe.split_embedding_weights()[0].detach()

    def score_grad(self):
        return self.weights_in.grad


def rowwise_peers(with_fbgemm):
    """name -> step class of the row-wise Adagrad comparison (rmt fused, rmt unfused, FBGEMM)."""
    out = {"rmt fused RowWiseAdagrad": (RmtRowwiseStep, True), "rmt sparse + RowWiseAdagrad": (RmtRowwiseStep, False)}
    if with_fbgemm:
        out["FBGEMM TBE EXACT_ROWWISE_ADAGRAD"] = (FbgemmRowwiseStep, True)
    return out


def rotated(items, k):
    """``items`` from position ``k`` (mod its length) on, then those before it. The methods of an
    interleaved comparison start one later each repeat, so that none always runs right after the
    same other one: a method's forward measured 0.4-0.6 ms slower (of ~3 ms, one core, cold cache)
    right after an unfused or FBGEMM step than right after rmt's fused one, with the caches
    flushed in between either way, and in a fixed order that put rmt's fused step after FBGEMM's
    in every repeat."""
    k %= len(items)
    return items[k:] + items[:k]


def bench_rowwise_peers(shapes, threads, repeats, backend, timer, flush, table_dtype, with_fbgemm, seed=0):
    """Row-wise Adagrad training steps side by side, interleaved (every repeat runs each method
    once, in turn, starting one method later than the repeat before: see ``rotated``), at each
    shape and thread count: forward, backward + optimizer, and their sum (medians; a warm-up step
    dropped). Each method trains its own copy of the same table on the
    same batches; after the first step the methods' outputs, score gradients and tables are
    compared with rmt's fused one (``max_diff_*``)."""
    rows = []
    before = torch.get_num_threads()
    for shape in shapes:
        N, D, T, K = (shape[k] for k in ("N", "D", "T", "K"))
        gen = torch.Generator().manual_seed(seed)
        init = torch.randn(N, D, generator=gen).to(table_dtype)
        batches = [
            (torch.randint(0, N, (T, K), generator=gen), torch.rand(T, K, 1, generator=gen)) for _ in range(repeats + 1)
        ]
        grad_out = torch.randn(T, 1, D, generator=gen)
        for n in threads:
            torch.set_num_threads(n)
            steps = {name: cls(init, backend, fused) for name, (cls, fused) in rowwise_peers(with_fbgemm).items()}
            samples = {name: [] for name in steps}
            diffs = {}
            for rep, (indices, scores) in enumerate(batches):
                for name, step in rotated(list(steps.items()), rep):
                    flush()
                    timer.start()
                    out = step.forward(indices, scores)
                    fwd = timer.stop()
                    flush()
                    timer.start()
                    step.backward_step(out, grad_out)
                    bwd = timer.stop()
                    if rep:
                        samples[name].append((fwd, bwd))
                    else:
                        diffs[name] = (out.detach(), step.score_grad().reshape(-1), step.weights())
            ref = diffs["rmt fused RowWiseAdagrad"]
            unique = statistics.mean(torch.unique(indices).numel() for indices, _ in batches[1:])
            fwd_bytes, _ = bytes_touched(N, D, T, K, 1, 1, unique, table_elem=init.element_size())
            for name, s in samples.items():
                got = diffs[name]
                fwd = statistics.median(x[0] for x in s)
                rows.append(
                    dict(
                        shape,
                        method=name,
                        threads=n,
                        unique_rows=unique,
                        fwd_s=fwd,
                        fwd_gbps=fwd_bytes / fwd / 1e9,
                        bwd_opt_s=statistics.median(x[1] for x in s),
                        step_s=statistics.median(x[0] + x[1] for x in s),
                        max_diff_output=float((got[0].float() - ref[0].float()).abs().max()),
                        max_diff_score_grad=float((got[1].float() - ref[1].float()).abs().max()),
                        max_diff_table=float((got[2].float() - ref[2].float()).abs().max()),
                    )
                )
            del steps
    torch.set_num_threads(before)
    return rows


def print_rowwise_peers(rows, note):
    print("\nrow-wise Adagrad training step side by side (interleaved), ms:" + (f" ({note})" if note else ""))
    header = f"{'K':>4} {'thr':>3}  {'method':<34} {'fwd':>8} {'bwd+opt':>8} {'step':>8} {'x fused':>8} {'max|dW|':>9}"
    print(header)
    print("-" * len(header))
    fused = {(r["K"], r["threads"]): r["step_s"] for r in rows if r["method"] == "rmt fused RowWiseAdagrad"}
    for r in rows:
        print(
            f"{r['K']:>4} {r['threads']:>3}  {r['method']:<34} {r['fwd_s'] * 1e3:8.3f} {r['bwd_opt_s'] * 1e3:8.3f} "
            f"{r['step_s'] * 1e3:8.3f} {r['step_s'] / fused[(r['K'], r['threads'])]:8.2f} {r['max_diff_table']:9.2e}"
        )


def profile_headline(backends, device, headline, rows=12, table_dtype=torch.float32):
    """One fwd+bwd of each method at the headline shape under torch.profiler: the ops and kernels
    that take the time (device time on a GPU), printed as torch's table. Returns, on a GPU, each
    method's summed kernel time in seconds (all streams)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rmt.quiet import profiler_lines_dropped

    table, indices, scores, _, grad_out = make_inputs(headline, 1, device, table_dtype)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    summed = {}
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for name, fn in methods(headline, backends).items():
        for _ in range(2):  # warm-up (JIT builds, allocator), then the profiled call
            with profiler_lines_dropped(), profile(activities=activities) as prof:
                out = fn(table, indices, scores, None)
                torch.autograd.grad(out, [table, scores], grad_out.to(out.dtype))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        averages = prof.key_averages()
        print(f"\nprofile: {name}")
        print(averages.table(sort_by=sort_by, row_limit=rows))
        if device.type == "cuda":
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            kernels_us = sum(e.time_range.elapsed_us() for e in kernels)
            print(f"summed kernel time (all streams): {kernels_us:.1f} us over {len(kernels)} kernels and memsets")
            summed[name] = kernels_us * 1e-6
    return summed


def shapes(quick, device, headline):
    if quick:
        return [headline, dict(headline, K=128, C=2, E=4)]
    grid = [dict(headline, K=k, C=c, E=e) for k in (32, 128) for c in (1, 2) for e in (1, 4)]
    larger = [dict(headline, N=4 * headline["N"])] + (
        [dict(headline, N=16 * headline["N"])] if device.type == "cuda" else []
    )
    return grid + larger


def print_table(rows, bandwidth, huge_pages, clock, cache, device):
    print(
        f"device: {device}; memory bandwidth (copy): {bandwidth:.1f} GB/s; huge pages (THP_MEM_ALLOC_ENABLE): "
        f"{huge_pages}; clock: {clock}; cache: {cache}"
    )
    header = (
        f"{'N':>8} {'K':>4} {'C':>2} {'E':>2}  {'method':<34} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b GB/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['N']:>8} {r['K']:>4} {r['C']:>2} {r['E']:>2}  {r['method']:<34} {r['fwd_s'] * 1e3:8.3f} "
            f"{r['bwd_s'] * 1e3:8.3f} {r['fwd_bwd_s'] * 1e3:8.3f} {r['fwd_bwd_gbps']:9.2f}"
        )


def print_steps(step_rows):
    print(f"\ntraining step of the table (fwd + bwd + optimizer step), N={step_rows[0]['N']}, K={step_rows[0]['K']}:")
    header = f"{'method':<46} {'step ms':>9}"
    print(header)
    print("-" * len(header))
    for r in step_rows:
        print(f"{r['method']:<46} {r['step_s'] * 1e3:9.3f}")


def best_case_s(head, bandwidth, table_elem=4):
    """(gather rate in GB/s, estimated fwd+bwd seconds of an ideal implementation) at the headline.

    Every method's forward is the same gather of the K*T looked-up rows, so the fastest forward
    measured gives the machine's rate for gathering random rows. The ideal fwd+bwd reads the
    forward's bytes and each touched row once more (score gradients) at that rate and writes
    each touched row's gradient at copy bandwidth, with the sort and any overlap free. It is a
    model, not a proof, of what the goals ask of the hardware."""
    fastest = min(head.values(), key=lambda r: r["fwd_s"])
    gather = fastest["fwd_gbps"] * 1e9
    touched_bytes = fastest["unique_rows"] * fastest["D"] * table_elem
    return gather / 1e9, fastest["fwd_s"] + touched_bytes / gather + touched_bytes / (bandwidth * 1e9)


def summarize(rows, bandwidth, backend, step_rows, headline, table_elem=4):
    head = {r["method"]: r for r in rows if all(r[k] == v for k, v in headline.items())}
    ours = head[f"lookup_reduce[{backend}] sparse grad"]
    step = {r["method"]: r["step_s"] for r in step_rows}
    gather_gbps, best = best_case_s(head, bandwidth, table_elem)
    return {
        "step_speedup_sparse_adam_vs_embedding_bag_sparse_adam": step["embedding_bag sparse + torch SparseAdam"]
        / step[f"lookup_reduce[{backend}] sparse + rmt SparseAdam"],
        "step_speedup_sparse_adam_vs_dense_adamw": step[f"lookup_reduce[{backend}] dense + AdamW"]
        / step[f"lookup_reduce[{backend}] sparse + rmt SparseAdam"],
        "speedup_vs_embedding_bag_sparse": head["embedding_bag sparse"]["fwd_bwd_s"] / ours["fwd_bwd_s"],
        "speedup_vs_embedding_bag_dense": head["embedding_bag dense"]["fwd_bwd_s"] / ours["fwd_bwd_s"],
        "fraction_of_bandwidth": ours["fwd_bwd_gbps"] / bandwidth,
        "gather_gbps": gather_gbps,
        "fwd_bwd_fraction_of_best_case": best / ours["fwd_bwd_s"],
        "best_case_speedup_vs_embedding_bag_sparse": head["embedding_bag sparse"]["fwd_bwd_s"] / best,
        "best_case_speedup_vs_embedding_bag_dense": head["embedding_bag dense"]["fwd_bwd_s"] / best,
    }


class CompetingLoad:
    """``n`` busy processes (pure-Python spin loops) for the duration of a ``with`` block: a
    machine shared with other jobs, to see how the kernels' threading copes (``--load``)."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer repeats (~1-3 minutes on 2 cores)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 5, quick 3)")
    parser.add_argument("--backend", default=None, help="lookup_reduce backend (default: auto / $RMT_LOOKUP_BACKEND)")
    parser.add_argument(
        "--huge-pages",
        choices=("on", "off"),
        default="on",
        help="THP_MEM_ALLOC_ENABLE for every tensor of the run (default on)",
    )
    parser.add_argument(
        "--clock",
        choices=(*CLOCKS, "events", "device"),
        default=None,
        help="wall: elapsed time (on a GPU between device syncs); thread: CPU time of the "
        "calling thread, which other jobs' load barely changes (needs OMP_NUM_THREADS=1); "
        "events: CUDA events around each isolated phase, host issue time included; "
        "device: CUDA events with the host ahead of the device (default on a GPU; wall "
        "on the CPU)",
    )
    parser.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: evict the caches before every timed forward and backward (default)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's table of one fwd+bwd per method at the headline shape",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where the tensors live (default: cuda where torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--table-dtype",
        choices=tuple(TABLE_DTYPES),
        default="fp32",
        help="the value table's storage dtype (scores and outputs stay fp32; default fp32)",
    )
    parser.add_argument(
        "--threads",
        default=None,
        help="thread counts of the row-wise Adagrad side-by-side table, comma-separated (default "
        "1,2 on the CPU; 1 with --clock thread)",
    )
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="run N competing busy processes during the whole benchmark (a loaded machine)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=HEADLINE["N"],
        metavar="N",
        help=f"value table rows of the headline shape (default {HEADLINE['N']}; the other shapes "
        "scale with it): a small table runs every path in seconds, with cache-resident timings",
    )
    args = parser.parse_args(argv)
    check_report(args.json, "bench_lookup_reduce")
    if args.rows < 1024:
        parser.error(f"--rows must be at least 1024; got {args.rows}")
    headline = dict(HEADLINE, N=args.rows)
    table_dtype = TABLE_DTYPES[args.table_dtype]
    table_elem = torch.empty(0, dtype=table_dtype).element_size()
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1" if args.huge_pages == "on" else "0"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU on this machine")
    repeats = args.repeats or (3 if args.quick else 5)
    gpu_backends = [name for name in ("cuda", "triton") if name in available_backends(device)]
    backends = [args.backend] if args.backend else (gpu_backends if device.type == "cuda" else [select_backend(device)])
    backend = backends[0]
    args.clock = args.clock or ("device" if device.type == "cuda" else "wall")
    if args.clock == "thread" and (torch.get_num_threads() != 1 or device.type == "cuda"):
        parser.error(
            "--clock thread measures the calling thread's CPU time only: run on the CPU with OMP_NUM_THREADS=1"
        )
    if args.clock in ("events", "device") and device.type != "cuda":
        parser.error(f"--clock {args.clock} times CUDA events: it needs --device cuda")
    try:
        threads = [int(x) for x in (args.threads or ("1" if args.clock == "thread" else "1,2")).split(",")]
    except ValueError:
        parser.error(f"--threads must be comma-separated positive integers; got {args.threads!r}")
    if min(threads) < 1 or (args.clock == "thread" and threads != [1]):
        parser.error("--threads: positive integers, and only 1 with --clock thread")
    if args.load < 0:
        parser.error(f"--load must be >= 0; got {args.load}")
    timer = make_timer(args.clock, device)
    # on the CPU a copy of twice the last-level cache (at least 256 MiB): memory, not cache, bandwidth
    probe_mib = 1024 if device.type == "cuda" else max(256, 2 * last_level_cache_bytes(device) >> 20)
    bandwidth = measure_bandwidth(probe_mib, 7, timer, device)
    flush = CacheFlusher(args.cache == "cold", device)
    with CompetingLoad(args.load):
        rows, step_rows, peer_rows, fbgemm_note, kernel_s = run_all(
            args, device, backends, backend, timer, flush, repeats, table_dtype, threads, headline
        )
    print_table(rows, bandwidth, args.huge_pages, args.clock, args.cache, device)
    print_steps(step_rows)
    print_rowwise_peers(peer_rows, fbgemm_note)
    summary = summarize(rows, bandwidth, backend, step_rows, headline, table_elem)
    summary.update(summarize_peers(peer_rows, bandwidth, table_elem))
    if kernel_s:
        ours = kernel_s[f"lookup_reduce[{backend}] sparse grad"]
        summary["kernel_time_speedup_vs_embedding_bag_sparse"] = kernel_s["embedding_bag sparse"] / ours
        summary["kernel_time_speedup_vs_embedding_bag_dense"] = kernel_s["embedding_bag dense"] / ours
    shape = ", ".join(f"{k}={v}" for k, v in headline.items())
    print(
        f"summary ({backend}; fwd+bwd at {shape}, {args.table_dtype} table, fp32 scores; "
        f"competing processes: {args.load}):"
    )
    for key, value in summary.items():
        print(f"  {key}: {value:.3f}")
    if args.json:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        where = machine(
            threads=torch.get_num_threads(),
            backend=backend,
            backends=backends,
            device=str(device),
            gpu=gpu,
            copy_bandwidth_gbps=bandwidth,
            huge_pages=args.huge_pages,
            clock=args.clock,
            cache=args.cache,
            table_dtype=args.table_dtype,
            load=args.load,
            peer_threads=threads,
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
            sort_digit_bits=cpu_backend._ext().sort_digit_bits(torch.get_num_threads()) if "cpu" in backends else None,
            fbgemm=fbgemm_note or "fbgemm-gpu-cpu",
        )
        write_report(
            args.json,
            "bench_lookup_reduce",
            rows,
            summary,
            where,
            step_rows=step_rows,
            peer_rows=peer_rows,
            kernel_s=kernel_s,
        )


def run_all(args, device, backends, backend, timer, flush, repeats, table_dtype, threads, headline):
    """Every timed table of the run: (fwd/bwd rows, training-step rows, row-wise peer rows, the
    note on FBGEMM ('' when it ran), profiled kernel seconds)."""
    rows = [
        r
        for shape in shapes(args.quick, device, headline)
        for r in bench_shape(shape, repeats, backends, timer, flush=flush, device=device, table_dtype=table_dtype)
    ]
    step_rows = bench_step(headline, repeats, backend, timer, flush=flush, device=device, table_dtype=table_dtype)
    note = fbgemm_missing() if device.type == "cpu" else "FBGEMM's CPU build only (fbgemm-gpu-cpu)"
    if note and device.type == "cpu":
        note = f"FBGEMM skipped: {note}; pip install -e '.[bench]'"
        print(note)
    elif device.type == "cpu" and table_dtype != torch.float32:
        note = "FBGEMM skipped: its CPU kernels take fp32 or fp16 weights, not bf16"
        print(note)
    peer_rows = []
    if device.type == "cpu":
        peer_rows = bench_rowwise_peers(
            (headline, dict(headline, K=128)),
            threads,
            repeats,
            backend,
            timer,
            flush,
            table_dtype,
            with_fbgemm=not note,
        )
    kernel_s = profile_headline(backends, device, headline, table_dtype=table_dtype) if args.profile else {}
    return rows, step_rows, peer_rows, note, kernel_s


def summarize_peers(peer_rows, bandwidth, table_elem=4):
    """Headline ratios of the row-wise Adagrad side-by-side table (K=32), per thread count: rmt's
    fused step over FBGEMM's and over rmt's unfused one, and the ideal step of ``best_case_s``'s
    model (the fastest forward of the three, then each touched row read once at that gather rate
    and written once, updated, at copy bandwidth; the sort and the per-row state free) as a
    fraction of rmt's fused step and over FBGEMM's step: no implementation of the step moves fewer
    bytes, so ``best_case_step_over_fbgemm_step`` is about the lowest ratio this machine allows."""
    out = {}
    step = {(r["method"], r["K"], r["threads"]): r["step_s"] for r in peer_rows}
    for (method, K, n), value in step.items():
        if method != "rmt fused RowWiseAdagrad" or K != HEADLINE["K"]:
            continue
        out[f"fused_step_speedup_vs_unfused_t{n}"] = step[("rmt sparse + RowWiseAdagrad", K, n)] / value
        _, best = best_case_s(
            {r["method"]: r for r in peer_rows if (r["K"], r["threads"]) == (K, n)}, bandwidth, table_elem
        )
        out[f"fused_step_fraction_of_best_case_t{n}"] = best / value
        if ("FBGEMM TBE EXACT_ROWWISE_ADAGRAD", K, n) in step:
            tbe = step[("FBGEMM TBE EXACT_ROWWISE_ADAGRAD", K, n)]
            out[f"fused_step_over_fbgemm_step_t{n}"] = value / tbe
            out[f"best_case_step_over_fbgemm_step_t{n}"] = best / tbe
    return out


if __name__ == "__main__":
    main()
