"""The gated feed-forward layer (``model.gated_linear_unit``; Shazeer, "GLU Variants Improve
Transformer", 2020, Eq. 5-6: ``FFN(x) = (act(x W) * (x V)) W2``, SwiGLU with ``act = SiLU``).

megatron-core's ``MLP`` computes it: its first linear is one column-parallel weight whose rows on
each tensor-parallel rank are that rank's slice of ``W`` followed by its slice of ``V``. Its
checkpoint entry describes that weight through a ``ShardedTensorFactory``, which splits it in two
at save time. rmt maps every parameter to one piece of one global tensor
(:mod:`rmt.parallel.sharding`: the layout-independent init, the gathered weights and gradients,
the optimizer's checkpointed states), so :class:`GatedMLP` describes the same weight as one piece
of a ``[2, F, D]`` global tensor (``W`` and ``V`` stacked): the rank's rows viewed as ``[2, F/t,
D]`` at offset ``(0, r F/t, 0)``, a box of the global tensor. The computation is megatron's.
"""

from __future__ import annotations

import dataclasses

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from rmt.config import RMTConfig


def stacked_halves(sh: ShardedTensor) -> ShardedTensor:
    """``sh``, a rank's rows of a gated first linear's weight or bias (its slice of ``W`` then its
    slice of ``V``), as a piece of the global ``[2, F, ...]`` stack of ``W`` and ``V``."""
    pre = sh.prepend_axis_num
    rows = sh.local_shape[0] // 2
    rank = sh.global_offset[pre] // sh.local_shape[0]
    data = sh.data.view(2, rows, *sh.local_shape[1:])
    return dataclasses.replace(
        sh,
        data=data,
        local_shape=tuple(data.shape),
        global_shape=sh.global_shape[:pre] + (2, sh.global_shape[pre] // 2) + sh.global_shape[pre + 1 :],
        global_offset=sh.global_offset[:pre] + (0, rank * rows) + sh.global_offset[pre + 1 :],
        axis_fragmentations=sh.axis_fragmentations[:pre] + (1,) + sh.axis_fragmentations[pre:],
    )


class GatedMLP(MLP):
    """megatron-core's gated ``MLP`` whose first linear is checkpointed as one piece of the
    ``[2, F, D]`` stack of its two halves (module docstring)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        out = {}
        for name, module in self._modules.items():
            sub = module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "linear_fc1":
                halves = (f"{prefix}{name}.weight", f"{prefix}{name}.bias")
                sub = {k: stacked_halves(v) if k in halves else v for k, v in sub.items()}
            out.update(sub)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A checkpoint's pieces of the stack come back ``[2, F/t, ...]``: the first linear's rows."""
        for name, param in self.linear_fc1.named_parameters(recurse=False):
            key = f"{prefix}linear_fc1.{name}"
            if key in state_dict:
                state_dict[key] = state_dict[key].reshape(param.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def with_gated_mlp(layer_spec: ModuleSpec, config: RMTConfig) -> ModuleSpec:
    """``layer_spec`` (a megatron-core transformer layer spec) with :class:`GatedMLP` as its
    feed-forward layer under ``model.gated_linear_unit``."""
    if not config.model.gated_linear_unit:
        return layer_spec
    mlp = dataclasses.replace(layer_spec.submodules.mlp, module=GatedMLP)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
