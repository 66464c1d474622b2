"""This machine's memory, as the kernel reports it (torch-free: the start-up fit check and
``rmt-plan memory --config`` on a CPU read the same figure)."""

from __future__ import annotations

import os


def meminfo_bytes(*fields: str) -> int:
    """The sum of ``fields`` of /proc/meminfo (``MemTotal``, ``MemAvailable``, ...) in bytes; 0
    where it cannot be read (not Linux)."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                if key in fields:
                    total += int(value.split()[0]) * 1024
    except OSError:
        pass
    return total


def machine_memory() -> int:
    """RAM plus swap of this machine (bytes): the most its CPU ranks can ever hold together."""
    return meminfo_bytes("MemTotal", "SwapTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
