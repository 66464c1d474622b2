"""Joining a job: the store the ranks of a process group meet in, and the roll call of nodes
that ``rmt.parallel.launcher`` holds before torch's rendezvous. Both wait a time the operator
sets and, when it expires, say exactly which ranks or nodes never came.

The process-group store is made here rather than by ``init_process_group(init_method=...)`` for
that reason, and so that restarted workers never meet what dead ones left in a store.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import List

import torch.distributed as dist

from rmt.errors import JobError
from rmt.parallel.launch_env import LaunchEnv, rank_locations


def wait_for_keys(store: dist.Store, keys: List[str], timeout: datetime.timedelta) -> List[int]:
    """Wait until every key is in ``store`` or ``timeout`` passes; returns the indices of the
    keys still missing. (Polls ``check``: a blocking ``wait`` that times out makes c10d print
    socket warnings.)"""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.01
    while True:
        missing = [i for i, key in enumerate(keys) if not store.check([key])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _await_server(host: str, port: int, timeout: datetime.timedelta) -> bool:
    """Whether ``host:port`` accepts connections within ``timeout`` (tried here, with plain
    sockets: c10d's client retries print a C++ stack for every attempt)."""
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.05
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def _tcp_store(
    host: str, port: int, serve: bool, world_size, timeout: datetime.timedelta, what: str, hint: str
) -> dist.TCPStore:
    """A TCPStore served here (``serve``) or a client of ``what`` at ``host:port``."""
    if not serve and not _await_server(host, port, timeout):
        raise JobError(f"could not reach {what} at {host}:{port} within {_duration(timeout)}; {hint}")
    try:
        return dist.TCPStore(
            host, port, world_size, is_master=serve, timeout=timeout, wait_for_workers=False, multi_tenant=True
        )
    except (RuntimeError, TimeoutError, ValueError) as err:
        detail = str(err).splitlines()[0][:200]
        where = f"serve {what} on port {port}" if serve else f"connect to {what} at {host}:{port}"
        raise JobError(f"cannot {where} ({detail})") from None


def process_group_store(launch: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """A store every rank of ``launch`` has joined (``parallel.join_timeout_minutes``); raises
    :class:`JobError` naming the ranks that did not join, and the nodes they belong on.

    Global rank 0 serves the store at MASTER_ADDR:MASTER_PORT, except under a torchrun that
    shares its own (``TORCHELASTIC_USE_AGENT_STORE``): that store outlives restarted workers
    and with them the addresses dead workers published, which a restarted gloo group then
    tries to reach ("Connection refused"). There each restart gets keys of its own; the restart
    count numbers attempts consistently only on one node, so several nodes should use
    ``launch/torchrun_multi_node.sh``, which gives every attempt a fresh store.
    """
    if launch.world_size == 1:
        return dist.HashStore()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = _tcp_store(
        launch.master_addr,
        launch.master_port,
        launch.rank == 0 and not agent_store,
        launch.world_size,
        timeout,
        "the rendezvous store",
        "check that rank 0 runs and that MASTER_ADDR/MASTER_PORT are right (parallel.join_timeout_minutes)",
    )
    if agent_store and os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
        store = dist.PrefixStore(f"rmt/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    keys = [f"rmt/joined/{r}" for r in range(launch.world_size)]
    store.set(keys[launch.rank], socket.gethostname())
    try:
        missing = wait_for_keys(store, keys, timeout)
    except (RuntimeError, TimeoutError) as err:
        raise JobError(
            f"lost the rendezvous store at {launch.master_addr}:{launch.master_port} while "
            f"waiting for the other ranks ({str(err).splitlines()[0][:200]})"
        ) from None
    if missing:
        located = rank_locations(launch.world_size)
        nodes = sorted({located[r] for r in missing}) if located else []
        on = f", expected on {', '.join(nodes)}" if nodes else ""
        raise JobError(
            f"{len(missing)} of {launch.world_size} ranks did not join the process group "
            f"within {_duration(timeout)} (parallel.join_timeout_minutes): "
            f"rank{'s' if len(missing) > 1 else ''} {_ranges(missing)}{on}"
        )
    return store


def roll_call(endpoint: str, nnodes: int, node_rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Every node announces its node rank in a store node 0 serves at ``endpoint``; returns the
    store once all ``nnodes`` have (node 0 must keep it for the job), else raises
    :class:`JobError` naming the missing node ranks."""
    host, _, port = endpoint.rpartition(":")
    limit = f"{_duration(timeout)} (JOIN_TIMEOUT / --join-timeout)"
    store = _tcp_store(
        host,
        int(port),
        node_rank == 0,
        None,
        timeout,
        "node 0's rendezvous",
        "check that launch/torchrun_multi_node.sh runs on node 0 and that "
        "MASTER_ADDR/MASTER_PORT are right (JOIN_TIMEOUT / --join-timeout)",
    )
    keys = [f"rmt-launch/node/{n}" for n in range(nnodes)]
    store.set(keys[node_rank], socket.gethostname())
    try:
        missing = wait_for_keys(store, keys, timeout)
        joined = [f"{n} ({store.get(k).decode()})" for n, k in enumerate(keys) if n not in missing]
    except (RuntimeError, TimeoutError):
        raise JobError(f"lost node 0's rendezvous at {endpoint} while waiting for the other nodes") from None
    if missing:
        raise JobError(
            f"{len(missing)} of {nnodes} nodes did not join the rendezvous at {endpoint} "
            f"within {limit}: node rank{'s' if len(missing) > 1 else ''} {_ranges(missing)} "
            f"missing (joined: {', '.join(joined)}); start launch/torchrun_multi_node.sh on "
            f"every node with its NODE_RANK and the same MASTER_ADDR/MASTER_PORT"
        )
    return store


def _duration(timeout: datetime.timedelta) -> str:
    seconds = timeout.total_seconds()
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} min"


def _ranges(ranks: List[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}-{r}" if r > start else f"{r}")
            start = None
    return ", ".join(parts)
