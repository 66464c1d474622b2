"""The per-step logs of a run that may be a restart: the JSONL file (``train.log_file``) and
TensorBoard scalars (``train.tensorboard_dir``).

Every run writes its TensorBoard events into a subdirectory of its own,
``train.tensorboard_dir/<run name>``; the name (start time and process id) is kept in the run's
checkpoints, so a restart continues the curves of the run it resumes, and runs of one config
never mix.

A run that resumes from the checkpoint of step N runs steps N+1... again, so whatever an
interrupted attempt logged after step N is dropped: every step appears once in both logs.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Optional, Tuple


def open_jsonl(path: str, last_step: int) -> Tuple[IO[str], int]:
    """Open ``path`` for appending after removing entries of steps after ``last_step`` (and a
    line torn by a kill). Returns the file and how many entries were dropped."""
    kept, dropped = [], 0
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    step = None
                if step is not None and step <= last_step and line.endswith("\n"):
                    kept.append(line)
                else:
                    dropped += 1
        if dropped:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return open(path, "a"), dropped


def new_run_name() -> str:
    """The name of a run started now: ``YYYYmmdd-HHMMSS-<pid>``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def run_log_dir(tensorboard_dir: str, run_name: str) -> str:
    """The TensorBoard directory of run ``run_name``."""
    return os.path.join(tensorboard_dir, run_name)


def open_tensorboard(path: Optional[str], last_step: int):
    """A SummaryWriter for ``path`` (None without one) that hides the events an interrupted
    attempt wrote for steps after ``last_step`` (TensorBoard's ``purge_step``)."""
    if not path:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(path, purge_step=last_step + 1)
