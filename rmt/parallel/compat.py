"""Make megatron-core 0.16.1 run on CPU (gloo). The only module that knows about the shim.

megatron-core assumes CUDA throughout: ``torch.cuda.current_device()`` as a device argument,
``device="cuda"`` literals in the pipeline schedules, the DDP buffers and the optimizers,
``torch.cuda`` RNG states (also in the recomputation's checkpoint function) and
synchronisation, and CUDA type names by which its float16 and distributed optimizers sort the
parameters they wrap (:func:`_cpu_mixed_precision_optimizers`). :func:`apply` patches exactly
those places, and only when CUDA is absent, so the same code takes the NCCL/CUDA paths on a GPU
cluster. The adjustments are written for megatron-core 0.16.1 (with torch 2.13), and
:func:`apply` refuses any other release (:func:`rmt.process.require_tested_megatron_core`).

Its MoE (:func:`_moe_without_te`, :func:`_cpu_moe_dispatch`, :func:`_gloo_uneven_gather`)
needs three more: the router's GEMM names a Transformer Engine function that is undefined
without TE (on GPUs too), the all-to-all dispatcher hands gloo its split sizes as tensors, and
with expert tensor parallelism it all-gathers and reduce-scatters chunks of unequal length,
which gloo does not do. Checkpoint saves take their writers' results on an in-process queue
(:func:`_in_process_writer_results`, on GPUs too).

:data:`PATCHES` lists every megatron-core and torch symbol rmt replaces, here and in the two
places that must act elsewhere (the launcher's agent, the deferred ``torch.compile``), with the
parameters each replacement expects; :func:`contract_problem` checks one against the installed
release (``tests/test_compat_contract.py`` runs it per symbol, so an upgrade that renames or
reshapes one fails by its name).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import queue
import types
from typing import Dict, Optional, Set, Tuple

import torch

from rmt import quiet
from rmt.process import require_tested_megatron_core


@dataclasses.dataclass(frozen=True)
class Patch:
    """One symbol rmt replaces: ``target`` is ``"module:attribute"`` (attribute may be dotted,
    ``Class.method``); ``params`` the parameter names, in order, that the replacement takes or
    passes on (None: it takes any, only the symbol's existence is assumed); ``where`` the
    function that replaces it; ``cpu_only`` whether it is replaced only without CUDA."""

    target: str
    params: Optional[Tuple[str, ...]]
    where: str
    cpu_only: bool = True


# Modules that create tensors with a literal ``device="cuda"``; each gets a torch proxy whose
# factory functions map that device to the CPU.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.utils",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like")

PATCHES: Tuple[Patch, ...] = (
    Patch("torch.cuda:current_device", (), "apply"),
    Patch("torch.cuda:synchronize", ("device",), "apply"),
    Patch("torch.cuda:Stream", None, "apply"),
    Patch("torch.cuda:Event", None, "apply"),
    Patch("torch.cuda:current_stream", ("device",), "apply"),
    Patch("torch.cuda:stream", ("stream",), "apply"),
    *(Patch(f"{name}:torch", None, "apply") for name in _CUDA_LITERAL_MODULES),
    Patch("torch:Tensor.type", None, "_cuda_type_names"),
    Patch(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
        None,
        "_cpu_mixed_precision_optimizers",
    ),
    Patch(
        "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
        None,
        "_cpu_mixed_precision_optimizers",
    ),
    Patch("megatron.core.tensor_parallel.random:_get_cuda_rng_state", None, "_cpu_checkpoint_rng"),
    Patch("megatron.core.tensor_parallel.random:_set_cuda_rng_state", None, "_cpu_checkpoint_rng"),
    Patch(
        "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        ("tensor", "as_numpy", "record_stream"),
        "_cpu_moe_dispatch",
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
        ("input_", "group", "output_split_sizes", "use_global_buffer"),
        "_gloo_uneven_gather",
    ),
    Patch(
        "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
        ("input_", "group", "input_split_sizes", "use_global_buffer"),
        "_gloo_uneven_gather",
    ),
    Patch("megatron.core.transformer.moe.moe_utils:te_general_gemm", None, "_moe_without_te", cpu_only=False),
    Patch(
        "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        None,
        "_in_process_writer_results",
        cpu_only=False,
    ),
    Patch("megatron.core.jit:jit_fuser", None, "rmt.deferred_compile.install", cpu_only=False),
    Patch("torch.distributed.launcher.api:LocalElasticAgent", None, "rmt.parallel.launcher.main", cpu_only=False),
    Patch(
        "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent._monitor_workers",
        ("self", "worker_group"),
        "rmt.parallel.launcher._Agent",
        cpu_only=False,
    ),
)

# The symbols as megatron-core and torch defined them, kept when :func:`_replace` replaces one.
_ORIGINALS: Dict[str, object] = {}
# Symbols that a release may leave unbound, replaced only where they are (the TE GEMM name).
_OPTIONAL = {"megatron.core.transformer.moe.moe_utils:te_general_gemm"}

_APPLIED = False


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


def _resolve(target: str):
    """The object that holds ``target``'s attribute, and the attribute's name."""
    module, attribute = target.split(":")
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _replace(target: str, value) -> None:
    """Replace the symbol ``target`` (one of :data:`PATCHES`) by ``value``, keeping the original."""
    owner, name = _resolve(target)
    _ORIGINALS.setdefault(target, getattr(owner, name, None))
    setattr(owner, name, value)


def replaced() -> Set[str]:
    """The targets of :data:`PATCHES` this process has replaced so far."""
    return set(_ORIGINALS)


def contract_problem(patch: Patch) -> Optional[str]:
    """What the installed release breaks of ``patch``'s assumptions (None: nothing): the symbol
    exists (for an optional one, its module still names it), a module's ``torch`` is torch, and
    the leading parameters are ``patch.params``. Judges the symbol as the release defines it,
    also after :func:`apply` replaced it."""
    try:
        owner, name = _resolve(patch.target)
    except (ImportError, AttributeError) as err:
        return f"{patch.target} is gone ({type(err).__name__}: {err})"
    if patch.target in _ORIGINALS:
        symbol = _ORIGINALS[patch.target]
    elif hasattr(owner, name):
        symbol = getattr(owner, name)
    elif patch.target in _OPTIONAL and name in inspect.getsource(owner):
        return None
    else:
        return f"{patch.target} is gone"
    if name == "torch" and symbol is not torch:
        return f"{patch.target} is no longer the torch module"
    if patch.params is None:
        return None
    try:
        found = tuple(inspect.signature(symbol).parameters)
    except (TypeError, ValueError) as err:
        return f"{patch.target} has no signature to check ({err})"
    if found[: len(patch.params)] != patch.params:
        return f"{patch.target} takes {found}, the replacement expects {patch.params} first"
    return None


def apply() -> None:
    """Install the CPU adjustments once per process (only the Transformer Engine fallback and
    the checkpoint writers' queue when CUDA is available)."""
    global _APPLIED
    if _APPLIED:
        return
    require_tested_megatron_core()
    _moe_without_te()
    _in_process_writer_results()
    if cuda_available():
        _APPLIED = True
        return
    quiet.on_cpu()
    _replace("torch.cuda:current_device", lambda: "cpu")
    _replace("torch.cuda:synchronize", lambda *args, **kwargs: None)
    _replace("torch.cuda:Stream", _NullStream)
    _replace("torch.cuda:Event", _NullStream)
    _replace("torch.cuda:current_stream", lambda *args, **kwargs: _NullStream())
    _replace("torch.cuda:stream", lambda *args, **kwargs: _NullStream())
    proxy = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        _replace(f"{name}:torch", proxy)
    _cpu_mixed_precision_optimizers()
    _cpu_checkpoint_rng()
    _cpu_moe_dispatch()
    _gloo_uneven_gather()
    _APPLIED = True


def _moe_without_te() -> None:
    """megatron's router GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not
    None``, a name only bound when Transformer Engine imports: bind it to None so the torch
    matmul path runs."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        _replace("megatron.core.transformer.moe.moe_utils:te_general_gemm", None)


def _in_process_writer_results() -> None:
    """megatron-core's torch_dist writer hands its writers' results to the saving process
    through a queue it takes from a ``multiprocessing.Manager``: a spawned server process (about
    300 MB, since it imports the trainer) that nothing stops when the trainer is killed. rmt's
    saves are synchronous: the trainer itself puts the results on that queue and takes them off
    (the forked writers report on a queue of their own), so an in-process queue does the same
    without the server."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        _replace("megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue", queue.Queue())


@contextlib.contextmanager
def _cuda_type_names():
    """``Tensor.type()`` (no argument) answers with the CUDA type name for a CPU tensor, for as
    long as the context lasts."""
    original = torch.Tensor.type

    def type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and not self.is_cuda:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _cpu_mixed_precision_optimizers() -> None:
    """megatron's distributed and float16 optimizers sort the parameters they wrap by
    ``param.type()`` against the CUDA names (``'torch.cuda.BFloat16Tensor'``) in their
    constructors, and refuse any other: construct them with CPU tensors answering those names.
    (Their ``device='cuda'`` literals are covered by the torch proxy above.)"""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    _ORIGINALS.setdefault("torch:Tensor.type", torch.Tensor.type)  # replaced during the constructors only
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        init = cls.__init__

        def cpu_init(self, *args, __init=init, **kwargs):
            with _cuda_type_names():
                __init(self, *args, **kwargs)

        _replace(f"{cls.__module__}:{cls.__name__}.__init__", cpu_init)


def _cpu_checkpoint_rng() -> None:
    """megatron's checkpoint function (activation recomputation) saves and restores the CUDA RNG
    state; without CUDA there is none: rmt's CPU tracker (:func:`seed_model_parallel`, megatron's
    inference tracker) forks no state, so dropout draws from the CPU generator, which the function
    saves and restores itself (``torch.get_rng_state``)."""
    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        _replace(f"megatron.core.tensor_parallel.random:{name}", lambda *args, **kwargs: None)


def _cpu_moe_dispatch() -> None:
    """The all-to-all dispatcher moves its split sizes to the host with
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which leaves CPU tensors as tensors; gloo's
    ``all_to_all_single`` then rejects them (it takes sequences of ints). Return numpy arrays
    for CPU tensors too, as the function does for CUDA tensors."""

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            return tensor.numpy() if as_numpy else tensor
        return tensor

    _replace("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu", to_host)


def seed_model_parallel(seed: int) -> None:
    """Seed megatron-core's model-parallel RNG tracker (the plain call fails without CUDA)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if cuda_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def _gloo_uneven_gather() -> None:
    """megatron's sequence all-gather and reduce-scatter take ``split_sizes`` for chunks of
    unequal length (the all-to-all MoE dispatcher over expert-tensor-parallel ranks) and then
    call the list forms of ``all_gather`` / ``reduce_scatter``, which gloo lacks or requires
    equal. Pad every chunk to the longest, run the equal-size collective, cut the padding."""
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def padded(chunks, width):
        out = chunks[0].new_zeros((len(chunks) * width,) + tuple(chunks[0].shape[1:]))
        for i, chunk in enumerate(chunks):
            out[i * width : i * width + chunk.shape[0]] = chunk
        return out

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        out = torch.empty((group.size() * width,) + tuple(input_.shape[1:]), dtype=input_.dtype)
        torch.distributed.all_gather_into_tensor(out, padded([input_], width), group=group)
        return torch.cat([out[i * width : i * width + n] for i, n in enumerate(output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        out = input_.new_empty((width,) + tuple(input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded(list(input_.split(input_split_sizes)), width), group=group)
        return out[: input_split_sizes[group.rank()]]

    _replace("megatron.core.tensor_parallel.mappings:_gather_along_first_dim", gather_uneven)
    _replace("megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim", reduce_scatter_uneven)
