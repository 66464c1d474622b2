"""The host's cost per operation of a training step, as :mod:`rmt.planner.calibrate` measures it:
rmt's transformer as the trainer runs it (megatron-core's layers, its DDP wrapper's gradient
hooks, the vocab-parallel loss), forward and backward, at a width where issuing its operations is
all of its time, over the aten operations it dispatches.

The Python around each operation (megatron's modules and autograd functions, the hooks) costs a
CPU several times a bare dispatch; the step-time model charges this figure for each operation it
counts in a traced step (:func:`rmt.planner.step_work.microbatch_ops`, ``layer_ops``)."""

from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.utils._python_dispatch import TorchDispatchMode

SHAPE = [
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.vocab_size=128",
    "model.dropout=0.0",
    "train.micro_batch_size=1",
]
"""The probed model: 16 tokens of width 64 (microseconds of arithmetic an operation)."""


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def probe_step(device: torch.device, layers: int = 2) -> Tuple[Callable[[], None], int, Callable[[], None]]:
    """``(step, operations, close)``: one forward and backward of the probed model of ``layers``
    layers on ``device``, the aten operations one dispatches, and what undoes the model-parallel
    state made for it (the process group, when it was made here, too)."""
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.models.build import build
    from rmt.models.documents import causal_mask
    from rmt.training.ddp import wrap_chunks
    from rmt.training.loss import lm_loss

    world = dist.get_world_size() if dist.is_initialized() else 1
    config = validate(load_config(None, SHAPE + [f"model.num_layers={layers}", f"train.global_batch_size={world}"]))
    owned = not dist.is_initialized()
    parallel.initialize(config)
    chunk = wrap_chunks(build(config), config)[0]
    length = config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (1, length), device=device)
    positions = torch.arange(length, device=device)[None]
    mask = causal_mask(length, device)
    loss_mask = torch.ones(1, length, device=device)

    def step() -> None:
        loss, _ = lm_loss(chunk(tokens, positions, mask), tokens, loss_mask, 0.0)
        loss.backward()

    step()
    counter = _Count()
    with counter:
        step()

    def close() -> None:
        if owned:
            parallel.destroy()
        else:
            parallel_state.destroy_model_parallel()

    return step, counter.n, close
