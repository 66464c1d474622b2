"""A device cache of a host-memory table's hot rows (``memory.host_cache_rows``), written back.

With ``memory.table_location: host`` (:class:`rmt.memory.storage.HostStorage`) every lookup stages its
distinct rows from the host. A :class:`HostCache` keeps up to ``C`` rows of a table shard on the
compute device together with their row-wise optimizer state (``sparse_adam``'s two moments,
``rowwise_adagrad``'s accumulator), as FBGEMM's UVM-caching embeddings keep a device cache of
a table held in host memory:

lookup
    the lookup's distinct rows are found in the cache's index (:class:`HotRows`: the cached rows
    sorted, ``searchsorted`` on the device); the cached ones are read from the device copy and
    only the others cross the link, as without the cache (their indices to the host, their rows
    back).
backward
    a cached row's gradient stays on the device, the others go to the host as before. The two
    parts of the step's gradient are summed over the table's replicas each (every replica
    caches the same rows), count in the gradient norm as one gradient
    (:meth:`HostCache.grad_sq_norm`) and are clipped alike.
step
    the table's optimizer steps the cached rows on the device (its ``step_param`` on the cache's
    rows and state, with the table's step count) while the host thread steps the others: every
    row is stepped once per step by the same update. On the CPU the kernels are the same, so a
    run equals the uncached one bit for bit.
refresh
    every ``memory.host_cache_refresh`` steps, at the start of a step and after the host step has
    finished, the cache takes the rows that the lookups of the table's replicas hit most often
    since the last refresh (:meth:`HotRows.choose`): evicted rows go back to the host with their
    state, admitted rows come to the device with theirs. No row changes value on the way.

It is a write-back cache: the host copy of a cached row is stale until the row is evicted or the
cache is flushed (:meth:`HostCache.flush`: before a checkpoint, an evaluation or the end of
training, :func:`rmt.memory.host_steps.settle_all`), and a checkpoint load empties it
(:meth:`HostCache.clear`).

Counters (training lookups, ``torch.is_grad_enabled``): ``rows`` / ``row_hits`` (the lookups'
distinct rows, and those the cache served), ``lookups`` / ``lookup_hits`` (their indices, with
repeats), ``saved`` (the bytes the hits kept off the host link, under the names of the table's
``link``) and :attr:`HostCache.device_bytes`. The table's ``link`` counts what did cross: the
misses' indices, rows and gradients, and the cache's own traffic (``step``: the host rows'
squared norms for the gradient norm; ``refresh``: candidates, evicted and admitted rows with their
state; ``flush``: the written-back rows with their state).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from rmt.memory.comm_counter import CommCounter
from rmt.ops.sparse_optim import coalesced, row_square_sums, rows_and_values

INDEX_BYTES = 8
"""Bytes of a row index crossing the host link (int64)."""
COUNT_BYTES = 8
"""Bytes of a lookup count (int64), and of a row's squared gradient norm (float64)."""


def sparse_rows(pairs: List[Tuple[torch.Tensor, torch.Tensor]], shape) -> torch.Tensor:
    """The coalesced sparse gradient of ``shape`` made of ``(rows, values)`` pairs: a row's
    values summed in the order of the pairs (:func:`rmt.ops.sparse_optim.coalesced`)."""
    rows = torch.cat([r for r, _ in pairs])
    values = torch.cat([v for _, v in pairs])
    return coalesced(torch.sparse_coo_tensor(rows.unsqueeze(0), values, tuple(shape), check_invariants=False))


def top_rows(rows: torch.Tensor, counts: torch.Tensor, capacity: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``capacity`` of the distinct ``rows`` with the largest ``counts`` (ties: the lower
    row), ascending, and their counts."""
    order = torch.argsort(rows)
    rows, counts = rows[order], counts[order]
    keep = torch.sort(counts, descending=True, stable=True).indices[:capacity]
    keep = keep[torch.argsort(rows[keep])]
    return rows[keep], counts[keep]


def summed_counts(rows: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The distinct ``rows`` (ascending) and the sum of each one's ``counts``."""
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    return unique, torch.zeros_like(unique).index_add_(0, inverse, counts)


class Hits(NamedTuple):
    """How a lookup's ``total`` distinct rows split: positions ``pos`` among them of the cached
    ones, their ``slots`` and ``rows`` (device), and the positions ``missed`` of the others."""

    total: int
    pos: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    missed: torch.Tensor


class HotRows:
    """Which rows of a shard ``capacity`` cache slots hold, and which they should hold.

    The index: ``slot_rows`` (the row in each slot, -1 for a free one) and, for lookups, the
    cached rows ascending (``sorted_rows``) with their slots (``sorted_slots``), on ``device``.
    The policy counts the lookups that found each row since the last refresh (training lookups):
    a cached row's hits on the device (``hits``, per slot), a missed row's on the host, where
    its index arrives anyway. :meth:`choose` takes the rows with the most such lookups, ties to
    the lower row, summed over the table's replicas so that they all choose alike.

    Frequency rather than recency: the cache changes only at step boundaries, and a step's lookups
    touch far more distinct rows than the cache holds, all as recent as each other, so recency
    cannot rank them; the slots of a memory layer are used unevenly and the same slots stay
    popular from one interval to the next, which counts over the last interval follow
    (docs/host-tables.md measures it). The counts restart at every refresh, so a row that cools
    down leaves after one interval.

    ``touched`` flags the slots a training lookup found since the table's slot counters last
    took them (:meth:`pop_touched`: the cached rows' share of
    :meth:`rmt.memory.table.MemoryTable.pop_hit_fraction`).

    ``device_bytes``: ``slot_rows`` and ``hits`` (8 bytes a slot each), ``touched`` (1 byte a
    slot) and the sorted index (16 bytes a cached row). The missed rows' counts live on the host
    (16 bytes a distinct row)."""

    INDEX_BYTES_PER_SLOT = 33
    """Device bytes of the index per cache slot (at most): ``slot_rows``, ``hits``, ``touched``,
    the sorted row and its slot."""

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = torch.device(device)
        self.slot_rows = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self.hits = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self.touched = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
        self.sorted_rows = self.slot_rows[:0].clone()
        self.sorted_slots = self.slot_rows[:0].clone()
        self._forget_misses()

    def __len__(self) -> int:
        return self.sorted_rows.numel()

    @property
    def device_bytes(self) -> int:
        index = self.slot_rows.numel() + self.hits.numel() + self.sorted_rows.numel() + self.sorted_slots.numel()
        return 8 * index + self.touched.numel()

    def _forget_misses(self) -> None:
        self._missed_rows = torch.zeros(0, dtype=torch.int64)
        self._missed_counts = torch.zeros(0, dtype=torch.int64)
        self._pending: List[torch.Tensor] = []
        self._pending_count = 0

    def find(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cached, slots)``: which of the distinct ``rows`` (device) are cached, and where
        (the slot is meaningless where ``cached`` is False)."""
        n = len(self)
        if not n:
            return torch.zeros_like(rows, dtype=torch.bool), torch.zeros_like(rows)
        pos = torch.searchsorted(self.sorted_rows, rows).clamp_(max=n - 1)
        return self.sorted_rows[pos] == rows, self.sorted_slots[pos]

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The slots of cached ``rows`` (device)."""
        return self.sorted_slots[torch.searchsorted(self.sorted_rows, rows)]

    def touch(self, hit_slots: torch.Tensor) -> None:
        """Flag the slots ``hit_slots`` (device) as found by a training lookup."""
        self.touched[hit_slots] = 1

    def pop_touched(self) -> torch.Tensor:
        """The rows of the slots flagged since the last call (device); clears the flags."""
        rows = self.slot_rows[(self.touched != 0) & (self.slot_rows >= 0)]
        self.touched.zero_()
        return rows

    def record(self, hit_slots: torch.Tensor, missed_rows: torch.Tensor) -> None:
        """Count one lookup: the slots of its cached rows (device) and its missed rows (host),
        each distinct. The missed rows are merged into per-row counts once the pending ones
        outnumber the rows counted so far and 65,536, so the host holds the distinct missed rows'
        counts (16 bytes each) and at most as many pending rows (8 bytes each) or 65,536."""
        self.hits[hit_slots] += 1
        self._pending.append(missed_rows)
        self._pending_count += missed_rows.numel()
        if self._pending_count > max(self._missed_rows.numel(), 1 << 16):
            self._merge_misses()

    def _merge_misses(self) -> None:
        if not self._pending:
            return
        rows = torch.cat([self._missed_rows] + self._pending)
        counts = torch.cat([self._missed_counts, torch.ones(self._pending_count, dtype=torch.int64)])
        self._missed_rows, self._missed_counts = summed_counts(rows, counts)
        self._pending, self._pending_count = [], 0

    def choose(self, group=None, link: Optional[CommCounter] = None) -> torch.Tensor:
        """The rows to cache from now on (device, ascending): the ``capacity`` rows with the most
        lookups since the last refresh among the cached and the missed ones, the counts summed
        over ``group`` (the table's replicas: each sends its own top ``capacity``). The missed
        rows' top ``capacity`` crosses to the device (``link`` ``refresh`` ``h2d_candidates``)."""
        self._merge_misses()
        rows, counts = top_rows(self._missed_rows, self._missed_counts, self.capacity)
        if link is not None:
            link.add("refresh", "h2d_candidates", rows.numel() * (INDEX_BYTES + COUNT_BYTES))
        rows = torch.cat([self.sorted_rows, rows.to(self.device)])
        counts = torch.cat([self.hits[self.sorted_slots], counts.to(self.device)])
        rows, counts = top_rows(rows, counts, self.capacity)
        if group is not None and dist.get_world_size(group) > 1:
            pad = self.capacity - rows.numel()
            mine = torch.stack(
                [torch.cat([rows, rows.new_full((pad,), -1)]), torch.cat([counts, counts.new_zeros(pad)])]
            )
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, mine, group=group)
            every = torch.cat(every, dim=1)
            every = every[:, every[0] >= 0]
            rows, counts = top_rows(*summed_counts(every[0], every[1]), self.capacity)
        return rows

    def assign(self, chosen: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hold the rows ``chosen`` (device, ascending, at most ``capacity``) from now on and
        restart the counts. Returns ``(evicted slots, evicted rows, admitted slots, admitted
        rows)``: the rows that leave, and the free slots (lowest first) the new rows take."""
        kept = torch.isin(self.sorted_rows, chosen)
        evicted_slots, evicted_rows = self.sorted_slots[~kept], self.sorted_rows[~kept]
        admitted_rows = chosen[~torch.isin(chosen, self.sorted_rows)]
        self.slot_rows[evicted_slots] = -1
        admitted_slots = (self.slot_rows < 0).nonzero().squeeze(1)[: admitted_rows.numel()]
        self.slot_rows[admitted_slots] = admitted_rows
        self._index()
        self.hits.zero_()
        self._forget_misses()
        return evicted_slots, evicted_rows, admitted_slots, admitted_rows

    def clear(self) -> None:
        """Hold no row and forget the counts."""
        self.slot_rows.fill_(-1)
        self._index()
        self.hits.zero_()
        self._forget_misses()

    def _index(self) -> None:
        slots = (self.slot_rows >= 0).nonzero().squeeze(1)
        rows = self.slot_rows[slots]
        order = torch.argsort(rows)
        self.sorted_rows, self.sorted_slots = rows[order], slots[order]


class HostCache:
    """Up to ``capacity`` rows of the host shard ``storage.weight`` and their optimizer state on
    ``device``, refreshed every ``refresh`` steps (module docstring); what it moves over the host
    link is counted in ``link`` (the storage's). The row values and state are allocated at the
    first refresh, once the table's optimizer has stepped it (the state's shape is the
    optimizer's). Its storage (:class:`rmt.memory.storage.CachedHostStorage`) waits for the
    shard's host step before a refresh or a flush."""

    def __init__(self, storage, device, link: CommCounter, capacity: int, refresh: int):
        self.storage = storage
        self.device = torch.device(device)
        self.link = link
        self.capacity = min(capacity, storage.weight.shape[0])
        self.refresh_steps = refresh
        self.rows = HotRows(self.capacity, self.device)
        self.values: Optional[torch.Tensor] = None
        self.state: Dict[str, object] = {}
        self._row_state: List[str] = []
        self.optimizer = None
        self.grad: Optional[torch.Tensor] = None
        self._grads: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.steps = 0
        self.saved = CommCounter()
        self.reset_counts()

    @property
    def weight(self) -> torch.nn.Parameter:
        """The host shard, as its storage holds it now."""
        return self.storage.weight

    # -- lookups ------------------------------------------------------------------------
    def find(self, unique: torch.Tensor) -> Hits:
        """How the distinct rows ``unique`` (device, ascending) of a lookup split."""
        cached, slots = self.rows.find(unique)
        pos = cached.nonzero().squeeze(1)
        return Hits(unique.numel(), pos, slots[pos], unique[pos], (~cached).nonzero().squeeze(1))

    def record(self, hits: Hits, missed_rows: torch.Tensor, inverse: torch.Tensor) -> None:
        """Count a lookup split as ``hits`` (``missed_rows``: its missed rows on the host,
        ``inverse``: each index's position among its distinct rows): the bytes its hits kept off
        the link always, the counters and the policy's counts for training lookups only."""
        n = hits.pos.numel()
        row = self.weight.shape[1] * self.weight.element_size()
        self.saved.add("forward", "d2h_indices", n * INDEX_BYTES)
        self.saved.add("forward", "h2d_rows", n * row)
        if not torch.is_grad_enabled():
            return
        self.rows.record(hits.slots, missed_rows)
        self.counts["rows"] += hits.total
        self.counts["row_hits"] += n
        self.counts["lookups"] += inverse.numel()
        if n:
            cached = torch.zeros(hits.total, dtype=torch.int64, device=inverse.device)
            cached[hits.pos] = 1
            self._lookup_hits += cached[inverse].sum()

    def read(self, hits: Hits) -> torch.Tensor:
        """The cached rows of ``hits`` (a new device tensor)."""
        return self.values.index_select(0, hits.slots)

    def reset_counts(self) -> None:
        self.counts = {"rows": 0, "row_hits": 0, "lookups": 0}
        self._lookup_hits = torch.zeros((), dtype=torch.int64, device=self.device)

    def pop_counts(self) -> Dict[str, int]:
        """The counters since the last call (``rows``, ``row_hits``, ``lookups``,
        ``lookup_hits``); resets them."""
        out = dict(self.counts, lookup_hits=int(self._lookup_hits))
        self.reset_counts()
        return out

    def pop_touched_rows(self) -> torch.Tensor:
        """The rows that training lookups found in the cache since the last call (device), for
        the table's slot counters (before the slots change hands too); they cross to the host
        (``link`` ``stats`` ``d2h_hit_rows``)."""
        rows = self.rows.pop_touched()
        self.link.add("stats", "d2h_hit_rows", rows.numel() * INDEX_BYTES)
        return rows

    # -- gradients ----------------------------------------------------------------------
    def add_grad(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Keep the gradient ``grad`` of cached ``rows`` (device); once the kept rows outnumber
        the cache's slots they are summed into one."""
        self.saved.add("backward", "d2h_row_grads", grad.numel() * grad.element_size())
        self._grads.append((rows, grad))
        if sum(r.numel() for r, _ in self._grads) > self.capacity:
            merged = self.take_grad()
            self._grads = [(merged.indices()[0], merged.values())]

    def take_grad(self) -> Optional[torch.Tensor]:
        """The step's gradient of the cached rows so far, a coalesced sparse device tensor over
        the shard's rows (None when no lookup was differentiated); clears it."""
        if not self._grads:
            return None
        grads, self._grads = self._grads, []
        return sparse_rows(grads, self.weight.shape)

    def grad_sq_norm(self, host_grad: torch.Tensor) -> torch.Tensor:
        """The squared norm of the shard's gradient, ``host_grad`` (the uncached rows', on the
        host) and :attr:`grad` together, as :func:`rmt.memory.groups.square_sum` of the whole
        gradient makes it: the rows' squared norms summed in row order (0-dim float64 on the
        device). The host rows' indices and squared norms cross to the device (``link`` ``step``
        ``h2d_grad_row_norms``)."""
        rows, values = rows_and_values(host_grad)
        sums = row_square_sums(values)
        self.link.add("step", "h2d_grad_row_norms", rows.numel() * (INDEX_BYTES + COUNT_BYTES))
        rows, sums = rows.to(self.device), sums.to(self.device)
        if self.grad is not None:
            cached_rows, cached_values = rows_and_values(self.grad)
            rows, sums = torch.cat([rows, cached_rows]), torch.cat([sums, row_square_sums(cached_values)])
        return sums[torch.argsort(rows)].sum()

    # -- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer, group: dict) -> None:
        """Step the cached rows with their gradient :attr:`grad` and ``group``'s
        hyper-parameters by ``optimizer``, the table's (on the main thread: on a GPU the update
        runs on the compute stream, before any later lookup reads the rows)."""
        self.optimizer = optimizer
        self.steps += 1
        if self.values is None:
            return
        if self.grad is None:
            rows = self.rows.sorted_rows[:0]
            values = self.values[:0]
        else:
            rows, values = rows_and_values(self.grad)
        slots = self.rows.slots_of(rows)
        order = torch.argsort(slots)
        grad = torch.sparse_coo_tensor(
            slots[order].unsqueeze(0), values[order], tuple(self.values.shape), check_invariants=False
        )
        optimizer.step_param(group, self.values, grad._coalesced_(True), state=self.state)

    @property
    def due(self) -> bool:
        """Whether the next step starts with a refresh."""
        return self.steps >= self.refresh_steps

    # -- moving rows --------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self, group=None) -> None:
        """Admit and evict (module docstring), at a step boundary on every replica of the table
        alike (``group``: the replicas), once the shard's host step is done. Before the table's
        first step there is no state to cache: nothing happens."""
        self.steps = 0
        if self.optimizer is None:
            return
        state = self.optimizer.state[self.weight]
        chosen = self.rows.choose(group, self.link)
        evicted_slots, evicted_rows, admitted_slots, admitted_rows = self.rows.assign(chosen)
        if self.values is None:
            self._allocate(state)
        self._write_back(evicted_slots, evicted_rows, state, "refresh", "d2h_evicted")
        self.link.add("refresh", "d2h_admitted_indices", admitted_rows.numel() * INDEX_BYTES)
        host_rows = admitted_rows.cpu()
        self.values[admitted_slots] = self.weight.detach()[host_rows].to(self.device)
        for name in self._row_state:
            self.state[name][admitted_slots] = state[name][host_rows].to(self.device)
        self.link.add("refresh", "h2d_admitted_rows", admitted_rows.numel() * self.row_bytes)
        self.state.update((k, v) for k, v in state.items() if k not in self._row_state)

    @torch.no_grad()
    def flush(self) -> None:
        """Write every cached row's value and state back to the host (the cache keeps them), once
        the shard's host step is done."""
        if self.values is None or not len(self.rows):
            return
        state = self.optimizer.state[self.weight]
        self._write_back(self.rows.sorted_slots, self.rows.sorted_rows, state, "flush", "d2h")

    def clear(self) -> None:
        """Forget the cached rows (the host holds new values: a checkpoint was loaded; the rows
        found since the slot counters last took them are taken first, :meth:`pop_touched_rows`)."""
        self.rows.clear()
        self._grads, self.grad, self.steps = [], None, 0

    def _allocate(self, state: dict) -> None:
        rows = self.weight.shape[0]
        self.values = torch.empty(
            (self.capacity,) + tuple(self.weight.shape[1:]), dtype=self.weight.dtype, device=self.device
        )
        self._row_state = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape[0] == rows]
        for name in self._row_state:
            self.state[name] = state[name].new_empty(
                (self.capacity,) + tuple(state[name].shape[1:]), device=self.device
            )

    def _write_back(self, slots, rows, state: dict, phase: str, name: str) -> None:
        self.link.add(phase, f"{name}_indices", rows.numel() * INDEX_BYTES)
        self.link.add(phase, f"{name}_rows", rows.numel() * self.row_bytes)
        host_rows = rows.cpu()
        self.weight.detach()[host_rows] = self.values[slots].cpu()
        for key in self._row_state:
            state[key][host_rows] = self.state[key][slots].cpu()

    @property
    def row_bytes(self) -> int:
        """Bytes of one cached row's value and row-wise state."""
        return sum(t[0].numel() * t.element_size() for t in [self.values] + [self.state[k] for k in self._row_state])

    @property
    def device_bytes(self) -> int:
        """Device bytes the cache holds: the rows, their state and the index."""
        held = self.rows.device_bytes
        if self.values is not None:
            held += self.capacity * self.row_bytes
        return held
