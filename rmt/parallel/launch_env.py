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
from typing import List, Optional


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str


def expand_nodelist(nodelist: str) -> List[str]:
    """Every host of a SLURM node list, in order (``node[03-05,7],gpu1`` -> node03, node04,
    node05, node7, gpu1); zero padding of a range is kept."""
    hosts = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", nodelist.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    if not hosts:
        raise ValueError(f"cannot parse SLURM_NODELIST '{nodelist}'")
    return hosts


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list (``node[03-05,7],gpu1`` -> ``node03``).

    ``scontrol show hostnames`` is asked first; the parser above covers machines without it.
    """
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_nodelist(nodelist)[0]


def rank_locations(world_size: int, environ=None) -> Optional[List[str]]:
    """Where each rank runs, as the launcher laid them out (``node 1`` under torchrun, ``node 1
    (gpu02)`` under SLURM's block distribution); None when the launcher does not say."""
    env = os.environ if environ is None else environ
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        per_node = int(env["LOCAL_WORLD_SIZE"])
        return [f"node {r // per_node}" for r in range(world_size)]
    if env.get("SLURM_TASKS_PER_NODE") and env.get("SLURM_JOB_NODELIST"):
        hosts = expand_nodelist(env["SLURM_JOB_NODELIST"])
        counts = []
        for part in env["SLURM_TASKS_PER_NODE"].split(","):  # e.g. "4(x2),2"
            m = re.match(r"(\d+)(?:\(x(\d+)\))?$", part)
            counts += [int(m.group(1))] * int(m.group(2) or 1) if m else []
        where = [f"node {n} ({hosts[n]})" for n, c in enumerate(counts[: len(hosts)]) for _ in range(c)]
        return where if len(where) == world_size else None
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_launch_env(environ=None) -> LaunchEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
            "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1"))
        job = int(env.get("SLURM_JOB_ID", "0"))
        port = int(env.get("MASTER_PORT", 20000 + job % 10000))
        return LaunchEnv(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm"
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", _free_port(), "single")


def world_size_from_env() -> int:
    """The launcher's world size (torchrun or SLURM), 1 when launched as a plain process."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1
