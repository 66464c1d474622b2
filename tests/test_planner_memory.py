"""rmt.planner.memory: exact byte counts per component and phase, the group sizes rmt can run,
rejections of layouts it cannot, and agreement with the tensors a built model holds."""

import math

import pytest
import torch

from rmt.memory.byte_sizes import CHECKPOINT_CHUNK_BYTES
from rmt.planner.memory import (
    TablePlan,
    checkpoint_bytes,
    components,
    group_sizes,
    min_group_size,
    phases,
    plan_memory,
)

GIB = 2**30
SMALL = dict(slots=64, dim=8, group_size=4, tokens=10, heads=2, topk=3, key_dim=4, tucker_rank=2, ive_blocks=4)


def test_components_of_a_small_number_wise_adamw_table():
    c = components(TablePlan(**SMALL, retrieval_kernel="unfused"))
    rows, cols, n = 16, 8, 8 * 2  # 64 / 4 rows; grid side 8 keys x sqrt(4)
    assert c == {
        "table": rows * cols * 4,
        "slot_stats": 16,
        "gradients": rows * cols * 4,
        "ddp_buffer": 0,  # a sharded table's gradient is reduced outside DDP
        "optimizer_states": 2 * rows * cols * 4,
        "keys": 2 * 2 * n * 4 * 4,
        "retrieval_activations": 2 * 10 * 2 * 2 * 2 * n * 4,
        "checkpoint_chunk": rows * cols * 4 // 4,
    }  # its rows of each of the 4 dimension-wise files
    dim = components(TablePlan(**dict(SMALL, partition="dimension")))
    assert dim["checkpoint_chunk"] == dim["table"] == 64 * 2 * 4  # whole rows of the number-wise files
    two = components(TablePlan(**SMALL, microbatches=3))
    assert two["gradients"] == 2 * rows * cols * 4  # the accumulated one and the new one


def test_optimizer_states_and_dtypes():
    bf16 = components(TablePlan(**SMALL, value_dtype="bf16"))
    assert (bf16["table"], bf16["optimizer_states"]) == (16 * 8 * 2, 2 * 16 * 8 * 2)  # torch AdamW: table dtype
    adam = components(TablePlan(**SMALL, value_dtype="bf16", value_optimizer="sparse_adam"))
    assert adam["optimizer_states"] == 2 * 16 * 8 * 4  # fp32 moments
    ada = components(TablePlan(**SMALL, value_optimizer="rowwise_adagrad"))
    assert ada["optimizer_states"] == 16 * 4  # one fp32 per row
    bf16 = TablePlan(**SMALL, precision="bf16", retrieval_kernel="unfused")
    assert components(bf16)["retrieval_activations"] == 2 * 10 * 2 * 2 * 2 * 16 * 2


def test_sparse_gradients_are_bounded_by_the_coalescing_hook():
    plan = dict(SMALL, value_optimizer="sparse_adam", tokens=1)
    served = 1 * 2 * 3  # T x heads x top-m lookups per micro-batch at the owner
    per_row = 8 * 4 + 8
    assert components(TablePlan(**plan, microbatches=2))["gradients"] == 2 * served * per_row
    assert components(TablePlan(**plan, microbatches=50))["gradients"] == (2 * 16 + served) * per_row
    dim = components(TablePlan(**dict(plan, partition="dimension"), microbatches=2))
    assert dim["gradients"] == 2 * 4 * served * (2 * 4 + 8)  # every requester's lookups, 2 columns


@pytest.mark.parametrize("ddp_buffered", [False, True])
def test_phases_compose_the_components(ddp_buffered):
    """A table whose gradient megatron's DDP buffers holds the fp32 buffer from init on."""
    plan = TablePlan(**SMALL, layers=3, ddp_buffered=ddp_buffered)
    c, p = components(plan), phases(plan)
    buffer = 3 * c["ddp_buffer"]
    assert buffer == (3 * 4 * 16 * 8 if ddp_buffered else 0)  # a number-wise shard: 64 / 4 rows of 8
    trained = c["table"] + c["slot_stats"] + 4 * c["keys"] + c["optimizer_states"]
    assert p["init"] == 3 * (c["table"] + c["slot_stats"] + 2 * c["keys"]) + 2 * c["keys"] + buffer
    assert p["step"] == 3 * (trained + c["gradients"]) + c["retrieval_activations"]
    assert p["save"] == 3 * (trained + c["gradients"])
    assert p["load"] == 3 * trained + 2 * c["keys"] + buffer
    assert p["load_resharded"] == 3 * trained + max(2 * c["keys"], c["checkpoint_chunk"]) + buffer
    big = components(TablePlan(slots=4096**2, dim=1024, group_size=2))
    assert big["checkpoint_chunk"] == CHECKPOINT_CHUNK_BYTES


def test_per_rank_bytes_fall_as_one_over_p_and_checkpoint_size_does_not_move():
    sizes = [
        phases(TablePlan(slots=1024**2, dim=64, group_size=P, value_optimizer="rowwise_adagrad"))["save"]
        for P in (1, 2, 4, 8)
    ]
    table_part = [s - sizes[-1] for s in sizes]  # the P-independent key grid cancels
    assert table_part[0] / table_part[1] == pytest.approx(2 * (1 - 1 / 8) / (1 - 1 / 4), rel=1e-6)
    assert checkpoint_bytes(TablePlan(slots=1024**2, dim=64, group_size=8)) == 3 * 1024**2 * 64 * 4


def test_group_sizes_are_the_divisors_rmt_can_run():
    assert group_sizes(TablePlan(slots=36, dim=8)) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert group_sizes(TablePlan(slots=36, dim=8, partition="dimension")) == [1, 2, 4, 8]


def test_min_group_size_is_the_smallest_runnable_fit():
    plan = TablePlan(slots=100_000**2, dim=64, group_size=64, value_optimizer="rowwise_adagrad")
    budget = 80 * GIB
    P = min_group_size(plan, budget)
    assert P is not None and max(phases(TablePlan(**{**plan.__dict__, "group_size": P})).values()) <= budget
    smaller = [q for q in group_sizes(plan) if q < P]
    assert all(max(phases(TablePlan(**{**plan.__dict__, "group_size": q})).values()) > budget for q in smaller)
    doc = plan_memory(plan, gpu_mem_gib=80)
    assert doc["min_group_size"] == P and doc["fits"] == (doc["peak"] <= doc["budget_bytes"])
    assert plan_memory(TablePlan(slots=64, dim=8), gpu_mem_gib=1e-9)["min_group_size"] is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(slots=10, dim=4), "not a square"),
        (dict(slots=64, dim=4, group_size=3), "divisible by the group size"),
        (dict(slots=64, dim=6, group_size=4, partition="dimension"), "value dim \\(6\\) divisible"),
        (dict(slots=64, dim=8, partition="dimension", value_optimizer="rowwise_adagrad"), "number-wise"),
        (dict(slots=64, dim=8, value_dtype="fp16"), "value dtype"),
        (dict(slots=64, dim=8, value_optimizer="sgd"), "value optimizer"),
        (dict(slots=64, dim=8, ive_blocks=2), "perfect square"),
        (dict(slots=64, dim=8, tokens=0), "tokens must be a positive integer"),
    ],
)
def test_layouts_rmt_cannot_run_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        phases(TablePlan(**kwargs))


def test_reserve_and_memory_must_make_sense():
    with pytest.raises(ValueError, match="must be positive"):
        plan_memory(TablePlan(slots=64, dim=8), gpu_mem_gib=0)
    with pytest.raises(ValueError, match="reserve"):
        plan_memory(TablePlan(slots=64, dim=8), gpu_mem_gib=80, reserve_gib=80)


def test_planned_tensors_match_a_built_layer():
    """The shard, the slot flags and the key grid the planner counts are the sizes a built memory
    layer allocates (here local: P = 1)."""
    from rmt.config import load_config
    from rmt.memory.layer import MemoryLayer, MemorySpec
    from rmt.planner.memory import plan_from_config

    config = load_config(
        None,
        [
            "model.hidden_size=32",
            "memory.type=ultramem",
            "memory.placement='1:2'",
            "memory.num_keys=16",
            "memory.key_dim=8",
            "memory.topk=4",
            "memory.retrieval_kernel=unfused",
        ],
    )
    layer = MemoryLayer(MemorySpec.from_config(config))
    c = components(plan_from_config(config, group_size=1, layers=1, microbatches=1))
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    assert c["table"] == nbytes(layer.values.weight)
    assert c["slot_stats"] == nbytes(layer.values.hits)
    assert c["keys"] == nbytes(layer.keys)
    h = torch.randn(config.train.micro_batch_size * config.model.seq_length, 32)
    s_row, s_col = layer.side_scores(layer.query_input(h[:, None]).reshape(h.shape[0], 32), layer.keys)
    assert c["retrieval_activations"] == 2 * (nbytes(s_row) + nbytes(s_col))
    assert math.isqrt(c["table"] // (4 * 16)) == 16


def test_fused_value_optimizer_holds_no_gradient_but_the_kept_lookups():
    """``memory.fused_value_optimizer``: one micro-batch holds nothing beyond the backward's own
    tensors; m micro-batches keep m - 1 micro-batches' lookups and concatenate all m."""
    from rmt.planner.memory import fused_kept_bytes

    plan = dict(SMALL, value_optimizer="rowwise_adagrad", cores=2)
    unfused = components(TablePlan(**plan))
    one = components(TablePlan(**plan, fused=True))
    assert one["gradients"] == 0 and unfused["gradients"] > 0
    assert {k: v for k, v in one.items() if k != "gradients"} == {k: v for k, v in unfused.items() if k != "gradients"}
    three = TablePlan(**plan, fused=True, microbatches=3)
    assert components(three)["gradients"] == 5 * fused_kept_bytes(three)
    # number-wise over P = 4: the owner's unit-score lookups of the T x topm served rows, 8 fp32 columns
    assert fused_kept_bytes(three) == 10 * 6 * (8 * 4 + 8 + 4)
    # dimension-wise: every requester's lookups on the 2 columns (one core each side), 4 blocks
    dim = TablePlan(**dict(plan, value_optimizer="sparse_adam", partition="dimension"), fused=True)
    assert fused_kept_bytes(dim) == 4 * 10 * (4 * 2 * 4 + 6 * (8 + 1 * 4 + 8))
    # bf16 training: 2-byte scores and output gradients with a bf16 table; a float32 table widens
    # them to 4 (rmt.memory.table), as in fp32 training
    bf16 = TablePlan(**dict(plan, group_size=1, precision="bf16", value_dtype="bf16"), fused=True)
    assert fused_kept_bytes(bf16) == 10 * (4 * 8 * 2 + 6 * (8 + 2 * 2 + 8))
    wide = TablePlan(**dict(plan, group_size=1, precision="bf16"), fused=True)
    assert (
        fused_kept_bytes(wide)
        == fused_kept_bytes(TablePlan(**dict(plan, group_size=1), fused=True))
        == 10 * (4 * 8 * 4 + 6 * (8 + 2 * 4 + 8))
    )
    with pytest.raises(ValueError, match="fused value optimizer"):
        phases(TablePlan(**SMALL, fused=True))


def test_fused_kept_lookups_match_what_a_built_layer_keeps():
    """The bytes a local layer's backward keeps for the fused step (all but the step's last
    micro-batch) are the planner's ``kept``."""
    from rmt.config import load_config
    from rmt.memory.descriptor import amend
    from rmt.memory.layer import MemoryLayer, MemorySpec
    from rmt.ops.fused_update import FusedValueUpdate
    from rmt.ops.sparse_optim import SparseAdam
    from rmt.planner.memory import fused_kept_bytes, plan_from_config

    config = load_config(
        None,
        [
            "model.hidden_size=32",
            "memory.type=ultramem",
            "memory.placement='1:2'",
            "memory.num_keys=16",
            "memory.key_dim=8",
            "memory.topk=4",
            "memory.value_optimizer=sparse_adam",
            "memory.fused_value_optimizer=true",
        ],
    )
    layer = MemoryLayer(MemorySpec.from_config(config))
    weight = layer.values.weight
    update = amend(weight, fused_update=FusedValueUpdate(weight, SparseAdam([weight], lr=1e-3))).fused_update
    update.final = False  # an early micro-batch of the step
    T = config.train.micro_batch_size * config.model.seq_length
    layer(torch.randn(T, 1, 32)).sum().backward()
    kept = sum(t.numel() * t.element_size() for entry in update.stash for t in entry[:4] if t is not None)
    plan = plan_from_config(config, group_size=1, layers=1, microbatches=2)
    assert plan.fused and plan.cores == config.memory.num_cores
    assert kept == fused_kept_bytes(plan)
    assert components(plan)["gradients"] == 3 * kept
