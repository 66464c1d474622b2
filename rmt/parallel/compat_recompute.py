"""megatron-core's checkpoint function under autocast (rmt's ``train.precision: bf16``).

megatron's ``tensor_parallel.checkpoint`` (``CheckpointFunction``) recomputes a span in the
backward without the autocast state of its first forward (torch's own checkpoint restores it).
rmt's bf16 runs autocast the forward only (the trainer's ``torch.autocast`` around the model
call), so the recomputed span would run in fp32: other values than the forward's, and fp32
outputs meeting bf16 gradients. :func:`apply` wraps the function so that the span enters the
autocast state current at the checkpoint, in the forward and in the recomputation; a no-op
without autocast (megatron's bf16 parameters without autocast, fp32). On CUDA and CPU alike:
the state is the device's. Without CUDA it also makes the function's RNG bookkeeping CPU-only
(:func:`_cpu_rng_states`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False


def apply() -> None:
    """Install the wrapper once per process (``tensor_parallel.checkpoint``, the name megatron's
    transformer block, attention and rmt's layer stacks call it by)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core import tensor_parallel

    from rmt.parallel import compat

    if not compat.cuda_available():
        _cpu_rng_states()

    original = tensor_parallel.checkpoint

    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        kinds = [kind for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)]
        if kinds:
            states = [(kind, torch.get_autocast_dtype(kind)) for kind in kinds]
            inner = function

            def function(*inputs):
                with contextlib.ExitStack() as stack:
                    for kind, dtype in states:
                        stack.enter_context(torch.autocast(kind, dtype=dtype))
                    return inner(*inputs)

        return original(function, distribute_saved_activations, *args)

    tensor_parallel.checkpoint = checkpoint
    _APPLIED = True



def _cpu_rng_states() -> None:
    """Without CUDA the checkpoint function's CUDA RNG state is nothing to save or restore:
    rmt's CPU tracker (:func:`rmt.parallel.compat.seed_model_parallel`, megatron's inference
    tracker) forks no state, so dropout draws from the CPU generator, which the function saves
    and restores itself (``torch.get_rng_state``)."""
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None
