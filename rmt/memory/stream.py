"""Async memory stream: a memory layer placed ``i:j`` runs beside the dense layers i+1..j.

:meth:`MemoryStream.launch` starts the layer (query, retrieval, lookup and the
memory-parallel collectives) as soon as layer i's output exists and
:meth:`MemoryStream.wait` joins it where layer j adds the result (UltraMem §3.2 skip-layer
structure, Appendix C: the memory layer's communication hidden behind dense compute). The
work runs on a worker thread (gloo collectives and the lookup kernels release the GIL while
the main thread computes the dense layers); on GPU it is issued into a side CUDA stream that
waits on an event recorded after layer i, and layer j's stream waits on an event recorded
after the memory layer. Autograd graph, grad mode and autocast state carry over, so the
numbers are those of the synchronous mode.

``busy_s`` accumulates the memory layers' forward time on the worker and ``exposed_s`` the
time the dense path spent blocked in :meth:`wait` (the part not hidden).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class MemoryStream:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rmt-memory")
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.busy_s = 0.0
        self.exposed_s = 0.0

    def launch(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Future:
        grad = torch.is_grad_enabled()
        kind = self.device.type
        autocast = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind)
        ready = None
        if self.side is not None:
            ready = torch.cuda.Event()
            ready.record()

        def run():
            start = time.perf_counter()
            with torch.set_grad_enabled(grad), torch.autocast(kind, dtype=dtype, enabled=autocast):
                if self.side is None:
                    y, done = fn(x), None
                else:
                    with torch.cuda.stream(self.side):
                        self.side.wait_event(ready)
                        y = fn(x)
                        done = torch.cuda.Event()
                        done.record(self.side)
            self.busy_s += time.perf_counter() - start
            return y, done

        return self.pool.submit(run)

    def wait(self, pending: Future) -> torch.Tensor:
        start = time.perf_counter()
        y, done = pending.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            y.record_stream(torch.cuda.current_stream())
        self.exposed_s += time.perf_counter() - start
        return y

    def reset_timers(self) -> None:
        self.busy_s = self.exposed_s = 0.0
