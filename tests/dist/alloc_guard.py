"""Accounting of the tensors torch allocates inside a context, for tests that prove a sharded
table costs its shard: every op output and factory call passes a TorchDispatchMode, which tracks
the largest new storage, the peak of the bytes allocated inside the context that are still alive,
and raises on a tensor that a predicate forbids (e.g. one with as many elements as the whole
table), so a test fails the moment any code path materialises one."""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ForbiddenAllocation(RuntimeError):
    pass


def _ptr(t: torch.Tensor) -> int:
    return _ptr(t._values()) if t.is_sparse else t.untyped_storage().data_ptr()


class AllocationTracker(TorchDispatchMode):
    """``forbid(tensor) -> reason or None`` is checked on every tensor an op returns; ``largest``
    and ``peak`` (bytes) cover the storages created inside the context."""

    def __init__(self, forbid: Optional[Callable[[torch.Tensor], Optional[str]]] = None):
        super().__init__()
        self.forbid = forbid
        self.largest = self.live = self.peak = 0
        self._seen = set()

    def _account(self, t: torch.Tensor) -> None:
        if t.is_sparse:
            for part in (t._indices(), t._values()):
                self._account(part)
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._seen or storage.nbytes() == 0:
            return
        nbytes = storage.nbytes()
        self._seen.add(ptr)
        self.largest = max(self.largest, nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, ptr, nbytes)

    def _release(self, ptr: int, nbytes: int) -> None:
        if ptr in self._seen:
            self._seen.discard(ptr)
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            # in-place ops, out= variants and views return storages that already existed
            if isinstance(t, torch.Tensor) and not t.is_meta and _ptr(t) not in inputs:
                if self.forbid is not None:
                    reason = self.forbid(t)
                    if reason:
                        raise ForbiddenAllocation(f"{func}: {reason} (shape {tuple(t.shape)})")
                self._account(t)
        return out
