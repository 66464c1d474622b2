"""Process groups: torch.distributed from the launcher's environment, then megatron-core's
``parallel_state`` for every tensor-, pipeline- and data-parallel group.

``initialize`` and ``destroy`` are imported on first use, so that the light modules of this
package (the launcher, launch environments, process lifetimes) do not import megatron-core."""

__all__ = ["initialize", "destroy", "lost_peer"]


def __getattr__(name):
    if name in __all__:
        from rmt.parallel import setup

        return getattr(setup, name)
    raise AttributeError(f"module 'rmt.parallel' has no attribute '{name}'")
