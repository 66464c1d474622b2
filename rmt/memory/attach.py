"""Attach memory layers to an architecture by config (``memory.*``), with forward hooks.

An architecture only has to expose its blocks: either a method ``memory_hook_layers()``
returning ``(layers, seq_dim)`` (the list of global layers 1..L of this chunk, and the sequence
dimension of their hidden states), or megatron's ``decoder.layers`` (GPTModel; ``[s, b, h]``).
A block's output may be a tensor or a tuple whose first element is the hidden state. For the
placement ``i:j`` the hook on layer i keeps its output and the hook on layer j adds
``memory(kept)`` to its output (UltraMem §3.2 "skip-layer" structure, Appendix E notation).
Hidden states with more than one feature dimension (the RMT's residual matrix ``[s, b, Dv, Dk]``)
are flattened for the memory layer (width :func:`~rmt.memory.validate.memory_width`) and its
output is viewed back: the memory reads the whole matrix and writes a full-matrix update.

Memory layers are replicated across tensor-parallel ranks (every TP rank holds the full hidden
state without sequence parallelism, so they compute the same result and receive the same
gradients). Pipeline parallelism is rejected by the config validation. With
``memory.partition`` other than ``local`` the value tables are sharded over the
memory-parallel group (:mod:`rmt.memory.groups`, :mod:`rmt.memory.sharded_table`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Dict, List, Optional

import torch
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rmt.memory.groups import memory_parallel_groups
from rmt.memory.layer import MemoryLayer, MemorySpec
from rmt.memory.moe import MoELayer
from rmt.memory.stream import MemoryStream
from rmt.memory.table import MemoryTable
from rmt.memory.validate import memory_width, parse_placement
from rmt.parallel import compat


def build_memory_layer(config, index: int) -> torch.nn.Module:
    """The ``index``-th memory module of ``config`` (UltraMem, PKM or MoE)."""
    mem, m = config.memory, config.model
    if mem.type == "moe":
        width = memory_width(config)
        return MoELayer(width, mem.num_experts,
                        mem.expert_hidden_size or 2 * (m.ffn_hidden_size or 4 * width) // mem.moe_topk,
                        mem.moe_topk, mem.balance_loss_weight, m.init_std, m.num_layers)
    layer = MemoryLayer(MemorySpec.from_config(config, index))
    if mem.partition != "local":
        group, replica_group, replica_index = memory_parallel_groups(mem.group_size)
        s = layer.spec
        layer.values = MemoryTable(
            s.num_values, s.value_dim, layer.values.weight.memory_init_std, mem.partition, group,
            owner_reduce=mem.owner_reduce, replica_index=replica_index, replica_group=replica_group,
            plan={"tokens": config.train.micro_batch_size * m.seq_length, "topm": s.num_heads * s.topk,
                  "ive": s.ive_blocks, "cores": s.num_cores})
    return layer


class MemoryModules(torch.nn.ModuleList):
    """The memory layers of a chunk. Its ``sharded_state_dict`` lets sharded tables describe
    their own shards; every other tensor is replicated (megatron's default)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        out = {}
        for name, module in self.named_modules():
            sub = f"{prefix}{name}." if name else prefix
            if isinstance(module, MemoryTable):
                out.update(module.sharded_state_dict(sub, sharded_offsets, metadata))
            else:
                own = dict(module.named_parameters(prefix="", recurse=False))
                own.update((n, b) for n, b in module.named_buffers(recurse=False)
                           if n not in module._non_persistent_buffers_set)
                out.update(make_sharded_tensors_for_checkpoint(own, sub, {}, sharded_offsets))
        return out


def _hook_layers(chunk: torch.nn.Module):
    if hasattr(chunk, "memory_hook_layers"):
        return chunk.memory_hook_layers()
    return chunk.decoder.layers, 0


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, hidden):
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


class MemoryWiring:
    """The hooks of one chunk: ``placement`` pairs -> ``chunk.memory[k]``. With ``stream``
    (:class:`~rmt.memory.stream.MemoryStream`, ``memory.async_stream``) memory layer k starts
    at layer i's hook and is joined at layer j's; without it, it runs at layer j's hook
    (``sync_s`` accumulates that time)."""

    def __init__(self, chunk: torch.nn.Module, placement: List, seq_dim: int, layers,
                 stream: Optional[MemoryStream] = None):
        self.placement, self.seq_dim, self.stream = placement, seq_dim, stream
        self.modules = chunk.memory
        self.kept: Dict[int, torch.Tensor] = {}
        self.pending: Dict[int, object] = {}
        self.sync_s = 0.0
        self.handles = []
        starts = {i for i, _ in placement}
        for number in sorted(starts | {j for _, j in placement}):
            self.handles.append(layers[number - 1].register_forward_hook(self._hook(number, number in starts)))

    def _run(self, k: int, x: torch.Tensor) -> torch.Tensor:
        x = x if self.seq_dim == 0 else x.transpose(0, self.seq_dim)
        # Flattened to [s, b, width]: the RMT's residual is a Dv x Dk matrix per token.
        y = self.modules[k](x.flatten(2)).view(x.shape)
        return y if self.seq_dim == 0 else y.transpose(0, self.seq_dim)

    def _hook(self, number: int, keep: bool) -> Callable:
        def hook(module, args, output):
            hidden = _hidden(output)
            if keep:
                self.kept[number] = hidden
                if self.stream is not None:
                    for k, (i, _) in enumerate(self.placement):
                        if i == number:
                            self.pending[k] = self.stream.launch(partial(self._run, k), hidden)
            added = None
            for k, (i, j) in enumerate(self.placement):
                if j != number:
                    continue
                if self.stream is not None:
                    y = self.stream.wait(self.pending.pop(k))
                else:
                    start = time.perf_counter()
                    y = self._run(k, self.kept[i])
                    self.sync_s += time.perf_counter() - start
                added = y if added is None else added + y
            if number == max(j for _, j in self.placement):
                self.kept.clear()
            return None if added is None else _replace_hidden(output, hidden + added)

        return hook


def attach_memory(chunks: List[torch.nn.Module], config,
                  std_rule: Callable[[str, torch.Tensor], Optional[float]]):
    """Add ``config.memory`` layers to every chunk (as ``chunk.memory``, a ModuleList, so they
    are in the chunk's parameters and ``sharded_state_dict``) and return the init rule that
    gives memory parameters their own std (``memory_init_std``; None keeps the module's init)."""
    placement = parse_placement(config.memory.placement, config.model.num_layers)
    for chunk in chunks:
        layers, seq_dim = _hook_layers(chunk)
        chunk.memory = MemoryModules(build_memory_layer(config, k) for k in range(len(placement)))
        stream = MemoryStream(compat.device()) if config.memory.async_stream else None
        chunk.memory_wiring = MemoryWiring(chunk, placement, seq_dim, layers, stream)

    def rule(key: str, param: torch.Tensor) -> Optional[float]:
        if hasattr(param, "memory_init_std"):
            return param.memory_init_std
        return std_rule(key, param)

    return rule


def memory_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (MemoryLayer, MoELayer))]


def pop_aux_loss(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """Sum of the auxiliary losses (TDQKR Eq. 12, MoE balance) of the last forward; clears them."""
    total = None
    for m in memory_modules(model):
        if m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
            m.aux_loss = None
    return total


def pop_memory_stats(chunks: List[torch.nn.Module], group=None) -> Dict[str, float]:
    """``memory/layer{k}/<stat>`` slot-usage scalars since the last call (collective over
    ``group``); empty without UltraMem/PKM layers."""
    out = {}
    layers = [m for c in chunks for m in memory_modules(c) if isinstance(m, MemoryLayer)]
    for k, layer in enumerate(layers):
        for name, value in layer.pop_stats(group).items():
            out[f"memory/layer{k}/{name}"] = value
    return out
