"""Rank, world size and rendezvous address from the launcher's environment.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; under ``srun`` SLURM sets
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODELIST. A plain ``python`` process is a world of
one on a free local port.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list (``node[03-05,7],gpu1`` -> ``node03``).

    ``scontrol show hostnames`` is asked first; the parser below covers machines without it.
    """
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"cannot parse SLURM_NODELIST '{nodelist}'")
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launch_env(environ=None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                         "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1"))
        job = int(env.get("SLURM_JOB_ID", "0"))
        port = int(env.get("MASTER_PORT", 20000 + job % 10000))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm")
    return LaunchEnv(0, 1, 0, "127.0.0.1", _free_port(), "single")
