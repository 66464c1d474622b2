"""Attach memory layers to an architecture by config (``memory.*``), with forward hooks.

An architecture only has to expose its blocks: either a method ``memory_hook_layers()``
returning ``(layers, seq_dim)`` (the list of global layers 1..L of this chunk, and the sequence
dimension of their hidden states), or megatron's ``decoder.layers`` (GPTModel; ``[s, b, h]``).
A block's output may be a tensor or a tuple whose first element is the hidden state. For the
placement ``i:j`` the hook on layer i keeps its output and the hook on layer j adds
``memory(kept)`` to its output (UltraMem §3.2 "skip-layer" structure, Appendix E notation).
UltraMemV2 (``memory.type: ultramem_v2``) sits beside the FFN, placed ``i:i``: its input is kept
from inside layer i, the layer's normed FFN input (:func:`_ffn_input`; a norm the memory applies
itself, the RMT's, runs in the dense graph, :meth:`MemoryWiring._read`), and its output is added
to layer i's output.
Hidden states with more than one feature dimension (the RMT's residual matrix ``[s, b, Dv, Dk]``)
are flattened for the memory layer (width :func:`~rmt.memory.shapes.memory_width`) and its
output is viewed back: the memory reads the whole matrix and writes a full-matrix update.

Memory layers are replicated across tensor-parallel ranks (every TP rank holds the full hidden
state without sequence parallelism, so they compute the same result and receive the same
gradients). Under ``parallel.sequence_parallel`` a rank holds ``1 / TP`` of the sequence (layer
i's output, or UltraMemV2's pre-MLP norm output): the memory layer's input is all-gathered over
the TP group first and each rank adds its own share of the output, so the memory layers compute
and receive exactly what they do under TP alone.
Under ``train.recompute_granularity: full`` the hooks of a recomputed span fire again in the
backward: every memory layer runs once, in the span's forward, on a graph of its own (the
stream's links, :class:`~rmt.memory.stream.InlineStream` without the async stream), each hook
records the links it forked or joined, and the span's recomputation puts them back into its
graph at the same hooks (:meth:`MemoryWiring._relink`: UltraMemV2's fork at its input module's
output, its join at layer i's output) instead of running retrieval and collectives twice.
Under pipeline parallelism every placement lies inside one model chunk (a stage, or
a virtual stage of the interleaved schedule; checked by the config validation); its memory layer
is built only in that chunk, hooked on the chunk's local layers, and keeps its global index ``k``
(``memory.k.*`` keys as in the single-stage run). The loss is computed in the last chunk of the
last stage only, so in earlier chunks the auxiliary losses ride on the
hidden state (:class:`AuxLossToActivation`, megatron-core's ``MoEAuxLossAutoScaler`` trick);
with the async stream in training they backpropagate with the memory layer's own graph instead
(:mod:`rmt.memory.stream`), on every stage at the schedule's loss scale. With
``memory.partition`` other than ``local`` the value tables are sharded over the
memory-parallel group (:mod:`rmt.memory.groups`, :mod:`rmt.memory.distribution`).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict, deque
from functools import partial
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rmt.memory.byte_sizes import lookup_bytes
from rmt.memory.descriptor import is_table
from rmt.memory.groups import memory_parallel_groups
from rmt.memory.layer import MemoryLayer, MemorySpec
from rmt.memory.layer_v2 import UltraMemV2Layer
from rmt.memory.moe import SkipMoE, moe_modules, set_aux_loss_scale
from rmt.memory.shapes import memory_placement, stage_layers
from rmt.memory.stream import ForkMemory, InlineStream, JoinMemory, MemoryLink, MemoryStream
from rmt.memory.table import MemoryTable
from rmt.models.documents import document_starts
from rmt.parallel import compat


def build_memory_layer(config, index: int, base=None) -> torch.nn.Module:
    """The ``index``-th memory module of ``config`` (UltraMem, UltraMemV2, PKM or a skip-placed
    MoE, which takes the model's megatron ``TransformerConfig`` ``base``)."""
    mem, m = config.memory, config.model
    if mem.type == "moe":
        return SkipMoE(config, base)
    spec = MemorySpec.from_config(config, index)
    v2 = spec.version == 2
    sharding = {"device": compat.device(), "location": mem.table_location}
    pre_sharding = dict(sharding)
    if mem.partition != "local":
        group, replica_group, replica_index, split_group = memory_parallel_groups(mem.group_size)
        tokens, topm = config.train.micro_batch_size * m.seq_length, spec.num_heads * spec.topk
        activation_bytes = lookup_bytes(config.train.precision, mem.value_dtype)
        sharding.update(
            partition=mem.partition,
            group=group,
            owner_reduce=mem.owner_reduce,
            replica_index=replica_index,
            replica_group=replica_group,
            split_group=split_group,
            plan={
                "tokens": tokens,
                "topm": topm,
                "ive": 1 if v2 else spec.ive_blocks,
                "cores": spec.num_cores,
                "activation_bytes": activation_bytes,
            },
        )
        # UltraMemV2's pre-values: one lookup of score 1 per retrieved row (UltraMemV2Layer.gates)
        pre_sharding = dict(
            sharding,
            plan={"tokens": tokens * topm, "topm": 1, "ive": 1, "cores": 1, "activation_bytes": activation_bytes},
        )
    if v2:
        return UltraMemV2Layer(
            spec, spec.table(**sharding), spec.pre_table(**pre_sharding) if spec.pre_value_dim else None
        )
    return MemoryLayer(spec, spec.table(**sharding))


class MemoryModules(torch.nn.Module):
    """The memory layers of a chunk, indexed (and named, ``memory.k.*``) by their global
    placement index k, so that a pipeline stage holding only some of them uses the keys of the
    single-stage run; iterating gives the layers. Its ``sharded_state_dict`` lets sharded
    tables and megatron modules (the MoE: experts at their global indices) describe their own
    shards; every other tensor is replicated (megatron's default)."""

    def __init__(self, modules: Dict[int, torch.nn.Module]):
        super().__init__()
        for k, module in modules.items():
            self.add_module(str(k), module)

    def __getitem__(self, k: int) -> torch.nn.Module:
        return self._modules[str(k)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        out = {}
        delegated = [f"{k}." for k, module in self._modules.items() if isinstance(module, MegatronModule)]
        for name, module in self.named_modules():
            sub = f"{prefix}{name}." if name else prefix
            if any(f"{name}.".startswith(d) for d in delegated):
                if f"{name}." in delegated:
                    out.update(module.sharded_state_dict(sub, sharded_offsets, metadata))
            elif isinstance(module, MemoryTable):
                out.update(module.sharded_state_dict(sub, sharded_offsets, metadata))
            else:
                own = dict(module.named_parameters(prefix="", recurse=False))
                own.update(
                    (n, b)
                    for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set
                )
                out.update(make_sharded_tensors_for_checkpoint(own, sub, {}, sharded_offsets))
        return out


def _hook_layers(chunk: torch.nn.Module):
    if hasattr(chunk, "memory_hook_layers"):
        return chunk.memory_hook_layers()
    return chunk.decoder.layers, 0


def _ffn_input(layer):
    """Where UltraMemV2 reads ``layer``'s FFN input: the module whose output it is kept from
    and the map from that output to the normed FFN input (None: the output itself). Megatron's
    transformer layer: its pre-MLP norm. The RMT's layer: its ``ffn_input`` (the residual before
    the feed-forward, whose norm is fused into the read), then the layer's own ``ff_norm``."""
    if hasattr(layer, "ffn_input"):
        return layer.ffn_input, layer.ff_norm
    return layer.pre_mlp_layernorm, None


def _hidden(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output, hidden):
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


class AuxLossToActivation(torch.autograd.Function):
    """Identity on ``hidden`` whose backward also gives ``aux`` the gradient ``scale`` (the
    schedule's loss scale, ``1 / num_microbatches``): an auxiliary loss of a stage without
    the loss function enters backward as if added to it (megatron-core's
    ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return hidden

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MemoryWiring:
    """The hooks of one chunk: ``placement`` (global index k -> local layers ``(i, j)``) ->
    ``chunk.memory[k]``. With ``stream`` (:class:`~rmt.memory.stream.MemoryStream`,
    ``memory.async_stream``) memory layer k starts at layer i's hook and is joined at layer
    j's, and in training its backward runs on the stream too (:meth:`_launch`, :meth:`_join`);
    without it, it runs at layer j's hook (``sync_s`` accumulates that time). With
    ``aux_scale`` (a stage before the last) the auxiliary losses of the memory layers are
    attached to layer j's output (:class:`AuxLossToActivation`). ``inputs`` (UltraMemV2, placed
    ``i:i``): layer number i -> ``(module, transform)``, the input is kept from that module
    inside layer i (:func:`_ffn_input`) instead of layer i's output, and ``transform`` (or
    None) is applied to it in the dense graph, before the memory layer's own (:meth:`_read`)."""

    def __init__(
        self,
        chunk: torch.nn.Module,
        placement: Dict[int, Tuple[int, int]],
        seq_dim: int,
        layers,
        stream: Optional[MemoryStream] = None,
        aux_scale: Optional[float] = None,
        loss_scale: float = 1.0,
        sequence_parallel: bool = False,
        inputs: Optional[Dict[int, Tuple[torch.nn.Module, Callable]]] = None,
    ):
        self.placement, self.seq_dim, self.stream, self.aux_scale = placement, seq_dim, stream, aux_scale
        self.loss_scale, self.sequence_parallel = loss_scale, sequence_parallel
        self.modules = chunk.memory
        self.kept: Dict[int, torch.Tensor] = {}
        self.pending: Dict[int, object] = {}
        self.sync_s = 0.0
        self.documents: Optional[torch.Tensor] = None
        self.recording = False
        # Links made in a recomputed span's first forward, per hook (its site: the layer number
        # and whether it is the layer's output hook), oldest first, each with whether the hook
        # forked it (True) or joined it, for the span's recomputation in the backward
        # (micro-batches run backward in their forward order under every megatron schedule, per
        # model chunk).
        self.relink: Dict[Tuple[int, bool], Deque[List[Tuple[int, MemoryLink, bool]]]] = defaultdict(deque)
        self.handles = [chunk.register_forward_pre_hook(self.capture_documents, with_kwargs=True)]
        inputs = inputs or {}
        self.transforms = {
            k: inputs[i][1] for k, (i, _) in placement.items() if i in inputs and inputs[i][1] is not None
        }
        starts = {i for i, _ in placement.values()}
        for number in sorted(starts | {j for _, j in placement.values()}):
            keep = number in starts
            if keep and number in inputs:
                self.handles.append(inputs[number][0].register_forward_hook(self._hook(number, True, join=False)))
                keep = False
            self.handles.append(layers[number - 1].register_forward_hook(self._hook(number, keep)))

    def capture_documents(self, module, args, kwargs) -> None:
        """Forward pre-hook of the chunk: the document starts of its attention mask (argument
        ``attention_mask``, the third positional one), for the memory layers' query convolution
        (:mod:`rmt.models.documents`; None without document boundaries)."""
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        self.documents = document_starts(mask)
        # A training forward: the one whose recomputed spans run again in its backward (inside
        # a span grad mode is off, whatever the schedule's).
        self.recording = torch.is_grad_enabled() and module.training

    def _read(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Memory layer k's input from the kept tensor: its ``transform`` (the RMT's FFN norm)
        applied, on the dense side (the norm's weight gets its gradient from the dense graph)."""
        return self.transforms[k](hidden) if k in self.transforms else hidden

    def _run(self, k: int, x: torch.Tensor, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x if self.seq_dim == 0 else x.transpose(0, self.seq_dim)
        module = self.modules[k]
        extra = {"documents": documents} if documents is not None and isinstance(module, MemoryLayer) else {}
        # Flattened to [s, b, width]: the RMT's residual is a Dv x Dk matrix per token.
        y = module(x.flatten(2), **extra).view(x.shape)
        return y if self.seq_dim == 0 else y.transpose(0, self.seq_dim)

    def _gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The memory layers' input: under sequence parallelism the whole sequence, all-gathered
        over the tensor-parallel group (backward: this rank's share of the gradient, which every
        rank's replicated memory layer computes whole)."""
        if not self.sequence_parallel:
            return hidden
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)

    @staticmethod
    def _fork(hidden: torch.Tensor, link: MemoryLink, read: torch.Tensor) -> torch.Tensor:
        """``hidden`` behind the :class:`~rmt.memory.stream.ForkMemory` of ``link``, whose input
        gradient goes to ``read`` (:meth:`_read` of ``hidden``, in the dense graph)."""
        return ForkMemory.apply(hidden, link, None if read is hidden else read)

    def _launch(self, k: int, hidden: torch.Tensor, checkpointed: bool) -> Tuple[torch.Tensor, Optional[MemoryLink]]:
        """Start memory layer k on the stream from ``hidden`` (transformed, :meth:`_read`); when
        training, on a detached copy (its own graph, :class:`~rmt.memory.stream.MemoryLink`),
        returning ``hidden`` behind a :class:`~rmt.memory.stream.ForkMemory` that collects its
        input gradient. In the first forward of a recomputed span (``checkpointed``: grad mode
        off) the memory layer still records its graph, and the fork is made when the span is
        recomputed (:meth:`_relink`)."""
        link = None
        read = self._read(k, hidden)
        x = self._gather(read)
        if self.recording and (checkpointed or hidden.requires_grad):
            x = x.detach().requires_grad_()
            link = MemoryLink(self.stream, x, self.sequence_parallel)
            if not checkpointed:
                hidden = self._fork(hidden, link, read)
        with torch.enable_grad() if link is not None else contextlib.nullcontext():
            self.pending[k] = (self.stream.launch(partial(self._run, k, documents=self.documents), x), link)
        return hidden, link

    def _join(
        self, k: int, hidden: torch.Tensor, links: List[Tuple[int, MemoryLink, bool]]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``hidden`` plus memory layer k's output from the stream. With a link (noted in
        ``links`` as joined here), the output and the auxiliary loss (its gradient at the
        schedule's loss scale) backpropagate on the stream and the module keeps the loss detached,
        for the reported value only; otherwise the output is returned for the caller to add, with
        ``hidden`` unchanged."""
        pending, link = self.pending.pop(k)
        y = self.stream.wait(pending)
        if link is None:
            return hidden, self._local(y)
        links.append((k, link, False))
        module = self.modules[k]
        link.outputs = [y]
        if module.aux_loss is not None:
            link.outputs.append(module.aux_loss)
            link.aux_grads = [torch.full_like(module.aux_loss, self.loss_scale)]
            module.aux_loss = None if self.aux_scale is not None else module.aux_loss.detach()
        return JoinMemory.apply(hidden, link.local_output(), link), None

    def _local(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's share of a memory output under sequence parallelism (backward: the
        all-gathered gradient)."""
        return scatter_to_sequence_parallel_region(y) if self.sequence_parallel else y

    def _relink(self, site: Tuple[int, bool], output):
        """A hook's call when its span is recomputed in the backward (``site``: the layer number
        and whether it is the layer's output hook): the memory layers ran once, in the span's
        first forward; the links that hook made then (oldest first) enter the recomputed graph
        exactly where they were made, a fork or a join, so no retrieval and no memory collective
        runs again."""
        hidden = _hidden(output)
        number, _ = site
        assert self.relink[site], f"layer {number} recomputed without a forward that recorded its memory layers"
        for k, link, fork in self.relink[site].popleft():
            if fork:
                hidden = self._fork(hidden, link, self._read(k, hidden))
            else:
                hidden = JoinMemory.apply(hidden, link.local_output(), link)
        return _replace_hidden(output, hidden)

    def _hook(self, number: int, keep: bool, join: bool = True) -> Callable:
        """The forward hook of layer ``number``'s output (``join``: it adds the memory layers
        placed ``i:number``), or of the module inside the layer that UltraMemV2 reads
        (``join=False``); ``keep``: the memory layers placed ``number:j`` start from its output."""
        site = (number, join)

        def hook(module, args, output):
            if is_checkpointing() and torch.is_grad_enabled():  # a span recomputed in the backward
                return self._relink(site, output)
            return self._forward(site, keep, output)

        return hook

    def _forward(self, site: Tuple[int, bool], keep: bool, output):
        """A hook's call in a forward (``site``: the layer number and whether it is the layer's
        output hook): the memory layers placed there start (:meth:`_start`) and those ending there
        are added (:meth:`_finish`). In a recomputed span's first forward (under no_grad) of a
        training step the memory layers record their graphs on links (the stream, or
        InlineStream without it), and the hook notes each link it forks or joins, for the
        recomputation (:meth:`_relink`)."""
        number, join = site
        checkpointed = is_checkpointing() and self.recording
        links: List[Tuple[int, MemoryLink, bool]] = []
        hidden = original = _hidden(output)
        if keep:
            hidden = self._start(number, hidden, checkpointed, links)
        added, aux = None, None
        if join:
            hidden, added, aux = self._finish(number, hidden, links)
        if checkpointed and links:
            self.relink[site].append(links)
        if join and number == max(j for _, j in self.placement.values()):
            self.kept.clear()
        return self._output(output, original, hidden, added, aux)

    def _start(
        self, number: int, hidden: torch.Tensor, checkpointed: bool, links: List[Tuple[int, MemoryLink, bool]]
    ) -> torch.Tensor:
        """The memory layers placed ``number:j`` start from ``hidden``: launched on the stream
        (:meth:`_launch`; each link noted in ``links`` as forked here), or kept for layer j's hook
        (:meth:`_keep`)."""
        if self.stream is None:
            return self._keep(number, hidden)
        for k, (i, _) in self.placement.items():
            if i == number:
                hidden, link = self._launch(k, hidden, checkpointed)
                if link is not None:
                    links.append((k, link, True))
        return hidden

    def _keep(self, number: int, hidden: torch.Tensor) -> torch.Tensor:
        """Keep layer ``number``'s output (gathered under sequence parallelism) for the memory
        layers that run at a later hook without the stream."""
        self.kept[number] = self._gather(hidden)
        if torch.is_grad_enabled() and hidden.requires_grad:
            # The dense layers read a copy, so layer i's output gradient is (their gradient,
            # summed) + (the memory layers' input gradient, summed), added once: the two partial
            # sums the async stream's ForkMemory adds, so both modes round alike and give the
            # same gradients bit for bit.
            hidden = ForkMemory.apply(hidden, None)
        return hidden

    def _finish(
        self, number: int, hidden: torch.Tensor, links: List[Tuple[int, MemoryLink, bool]]
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The memory layers placed ``i:number`` end: joined from the stream (:meth:`_join`) or
        run now (:meth:`_run_now`). Returns ``hidden`` (behind the stream's joins), the sum of the
        outputs to add (None: none) and of the auxiliary losses to carry (:meth:`_carry_aux`)."""
        added, aux = None, None
        for k, (i, j) in self.placement.items():
            if j != number:
                continue
            if self.stream is not None:
                hidden, y = self._join(k, hidden, links)
                if y is None:
                    continue
            else:
                y = self._run_now(k, i)
            added = y if added is None else added + y
            aux = self._carry_aux(k, aux)
        return hidden, added, aux

    def _run_now(self, k: int, i: int) -> torch.Tensor:
        """Memory layer k on the output kept at layer ``i``, without the stream (its time in
        ``sync_s``); this rank's share of its output."""
        start = time.perf_counter()
        y = self._local(self._run(k, self._read(k, self.kept[i]), self.documents))
        self.sync_s += time.perf_counter() - start
        return y

    def _carry_aux(self, k: int, aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """On a stage before the last (``aux_scale``): memory layer k's auxiliary loss taken from
        the module and added to ``aux``, to ride on the hidden state (:meth:`_output`)."""
        if self.aux_scale is None:
            return aux
        module = self.modules[k]
        if module.aux_loss is not None:
            aux = module.aux_loss if aux is None else aux + module.aux_loss
            module.aux_loss = None
        return aux

    def _output(self, output, original: torch.Tensor, hidden: torch.Tensor, added, aux):
        """The hook's result: None (the output unchanged), or the output with its hidden state
        ``hidden`` plus ``added``, carrying ``aux`` (:class:`AuxLossToActivation`)."""
        if added is None:
            return None if hidden is original else _replace_hidden(output, hidden)
        hidden = hidden + added
        if aux is not None:
            hidden = AuxLossToActivation.apply(hidden, aux, self.aux_scale)
        return _replace_hidden(output, hidden)


def attach_memory(chunks: List[torch.nn.Module], config, std_rule: Callable[[str, torch.Tensor], Optional[float]]):
    """Add the ``config.memory`` layers of this pipeline stage to every chunk (as
    ``chunk.memory``, :class:`MemoryModules`, so they are in the chunk's parameters and
    ``sharded_state_dict``) and return the init rule that
    leaves value tables, which draw their own shard at construction, as they are (the memory
    layers' other parameters carry their own std, :func:`rmt.models.init.set_init_std`). An MoE replacing MLPs
    (``memory.moe_placement: mlp``) is the architecture's own: nothing to attach."""
    mem, t = config.memory, config.train
    dp = parallel_state.get_data_parallel_world_size()
    loss_scale = t.micro_batch_size * dp / (t.global_batch_size or t.micro_batch_size * dp)  # 1 / microbatches
    if mem.type == "moe":
        set_aux_loss_scale(loss_scale)
        if mem.moe_placement == "mlp":
            return std_rule
    placement = memory_placement(config)
    if mem.partition != "local":
        memory_parallel_groups(mem.group_size)  # collective: also on stages without memory layers
    # One stream for all chunks of the rank: a single worker issues the memory collectives in
    # the schedule's order, the same on every rank of a memory-parallel group.
    # Recomputed spans (train.recompute_granularity: full) need every memory layer on a graph of
    # its own, as the stream makes them: InlineStream, in order, without the async stream.
    stream = (
        MemoryStream(compat.device())
        if mem.async_stream
        else (InlineStream() if t.recompute_granularity == "full" else None)
    )
    rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = config.parallel.virtual_pipeline_model_parallel_size
    for vp_stage, chunk in enumerate(chunks):
        first, last = stage_layers(config, rank, vp_stage if vpp else None)
        own = {k: (i - first + 1, j - first + 1) for k, (i, j) in enumerate(placement) if first <= i and j <= last}
        chunk.memory = MemoryModules({k: build_memory_layer(config, k, chunk.config) for k in own})
        if own:
            layers, seq_dim = _hook_layers(chunk)
            loss_chunk = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and vp_stage == len(chunks) - 1
            inputs = {i: _ffn_input(layers[i - 1]) for i, _ in own.values()} if mem.type == "ultramem_v2" else None
            chunk.memory_wiring = MemoryWiring(
                chunk,
                own,
                seq_dim,
                layers,
                stream,
                None if loss_chunk else loss_scale,
                loss_scale,
                config.parallel.sequence_parallel,
                inputs,
            )

    def rule(key: str, param: torch.Tensor) -> Optional[float]:
        if is_table(param):
            return None  # a value table draws its own shard (MemoryTable)
        return std_rule(key, param)

    return rule


def memory_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (MemoryLayer, SkipMoE))]


def pop_aux_loss(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """Sum of the auxiliary losses of the last forward (TDQKR Eq. 12); clears them. MoE balance
    losses are not among them: megatron attaches them to the routing weights."""
    total = None
    for m in memory_modules(model):
        if m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
            m.aux_loss = None
    return total


def pop_memory_stats(chunks: List[torch.nn.Module], group=None) -> Dict[str, float]:
    """Scalars since the last call (collective over ``group``): ``memory/layer{k}/<stat>``
    slot usage of UltraMem/PKM layers and load of skip-placed MoE layers, k the global placement
    index; ``moe/layer{n}/<stat>`` of the MoE MLP of transformer layer n."""
    out = {}
    layers = [
        (k, m)
        for c in chunks
        for own in c.modules()
        if isinstance(own, MemoryModules)
        for k, m in own._modules.items()
        if isinstance(m, (MemoryLayer, SkipMoE))
    ]
    skip = set()
    for k, layer in layers:
        stats = layer.pop_stats(group) if isinstance(layer, MemoryLayer) else layer.moe.pop_stats(group)
        skip.update(layer.modules())
        for name, value in stats.items():
            out[f"memory/layer{k}/{name}"] = value
    for moe in moe_modules(chunks):
        if moe not in skip:
            for name, value in moe.pop_stats(group).items():
                out[f"moe/layer{moe.layer_number}/{name}"] = value
    return out
