"""The training step's calls to the value tables in host memory (``memory.table_location: host``,
:class:`rmt.memory.storage.HostStorage`): their steps launched on the host-step thread, held back
from the optimizer's own step, and settled before a whole-table read."""

from __future__ import annotations

from typing import List

import torch

from rmt.memory.descriptor import descriptor
from rmt.memory.storage import HostStorage


def host_tables(modules) -> List[HostStorage]:
    """The host storages of the value tables of ``modules``."""
    out = []
    for m in modules:
        for p in m.parameters():
            record = descriptor(p)
            if record is not None and record.storage.location == "host":
                out.append(record.storage)
    return out


def settle_all(modules) -> None:
    """Wait for the launched steps of every table of ``modules`` and write their cached rows back
    (before reading them whole: a checkpoint, an evaluation, the end of training)."""
    for m in modules:
        for p in m.parameters():
            record = descriptor(p)
            if record is not None:
                record.storage.settle()


def launch_host_steps(optimizer: torch.optim.Optimizer) -> List[torch.nn.Parameter]:
    """Launch the step of every table ``optimizer`` holds whose storage steps it elsewhere (a host
    shard: :meth:`HostStorage.launch`, its cached rows stepped on the device first) with its
    gradient and a copy of its param group (the scheduler sets the next ``lr`` meanwhile); returns
    those tables, which the optimizer's own ``step`` must then skip (:class:`held_back`)."""
    launched = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            record = descriptor(p)
            if record is None or p.grad is None:
                continue
            if record.storage.launch(optimizer, dict(group), p.grad):
                launched.append(p)
    return launched


class held_back:
    """Context: the gradients of ``params`` (host tables whose step is launched) are hidden from
    an optimizer's ``step`` while it lasts, and are the step's gradients again after it."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.grads: List[torch.Tensor] = []

    def __enter__(self):
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.grads):
            p.grad = g
