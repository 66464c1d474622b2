"""Make megatron-core 0.16.1 run on CPU (gloo). The only module that knows about the shim.

megatron-core assumes CUDA throughout: ``torch.cuda.current_device()`` as a device argument,
``device="cuda"`` literals in the pipeline schedules and the DDP buffers, ``torch.cuda``
RNG states and synchronisation. :func:`apply` patches exactly those places, and only when
CUDA is absent, so the same code takes the NCCL/CUDA paths on a GPU cluster. The adjustments
were measured on megatron-core 0.16.1 with torch 2.13 (see REFERENCE_NOTES.md).
"""

from __future__ import annotations

import importlib
import types

import torch

_APPLIED = False

# Modules that create tensors with a literal ``device="cuda"``; each gets a torch proxy whose
# factory functions map that device to the CPU.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like")


def cuda_available() -> bool:
    """The single device decision of the code base: CUDA when present, else CPU."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this process computes on (``cuda:<local rank>`` or ``cpu``)."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


def _cpu_device(value):
    if isinstance(value, int) or (isinstance(value, str) and value.startswith("cuda")):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return "cpu"
    return value


class _CpuTorch(types.ModuleType):
    """A stand-in for ``torch`` inside one megatron module: tensor factories asked for a CUDA
    device get the CPU; everything else is torch itself."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


class _NullStream:
    """CPU stand-in for ``torch.cuda.Stream``/``Event`` (work on CPU is already ordered)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def apply() -> None:
    """Install the CPU adjustments once per process; a no-op when CUDA is available."""
    global _APPLIED
    if _APPLIED or cuda_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NullStream()
    torch.cuda.stream = lambda *args, **kwargs: _NullStream()
    proxy = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = proxy
    _cpu_autocast_linears()
    _APPLIED = True


def _cpu_autocast_linears() -> None:
    """megatron's TP linear autograd functions carry ``custom_fwd/custom_bwd`` for CUDA only, so
    under CPU autocast (bf16) their backward multiplies bf16 grads by fp32 weights. Re-wrap the
    undecorated functions for the CPU autocast device."""
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithGradAccumulationAndAsyncCommunication, layers.LinearWithFrozenWeight):
        if hasattr(cls.forward, "__wrapped__"):
            cls.forward = staticmethod(torch.amp.custom_fwd(cls.forward.__wrapped__, device_type="cpu"))
        if hasattr(cls.backward, "__wrapped__"):
            cls.backward = staticmethod(torch.amp.custom_bwd(cls.backward.__wrapped__, device_type="cpu"))


def seed_model_parallel(seed: int) -> None:
    """Seed megatron-core's model-parallel RNG tracker (the plain call fails without CUDA)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if cuda_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
