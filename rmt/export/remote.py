"""rmt's architectures as ``trust_remote_code`` model directories (:mod:`rmt.export.hf_model`):
the config with the checkpoint's full rmt config and an ``auto_map`` to the code files copied
beside the weights, and the single-process state dict of rmt's module as it is."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Dict

import torch

from rmt.config import RMTConfig, to_dict

if TYPE_CHECKING:
    from rmt.export.weights import Streamed

CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_code")
AUTO_MAP = {"AutoConfig": "configuration_rmt.RMTHFConfig", "AutoModelForCausalLM": "modeling_rmt.RMTForCausalLM"}


def remote_config(config: RMTConfig, eod: int):
    from rmt.export.hf_model import RMTHFConfig

    rmt = to_dict(config)
    rmt["train"].update(load=None, save=None)
    cfg = RMTHFConfig(rmt=rmt, bos_token_id=eod, eos_token_id=eod, architectures=["RMTForCausalLM"])
    cfg.auto_map = dict(AUTO_MAP)
    return cfg


def remote_state_dict(model: torch.nn.Module, skip=()) -> Dict[str, torch.Tensor]:
    """``model.<key>`` for every tensor of the module's single-process state dict but ``skip``
    (megatron's ``_extra_state`` entries hold no tensor and are left out)."""
    return {
        f"model.{k}": v.detach().contiguous().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and k not in skip
    }


def streamed_tables(root: str, model: torch.nn.Module, chunk_bytes: int) -> Dict[str, Streamed]:
    """``model.<key>`` of every memory value table of ``model``, streamed from the checkpoint
    directory ``root`` (:func:`rmt.export.weights.table_rows`)."""
    from rmt.export.weights import table_rows
    from rmt.training.table_checkpoint import table_shards

    return {f"model.{s.name}": table_rows(root, s.key, s.global_shape, chunk_bytes) for s in table_shards([model])}


def copy_code(out: str) -> None:
    for name in sorted(os.listdir(CODE)):
        if name.endswith(".py"):
            shutil.copy(os.path.join(CODE, name), os.path.join(out, name))
