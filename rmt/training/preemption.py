"""Preemption: SIGTERM or SIGUSR1 (what SLURM sends before a time limit with ``--signal``, or on
preemption) asks a run to stop at the next step boundary. The trainer then saves a checkpoint
and the process exits with status 0, so a requeued or restarted job continues from there.
Ctrl-C (SIGINT, which ``rmt-launch`` passes to its workers) is the same stop, said in one line; a
second Ctrl-C quits at once, also in one line, without a traceback (exit status 130).

The handler only records the signal; the ranks agree on it at each step boundary
(:func:`agreed_signal`), so all of them stop after the same step even when the signal reached
only some of them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_received = 0
_interrupts = 0


def _says() -> bool:
    """Whether this process speaks for the job (global rank 0, or a process alone)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _record(signum, _frame) -> None:
    global _received, _interrupts
    if signum == signal.SIGINT:
        _interrupts += 1
        if _interrupts > 1:
            if _says():
                print("rmt: Ctrl-C again: quitting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGINT)
        if _says():
            print(
                "rmt: Ctrl-C: stopping after this step (with a checkpoint where train.save is set); "
                "Ctrl-C again quits at once",
                file=sys.stderr,
                flush=True,
            )
    _received = _received or signum


def install() -> None:
    """Route SIGTERM, SIGUSR1 and SIGINT to a stop request (main thread only, as Python
    requires)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _record)


def agreed_signal() -> Optional[str]:
    """The name of a stop signal any rank received (collective over the world), else None."""
    import torch  # not at import time: install() runs before the slow imports of a worker
    import torch.distributed as dist

    from rmt.parallel import compat

    flag = torch.tensor([_received], dtype=torch.int64, device=compat.device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return signal.Signals(int(flag.item())).name if int(flag.item()) else None
