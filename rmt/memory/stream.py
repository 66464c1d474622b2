"""Async memory stream: a memory layer placed ``i:j`` runs beside the dense layers i+1..j,
in the forward and in the backward.

Forward: :meth:`MemoryStream.launch` starts the layer (query, retrieval, lookup and the
memory-parallel collectives) as soon as layer i's output exists and :meth:`MemoryStream.wait`
joins it where layer j adds the result (UltraMem §3.2 skip-layer structure, Appendix C: the
memory layer's communication hidden behind dense compute). The work runs on a worker thread
(gloo collectives and the lookup kernels release the GIL while the main thread computes the
dense layers); on GPU it is issued into a side CUDA stream that waits on an event recorded
after layer i, and layer j's stream waits on an event recorded after the memory layer.
Autograd graph, grad mode and autocast state carry over, so the numbers are those of the
synchronous mode.

Backward (training): the memory layer's input is detached at layer i, so the layer has an
autograd graph of its own, linked to the dense one by two functions. :class:`JoinMemory` adds
its output at layer j; its backward hands the output gradient (and the auxiliary loss's, at
the schedule's loss scale) to :meth:`MemoryStream.launch_backward`, which runs the memory
layer's backward (kernels, gradient collectives) on the worker while the main thread runs the
dense backward of layers j..i+1. :class:`ForkMemory`, an identity on layer i's output, waits for
it in its backward and adds the input gradient. Gradients are those of the synchronous mode.

``busy_s`` / ``exposed_s`` accumulate the memory layers' forward time on the worker and the
time the dense path spent blocked in :meth:`wait` (the part not hidden); ``busy_backward_s`` /
``exposed_backward_s`` the same for the backward.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


class MemoryStream:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rmt-memory")
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.side is not None:
            # The memory layers' parameter gradients are made on the side stream and accumulated
            # by nodes created on the default stream; autograd makes the one wait for the other,
            # as the join needs, and would warn about it at every step (seen on an H100)
            torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        self.busy_s = 0.0
        self.exposed_s = 0.0
        self.busy_backward_s = 0.0
        self.exposed_backward_s = 0.0

    def _issue(self, work: Callable[[], object]) -> Callable[[], tuple]:
        """``work`` as a call returning ``(result, done)``, ordered after the current stream's
        work so far: on GPU run in the side stream (``done`` its completion event), on CPU as
        is (``done`` None)."""
        ready = None
        if self.side is not None:
            ready = torch.cuda.Event()
            ready.record()

        def run():
            if self.side is None:
                return work(), None
            with torch.cuda.stream(self.side):
                self.side.wait_event(ready)
                out = work()
                done = torch.cuda.Event()
                done.record(self.side)
            return out, done

        return run

    def launch(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Future:
        grad = torch.is_grad_enabled()
        kind = self.device.type
        autocast = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind)
        issued = self._issue(lambda: fn(x))

        def run():
            start = time.perf_counter()
            with torch.set_grad_enabled(grad), torch.autocast(kind, dtype=dtype, enabled=autocast):
                out = issued()
            self.busy_s += time.perf_counter() - start
            return out

        return self.pool.submit(run)

    def wait(self, pending: Future) -> torch.Tensor:
        start = time.perf_counter()
        y, done = pending.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            y.record_stream(torch.cuda.current_stream())
        self.exposed_s += time.perf_counter() - start
        return y

    def launch_backward(self, tensors: List[torch.Tensor], grads: List[torch.Tensor]) -> Future:
        """Run ``torch.autograd.backward(tensors, grads)`` beside the dense backward; the
        future's result is the completion event (None on CPU).

        On CPU it runs on the worker thread. On GPU it is issued here, re-entrantly, into the side
        stream after the current stream's work: the autograd engine runs CUDA backward nodes on
        its device thread, the one calling this from :class:`JoinMemory`, so a backward started
        from the worker would queue behind :class:`ForkMemory`'s wait and deadlock; the GPU
        overlaps the side stream's kernels and collectives with the dense backward anyway."""
        issued = self._issue(lambda: torch.autograd.backward(tensors, grads))

        def run():
            start = time.perf_counter()
            _, done = issued()
            self.busy_backward_s += time.perf_counter() - start
            return done

        if self.side is None:
            return self.pool.submit(run)
        now = Future()
        now.set_result(run())
        return now

    def wait_backward(self, pending: Future) -> None:
        start = time.perf_counter()
        done = pending.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.exposed_backward_s += time.perf_counter() - start

    def reset_timers(self) -> None:
        self.busy_s = self.exposed_s = self.busy_backward_s = self.exposed_backward_s = 0.0


class InlineStream(MemoryStream):
    """The stream's interface computing in the caller's thread and stream, in order: the
    synchronous mode's memory layers on graphs of their own (:class:`MemoryLink`), as recomputed
    layer spans need them (:mod:`rmt.memory.attach`)."""

    def __init__(self):
        self.busy_s = self.exposed_s = self.busy_backward_s = self.exposed_backward_s = 0.0

    def launch(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Future:
        start = time.perf_counter()
        done = Future()
        done.set_result((fn(x), None))
        self.busy_s += time.perf_counter() - start
        return done

    def launch_backward(self, tensors: List[torch.Tensor], grads: List[torch.Tensor]) -> Future:
        start = time.perf_counter()
        torch.autograd.backward(tensors, grads)
        self.busy_backward_s += time.perf_counter() - start
        done = Future()
        done.set_result(None)
        return done


class MemoryLink:
    """One memory layer's graph in one forward: its detached input ``x`` (a leaf), and once
    joined its output and auxiliary loss, whose backward runs on the stream. With
    ``sequence_parallel`` the dense side holds this tensor-parallel rank's share of the
    sequence and ``x`` the whole gathered sequence: the output gradient is all-gathered before
    the memory layer's backward (in the caller's thread, where megatron's tensor-parallel
    collectives run) and the input gradient cut to this rank's share."""

    def __init__(self, stream: MemoryStream, x: torch.Tensor, sequence_parallel: bool = False):
        self.stream, self.x, self.sequence_parallel = stream, x, sequence_parallel
        self.outputs: List[torch.Tensor] = []
        self.aux_grads: List[torch.Tensor] = []
        self.pending: Optional[Future] = None

    def start_backward(self, grad: torch.Tensor) -> None:
        if self.sequence_parallel:
            grad = gather_from_sequence_parallel_region(grad, tensor_parallel_output_grad=False)
        self.pending = self.stream.launch_backward(self.outputs, [grad] + self.aux_grads)

    def input_grad(self) -> Optional[torch.Tensor]:
        if self.pending is not None:
            self.stream.wait_backward(self.pending)
        grad = self.x.grad
        if self.sequence_parallel and grad is not None:
            grad = scatter_to_sequence_parallel_region(grad)
        return grad

    def local_output(self) -> torch.Tensor:
        """The memory layer's output (detached), this rank's sequence share of it under
        sequence parallelism."""
        y = self.outputs[0].detach()
        return scatter_to_sequence_parallel_region(y) if self.sequence_parallel else y


class ForkMemory(torch.autograd.Function):
    """Identity on layer i's output; backward adds the memory layer's input gradient, waiting
    for its backward on the stream (with no link, a plain identity node: the synchronous mode's
    branch point, see :class:`~rmt.memory.attach.MemoryWiring`). With ``read``, the memory
    layer's input made from ``hidden`` in the dense graph (the RMT's FFN norm of it), the input
    gradient is ``read``'s instead."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, link: Optional[MemoryLink], read: Optional[torch.Tensor] = None):
        ctx.link, ctx.read = link, read is not None
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        extra = None if ctx.link is None else ctx.link.input_grad()
        if ctx.read:
            return grad, None, extra
        return (grad if extra is None else grad + extra), None, None


class JoinMemory(torch.autograd.Function):
    """``hidden + y`` with ``y`` (detached) the memory layer's output; backward starts the
    memory layer's backward on the stream with the same output gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, y: torch.Tensor, link: MemoryLink):
        ctx.link = link
        return hidden + y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.link.start_backward(grad)
        return grad, None, None
