"""Planning formulas: communication volume, memory per rank and partition choice.

See :mod:`rmt.planner.comm` (UltraMem Appendix D) and :mod:`rmt.planner.memory`.
"""

from rmt.planner.comm import choose_partition, comm_volume, plan_comm
from rmt.planner.memory import memory_per_rank, min_group_size, plan_memory

__all__ = ["choose_partition", "comm_volume", "plan_comm", "memory_per_rank",
           "min_group_size", "plan_memory"]
