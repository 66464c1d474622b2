"""Planning formulas: FLOPs, communication volume, memory per rank, step time and layouts
(``rmt-plan``, :mod:`rmt.planner.cli`). The arithmetic the runtime shares with it lives in
torch-free leaves it imports: :mod:`rmt.memory.comm_volume` (UltraMem Appendix D and the
partition choice), :mod:`rmt.memory.byte_sizes` and :mod:`rmt.models.vocab`."""
