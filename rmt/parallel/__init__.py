"""Process groups: torch.distributed from the launcher's environment, then megatron-core's
``parallel_state`` for every tensor-, pipeline- and data-parallel group."""

from rmt.parallel.setup import destroy, initialize

__all__ = ["initialize", "destroy"]
