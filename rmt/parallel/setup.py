"""Bring up and tear down torch.distributed and megatron-core's parallel state.

The rendezvous store is made here rather than by ``init_process_group(init_method=...)`` so
that joining has its own time limit (``parallel.join_timeout_minutes``) and a failure names the
ranks that never came, and so that restarted workers never meet what dead ones left behind.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rmt.config import RMTConfig
from rmt.errors import JobError
from rmt.parallel import compat
from rmt.parallel.launch_env import LaunchEnv, rank_locations, read_launch_env


def initialize(config: RMTConfig) -> None:
    """Create the default process group (NCCL with CUDA, else gloo) and megatron-core's
    TP/PP/DP groups; seed every RNG. ``validate(config)`` must have run already."""
    compat.apply()
    launch = read_launch_env()
    if not dist.is_initialized():
        backend = config.parallel.backend
        if backend == "auto":
            backend = "nccl" if compat.cuda_available() else "gloo"
        if compat.cuda_available():
            torch.cuda.set_device(launch.local_rank)
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(
            backend=backend,
            store=rendezvous(launch, datetime.timedelta(minutes=config.parallel.join_timeout_minutes)),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(minutes=config.parallel.timeout_minutes),
        )
    p = config.parallel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        )
    compat.seed_model_parallel(config.train.seed)


def rendezvous(launch: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """A store every rank of ``launch`` has joined; raises :class:`JobError` naming the ranks
    that did not join within ``timeout``.

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
    where = f"{launch.master_addr}:{launch.master_port}"
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                              is_master=launch.rank == 0 and not agent_store, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, TimeoutError, ValueError) as err:
        serve = launch.rank == 0 and not agent_store
        raise JobError(
            (f"cannot serve the rendezvous store on {where}" if serve else
             f"could not reach the rendezvous store at {where} (served by rank 0) within "
             f"{_minutes(timeout)} (parallel.join_timeout_minutes); check that rank 0 started and "
             f"that MASTER_ADDR/MASTER_PORT are right") + f": {str(err).splitlines()[0][:200]}") from None
    if agent_store and os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE"):
        store = dist.PrefixStore(f"rmt/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    keys = [f"rmt/joined/{r}" for r in range(launch.world_size)]
    store.set(keys[launch.rank], socket.gethostname())
    try:
        store.wait(keys, timeout)
    except (RuntimeError, TimeoutError) as err:
        raise JobError(_missing_ranks(store, keys, launch, timeout, err)) from None
    return store


def _missing_ranks(store, keys: List[str], launch: LaunchEnv, timeout, err) -> str:
    try:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    except (RuntimeError, TimeoutError):
        return (f"lost the rendezvous store at {launch.master_addr}:{launch.master_port} while "
                f"waiting for the other ranks to join ({str(err).splitlines()[0][:200]})")
    located = rank_locations(launch.world_size)
    nodes = sorted({located[r] for r in missing}) if located else []
    on = f", expected on {', '.join(nodes)}" if nodes else ""
    return (f"{len(missing)} of {launch.world_size} ranks did not join the process group within "
            f"{_minutes(timeout)} (parallel.join_timeout_minutes): rank{'s' if len(missing) > 1 else ''} "
            f"{_ranges(missing)}{on}")


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"


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


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
