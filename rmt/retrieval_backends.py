"""The fused retrieval's backends as declared, and the path ``memory.retrieval_kernel`` takes.

Torch-free, so that config validation and the planner read the same declarations that
:mod:`rmt.ops.dispatch` resolves to modules and runs (:mod:`rmt.ops.fused_retrieval`). A dtype is
named as torch prints it without its ``torch.`` prefix (``float32``, ``bfloat16``); the functions
here take either a ``torch.dtype`` or that name."""

from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, List, Optional

KERNELS = ("auto", "fused", "unfused")
"""The values of ``memory.retrieval_kernel``."""

CPU_KEY_TILE = 256
"""Keys per tile of the CPU backend's selection (:mod:`rmt.ops.retrieval_cpu`; measured on CPU:
``tools/bench_retrieval.py``)."""
CPU_TOKEN_BLOCK = 128
"""Tokens per block of the CPU backend's selection: one task per block, head and grid side."""


@dataclasses.dataclass(frozen=True)
class RetrievalBackendSpec:
    """A fused-retrieval backend's declaration: its module (``is_available(device)`` and
    ``select(q_row, q_col, keys, m, selector, key_tile, token_block)``, the contract of
    :func:`rmt.ops.retrieval_reference.select`), the device type whose tensors it takes (None:
    any) and the names of the input dtypes it covers. What it declares is what validation
    promises before training (and the planner counts), so a backend covers every shape of its
    dtypes."""

    name: str
    module: str
    device_type: Optional[str]
    dtypes: FrozenSet[str]


#: Fused-retrieval backends, fastest first (on a GPU: CUDA before Triton, as lookup-reduce orders
#: them; ``tools/bench_retrieval.py --device gpu --backend NAME`` measures each). ``auto`` picks the
#: first one available for the tensors, and ``memory.retrieval_kernel: fused`` is accepted for the
#: devices and dtypes they declare.
RETRIEVAL_REGISTRY: Dict[str, RetrievalBackendSpec] = {
    "cuda": RetrievalBackendSpec("cuda", "rmt.ops.retrieval_cuda", "cuda", frozenset({"float32", "bfloat16"})),
    "triton": RetrievalBackendSpec("triton", "rmt.ops.retrieval_triton", "cuda", frozenset({"float32", "bfloat16"})),
    "cpu": RetrievalBackendSpec("cpu", "rmt.ops.retrieval_cpu", "cpu", frozenset({"float32", "bfloat16", "float64"})),
    "reference": RetrievalBackendSpec(
        "reference", "rmt.ops.retrieval_reference", None, frozenset({"float32", "bfloat16", "float16", "float64"})
    ),
}


def dtype_name(dtype) -> str:
    """``float32`` for ``torch.float32`` or ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def covers(spec: RetrievalBackendSpec, device_type: str, dtype) -> bool:
    """Whether ``spec`` declares ``device_type`` tensors of ``dtype``."""
    return spec.device_type in (None, device_type) and dtype_name(dtype) in spec.dtypes


def fused_retrieval_backends(device_type: str, dtype) -> List[str]:
    """Names of the fused-retrieval backends other than the reference that declare ``device_type``
    tensors of ``dtype``, fastest first (none is imported or built)."""
    return [
        name for name, spec in RETRIEVAL_REGISTRY.items() if name != "reference" and covers(spec, device_type, dtype)
    ]


def declared_devices() -> str:
    """What the fused retrieval's backends other than the reference declare, each device once:
    ``cpu bfloat16, float32, float64; cuda bfloat16, float32``."""
    dtypes: Dict[str, set] = {}
    for name, spec in RETRIEVAL_REGISTRY.items():
        if name != "reference":
            dtypes.setdefault(spec.device_type, set()).update(spec.dtypes)
    return "; ".join(f"{device} {', '.join(sorted(names))}" for device, names in sorted(dtypes.items()))


def takes_fused(kernel: str, device_type: str, dtype) -> bool:
    """Whether a memory layer's retrieval under ``memory.retrieval_kernel`` = ``kernel`` runs the
    fused op on ``device_type`` tensors of ``dtype`` where the declared backends build:
    ``unfused`` never; ``fused`` always (validation refuses it before training where no backend
    declares the tensors); ``auto`` where a backend other than the reference declares them
    (:func:`rmt.ops.fused_retrieval.choose_backend`, the runtime's choice, which also asks
    whether the backend's extension built)."""
    if kernel not in KERNELS:
        raise ValueError(f"retrieval kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if kernel == "unfused":
        return False
    return kernel == "fused" or bool(fused_retrieval_backends(device_type, dtype))
