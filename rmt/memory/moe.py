"""The MoE baseline: megatron-core's ``MoELayer`` (top-k router with the Switch load-balancing
loss, token dispatcher, experts), either as the MLP of chosen transformer layers (megatron's
usual form, ``memory.moe_placement: mlp``) or beside the dense model at UltraMem's skip
placements (``skip``, :class:`SkipMoE`).

Routing (megatron's ``topk_routing_with_score_function``, no pre-softmax): each token goes to the
k experts of largest router logit with weights ``softmax`` over those k logits (Mixtral; for
k = 1 the full softmax probability, as Switch). The load-balancing loss is Switch Transformer's
Eq. 4 (Fedus et al. 2022), ``alpha * N * sum_i f_i P_i`` with ``f_i`` the fraction of the k
routing slots that chose expert i and ``P_i`` its mean router probability, computed per
microbatch; megatron attaches it to the routing weights (``MoEAuxLossAutoScaler``), so its
gradient enters backward at the schedule's loss scale on every pipeline stage.

Expert parallelism is megatron's: ``parallel.expert_model_parallel_size`` ranks hold
``num_experts / EP`` experts each, ``parallel.expert_tensor_parallel_size`` ranks split each
expert's MLP, megatron DDP reduces expert gradients over the expert-data-parallel group, and
checkpoints map local experts to global expert indices (so they reshard across EP sizes).

What rmt adds to megatron's class (:class:`MoE`): megatron runs an MoE under tensor parallelism
only with sequence parallelism, which its torch-only layer spec does not support (torch norms).
So each TP rank routes its ``1 / TP`` of the sequence (``scatter_to_sequence_parallel_region``)
and the outputs are all-gathered afterwards: the MoE sees exactly the sequence-parallel input
megatron designs it for. The router's weight gradient, then a partial sum per TP rank, is summed
over TP inside autograd (:class:`Router`). Experts carry no biases (megatron's SequentialMLP
adds an expert bias in place on a custom Function's output and fails without expert TP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
    router_gating_linear,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from rmt.memory.shapes import expert_hidden_size, memory_width
from rmt.models.attention import with_attention_kernel
from rmt.models.init import set_init_std


def moe_fields(config) -> Dict:
    """The MoE fields of megatron's ``TransformerConfig`` for the rmt config ``config``."""
    mem, p = config.memory, config.parallel
    return dict(
        num_moe_experts=mem.num_experts,
        moe_router_topk=mem.moe_topk,
        moe_ffn_hidden_size=expert_hidden_size(config),
        moe_aux_loss_coeff=mem.balance_loss_weight,
        moe_router_load_balancing_type="aux_loss",
        moe_router_pre_softmax=mem.moe_topk == 1,
        moe_router_dtype="fp32",  # router logits and softmax in fp32 under bf16 autocast
        moe_token_dispatcher_type=mem.moe_token_dispatcher_type,
        moe_expert_capacity_factor=mem.moe_expert_capacity_factor,
        moe_token_drop_policy="probs",
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
    )


def _sequence_split() -> bool:
    """Whether MoE layers route a 1/TP share of the sequence on each tensor-parallel rank."""
    return parallel_state.get_tensor_model_parallel_world_size() > 1


class Router(TopKRouter):
    """megatron's top-k router; under the sequence split its weight enters the gating GEMM
    through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so
    the gradients of the TP ranks' sequence shares are summed. The GEMM runs outside any
    autocast: megatron's gating function computes in the router dtype itself, and under bf16
    autocast its forward would return bf16 logits that its backward multiplies with the fp32
    weight. ``balance_loss`` sums the load-balancing losses (without their
    coefficient) of this router's calls since :meth:`MoE.pop_stats`: megatron's own tracker is
    one process-wide table indexed by layer number."""

    def __init__(self, config: TransformerConfig, pg_collection=None):
        super().__init__(config, pg_collection)
        # The gating sums the TP ranks' gradients itself (copy_to_tensor_model_parallel_region):
        # unmarked, so that megatron's finalize_model_grads does not sum them once more under
        # the model's parallel.sequence_parallel.
        for param in self.parameters(recurse=False):
            param.sequence_parallel = False
        self.register_buffer("balance_loss", torch.zeros((), dtype=torch.float64), persistent=False)
        # megatron's logging table (unread by rmt) is sized by the first model's layer count at its
        # first entry: a model of more layers built later in the same process would index past it
        get_moe_layer_wise_logging_tracker().clear()

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, *args, **kwargs):
        with torch.no_grad():
            self.balance_loss += aux_loss.detach().double() / aux_loss_coeff
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss, *args, **kwargs)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if _sequence_split():
            weight = copy_to_tensor_model_parallel_region(weight)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        with torch.autocast(input.device.type, enabled=False):
            return router_gating_linear(input, weight, self.bias, dtype)


class MoE(MoELayer):
    """megatron-core's ``MoELayer`` on its own copy of the model's config with the MoE fields
    ``moe`` (:func:`moe_fields`), no linear biases, and marked sequence-parallel under TP: it
    routes a ``1 / TP`` share of the sequence per tensor-parallel rank (module docstring), split
    from its input here, or, under the model's ``parallel.sequence_parallel``, its input itself.
    Returns ``(output, None)`` like megatron's MLPs. The model's own config declares no experts
    (megatron rejects linear biases next to tensor-parallel experts in one config), so the
    aux-loss scale is set by :func:`set_aux_loss_scale`.

    Also counts, in training, the router calls and tokens per expert since :meth:`pop_stats`
    (the load-balancing loss values: :class:`Router`)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules,
        layer_number: Optional[int] = None,
        pg_collection=None,
        moe: Optional[Dict] = None,
    ):
        # Under the model's sequence parallelism (parallel.sequence_parallel) the input is this
        # rank's sequence share already; otherwise this layer splits the sequence itself.
        self_split = _sequence_split() and not config.sequence_parallel
        config = dataclasses.replace(config, add_bias_linear=False, sequence_parallel=_sequence_split(), **(moe or {}))
        super().__init__(config, submodules, layer_number, pg_collection)
        self.split = self_split
        self.register_buffer("load", torch.zeros(config.num_moe_experts, dtype=torch.float64), persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64), persistent=False)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        probs, routing_map = super().route(hidden_states, padding_mask)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.load += routing_map.sum(0).to(self.load.dtype)
                self.calls += 1
        return probs, routing_map

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if self.split:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states)
        output, bias = super().forward(hidden_states, intermediate_tensors, padding_mask)
        if self.split:
            output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)
        return output, bias

    @torch.no_grad()
    def pop_stats(self, group=None) -> Dict[str, float]:
        """Mean load-balancing loss (without its coefficient) per training router call and the
        load of the busiest expert relative to a balanced one (1 = balanced) since the last
        call, summed over the tensor-parallel sequence shares and averaged over ``group``;
        resets the counters."""
        # on the counters' device: an NCCL process group takes no CPU tensors
        sums = torch.cat([self.router.balance_loss.view(1), self.load, self.calls.view(1)])
        if _sequence_split():
            dist.all_reduce(sums, group=parallel_state.get_tensor_model_parallel_group())
            sums[-1] /= parallel_state.get_tensor_model_parallel_world_size()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        self.load.zero_()
        self.calls.zero_()
        self.router.balance_loss.zero_()
        calls, load = max(float(sums[-1]), 1.0), sums[1:-1]
        total = float(load.sum())
        balance = float(load.max()) * load.numel() / total if total else 0.0
        return {"load_balancing_loss": float(sums[0]) / calls, "max_expert_load": balance}


def moe_spec(config) -> ModuleSpec:
    """megatron's local (torch-only) MoE spec with rmt's :class:`MoE` (given ``config``'s MoE
    fields) and :class:`Router`."""
    spec = get_moe_module_spec(use_te=False, num_experts=config.memory.num_experts)
    spec = dataclasses.replace(spec, module=MoE, params={"moe": moe_fields(config)})
    spec.submodules.router = Router
    return spec


def moe_block_spec(config, tcfg: TransformerConfig, vp_stage: Optional[int]):
    """megatron's decoder block spec (this pipeline chunk's layers) with :class:`MoE` as the
    MLP of the layers of ``memory.placement`` (megatron's ``moe_layer_freq`` pattern) and every
    layer's core attention computed by ``model.attention_kernel``."""
    pattern = dataclasses.replace(
        tcfg, add_bias_linear=False, moe_layer_freq=moe_layer_pattern(config), **moe_fields(config)
    )
    block = get_gpt_decoder_block_spec(
        pattern, use_transformer_engine=False, normalization=config.model.normalization, vp_stage=vp_stage
    )
    ours = moe_spec(config)

    def layer(spec: ModuleSpec) -> ModuleSpec:
        if spec.submodules.mlp.module is MoELayer:
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=ours))
        return with_attention_kernel(spec, config)

    block.layer_specs = [layer(spec) for spec in block.layer_specs]
    return block


def moe_layer_pattern(config) -> List[int]:
    """megatron's ``moe_layer_freq`` list (1 = MoE MLP) of ``memory.moe_placement: mlp``."""
    from rmt.memory.shapes import parse_moe_layers

    layers = set(parse_moe_layers(config.memory.placement, config.model.num_layers))
    return [int(i + 1 in layers) for i in range(config.model.num_layers)]


def set_aux_loss_scale(scale: float) -> None:
    """The gradient of every MoE load-balancing loss: the schedule's loss scale
    (``1 / microbatches``). megatron's schedule sets it only for models whose own config
    declares experts, and rmt's never do (:class:`MoE`)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))


class SkipMoE(MegatronModule):
    """An MoE at a skip placement ``i:j``: ``x [s, b, width] -> MoE(LayerNorm(x))``, added by the
    hooks of :mod:`rmt.memory.attach` after layer j. ``base`` is the model's megatron config
    (the MoE's is that at the memory width)."""

    def __init__(self, config, base: TransformerConfig):
        width = memory_width(config)
        heads = config.parallel.tensor_model_parallel_size
        # It sees the whole sequence (gathered under sequence parallelism, rmt.memory.attach).
        tcfg = dataclasses.replace(
            base, hidden_size=width, num_attention_heads=heads, kv_channels=width // heads, sequence_parallel=False
        )
        super().__init__(config=tcfg)
        self.norm = torch.nn.LayerNorm(width, eps=config.model.layernorm_epsilon)
        spec = moe_spec(config)
        self.moe = MoE(tcfg, spec.submodules, **spec.params)
        # Layout-independent init for every architecture (rmt.models.init): init_std, the expert
        # output projections init_std / sqrt(2 L) (GPT-2's residual rule).
        std = config.model.init_std
        for name, param in self.moe.named_parameters():
            set_init_std(
                param, std / math.sqrt(2.0 * config.model.num_layers) if name.endswith("linear_fc2.weight") else std
            )
        self.aux_loss = None  # the balance loss rides on the routing weights (module docstring)

    def forward(self, x: torch.Tensor, state=None) -> torch.Tensor:
        return self.moe(self.norm(x))[0]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The norm replicated; the MoE's own (experts at their global indices)."""
        out = make_sharded_tensors_for_checkpoint(
            dict(self.norm.named_parameters()), f"{prefix}norm.", {}, sharded_offsets
        )
        out.update(self.moe.sharded_state_dict(f"{prefix}moe.", sharded_offsets, metadata))
        return out


def moe_modules(chunks) -> List[MoE]:
    return [m for c in chunks for m in c.modules() if isinstance(m, MoE)]
