"""Planning formulas: communication volume, memory per rank and partition choice.

See :mod:`rmt.planner.comm` (UltraMem Appendix D) and :mod:`rmt.planner.memory`.
"""

from rmt.planner.comm import choose_partition, comm_volume, plan_comm
from rmt.planner.memory import TablePlan, min_group_size, phases, plan_memory

__all__ = ["choose_partition", "comm_volume", "plan_comm", "TablePlan", "phases", "min_group_size", "plan_memory"]
