"""rmt.planner.memory: exact byte counts and the minimal group size."""

import pytest

from rmt.planner.memory import memory_per_rank, min_group_size, plan_memory

GIB = 2 ** 30


def test_small_bf16_adam_exact():
    # 10 slots x 4 over 3 ranks: ceil(10/3) = 4 rows -> 16 elements.
    m = memory_per_rank(10, 4, 3)
    assert m == {"elements": 16, "table": 32, "gradients": 32, "gradients_dense": 32,
                 "gradients_sparse": None, "master_weights": 0,
                 "optimizer_states": 16 * 2 * 2, "total": 32 + 32 + 64}


def test_master_fp32_widens_grads_and_states():
    m = memory_per_rank(10, 4, 3, master_fp32=True)
    assert (m["table"], m["gradients"], m["master_weights"], m["optimizer_states"]) == \
        (16 * 2, 16 * 4, 16 * 4, 16 * 2 * 4)
    assert m["total"] == 32 + 64 + 64 + 128


def test_fp32_table_sgd_and_adagrad():
    sgd = memory_per_rank(10, 4, 3, dtype="fp32", optimizer="sgd", master_fp32=True)
    assert (sgd["table"], sgd["gradients"], sgd["master_weights"],
            sgd["optimizer_states"], sgd["total"]) == (64, 64, 0, 0, 128)
    ada = memory_per_rank(10, 4, 3, optimizer="adagrad")
    assert ada["optimizer_states"] == 16 * 2
    # row-wise Adagrad: one fp32 per row of the shard (4 rows number-wise, 10 dimension-wise)
    assert memory_per_rank(10, 4, 3, optimizer="rowwise_adagrad")["optimizer_states"] == 4 * 4
    assert memory_per_rank(10, 4, 3, optimizer="rowwise_adagrad", partition="dimension")["optimizer_states"] == 10 * 4


def test_dimension_partition_splits_columns():
    m = memory_per_rank(10, 4, 3, partition="dimension")  # 10 rows x ceil(4/3) = 2 cols
    assert m["elements"] == 20 and m["table"] == 40


def test_sparse_gradients():
    # Number-wise: T K = 10 rows of 4 bf16 + an int64 index each.
    m = memory_per_rank(10, 4, 3, grad="sparse", tokens=5, topm=2)
    assert m["gradients_sparse"] == 10 * (4 * 2 + 8)
    assert m["gradients"] == m["gradients_sparse"] and m["gradients_dense"] == 32
    assert m["total"] == 32 + 160 + 64
    # Dimension-wise: P T K = 30 rows of 2 columns.
    d = memory_per_rank(10, 4, 3, grad="sparse", tokens=5, topm=2, partition="dimension")
    assert d["gradients_sparse"] == 30 * (2 * 2 + 8)


def test_ten_billion_slots():
    # 10^10 x 64 bf16, Adam, no master: 2 + 2 + 2*2 = 8 bytes/element = 512 bytes/slot;
    # 5.12e12 / (80 * 2^30) = 59.6 -> 60 GPUs.
    budget = 80 * GIB
    assert min_group_size(10 ** 10, 64, budget) == 60
    assert memory_per_rank(10 ** 10, 64, 59)["total"] > budget
    assert memory_per_rank(10 ** 10, 64, 60)["total"] <= budget
    # With an fp32 master: 2 + 4 + 4 + 2*4 = 18 bytes/element -> 11.52e12 / 80 GiB -> 135.
    assert min_group_size(10 ** 10, 64, budget, master_fp32=True) == 135
    plan = plan_memory(10 ** 10, 64, 64)
    assert plan["fits"] and plan["min_group_size"] == 60
    assert plan["budget_bytes"] == budget
    assert plan["min_group_bytes_per_rank"]["total"] == 8 * 64 * -(-10 ** 10 // 60)


def test_reserve_and_unfittable_budget():
    with_reserve = plan_memory(10 ** 10, 64, gpu_mem_gib=80, reserve_gib=20)
    assert with_reserve["min_group_size"] == 80  # 5.12e12 / (60 * 2^30) = 79.5 -> 80
    # Sparse gradients of T K rows per rank do not shrink with P.
    assert min_group_size(1000, 64, 10 ** 4, grad="sparse", tokens=1000, topm=32) is None
    assert min_group_size(1000, 64, 10 ** 4, partition="dimension", grad="sparse",
                          tokens=1000, topm=32) is None
    assert plan_memory(10, 4, gpu_mem_gib=1e-9)["min_group_size"] is None


def test_dimension_min_group_size_scans():
    per_element = 8  # bf16 adam
    budget = 10 * 4 * per_element  # 10 rows x 4 columns fits exactly
    assert min_group_size(10, 16, budget, partition="dimension") == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(slots=0), "slots"), (dict(dim=-4), "dim"), (dict(P=11), "exceeds slots"),
    (dict(P=5, partition="dimension"), "exceeds dim"), (dict(dtype="int8"), "dtype"),
    (dict(optimizer="lion"), "optimizer"), (dict(grad="sparse"), "tokens and topm"),
    (dict(grad="sparse", tokens=4, topm=11), "exceed"), (dict(grad="lazy"), "grad"),
])
def test_invalid_input(kwargs, match):
    args = dict(slots=10, dim=4, P=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        memory_per_rank(args.pop("slots"), args.pop("dim"), args.pop("P"), **args)


def test_invalid_budget():
    with pytest.raises(ValueError, match="positive"):
        plan_memory(10, 4, gpu_mem_gib=0)
    with pytest.raises(ValueError, match="reserve"):
        plan_memory(10, 4, gpu_mem_gib=80, reserve_gib=80)
