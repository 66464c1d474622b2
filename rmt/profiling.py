"""Peak memory of one training step, on a GPU and on a CPU (for the benchmarks)."""

from __future__ import annotations

from typing import Callable

import torch


def step_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Highest memory in use while ``step()`` runs, beyond what was allocated before it: CUDA's
    allocator statistics on a GPU; on a CPU, the running sum of the profiler's allocation events
    (torch keeps no allocator peak for the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    from rmt.quiet import profiler_lines_dropped

    with profiler_lines_dropped(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # The profiler attributes an allocation to the op that made it (its self memory: net of what
    # its children allocate) and records the rest, mostly frees outside any op, as "[memory]".
    events = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak
