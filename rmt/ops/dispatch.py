"""Where the fused ops' fronts meet their backends: ``lookup_reduce``'s
(:mod:`rmt.ops.lookup_reduce`, :mod:`rmt.ops.fused_update`) and the fused retrieval's
(:mod:`rmt.ops.fused_retrieval`, at the end): the interface a backend implements, the registry
that declares each backend's optional kernels (lookup-reduce; the retrieval backends' tensors are
declared torch-free in :mod:`rmt.retrieval_backends`), and the choice of a backend for a device and dtype.

A backend is a module with the functions of :class:`LookupReduceBackend`. ``is_available``,
``forward`` and ``backward`` are required; the others are optional kernels, and the registry
(:data:`REGISTRY`) says which ones each backend has. :func:`get_backend` binds a backend to the
interface, with the plain formulation standing in for every optional kernel it does not
declare, so the front calls every kernel the same way and never asks a module what it has.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Dict, FrozenSet, Optional, Protocol

import torch

from rmt.retrieval_backends import RETRIEVAL_REGISTRY, covers, fused_retrieval_backends

from . import reference

ENV_BACKEND = "RMT_LOOKUP_BACKEND"
BACKENDS = ("cuda", "triton", "cpu", "reference")  # fastest first
FLOAT64_BACKENDS = ("cpu", "reference")

#: The optional kernels a backend may declare.
OPTIONAL_KERNELS = frozenset({"forward_for_backward", "backward_dense", "score_gradients", "backward_update"})


class LookupReduceBackend(Protocol):
    """The functions of a backend module (argument order of the kernels: see
    :mod:`rmt.ops.reference`, the plain formulation of each)."""

    def is_available(self, device: torch.device) -> bool:
        """Whether the backend runs on ``device``'s tensors here (its extension builds, ...)."""

    def forward(self, table, indices, scores, block_ids, num_blocks):
        """``[T, num_blocks, D]`` output."""

    def backward(self, grad_out, table, indices, scores, block_ids, num_blocks, **prep):
        """``(unique rows [U], their gradient rows [U, D], score gradients [T, K, C])``."""

    def forward_for_backward(self, table, indices, scores, block_ids, num_blocks):
        """Optional: ``(output, prep)``, the backward's index-only work (the sort by row) started in
        the forward; the backward then takes ``prep=prep``."""

    def backward_dense(self, grad_out, table, indices, scores, block_ids, num_blocks, **prep):
        """Optional: ``(dense [N, D] table gradient, score gradients)`` in one pass."""

    def score_gradients(self, grad_out, table, indices, scores, block_ids, num_blocks):
        """Optional: the score gradients alone."""

    def backward_update(
        self, grad_out, table, indices, scores, block_ids, num_blocks, score_first, score_tokens, update
    ):
        """Optional: the backward with the row optimizer's step ``update`` (a
        :class:`~rmt.ops.row_step.RowStep`) fused in (:mod:`rmt.ops.fused_update`)."""


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """A backend's declaration: its name, its module, and the optional kernels it has."""

    name: str
    module: str
    kernels: FrozenSet[str] = frozenset()


REGISTRY: Dict[str, BackendSpec] = {
    "cuda": BackendSpec(
        "cuda",
        "rmt.ops.cuda_backend",
        frozenset({"forward_for_backward", "backward_dense", "score_gradients", "backward_update"}),
    ),
    "triton": BackendSpec(
        "triton", "rmt.ops.triton_backend", frozenset({"backward_dense", "score_gradients", "backward_update"})
    ),
    "cpu": BackendSpec(
        "cpu", "rmt.ops.cpu_backend", frozenset({"backward_dense", "score_gradients", "backward_update"})
    ),
    "reference": BackendSpec("reference", "rmt.ops.reference", frozenset({"score_gradients", "backward_update"})),
}


class Backend:
    """A backend bound to :class:`LookupReduceBackend`: each call goes to the module's kernel, or
    for an optional kernel the backend does not declare, to the plain formulation
    (``backward_dense``: the touched rows of ``backward`` written into a zero table;
    ``score_gradients``, ``backward_update``: :mod:`rmt.ops.reference`'s).
    ``sorts_in_forward`` says whether it has ``forward_for_backward``."""

    def __init__(self, spec: BackendSpec):
        self.name, self.spec = spec.name, spec
        self.module = importlib.import_module(spec.module)
        unknown = spec.kernels - OPTIONAL_KERNELS
        needed = ("is_available", "forward", "backward", *sorted(spec.kernels))
        missing = [k for k in needed if not hasattr(self.module, k)]
        if unknown or missing:
            raise TypeError(
                f"lookup_reduce backend {spec.name!r} ({spec.module}) does not implement its declaration: "
                f"unknown kernels {sorted(unknown)}, missing {missing}"
            )
        self.sorts_in_forward = "forward_for_backward" in spec.kernels

    def is_available(self, device) -> bool:
        return self.module.is_available(device)

    def forward(self, *args):
        return self.module.forward(*args)

    def forward_for_backward(self, *args):
        return self.module.forward_for_backward(*args)

    def backward(self, *args, **prep):
        return self.module.backward(*args, **prep)

    def backward_dense(self, grad_out, table, *args, **prep):
        if "backward_dense" in self.spec.kernels:
            return self.module.backward_dense(grad_out, table, *args, **prep)
        rows, values, grad_scores = self.module.backward(grad_out, table, *args, **prep)
        return table.new_zeros(table.shape).index_copy_(0, rows, values), grad_scores

    def score_gradients(self, *args):
        impl = self.module if "score_gradients" in self.spec.kernels else reference
        return impl.score_gradients(*args)

    def backward_update(self, *args):
        impl = self.module if "backward_update" in self.spec.kernels else reference
        return impl.backward_update(*args)


_bound: Dict[BackendSpec, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend ``name`` of :data:`REGISTRY`, bound to the interface (imported on first use)."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"lookup_reduce: backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if spec not in _bound:
        _bound[spec] = Backend(spec)
    return _bound[spec]


def available_backends(device):
    """Names of the backends that can run on ``device``, fastest first."""
    device = torch.device(device)
    return [name for name in BACKENDS if get_backend(name).is_available(device)]


def select_backend(device, backend=None, dtype=torch.float32):
    """Resolve the backend name: explicit argument, else $RMT_LOOKUP_BACKEND, else the fastest present.

    float64 runs only on the reference and CPU backends (the GPU kernels accumulate in fp32).
    """
    device = torch.device(device)
    forced = backend or os.environ.get(ENV_BACKEND) or None
    if forced is not None:
        if dtype == torch.float64 and forced not in FLOAT64_BACKENDS:
            raise ValueError(
                f"lookup_reduce: float64 runs only on the {' and '.join(FLOAT64_BACKENDS)} "
                f"backends; got backend {forced!r}"
            )
        if not get_backend(forced).is_available(device):
            raise RuntimeError(f"lookup_reduce: backend {forced!r} is not available for {device} tensors")
        return forced
    order = ("cuda", "triton", "reference") if device.type == "cuda" else ("cpu", "reference")
    if dtype == torch.float64:
        order = tuple(name for name in order if name in FLOAT64_BACKENDS)
    return next(name for name in order if get_backend(name).is_available(device))


# -- the fused retrieval op (rmt.ops.fused_retrieval) ----------------------------------------------

ENV_RETRIEVAL_BACKEND = "RMT_RETRIEVAL_BACKEND"


def retrieval_module(name: str):
    """The module of fused-retrieval backend ``name``."""
    spec = RETRIEVAL_REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"fused_retrieval: backend must be one of {', '.join(RETRIEVAL_REGISTRY)}; got {name!r}")
    return importlib.import_module(spec.module)


def select_retrieval_backend(device, dtype, backend: Optional[str] = None) -> Optional[str]:
    """The fused-retrieval backend for ``device`` tensors of ``dtype``: ``backend``, else
    $RMT_RETRIEVAL_BACKEND, else the fastest declared one that is available here (its extension
    built); None when none but the reference is (the caller then takes the unfused path, or
    refuses). A forced backend that does not cover the tensors raises."""
    device = torch.device(device)
    forced = backend or os.environ.get(ENV_RETRIEVAL_BACKEND) or None
    if forced is not None:
        spec = RETRIEVAL_REGISTRY.get(forced)
        if spec is None or not covers(spec, device.type, dtype) or not retrieval_module(forced).is_available(device):
            raise ValueError(
                f"fused_retrieval: backend {forced!r} does not run {device.type} tensors of {dtype} here "
                f"(backends: {', '.join(RETRIEVAL_REGISTRY)})"
            )
        return forced
    for name in fused_retrieval_backends(device.type, dtype):
        if retrieval_module(name).is_available(device):
            return name
    return None
