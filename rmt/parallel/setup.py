"""Bring up and tear down torch.distributed and megatron-core's parallel state, and tell a
collective that failed because a peer rank went away (:func:`lost_peer`)."""

from __future__ import annotations

import datetime
import os
import re
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from rmt.config import RMTConfig
from rmt.parallel import compat
from rmt.parallel.launch_env import read_launch_env
from rmt.parallel.rendezvous import process_group_store


def initialize(config: RMTConfig) -> None:
    """Create the default process group (NCCL with CUDA, else gloo) and megatron-core's
    TP/PP/DP groups and its expert (EP, expert-TP, expert-DP) groups; seed every RNG. ``validate(config)`` must have run already."""
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
        # NCCL bound to this rank's GPU: otherwise it guesses the device from the global rank and
        # warns at every barrier (seen on an H100)
        device = {"device_id": torch.device("cuda", launch.local_rank)} if backend == "nccl" else {}
        dist.init_process_group(
            backend=backend,
            **device,
            store=process_group_store(launch, datetime.timedelta(minutes=config.parallel.join_timeout_minutes)),
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
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        )
    compat.seed_model_parallel(config.train.seed)


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def lost_peer(err: BaseException) -> Optional[str]:
    """The reason, in a few words, when ``err`` is a collective that failed because a peer rank
    went away or stopped answering (gloo's closed connections, a process group's timeout), else
    None. The surviving ranks of a killed one meet this in their next collective, at once when
    the peer's connections close, or after ``parallel.timeout_minutes`` when it hangs."""
    text = str(err)
    peer = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out", "timed out")
    if not (isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and "gloo" in text)):
        return None
    if isinstance(err, dist.DistError) or any(p in text for p in peer):
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        return re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]
    return None
