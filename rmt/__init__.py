"""rmt: a megatron-core based pretraining framework for memory-centric language models."""

import os

# OpenMP threads wait passively (they sleep when a parallel region ends) instead of spinning: on a
# machine shared with other jobs a spinning thread burns the time slice its descheduled partner
# needs, and rmt's 2-thread CPU kernels ran 10x slower than on 1 thread
# (docs/notes/lookup-reduce-cpu.md). torch's OpenMP runtime reads this once, when torch is first imported, so
# it takes effect where rmt is imported first (rmt-train, rmt-plan, the tools); a user's own
# OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rmt import deferred_compile, quiet  # noqa: E402

__version__ = "0.1.0"

quiet.install()
deferred_compile.install()
