"""Which operations of a training step make the host wait for a CUDA device, found on any device.

On a GPU, an operation whose result the host must read (``.item()``, ``float(t)``, ``if t:``, a
boolean-mask index, ``nonzero``, a linear-algebra solver's status check) waits until the device
has run everything queued before it, and the device then idles while the host issues the next
launches: in the middle of a step such a wait also ends the overlap of the async memory stream.
torch's own detector (``torch.cuda.set_sync_debug_mode``) works only on a GPU, and
``tools/bench_memory_stream.py --profile`` counts the waits there. :class:`HostSyncAudit`
records, from a run on any device, the aten operations that wait on a GPU and the frames of rmt
and megatron that called them, so that a CPU test can hold the step to the waits it needs.
Written here because torch has no device-independent detector.

The mode is thread-local: work run by another thread (the async memory stream's worker on the
CPU) is not seen. Nor are copies from the host to the device (``torch.tensor(numbers,
device=...)``, ``.to(device)`` of a tensor in pageable memory), which on a GPU wait for the
stream before they start and on the CPU copy nothing.
"""

from __future__ import annotations

import collections
import os
import traceback
from typing import Counter, Tuple

import megatron.core
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rmt

#: aten operations that wait for the device on a GPU whatever their arguments.
WAITING_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(t), int(t), bool(t), `if t:`
        "is_nonzero",
        "equal",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",  # its size depends on the largest value
        "_linalg_svd",
        "_linalg_eigh",
        "_linalg_check_errors",  # solver status read on the host
    }
)
#: aten operations that wait when one of their indices is a boolean mask (turned into
#: ``nonzero``, whose size the host must know), but for :func:`_masked_fill`'s case.
MASK_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
#: Callers that work on the host's own tensors on a GPU machine too (data loading).
HOST_SIDE = ("rmt/data/", "megatron/core/datasets/")
#: Tensor methods that copy to the host (a wait on a GPU), which on the CPU return the tensor's
#: own data without an aten operation: recorded by wrapping them while an audit is open.
HOST_COPIES = ("tolist", "numpy", "cpu")
#: The packages whose frames are reported as callers: rmt and megatron (not this module).
CALLER_ROOTS = (
    os.path.dirname(os.path.abspath(rmt.__file__)),
    os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))),
)


def _masked_fill(name: str, args) -> bool:
    """Whether torch runs an indexed assignment as ``masked_fill_`` (no wait): one boolean-mask
    index, a one-element value on the host (``x[mask] = 0.0`` puts its number there on a GPU too),
    no accumulation."""
    indices = [i for i in args[1] if i is not None]
    value = args[2] if len(args) > 2 else None
    return (
        name != "index"
        and len(indices) == 1
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value.device.type == "cpu"
        and not (len(args) > 3 and args[3])
    )


def _waits(name: str, args) -> bool:
    if name in WAITING_OPS:
        return True
    if name in MASK_INDEX_OPS and len(args) > 1:
        masks = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        return masks and not _masked_fill(name, args)
    return False


def caller(depth: int = 2) -> str:
    """The innermost ``depth`` frames of rmt or megatron on the stack, innermost first, as
    ``rmt/memory/file.py:line function`` (empty when there is none)."""
    out = []
    for f in reversed(traceback.extract_stack()):
        path = os.path.abspath(f.filename)
        root = next((r for r in CALLER_ROOTS if path.startswith(r + os.sep)), None)
        if root is None or path == os.path.abspath(__file__):
            continue
        out.append(f"{os.path.relpath(path, os.path.dirname(root))}:{f.lineno} {f.name}")
        if len(out) == depth:
            break
    return " < ".join(out)


class HostSyncAudit(TorchDispatchMode):
    """``with HostSyncAudit() as audit:`` records in ``audit.waits`` (a Counter of ``(aten op or
    Tensor method, caller)``) every operation run inside that would wait for the device on a GPU.
    The wrapped Tensor methods (:data:`HOST_COPIES`) are recorded on every thread."""

    def __init__(self, depth: int = 2):
        super().__init__()
        self.depth = depth
        self.waits: Counter[Tuple[str, str]] = collections.Counter()
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if _waits(name, args):
            self.waits[(name, caller(self.depth))] += 1
        return func(*args, **(kwargs or {}))

    def device_waits(self) -> Counter[Tuple[str, str]]:
        """``waits`` without those of data loading (:data:`HOST_SIDE`), whose tensors stay on the
        host on a GPU machine too."""
        return collections.Counter({k: n for k, n in self.waits.items() if not k[1].startswith(HOST_SIDE)})

    def _recording(self, name, method):
        def wrapper(tensor, *args, **kwargs):
            self.waits[(f"Tensor.{name}", caller(self.depth))] += 1
            return method(tensor, *args, **kwargs)

        return wrapper

    def __enter__(self):
        for name in HOST_COPIES:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._recording(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        return super().__exit__(*exc)
