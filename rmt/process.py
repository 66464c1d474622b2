"""The process-wide settings rmt's commands run with, installed by one call: :func:`setup_process`.

Importing rmt, or any module of it, changes nothing in the process. Every console script
(``rmt-train``, ``rmt-plan``, ...), ``python -m rmt.parallel.launcher``, the tools and the test
suite call :func:`setup_process` first, before torch or megatron-core is imported; a program that
embeds rmt calls it too if it wants what they get:

* ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: OpenMP threads sleep when a
  parallel region ends instead of spinning, which on a machine shared with other jobs keeps the
  2-thread CPU kernels from stalling on a descheduled partner (docs/notes/lookup-reduce-cpu.md). torch's
  OpenMP runtime reads it once, when torch is first imported.
* the warning filters of :mod:`rmt.quiet` (messages a user cannot act on, each matched narrowly);
* megatron-core's import-time ``torch.compile`` deferred to first use (:mod:`rmt.deferred_compile`:
  an import hook on ``megatron.core.jit``), which only works before megatron-core is imported.

The CPU shim of megatron-core (:mod:`rmt.parallel.compat`) is installed by
:func:`rmt.parallel.initialize`, the call that makes the process groups, and refuses a
megatron-core other than the one it was written for (:func:`require_tested_megatron_core`).
"""

from __future__ import annotations

import os

from rmt import deferred_compile, quiet
from rmt.errors import UserError

#: The megatron-core release rmt's CPU shim and import hook were written for and tested with.
TESTED_MEGATRON_CORE = "0.16.1"


def setup_process() -> None:
    """Install the settings above; calling it again changes nothing."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    quiet.install()
    deferred_compile.install()


def _megatron_core_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout on the path
        from megatron.core import package_info

        return package_info.__version__


def require_tested_megatron_core() -> None:
    """Raise :class:`UserError` (one sentence) unless megatron-core is the tested release."""
    found = _megatron_core_version()
    if found != TESTED_MEGATRON_CORE:
        raise UserError(
            f"rmt's CPU shim of megatron-core was written for megatron-core {TESTED_MEGATRON_CORE}, "
            f"but this environment has {found}; install megatron-core=={TESTED_MEGATRON_CORE}"
        )
