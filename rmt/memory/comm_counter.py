"""Bytes a rank actually puts on the wire, per collective, for the sharded memory table.

Counted under the conventions of :mod:`rmt.planner.comm` (UltraMem Appendix D): the chunk a
collective keeps locally is excluded, split-size metadata is not counted, and each backward
collective is recorded under the name the planner gives it. Tests compare these counts with
:func:`rmt.planner.comm.comm_volume` exactly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict


class CommCounter:
    """``forward`` / ``backward``: collective name -> bytes sent since the last :meth:`reset`."""

    def __init__(self):
        self.forward: Dict[str, int] = defaultdict(int)
        self.backward: Dict[str, int] = defaultdict(int)

    def add(self, phase: str, name: str, nbytes: int) -> None:
        getattr(self, phase)[name] += int(nbytes)

    def reset(self) -> None:
        self.forward.clear()
        self.backward.clear()

    def totals(self) -> Dict[str, int]:
        f, b = sum(self.forward.values()), sum(self.backward.values())
        return {"forward_total": f, "backward_total": b, "forward_backward_total": f + b}
