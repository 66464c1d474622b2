"""Where a value table's shard lives, and how the lookups read it: one strategy per place.

:class:`rmt.memory.table.MemoryTable` composes one storage with one distribution
(:mod:`rmt.memory.distribution`). The distribution decides which rows of the shard a lookup
needs; the storage serves them through two reads, ``lookup`` (``lookup_reduce`` of its rows) and
``gather`` (rows, repeats allowed), which carry the table's sparse gradient or fused update, and
marks the rows it serves in training (``mark``, the table's slot counters).

:class:`DeviceStorage`
    the shard on the compute device; the lookups read it in place.
:class:`HostStorage` (``memory.table_location: host``)
    the shard in host memory (TorchRec/FBGEMM keep recommendation tables there the same way),
    rows moved per lookup. The shard stays pageable; the rows cross the link through page-locked
    staging buffers, so that on a GPU both copies run asynchronously while only the bytes in
    flight are locked:

    forward
        the lookup's indices are deduplicated on the device (``torch.unique``), the ``U``
        distinct rows' indices go to the host (``8 U`` bytes), the rows are gathered into a
        staging buffer and copied to the device (``U x D`` values); the lookup-reduce runs there
        on the staged rows with the inverse indices. With ``memory.async_stream`` all of it runs
        on the memory stream beside the dense layers between the memory's input and output layer
        (its skip placement).
    backward
        the staged rows' gradient (``U x D``, summed over the lookups of each row on the device)
        goes back to the host, asynchronously on a GPU; the step's row gradients are summed there
        into one sparse gradient of the shard, which the memory code reduces like any sparse table
        gradient (:func:`rmt.memory.groups.finish_memory_grads`).
    step
        the row-wise value optimizer (``sparse_adam``, ``rowwise_adagrad``: the fused CPU kernels
        of :mod:`rmt.ops.sparse_optim`) steps the touched rows on a host thread of its own
        (:meth:`HostStorage.launch`), beside the dense optimizer's step and the next step's start.
        Every read of the shard (the next lookup, a checkpoint, an evaluation) first waits for
        that step (:meth:`HostStorage.wait`), so no step reads a row before the previous step's
        update of it; a whole-shard read also writes the cache back first
        (:func:`rmt.memory.host_steps.settle_all`).

    The numbers are those of the device table: the same gradient rows (summed in the same order
    up to the row's lookups), the same reduction, clipping, optimizer and learning rate.
:class:`CachedHostStorage` (``memory.host_cache_rows``)
    a host shard whose most looked-up rows and their optimizer state stay on the device
    (:class:`rmt.memory.host_cache.HostCache`): lookups read those there, their gradients stay
    there and the table's optimizer steps them there; only the other rows cross as above.

A host storage counts what crosses the host link (``link``, a
:class:`~rmt.memory.comm_counter.CommCounter`: forward ``d2h_indices`` and ``h2d_rows``, backward
``d2h_row_grads``; a cache's own traffic under ``step``, ``refresh``, ``flush`` and ``stats``)
and the device bytes its staged rows hold (``staged_bytes`` now, ``staged_peak`` since
:meth:`HostStorage.reset_peak`); ``rmt-plan memory --table-location host`` plans both.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from rmt.memory.comm_counter import CommCounter
from rmt.memory.descriptor import describe, descriptor
from rmt.memory.host_cache import INDEX_BYTES, Hits, HostCache, sparse_rows
from rmt.ops import lookup_reduce

FLAG_CHUNK = 1 << 26
"""Slot counters a host table sends through the device at a time (bytes)."""

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


class Storage:
    """What a table asks of the place its shard lives (the module docstring); the defaults are
    those of a storage with nothing to wait for, no cache and no step of its own.

    Built before the weight: :meth:`allocate` gives the shard's tensor and :meth:`flags` the slot
    counters' bytes, then :meth:`bind` hands over the table (whose ``weight`` is the shard) and its
    ``mark`` (called with the shard's local row numbers a training lookup reads, while
    ``recording``)."""

    location = "device"
    cache: Optional[HostCache] = None

    def __init__(self, device):
        self.device = torch.device(device if device is not None else "cpu")
        self.table: Optional[torch.nn.Module] = None
        self._bound: Optional[torch.nn.Parameter] = None
        self.mark: Optional[Callable[[torch.Tensor], None]] = None
        self.recording = False

    def bind(self, table: torch.nn.Module, mark: Callable[[torch.Tensor], None]) -> None:
        self.table, self._bound, self.mark = table, table.weight, mark

    @property
    def weight(self) -> torch.nn.Parameter:
        """The table's weight as the module holds it now. A loader may put a new Parameter in its
        place (transformers' ``from_pretrained`` materialises every parameter anew, as does
        ``load_state_dict(assign=True)``); the new one is given the table's descriptor."""
        weight = self.table.weight
        if weight is not self._bound:
            if descriptor(weight) is None:
                describe(weight, descriptor(self._bound))
            self._bound = weight
        return weight

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def _mark(self, rows: torch.Tensor) -> None:
        if self.recording and self.mark is not None:
            self.mark(rows)

    def stays_put(self, module: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Context around moving or casting ``module`` (the table): what must not move."""
        return contextlib.nullcontext()

    def flag_chunk(self, n: int) -> int:
        """Slot flags sent through the device at a time, of ``n``."""
        return n

    def collect_grad(self) -> None:
        """Put the step's gradient of the shard into ``weight.grad`` (autograd did already)."""

    def launch(self, optimizer, group: dict, grad: torch.Tensor) -> bool:
        """Start the ``optimizer``'s step of the shard elsewhere; False: it steps with the
        others."""
        return False

    def wait(self) -> None:
        """Return once a launched step is done."""

    def settle(self) -> None:
        """Before the shard is read whole: launched steps done, cached rows written back."""

    def flush_marks(self) -> None:
        """Hand the rows the training lookups found in a cache to ``mark``."""

    def pop_cache_counts(self) -> Optional[Dict[str, int]]:
        """A cache's counters since the last call (None: no cache)."""
        return None

    def forget_cache(self) -> None:
        """A cache forgets its rows (the shard holds new values: a checkpoint was loaded)."""


class DeviceStorage(Storage):
    """The shard on the compute device ``device``."""

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def flags(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=self.device)

    @property
    def compute_device(self) -> torch.device:
        return self.weight.device

    def _read(self, indices, scores, block_ids=None, num_blocks: int = 1, validate: bool = False):
        record = descriptor(self.weight)
        return lookup_reduce(
            self.weight,
            indices,
            scores,
            block_ids,
            num_blocks,
            sparse_grad=record.sparse_grad,
            validate=validate,
            update=record.fused_update,
        )

    def lookup(self, indices, scores, block_ids=None, num_blocks: int = 1, validate: bool = False):
        self._mark(indices)
        return self._read(indices, scores, block_ids, num_blocks, validate)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n]`` rows -> ``[n, D]``; with a fused update a unit-score lookup, so that the fused
        kernel sums the copies of a row."""
        self._mark(rows)
        record = descriptor(self.weight)
        if record.fused_update is not None:
            ones = self.weight.new_ones(rows.numel(), 1, 1)
            return self._read(rows.view(-1, 1), ones).view(-1, self.weight.shape[1])
        return F.embedding(rows, self.weight, sparse=record.sparse_grad)


class _Stage(torch.autograd.Function):
    """A lookup's distinct rows, staged on the device (:meth:`HostStorage.read`); the backward
    hands their gradient to the storage (:meth:`HostStorage.write_grad`) instead of returning one
    for ``weight``."""

    @staticmethod
    def forward(ctx, weight, rows, hits, storage):
        ctx.rows, ctx.hits, ctx.storage = rows, hits, storage
        return storage.read(rows, hits)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ctx.storage.write_grad(ctx.rows, ctx.hits, grad)
        return None, None, None, None


class HostStorage(Storage):
    """The shard in host memory (a CPU parameter, pageable), looked up on ``device`` (module
    docstring); it stays on the host when the table is moved."""

    location = "host"

    def __init__(self, device):
        super().__init__(device)
        self.pinned = self.device.type == "cuda"
        self.link = CommCounter()
        self.staged_bytes = 0
        self.staged_peak = 0
        self._lock = threading.Lock()
        self._grads: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.cuda.Event]]] = []
        self._pending: Optional[Future] = None

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor:
        # pageable: its rows move through pinned staging buffers, and page-locking a TiB-sized
        # shard would take it from the OS
        return torch.empty(shape, dtype=dtype, device="cpu")

    def flags(self, n: int) -> torch.Tensor:
        """Slot counters in host memory too (the device holds no byte per slot), marked from the
        staged rows' indices, which cross to the host anyway."""
        return torch.zeros(n, dtype=torch.uint8, device="cpu")

    @property
    def compute_device(self) -> torch.device:
        return self.device

    def flag_chunk(self, n: int) -> int:
        return FLAG_CHUNK

    @contextlib.contextmanager
    def stays_put(self, module: torch.nn.Module):
        """The weight and the slot counters stay where they are when ``module`` is moved or cast."""
        weight, hits = module._parameters.pop("weight"), module._buffers.pop("hits")
        try:
            yield
        finally:
            module._parameters["weight"], module._buffers["hits"] = weight, hits

    # -- reads --------------------------------------------------------------------------
    def _split(self, unique: torch.Tensor) -> Tuple[torch.Tensor, Optional[Hits]]:
        """The distinct rows of a lookup that cross the link, and how the others are cached."""
        return unique, None

    def _count(self, hits: Optional[Hits], rows: torch.Tensor, inverse: torch.Tensor) -> None:
        """Count a lookup's cached and missed rows (with a cache)."""

    def stage(self, indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(staged, inverse)``: the distinct rows of ``indices`` (local row numbers, any shape,
        on the device) staged on the device, and each index's position among them. Rows a cache
        holds are read there; the others' indices go to the host."""
        unique, inverse = torch.unique(indices.reshape(-1).long(), sorted=True, return_inverse=True)
        unique, hits = self._split(unique)
        rows = unique.to("cpu")
        self.link.add("forward", "d2h_indices", rows.numel() * INDEX_BYTES)
        self._mark(rows)
        self._count(hits, rows, inverse)
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
        """A lookup's distinct rows on the device: the host's ``rows``, fetched."""
        return self.fetch(rows)

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
        """The gradient ``grad`` of a lookup's staged rows, kept for the host (:meth:`add_grad`)."""
        self.add_grad(rows, grad)

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

    def collect_grad(self) -> None:
        self.weight.grad = self.take_grad()

    # -- the host step ------------------------------------------------------------------
    def launch_step(self, step: Callable[[], None]) -> None:
        """Run ``step`` (the optimizer's update of this shard) on the host-step thread; the next
        read of the table waits for it."""
        self.wait()
        self._pending = _pool().submit(step)

    def launch(self, optimizer, group: dict, grad: torch.Tensor) -> bool:
        """The ``optimizer``'s step of the shard with ``grad`` and ``group`` (a copy of its param
        group: the scheduler sets the next ``lr`` meanwhile) on the host-step thread."""
        weight = self.weight
        self.launch_step(lambda: optimizer.step_param(group, weight, grad))
        return True

    def wait(self) -> None:
        """Return once this table's launched step is done (raising what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def settle(self) -> None:
        self.wait()


class CachedHostStorage(HostStorage):
    """A host shard with a device cache (:class:`~rmt.memory.host_cache.HostCache`) of
    ``cache_rows`` of its rows, refreshed every ``cache_refresh`` steps."""

    def __init__(self, device, cache_rows: int, cache_refresh: int):
        super().__init__(device)
        self.cache_rows, self.cache_refresh = cache_rows, cache_refresh

    def bind(self, table: torch.nn.Module, mark: Callable[[torch.Tensor], None]) -> None:
        super().bind(table, mark)
        self.cache = HostCache(self, self.device, self.link, self.cache_rows, self.cache_refresh)

    def _split(self, unique: torch.Tensor) -> Tuple[torch.Tensor, Optional[Hits]]:
        hits = self.cache.find(unique)
        return unique[hits.missed], hits

    def _count(self, hits: Optional[Hits], rows: torch.Tensor, inverse: torch.Tensor) -> None:
        if self.recording:
            self.cache.rows.touch(hits.slots)
        self.cache.record(hits, rows, inverse)

    def read(self, rows: torch.Tensor, hits: Optional[Hits]) -> torch.Tensor:
        """A lookup's distinct rows on the device: the host's ``rows`` (fetched) and the cached
        rows of ``hits``, in the order of the lookup's distinct rows."""
        out = torch.empty((hits.total, self.weight.shape[1]), dtype=self.weight.dtype, device=self.device)
        if hits.pos.numel():
            out.index_copy_(0, hits.pos, self.cache.read(hits))
        if rows.numel():
            out.index_copy_(0, hits.missed, self.fetch(rows))
        return out

    def write_grad(self, rows: torch.Tensor, hits: Optional[Hits], grad: torch.Tensor) -> None:
        """The gradient ``grad`` of a lookup's staged rows: the cached rows' stays on the device
        (:meth:`HostCache.add_grad`), the others' goes to the host (:meth:`add_grad`)."""
        if rows.numel():
            self.add_grad(rows, grad.index_select(0, hits.missed))
        if hits.pos.numel():
            self.cache.add_grad(hits.rows, grad.index_select(0, hits.pos))

    def launch(self, optimizer, group: dict, grad: torch.Tensor) -> bool:
        """The cached rows stepped on the device first (:meth:`HostCache.step`), then the host
        rows on the host-step thread."""
        self.cache.step(optimizer, group)
        return super().launch(optimizer, group, grad)

    def refresh(self, group=None) -> None:
        """The cache admits and evicts rows (:meth:`HostCache.refresh`) once the launched step is
        done, the rows its lookups found handed to the slot counters first (before the slots
        change hands)."""
        if self.cache.optimizer is not None:
            self.wait()
            self.flush_marks()
        self.cache.refresh(group)

    def settle(self) -> None:
        self.wait()
        self.cache.flush()

    def flush_marks(self) -> None:
        rows = self.cache.pop_touched_rows()
        if self.mark is not None:
            self.mark(rows.cpu())

    def pop_cache_counts(self) -> Optional[Dict[str, int]]:
        return self.cache.pop_counts()

    def forget_cache(self) -> None:
        self.flush_marks()
        self.cache.clear()


def make_storage(location: str, device, cache_rows: int = 0, cache_refresh: int = 1) -> Storage:
    """The storage of ``location`` (``"device"`` or ``"host"``; a host one with a cache of
    ``cache_rows`` rows when that is positive) looked up on ``device``."""
    if location == "device":
        return DeviceStorage(device)
    if cache_rows:
        return CachedHostStorage(device, cache_rows, cache_refresh)
    return HostStorage(device)
