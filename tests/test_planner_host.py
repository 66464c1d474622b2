"""Tables in host memory in the planner (rmt.planner.host, the host terms of rmt.planner.memory):
the link bytes equal a real host MemoryTable's counters, the staged-row expectation matches
uniform lookups within its binomial spread, the device / host split of every phase, the whole-rank
plan, the overlap window against the layers' FLOPs, and the flags' errors."""

import json
import math
from dataclasses import replace

import pytest
import torch

from rmt.memory import host_cache, host_steps
from rmt.memory.table import MemoryTable
from rmt.planner import host
from rmt.planner.cli import main
from rmt.planner.memory import (
    TablePlan,
    components,
    hit_fraction,
    host_phases,
    lookups_staged,
    phases,
    plan_memory,
    staged_rows,
)

from conftest import memory_spec

SMALL = dict(slots=64, dim=8, group_size=4, tokens=10, heads=2, topk=3, key_dim=4, tucker_rank=2, ive_blocks=4)
HOST = dict(SMALL, location="host", value_optimizer="sparse_adam")


def _lookup(table, indices, cores, blocks):
    T, K = indices.shape
    scores = torch.randn(T, K, cores, requires_grad=True)
    block_ids = torch.randint(0, blocks, (T, K)) if blocks > 1 else None
    out = table.lookup_reduce(indices, scores, block_ids, blocks)
    out.backward(torch.randn_like(out))


@pytest.mark.parametrize("dtype,blocks", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 4)])
def test_link_bytes_equal_the_host_tables_counters(dtype, blocks):
    torch.manual_seed(0)
    N, D, T, K, C = 512, 16, 24, 8, 2
    table = MemoryTable(N, D, 0.02, sparse_grad=True, location="host", device="cpu", dtype=dtype)
    indices = torch.randint(0, N, (T, K))
    _lookup(table, indices, C, blocks)
    U = indices.unique().numel()
    assert U < T * K  # repeats, deduplicated before they cross
    want = host.host_link_bytes(U, D, torch.finfo(dtype).bits // 8)
    assert dict(table.storage.link.forward) == want["forward"]
    assert dict(table.storage.link.backward) == want["backward"]
    assert table.storage.take_grad().indices().shape[1] == U  # the step's gradient: the staged rows
    assert host.INDEX_BYTES == host_cache.INDEX_BYTES


def _binomial_spread(plan, microbatches=1):
    """The standard deviation of the distinct rows if every row were missed independently
    (probability ``a``); the misses of a row and another are negatively correlated (a pair's top-k
    slots are distinct), so the true spread is below this."""
    P, T = plan.group_size, -(-plan.tokens // plan.tensor_parallel)
    a = (1 - plan.topk / plan.slots) ** (microbatches * P * T * plan.heads)
    rows = plan.shard_shape[0] if plan.partition == "number" else plan.slots
    return math.sqrt(rows * a * (1 - a))


def _draw(pairs, topk, slots, gen):
    """Each (token, head) pair's top-k distinct slots, uniform: ``[pairs, topk]``."""
    return torch.rand(pairs, slots, generator=gen).topk(topk, dim=1).indices


def test_uniform_lookups_stage_the_expected_rows_of_a_host_table():
    gen = torch.Generator().manual_seed(1)
    plan = TablePlan(slots=4096, dim=4, tokens=64, heads=2, topk=16, location="host", value_optimizer="sparse_adam")
    expected, spread = staged_rows(plan), _binomial_spread(plan)
    assert 0.5 * 64 * 32 < expected < 64 * 32  # about 1,613 of 2,048 lookups: dedup matters here
    counted = []
    for _ in range(12):
        table = MemoryTable(4096, 4, 0.02, sparse_grad=True, location="host", device="cpu")
        slots = _draw(64 * 2, 16, 4096, gen).reshape(64, 2 * 16)
        _lookup(table, slots, 1, 1)
        counted.append(table.storage.link.forward["h2d_rows"] // (4 * 4))
        assert abs(counted[-1] - expected) < 4 * spread
    assert abs(sum(counted) / len(counted) - expected) < 4 * spread / math.sqrt(len(counted))


@pytest.mark.parametrize("partition", ["number", "dimension"])
def test_sharded_staged_rows_match_uniform_lookups_of_the_group(partition):
    """A number-wise owner stages the distinct rows of its range among all the group's lookups
    (the union of the requesters' distinct rows); a dimension-wise shard all the group's."""
    gen = torch.Generator().manual_seed(2)
    P, t, T, H, k, N = 4, 2, 30, 2, 8, 2304  # 48^2 slots
    plan = TablePlan(
        slots=N,
        dim=8,
        group_size=P,
        partition=partition,
        tokens=T,
        heads=H,
        topk=k,
        tensor_parallel=t,
        location="host",
        value_optimizer="sparse_adam",
    )
    assert lookups_staged(plan) == 15 * H * k * (P if partition == "dimension" else 1)
    expected, spread = staged_rows(plan), _binomial_spread(plan)
    counted = []
    for _ in range(12):
        group = _draw(P * 15 * H, k, N, gen).unique()  # each rank looks up its T / t tokens
        counted.append(int((group < N // P).sum()) if partition == "number" else group.numel())
    mean = sum(counted) / len(counted)
    assert abs(mean - expected) < 4 * spread / math.sqrt(len(counted))


def test_a_measured_unique_fraction_sets_the_staged_rows():
    plan = TablePlan(**dict(HOST, unique_fraction=0.25, tokens=8))
    assert staged_rows(plan) == 0.25 * 8 * 6  # T x heads x top-k at the owner
    assert staged_rows(replace(plan, partition="dimension")) == 0.25 * 4 * 8 * 6
    assert staged_rows(replace(plan, unique_fraction=1.0, tokens=1000)) == 16  # at most the shard's rows


def test_the_table_its_state_and_gradient_move_to_the_host():
    plan = TablePlan(**dict(HOST, tokens=1), microbatches=2, device="gpu")
    device = components(replace(plan, location="device"))
    c = components(plan)
    U = round(staged_rows(plan))
    rows, cols = 16, 8
    assert (c["table"], c["optimizer_states"]) == (device["table"], device["optimizer_states"])
    assert 0 < U < 6  # of the 6 lookups an owner serves (T x heads x top-k)
    assert c["gradients"] == 2 * U * (cols * 4 + 8)  # the staged rows of both micro-batches, not the lookups
    many = components(replace(plan, microbatches=50))["gradients"]
    assert many == (2 * rows + U) * (cols * 4 + 8)  # bounded as the device's sparse gradient
    assert c["staging"] == U * cols * 4
    keys, flags, acts = c["keys"], c["slot_stats"], c["retrieval_activations"]
    assert flags == rows  # one byte a slot, in host memory: the device holds none per slot
    assert phases(plan) == {
        "init": 2 * keys + 2 * keys,
        "step": 4 * keys + acts + c["staging"],
        "save": 4 * keys,
        "load": 4 * keys + 2 * keys,
        "load_resharded": 4 * keys + 2 * keys,
    }
    trained = rows * cols * 4 + flags + 2 * rows * cols * 4
    assert host_phases(plan) == {
        "init": rows * cols * 4 + flags,
        "step": trained + c["gradients"] + c["staging"],
        "save": trained + c["gradients"] + c["staging"],
        "load": trained,
        "load_resharded": trained + c["checkpoint_chunk"],
    }
    assert host_phases(replace(plan, location="device")) == dict.fromkeys(host_phases(plan), 0)
    on_cpu = host_phases(replace(plan, device="cpu"))  # the staged rows are the gather's output there
    assert on_cpu["step"] == host_phases(plan)["step"] - c["staging"]
    two = replace(plan, layers=3, staged_layers=6)  # two micro-batches of 3 layers in flight
    assert phases(two)["step"] - 3 * 4 * keys - acts == 6 * c["staging"]


def test_plan_memory_reports_the_host_budget():
    plan = TablePlan(**HOST)
    budget = 1e-6  # GiB: 1,073 bytes of host memory per rank
    doc = plan_memory(plan, gpu_mem_gib=1.0, host_gib=budget)
    assert doc["host_peak"] == max(host_phases(plan).values()) and doc["host_fits"] is False
    assert doc["min_group_size"] == 16  # 4 rows: 672 bytes; 8 rows (P = 8) take 1,344
    assert max(host_phases(replace(plan, group_size=16)).values()) <= budget * 2**30
    assert max(host_phases(replace(plan, group_size=8)).values()) > budget * 2**30


def test_step_bytes_optimizer_work_and_overlap():
    plan = TablePlan(**HOST, layers=2, microbatches=3, replicas=2)
    U = round(staged_rows(plan))
    per = host.layer_link_bytes(plan)
    assert per == host.host_link_bytes(U, 8, 4)
    step = host.step_link_bytes(plan)
    assert step["forward"] == {"d2h_indices": 6 * 8 * U, "h2d_rows": 6 * U * 32}
    assert step["backward"] == {"d2h_row_grads": 6 * U * 32}
    G = round(staged_rows(plan, 3))
    assert step["step"] == {"h2d_grad_rows": 2 * G * 40, "d2h_summed_grad_rows": 2 * 2 * G * 40}
    R = round(staged_rows(plan, 6))  # 3 micro-batches on each of 2 replicas
    assert host.optimizer_work(plan) == {"touched_rows": 2 * R, "elements": 2 * R * 8, "bytes": 2 * R * 8 * (12 + 16)}
    ada = replace(plan, value_optimizer="rowwise_adagrad")
    assert host.optimizer_work(ada)["bytes"] == 2 * (R * 8 * 12 + R * 8)
    v2 = replace(plan, index_tables=2)
    assert host.layer_link_bytes(v2)["forward"]["d2h_indices"] == 2 * 8 * U
    fwd_s, bwd_s = (8 * U + 32 * U) / 25e9, 32 * U / 25e9
    window = 0.75 * fwd_s * 400e12  # forward window 0.75x the forward transfer, backward 1.5x
    over = host.overlap(plan, [window, window], link_gbps=25, tflops=400)
    assert [r["fits"] for r in over["layers"]] == [False, False]
    assert over["exposed_s_per_step"] == pytest.approx(3 * 2 * 0.25 * fwd_s)
    assert host.overlap(plan, [4 * window], 25, 400)["fits"]
    off = host.overlap(plan, [4 * window], 25, 400, async_stream=False)
    assert off["exposed_s_per_step"] == pytest.approx(3 * (fwd_s + bwd_s))


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_flags_plan_a_host_table(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["memory", "--slots", "1000000", "--dim", "64", "--group-size", "4", "--tokens", "512"]
    argv += ["--value-optimizer", "rowwise_adagrad", "--table-location", "host", "--host-gib", "1"]
    code, out, err = _run(argv + ["--window-gflops", "10", "--json", str(path)], capsys)
    assert code == 0, err
    doc = json.loads(path.read_text())
    plan = TablePlan(slots=10**6, dim=64, group_size=4, tokens=512, value_optimizer="rowwise_adagrad", location="host")
    assert doc["host_phases"] == host_phases(plan) and doc["host_fits"] is True
    assert doc["host_link"]["per_step"] == json.loads(json.dumps(host.step_link_bytes(plan)))
    assert doc["host_link"]["overlap"]["layers"][0]["window_flops"] == 10e9
    assert "host budget per rank: 1 GiB -> fits" in out and "exposed per step" in out
    code, out, _ = _run(argv + ["--unique-fraction", "0.5"], capsys)
    assert code == 0 and f"{0.5 * 512 * 32:,.0f} distinct rows staged per lookup" in out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--table-location", "host"], "needs the value optimizer sparse_adam or rowwise_adagrad, got adamw."),
        (["--host-gib", "4"], "--host-gib plans tables in host memory: it needs --table-location host."),
        (["--unique-fraction", "0.5"], "--unique-fraction plans tables in host memory"),
        (["--tflops", "100"], "--tflops plans tables in host memory"),
        (
            ["--table-location", "host", "--value-optimizer", "sparse_adam", "--fused-value-optimizer"],
            "a fused value optimizer never forms",
        ),
        (
            ["--table-location", "host", "--value-optimizer", "sparse_adam", "--unique-fraction", "1.5"],
            "the unique fraction must be in (0, 1], got 1.5.",
        ),
    ],
)
def test_bad_host_flags_are_one_sentence(flags, message, capsys):
    code, out, err = _run(["memory", "--slots", "4096", "--dim", "8"] + flags, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


TINY = ["memory", "--config", "configs/ultramem_tiny.yaml", "--world-size", "2"]


def test_the_whole_rank_holds_its_tables_in_host_memory(tmp_path, capsys):
    from rmt.planner.flops import _layer_counts
    from rmt.planner.rank import layout_of, stage_table_plan
    from rmt.planner.rank_cli import load_planned

    path = tmp_path / "rank.json"
    over = ["memory.value_optimizer=sparse_adam", "memory.partition=number", "memory.async_stream=true"]
    gpu = ["--device", "gpu", "--json", str(path)]
    code, out, err = _run(TINY + over + ["--table-location", "host", "--host-gib", "2"] + gpu, capsys)
    assert code == 0, err
    doc = json.loads(path.read_text())
    config = load_planned("configs/ultramem_tiny.yaml", over + ["memory.table_location=host"], 2)
    plan = stage_table_plan(config, layout_of(config, 2, "gpu"), 0)
    assert (plan.group_size, plan.replicas, plan.staged_layers, plan.device) == (2, 1, 1, "gpu")
    on_host = {p: v for p, v in host_phases(plan).items() if p != "load_resharded"}
    assert doc["stages"]["0"]["host_tables"] == on_host
    assert doc["stages"]["0"]["phases"]["step"]["tables"] == phases(plan, keys=False)["step"]
    assert doc["host_fits"] is True and doc["fits"] is True
    # the window of the layer at 1:2 is layer 2's forward FLOPs over the micro-batch's 8 x 128 tokens
    layer = _layer_counts(128, 4, 32, 512, 128, 2 * 128)["flops"] / 128
    assert doc["host_link"]["overlap"]["layers"][0]["window_flops"] == pytest.approx(8 * 128 * layer)
    assert "layer 1:2" in out and "fits 2 GiB of host memory per rank" in out
    code, _, _ = _run(TINY + over + gpu, capsys)  # the same run, tables on the device
    device = json.loads(path.read_text())
    assert "host_tables" not in device["stages"]["0"]
    assert device["stages"]["0"]["phases"]["step"]["tables"] > doc["stages"]["0"]["phases"]["step"]["tables"]
    code, _, _ = _run(TINY + over + ["--table-location", "host", "--json", str(path)], capsys)
    cpu = json.loads(path.read_text())  # a CPU rank: host and device memory are one
    plan = replace(plan, device="cpu")
    want = phases(plan, keys=False)["step"] + host_phases(plan)["step"]
    assert cpu["stages"]["0"]["phases"]["step"]["tables"] == want


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--table-location", "host"], "memory.table_location 'host' steps the touched rows on the host"),
        (["--host-gib", "4"], "--host-gib plans tables in host memory: it needs --table-location host (or "),
        (["--window-gflops", "4"], "--window-gflops is for a --slots/--dim plan"),
    ],
)
def test_bad_host_flags_with_a_config(flags, message, capsys):
    code, out, err = _run(TINY + flags, capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_the_layout_search_needs_host_tables_for_a_host_budget():
    from rmt.planner.layouts import search

    with pytest.raises(ValueError, match="needs memory.table_location=host"):
        search("configs/ultramem_tiny.yaml", [], 1, 80.0, host_gib=64.0)


def test_the_layout_search_fits_the_host_budget_and_times_the_exposed_transfers():
    """On a profile whose host link is slow, every host-table layout's step exposes transfers, as
    :func:`rmt.planner.time.plan_time` computes them for that layout."""
    from rmt.planner.hardware import load_profile, profile_from_dict
    from rmt.planner.layouts import search
    from rmt.planner.rank_cli import load_planned
    from rmt.planner.time import plan_time

    slow = profile_from_dict(dict(load_profile("h100").to_dict(), host_link=1e7))
    over = ["memory.table_location=host", "memory.value_optimizer=sparse_adam"]
    doc = search("configs/ultramem_tiny.yaml", over, 1, 80.0, device="cpu", host_gib=1.0, profile=slow)
    assert doc["fitting"] and doc["host_gib"] == 1.0
    for r in doc["fitting"]:
        assert 0 < r["host_peak"] <= 2**30
        c = load_planned("configs/ultramem_tiny.yaml", over + r["overrides"], 1)
        planned = plan_time(c, 1, slow)
        exposed = sum(m["exposed_s"] for m in planned["stages"]["0"]["memory"])
        assert r["time"]["memory_exposed_s"] == pytest.approx(exposed) and exposed > 0
    tight = search("configs/ultramem_tiny.yaml", over, 1, 80.0, device="cpu", host_gib=1e-4)
    assert not tight["fitting"] and tight["too_big"] == len(doc["fitting"]) + doc["too_big"]


def test_an_ultramem_v2_layer_stages_its_rows_through_both_tables():
    """The value and pre-value tables of an UltraMemV2 layer in host memory each send the
    layer's distinct slots' indices and rows: the plan's ``index_tables = 2`` and ``D = Dv + Dp``."""
    from rmt.memory.layer_v2 import UltraMemV2Layer

    spec = memory_spec(
        type="ultramem_v2", hidden_size=12, num_heads=2, topk=3, key_dim=5, num_keys=4, retrieval="tucker",
        tucker_rank=2, num_cores=2, ive_blocks=1, value_dim=8, pre_value_dim=6, value_optimizer="sparse_adam",
    )  # fmt: skip
    torch.manual_seed(3)
    tables = dict(location="host", device="cpu")
    layer = UltraMemV2Layer(spec, values=spec.table(**tables), pre_values=spec.pre_table(**tables))
    x = torch.randn(5, 2, 12)
    layer(x).square().sum().backward()
    with torch.no_grad():
        slots, _ = layer.physical(layer.retrieve(x.reshape(10, 12))[0])
    U = slots.unique().numel()
    assert U < slots.numel()
    links = [layer.values.storage.link, layer.pre_values.storage.link]
    forward = {k: sum(link.forward[k] for link in links) for k in ("d2h_indices", "h2d_rows")}
    backward = {"d2h_row_grads": sum(link.backward["d2h_row_grads"] for link in links)}
    plan = TablePlan(slots=16, dim=8 + 6, tokens=10, heads=2, topk=3, ive_blocks=1, location="host",
                     value_optimizer="sparse_adam", index_tables=2, unique_fraction=U / 60)  # fmt: skip
    assert {"forward": forward, "backward": backward} == host.layer_link_bytes(plan)


def test_the_first_pipeline_stage_holds_the_staged_rows_of_its_micro_batches_in_flight():
    from rmt.planner.rank import in_flight, layout_of, stage_table_plan, stage_tables
    from rmt.planner.rank_cli import load_planned

    over = ["memory.table_location=host", "memory.value_optimizer=sparse_adam", "model.num_layers=4"]
    over += ["parallel.pipeline_model_parallel_size=2", "train.global_batch_size=32"]
    config = load_planned("configs/ultramem_tiny.yaml", over, 2)
    layout = layout_of(config, 2)
    assert (layout.microbatches, in_flight(layout, 0)) == (4, 2)
    plan = stage_table_plan(config, layout, 0)
    assert (plan.layers, plan.staged_layers, plan.replicas) == (1, 2, 1)  # local table, DP 1
    assert stage_table_plan(config, layout, 1) is None  # the memory at 1:2 is on stage 0
    c = components(plan)
    one = phases(replace(plan, staged_layers=1), keys=False)["step"]
    assert stage_tables(config, layout, 0)["step"] - one == c["staging"]


def _cached_table(optimizer, capacity, dtype=torch.float32, N=256, D=8):
    """A host table of ``N`` rows with a device cache of ``capacity`` rows, filled with the rows
    ``0..capacity-1`` (looked up and stepped once, then refreshed)."""
    from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam

    table = MemoryTable(
        N, D, 0.02, sparse_grad=True, location="host", device="cpu", dtype=dtype, host_cache_rows=capacity
    )
    opt = (SparseAdam if optimizer == "sparse_adam" else RowWiseAdagrad)([table.weight], lr=0.01)
    _lookup(table, torch.arange(capacity).view(1, -1), 1, 1)
    table.weight.grad, table.storage.cache.grad = table.storage.take_grad(), table.storage.cache.take_grad()
    host_steps.launch_host_steps(opt)
    table.storage.refresh()
    assert table.storage.cache.rows.sorted_rows.tolist() == list(range(capacity))
    return table, opt


@pytest.mark.parametrize(
    "optimizer,dtype",
    [("sparse_adam", torch.float32), ("sparse_adam", torch.bfloat16), ("rowwise_adagrad", torch.float32)],
)
def test_cache_device_bytes_equal_the_caches(optimizer, dtype):
    table, _ = _cached_table(optimizer, 24, dtype)
    plan = TablePlan(slots=256, dim=8, location="host", value_optimizer=optimizer, cache_rows=24,
                     value_dtype="bf16" if dtype == torch.bfloat16 else "fp32")  # fmt: skip
    assert components(plan)["cache"] == table.storage.cache.device_bytes
    assert host.host_report(plan)["cache"]["device_bytes"] == table.storage.cache.device_bytes


def test_cached_link_bytes_equal_the_tables_counters():
    """A lookup of a table with 24 of its 256 rows cached: the plan at the lookup's distinct and
    cached fractions counts what its link counted, forward, backward and the step's norms; a
    refresh replacing every cached row moves the plan's refresh bytes exactly."""
    torch.manual_seed(4)
    table, opt = _cached_table("sparse_adam", 24)
    link = table.storage.link
    link.reset()
    indices = torch.randint(0, 64, (12, 6))
    _lookup(table, indices, 1, 1)
    U, hits = indices.unique().numel(), int((indices.unique() < 24).sum())
    assert 0 < hits < U
    plan = TablePlan(slots=256, dim=8, tokens=12, heads=1, topk=6, location="host", value_optimizer="sparse_adam",
                     cache_rows=24, unique_fraction=U / 72, cache_hit=hits / U)  # fmt: skip
    want = host.step_link_bytes(plan)
    assert {"forward": dict(link.forward), "backward": dict(link.backward)} == {
        "forward": want["forward"],
        "backward": want["backward"],
    }
    table.weight.grad, table.storage.cache.grad = table.storage.take_grad(), table.storage.cache.take_grad()
    table.storage.cache.grad_sq_norm(table.weight.grad)
    assert dict(link.phases["step"]) == want["step"]
    host_steps.launch_host_steps(opt)
    for _ in range(2):  # 24 other rows, none cached, looked up more often than any since the refresh
        _lookup(table, torch.arange(100, 124).view(1, -1), 1, 1)
    table.weight.grad, table.storage.cache.grad = table.storage.take_grad(), table.storage.cache.take_grad()
    host_steps.launch_host_steps(opt)
    link.reset()
    table.storage.refresh()
    assert table.storage.cache.rows.sorted_rows.tolist() == list(range(100, 124))
    assert dict(link.phases["refresh"]) == host.cache_refresh_bytes(plan)


def test_uniform_lookups_hit_the_cached_share():
    """Under uniform access a cache of C of the N rows finds C / N of a lookup's distinct rows,
    within the binomial spread."""
    gen = torch.Generator().manual_seed(5)
    plan = TablePlan(slots=4096, dim=4, tokens=64, heads=2, topk=16, location="host", value_optimizer="sparse_adam",
                     cache_rows=1024)  # fmt: skip
    h = hit_fraction(plan)
    assert h == 0.25
    hits, staged = 0, 0
    for _ in range(12):
        slots = _draw(64 * 2, 16, 4096, gen).unique()
        hits, staged = hits + int((slots < 1024).sum()), staged + slots.numel()
    assert abs(hits - h * staged) < 4 * math.sqrt(staged * h * (1 - h))


def test_the_cache_holds_device_memory_and_shrinks_the_host_rows():
    plan = TablePlan(**dict(HOST, tokens=4), device="gpu", cache_rows=16, cache_hit=0.5)
    plain = replace(plan, cache_rows=0, cache_hit=None)
    c, p = components(plan), components(plain)
    U = round(staged_rows(plan))
    assert c["cache"] == 16 * (8 * 4 + 2 * 8 * 4 + 33)  # the whole shard of 16 rows
    assert c["cache_gradients"] == c["gradients"] == round(0.5 * U) * (8 * 4 + 8)
    assert p["gradients"] == U * (8 * 4 + 8)
    assert c["staging"] == p["staging"] and c["pinned_staging"] == round(0.5 * U) * 8 * 4
    extra = c["cache"] + c["cache_gradients"]
    for phase, n in phases(plan).items():
        assert n - phases(plain)[phase] == (extra if phase in ("step", "save") else 0), phase
    assert host_phases(plain)["step"] - host_phases(plan)["step"] == (p["gradients"] - c["gradients"]) + (
        p["staging"] - c["pinned_staging"]
    )
    assert host.optimizer_work(plan)["touched_rows"] == round(0.5 * U)


def test_the_cache_flags(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["memory", "--slots", "1000000", "--dim", "64", "--group-size", "4", "--tokens", "512"]
    argv += ["--value-optimizer", "sparse_adam", "--table-location", "host", "--cache-rows", "50000"]
    code, out, err = _run(argv + ["--json", str(path)], capsys)
    assert code == 0, err
    doc = json.loads(path.read_text())
    plan = TablePlan(slots=10**6, dim=64, group_size=4, tokens=512, value_optimizer="sparse_adam", location="host",
                     cache_rows=50000)  # fmt: skip
    assert doc["host_link"]["cache"]["hit_fraction"] == 0.2 and doc["phases"] == phases(plan)
    assert "0.200 of the staged rows found there (uniform access)" in out
    code, out, _ = _run(argv + ["--cache-hit", "0.9"], capsys)
    assert code == 0 and "0.900 of the staged rows found there (as given)" in out


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--cache-rows", "8"], "--cache-rows plans tables in host memory: it needs --table-location host."),
        (
            ["--table-location", "host", "--value-optimizer", "sparse_adam", "--cache-hit", "0.5"],
            "a cache hit fraction is the share of rows a device cache serves: it needs cache rows.",
        ),
        (
            ["--table-location", "host", "--value-optimizer", "sparse_adam", "--cache-rows", "8", "--cache-hit", "2"],
            "the cache hit fraction must be in [0, 1], got 2.0.",
        ),
    ],
)
def test_bad_cache_flags_are_one_sentence(flags, message, capsys):
    code, out, err = _run(["memory", "--slots", "4096", "--dim", "8"] + flags, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_the_whole_rank_and_the_layouts_count_the_cache():
    from rmt.planner.layouts import search
    from rmt.planner.rank import layout_of, stage_table_plan, stage_tables
    from rmt.planner.rank_cli import load_planned

    over = ["memory.table_location=host", "memory.value_optimizer=sparse_adam"]
    cached = load_planned("configs/ultramem_tiny.yaml", over + ["memory.host_cache_rows=4096"], 1)
    plain = load_planned("configs/ultramem_tiny.yaml", over, 1)
    layout = layout_of(cached, 1, "gpu")
    plan = stage_table_plan(cached, layout, 0)
    assert plan.cache_rows == 4096
    c = components(plan)
    assert stage_tables(cached, layout, 0)["step"] - stage_tables(plain, layout, 0)["step"] == plan.layers * (
        c["cache"] + c["cache_gradients"]
    )
    with_cache = search("configs/ultramem_tiny.yaml", over + ["memory.host_cache_rows=4096"], 1, 80.0)
    without = {tuple(r["overrides"]): r["peak"] for r in search("configs/ultramem_tiny.yaml", over, 1, 80.0)["fitting"]}
    assert with_cache["fitting"] and all(r["peak"] > without[tuple(r["overrides"])] for r in with_cache["fitting"])
