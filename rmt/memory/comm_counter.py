"""Bytes a rank actually puts on the wire, per collective, for the sharded memory table.

Counted under the conventions of :mod:`rmt.memory.comm_volume` (UltraMem Appendix D): the chunk a
collective keeps locally is excluded, split-size metadata is not counted, and each backward
collective is recorded under the name the planner gives it. Tests compare these counts with
:func:`rmt.memory.comm_volume.comm_volume` exactly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict


class CommCounter:
    """``phases``: phase -> name -> bytes sent since the last :meth:`reset`; ``forward`` and
    ``backward`` are a lookup's, other phases (a host table cache's ``step``, ``refresh`` and
    ``flush``, :mod:`rmt.memory.host_cache`) appear on first use."""

    def __init__(self):
        self.phases: Dict[str, Dict[str, int]] = {"forward": defaultdict(int), "backward": defaultdict(int)}

    @property
    def forward(self) -> Dict[str, int]:
        return self.phases["forward"]

    @property
    def backward(self) -> Dict[str, int]:
        return self.phases["backward"]

    def add(self, phase: str, name: str, nbytes: int) -> None:
        self.phases.setdefault(phase, defaultdict(int))[name] += int(nbytes)

    def reset(self) -> None:
        for counts in self.phases.values():
            counts.clear()

    def totals(self) -> Dict[str, int]:
        f, b = sum(self.forward.values()), sum(self.backward.values())
        return {"forward_total": f, "backward_total": b, "forward_backward_total": f + b}
