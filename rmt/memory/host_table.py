"""Value tables in host memory (``memory.table_location: host``), rows moved per lookup.

A :class:`HostTable` holds a rank's shard of a value table in host memory (TorchRec/FBGEMM keep
recommendation tables there the same way) and serves the lookups of
:class:`rmt.memory.table.MemoryTable` in place of the device shard. The shard itself stays
pageable; the rows cross the link through page-locked staging buffers, so that on a GPU both
copies run asynchronously while only the bytes in flight are locked:

forward
    the lookup's indices are deduplicated on the device (``torch.unique``), the ``U`` distinct
    rows' indices go to the host (``8 U`` bytes), the rows are gathered into a staging buffer
    and copied to the device (``U x D`` values); the lookup-reduce runs there on the staged rows
    with the inverse indices. With ``memory.async_stream`` all of it runs on the memory stream
    beside the dense layers between the memory's input and output layer (its skip placement).
backward
    the staged rows' gradient (``U x D``, summed over the lookups of each row on the device) goes
    back to the host, asynchronously on a GPU; the step's row gradients are summed there into one
    sparse gradient of the shard, which the memory code reduces like any sparse table gradient
    (:func:`rmt.memory.groups.finish_memory_grads`).
step
    the row-wise value optimizer (``sparse_adam``, ``rowwise_adagrad``: the fused CPU kernels of
    :mod:`rmt.ops.sparse_optim`) steps the touched rows on a host thread of its own
    (:meth:`HostTable.launch_step`), beside the dense optimizer's step and the next step's start.
    Every read of the shard (the next lookup, a checkpoint, an evaluation) first waits for that
    step (:meth:`HostTable.wait`), so no step reads a row before the previous step's update of it;
    a whole-shard read also writes the cache back first (:func:`settle_all`).

The numbers are those of the device table: the same gradient rows (summed in the same order up
to the row's lookups), the same reduction, clipping, optimizer and learning rate.

With ``memory.host_cache_rows`` a table keeps its most looked-up rows and their optimizer state on
the device (:mod:`rmt.memory.host_cache`): lookups read those there, their gradients stay there
and the table's optimizer steps them there; only the other rows cross as above.

Each table counts what crosses the host link (``link``, a
:class:`~rmt.memory.comm_counter.CommCounter`: forward ``d2h_indices`` and ``h2d_rows``, backward
``d2h_row_grads``; a cache's own traffic under ``step``, ``refresh`` and ``flush``) and the
device bytes its staged rows hold (``staged_bytes`` now, ``staged_peak`` since
:meth:`reset_peak`); ``rmt-plan memory --table-location host`` plans both.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Tuple

import torch

from rmt.memory.comm_counter import CommCounter
from rmt.memory.host_cache import INDEX_BYTES, Hits, HostCache, sparse_rows
from rmt.ops import lookup_reduce

_POOL: Optional[ThreadPoolExecutor] = None


def _pool() -> ThreadPoolExecutor:
    """The one thread stepping host tables, in launch order."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rmt-host-step")
    return _POOL


def host_tensor(shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pinned`` (copies to and from a GPU then
    run asynchronously)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


class _Stage(torch.autograd.Function):
    """A lookup's distinct rows, staged on the device (:meth:`HostTable.read`); the backward
    hands their gradient to the table (:meth:`HostTable.write_grad`) instead of returning one
    for ``weight``."""

    @staticmethod
    def forward(ctx, weight, rows, hits, table):
        ctx.rows, ctx.hits, ctx.table = rows, hits, table
        return table.read(rows, hits)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.table.write_grad(ctx.rows, ctx.hits, grad)
        return None, None, None, None


class HostTable:
    """The host-memory shard ``weight`` (a CPU parameter) of a table looked up on ``device``;
    with ``cache_rows`` a :class:`~rmt.memory.host_cache.HostCache` of that many rows on the
    device (``cache``), refreshed every ``cache_refresh`` steps.

    ``lookup`` and ``gather`` are the two reads the lookup routes make of a shard (the device
    shard's are :class:`rmt.memory.table.DeviceRows`)."""

    def __init__(self, weight: torch.nn.Parameter, device, cache_rows: int = 0, cache_refresh: int = 1):
        self.weight = weight
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.link = CommCounter()
        self.staged_bytes = 0
        self.staged_peak = 0
        self._lock = threading.Lock()
        self._grads: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]] = []
        self._pending: Optional[Future] = None
        # the slot counters' marking (MemoryTable._mark_shard_rows), for training lookups
        self.mark_rows: Optional[Callable[[torch.Tensor], None]] = None
        self.recording = False
        self.cache = HostCache(self, cache_rows, cache_refresh) if cache_rows else None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    # -- reads --------------------------------------------------------------------------
    def stage(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(staged, inverse)``: the distinct rows of ``indices`` (local row numbers, any shape,
        on the device) staged on the device, and each index's position among them. Rows the
        cache holds are read there; the others' indices go to the host."""
        unique, inverse = torch.unique(indices.reshape(-1).long(), sorted=True, return_inverse=True)
        hits = None
        if self.cache is not None:
            hits = self.cache.find(unique)
            unique = unique[hits.missed]
        rows = unique.to("cpu")
        self.link.add("forward", "d2h_indices", rows.numel() * INDEX_BYTES)
        if self.recording and self.mark_rows is not None:
            self.mark_rows(rows)
        if hits is not None:
            self.cache.record(hits, rows, inverse)
        staged = _Stage.apply(self.weight, rows, hits, self)
        nbytes = staged.numel() * staged.element_size()
        with self._lock:
            self.staged_bytes += nbytes
            self.staged_peak = max(self.staged_peak, self.staged_bytes)
        weakref.finalize(staged, self._released, nbytes)
        return staged, inverse.view(indices.shape)

    def lookup(self, indices, scores, block_ids=None, num_blocks: int = 1, validate: bool = False):
        """``lookup_reduce`` of the shard (``validate`` is kept for the device shard's signature:
        the host gather checks its rows itself)."""
        staged, inverse = self.stage(indices)
        return lookup_reduce(staged, inverse, scores, block_ids, num_blocks, validate=False)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The shard's rows ``rows`` (``[n]`` on the device, repeats allowed) ``[n, D]``, each
        distinct row staged once; the backward sums the repeats' gradients on the device."""
        staged, inverse = self.stage(rows)
        return staged.index_select(0, inverse)

    def read(self, rows: torch.Tensor, hits: Optional[Hits]) -> torch.Tensor:
        """A lookup's distinct rows on the device: the host's ``rows`` (fetched) and, given
        ``hits``, the cached rows, in the order of the lookup's distinct rows."""
        if hits is None:
            return self.fetch(rows)
        out = torch.empty((hits.total, self.weight.shape[1]), dtype=self.weight.dtype, device=self.device)
        if hits.pos.numel():
            out.index_copy_(0, hits.pos, self.cache.read(hits))
        if rows.numel():
            out.index_copy_(0, hits.missed, self.fetch(rows))
        return out

    def fetch(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows ``rows`` (a host index tensor) as a new device tensor, once this table's
        pending step is done."""
        self.wait()
        buf = host_tensor((rows.numel(), self.weight.shape[1]), self.weight.dtype, self.pinned)
        torch.index_select(self.weight.detach(), 0, rows, out=buf)
        out = buf.to(self.device, non_blocking=True)
        self.link.add("forward", "h2d_rows", out.numel() * out.element_size())
        return out

    def _released(self, nbytes: int) -> None:
        with self._lock:
            self.staged_bytes -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self.staged_peak = self.staged_bytes

    # -- gradients ----------------------------------------------------------------------
    def write_grad(self, rows: torch.Tensor, hits: Optional[Hits], grad: torch.Tensor) -> None:
        """The gradient ``grad`` of a lookup's staged rows: the cached rows' stays on the device
        (:meth:`HostCache.add_grad`), the others' goes to the host (:meth:`add_grad`)."""
        if hits is None:
            self.add_grad(rows, grad)
            return
        if rows.numel():
            self.add_grad(rows, grad.index_select(0, hits.missed))
        if hits.pos.numel():
            self.cache.add_grad(hits.rows, grad.index_select(0, hits.pos))

    def add_grad(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Keep the staged rows' gradient ``grad`` (device) for ``rows`` (host): copied to the
        host without waiting on a GPU; once the kept rows outnumber the shard's, summed into one
        (so a step's micro-batches hold at most the shard's rows plus one micro-batch's)."""
        event = None
        if grad.device.type == "cuda":
            host = host_tensor(grad.shape, grad.dtype, True)
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = grad
        self.link.add("backward", "d2h_row_grads", grad.numel() * grad.element_size())
        self._grads.append((rows, host, event))
        if sum(r.numel() for r, _, _ in self._grads) > self.weight.shape[0]:
            merged = self.take_grad()
            self._grads = [(merged.indices()[0], merged.values(), None)]

    def take_grad(self) -> Optional[torch.Tensor]:
        """The step's gradient of the shard's uncached rows so far, a coalesced sparse host tensor
        (None when no lookup was differentiated); clears it."""
        if not self._grads:
            return None
        for _, _, event in self._grads:
            if event is not None:
                event.synchronize()
        grads, self._grads = [(r, v) for r, v, _ in self._grads], []
        return sparse_rows(grads, self.weight.shape)

    # -- the host step ------------------------------------------------------------------
    def launch_step(self, step: Callable[[], None]) -> None:
        """Run ``step`` (the optimizer's update of this shard) on the host-step thread; the next
        read of the table waits for it."""
        self.wait()
        self._pending = _pool().submit(step)

    def wait(self) -> None:
        """Return once this table's launched step is done (raising what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def host_table(p: torch.nn.Parameter) -> Optional[HostTable]:
    """The :class:`HostTable` holding ``p`` (``memory.table_location: host``), or None."""
    return getattr(p, "memory_host", None)


def host_cache(p: torch.nn.Parameter) -> Optional[HostCache]:
    """The device cache of ``p``'s host table (``memory.host_cache_rows``), or None."""
    table = host_table(p)
    return None if table is None else table.cache


def host_tables(modules) -> List[HostTable]:
    return [host_table(p) for m in modules for p in m.parameters() if host_table(p) is not None]


def settle_all(modules) -> None:
    """Wait for the launched steps of every host table of ``modules`` and write their cached rows
    back (before reading them whole: a checkpoint, an evaluation, the end of training)."""
    for table in host_tables(modules):
        table.wait()
        if table.cache is not None:
            table.cache.flush()


def launch_host_steps(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    """Launch the step of every host table ``optimizer`` holds with its gradient and a copy of
    its param group (the scheduler sets the next ``lr`` meanwhile), its cached rows stepped on the
    device first (:meth:`HostCache.step`); returns those tables, which the optimizer's own
    ``step`` must then skip (:func:`held_back`)."""
    launched = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            table = host_table(p)
            if table is None or p.grad is None:
                continue
            snapshot, grad = dict(group), p.grad
            if table.cache is not None:
                table.cache.step(optimizer, snapshot)
            table.launch_step(lambda snapshot=snapshot, p=p, grad=grad: optimizer.step_param(snapshot, p, grad))
            launched.append(p)
    return launched


class held_back:
    """Context: the gradients of ``params`` (host tables whose step is launched) are hidden from
    an optimizer's ``step`` while it lasts, and are the step's gradients again after it."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.grads: List[torch.Tensor] = []

    def __enter__(self):
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.grads):
            p.grad = g
