"""No process of a job outlives the job.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) kills a process when the one that
started it dies, whatever killed that one (``kill -9`` included). Two places need it:

* a worker started by torchrun runs in a session of its own, so when the launcher itself is
  killed nothing else would stop the worker (:func:`die_with_parent`, called by the worker);
* processes a trainer forks, such as megatron-core's checkpoint writers, would otherwise keep
  writing into a checkpoint directory after the trainer died (:func:`forked_children_die_with_this_process`).

Elsewhere (macOS) these are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_hooked = False
_parent_at_fork = 0


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int) -> None:
    """Kill this process (SIGKILL) as soon as its parent ``parent_pid`` dies."""
    if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the signal was armed


def _remember_parent() -> None:
    global _parent_at_fork
    _parent_at_fork = os.getpid()


def _child_dies_with_parent() -> None:
    die_with_parent(_parent_at_fork)


def forked_children_die_with_this_process() -> None:
    """Every process this one forks from now on is killed when this one dies."""
    global _hooked
    if not _hooked and sys.platform.startswith("linux"):
        os.register_at_fork(before=_remember_parent, after_in_child=_child_dies_with_parent)
        _hooked = True
