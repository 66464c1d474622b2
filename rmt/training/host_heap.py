"""Keep freed host memory in glibc's heap for the next step's tensors.

A CPU training step allocates and frees the same activation-sized tensors every step. With
glibc's defaults, a tensor of more than a few hundred KiB is mapped fresh (``mmap``) or carved from
a heap top that ``free`` trims back to the OS, so every step faults its activations in again page by
page and the kernel zeroes each page: in the tiny RMT of ``tools/bench_rmt.py`` 13,000 page faults
per step, about 20% of its step time (4,700 in its transformer twin). Serving every allocation
below ``M_MMAP_THRESHOLD``'s ceiling (32 MiB) from the heap and trimming only above
``retain_mib`` removes them (under 200 faults per step).

PyTorch's CPU tuning guide gets the same effect by preloading jemalloc or tcmalloc before the
process starts (``torch.backends.xeon.run_cpu``); neither library ships with the project, and a
preload cannot be set from inside ``rmt-train``, so this sets glibc's own knobs with ``mallopt``
(written by hand: no library wraps it). Tensors of 32 MiB and more, such as memory tables, are
still mapped on their own and returned to the OS when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def retain_freed_memory(retain_mib: int) -> bool:
    """Serve allocations under 32 MiB from the heap and keep up to ``retain_mib`` MiB of freed
    memory at its top. Returns whether the settings took effect (False where the C library is not
    glibc, or for ``retain_mib`` 0, which leaves glibc's defaults)."""
    if retain_mib <= 0 or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, retain_mib << 20))
