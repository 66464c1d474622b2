"""An exponential moving average of the weights (Polyak averaging), kept beside the trained ones.

After every optimizer step ``ema = decay * ema + (1 - decay) * w`` (``train.ema_decay``), with
torch's own update (``torch.optim.swa_utils.get_ema_multi_avg_fn``, one fused lerp over the
tensors). torch's ``AveragedModel`` would deep-copy the module, gradient buffers and
process-group handles included; here only the parameters' shards are copied, each rank averaging
the shard it holds, so no communication is added and every parallel layout averages alike.

Left out are the memory value tables (parameters with a :class:`~rmt.memory.descriptor.TableDescriptor`), whatever their layout:
averaging them would cost a pass over every slot at every step where the step touches a few rows,
and a second copy of tables sized to fill the ranks. The averaged model uses the trained tables.

Where the trained weights oscillate around a minimum (a learning rate high for the batch), the
average sits nearer its centre: on selective copy at 512 noise tokens the validation loss of the
average (decay 0.99) is several times below the trained weights' (docs/recipes.md).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from rmt.memory.descriptor import is_table


class WeightAverage:
    """The average of the trainable parameters of ``chunks`` other than memory value tables,
    started at their current values."""

    def __init__(self, chunks: List[torch.nn.Module], decay: float):
        self.decay = decay
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad and not is_table(p)]
        self.averages = [p.detach().clone() for p in self.params]
        self._update = get_ema_multi_avg_fn(decay)

    def update(self) -> None:
        """Move the average towards the current weights (after an optimizer step)."""
        self._update(self.averages, [p.detach() for p in self.params], None)

    def restart(self) -> None:
        """Start the average afresh at the current weights."""
        torch._foreach_copy_(self.averages, [p.detach() for p in self.params])

    def by_param(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """The average of each averaged parameter (what checkpoints save and load)."""
        return dict(zip(self.params, self.averages))

    def put_in(self) -> None:
        """From now on the model holds the averaged weights (e.g. to generate with them)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.averages)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the model holds the averaged weights; the trained ones are put back
        after it (also on an exception)."""
        trained = [p.detach().clone() for p in self.params]
        self.put_in()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, trained)
