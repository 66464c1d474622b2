"""A device cache of a host table's hot rows (``memory.host_cache_rows``,
:mod:`rmt.memory.host_cache`) against the uncached host table and the device table. On the CPU
every location is CPU memory and the cached rows are stepped by the same kernels, so the runs
are equal bit for bit: losses, gradient norms, gradients, tables and optimizer states, over
steps whose refreshes admit and evict rows. The link carries exactly the uncached bytes less
those of the cached rows, and checkpoints are the uncached run's, byte for byte."""

import filecmp
import os

import pytest
import torch
from test_memory_host_table import HOST, assert_equal, overrides

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.memory.groups import square_sum
from rmt.memory.host_cache import HotRows
from rmt.memory.host_steps import launch_host_steps, settle_all
from rmt.memory.table import MemoryTable
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam

from conftest import rmt_train, train_runs

CACHE = ["memory.host_cache_rows=12", "memory.host_cache_refresh=1"]
NONE = torch.zeros(0, dtype=torch.int64)


def test_hot_rows_take_the_most_looked_up_rows():
    """The lookups since the last refresh decide, ties to the lower row; a row that stays keeps
    its slot, and the admitted rows take the free slots, lowest first."""
    hot = HotRows(3, "cpu")
    hot.record(NONE, torch.tensor([5, 7, 9]))
    hot.record(NONE, torch.tensor([2, 7, 9]))
    assert hot.choose().tolist() == [2, 7, 9]  # 7 and 9 twice; 2 and 5 once, the lower first
    evicted_slots, evicted, admitted_slots, admitted = hot.assign(hot.choose())
    assert evicted.tolist() == [] and admitted.tolist() == [2, 7, 9] and admitted_slots.tolist() == [0, 1, 2]
    cached, slots = hot.find(torch.tensor([1, 2, 9]))
    assert cached.tolist() == [False, True, True] and slots[1:].tolist() == [0, 2]
    hot.record(torch.tensor([0]), torch.tensor([4]))  # row 2 (slot 0) hit, 4 missed
    hot.record(torch.tensor([0]), torch.tensor([4, 6]))
    assert hot.choose().tolist() == [2, 4, 6]  # 7 and 9 (no lookups now) leave
    evicted_slots, evicted, admitted_slots, admitted = hot.assign(hot.choose())
    assert evicted.tolist() == [7, 9] and evicted_slots.tolist() == [1, 2]
    assert admitted.tolist() == [4, 6] and admitted_slots.tolist() == [1, 2]
    assert hot.slot_rows.tolist() == [2, 4, 6] and hot.hits.tolist() == [0, 0, 0]


def _host(cache_rows=0):
    return MemoryTable(
        64,
        8,
        0.02,
        sparse_grad=True,
        location="host",
        device="cpu",
        init_key=3,
        host_cache_rows=cache_rows,
        host_cache_refresh=1,
    )


@pytest.mark.parametrize("optimizer", [SparseAdam, RowWiseAdagrad])
def test_cached_rows_give_the_uncached_gradients_steps_and_link_bytes(optimizer):
    """Three steps of three lookups each on a table of 64 rows, 10 of them cached from the second
    step on: the gradient's two parts make the uncached gradient and its norm, bit for bit (a
    row's lookups summed in the same order, whatever rows share its part); the steps give the
    same table and state once the cache is written back; the link carries exactly the uncached
    bytes less the hits'."""
    torch.manual_seed(0)
    plain, cached = _host(), _host(cache_rows=10)
    opts = [optimizer([t.weight], lr=0.05) for t in (plain, cached)]
    cache = cached.storage.cache
    row = 8 * 4
    evicted = 0
    for step in range(3):
        if cache.due:
            before = dict(cached.storage.link.phases.get("refresh", {}))
            cached.storage.refresh()
            evicted += cached.storage.link.phases["refresh"]["d2h_evicted_indices"] - before.get(
                "d2h_evicted_indices", 0
            )
        lookups = [
            (torch.randint(0, 64, (6, 4)) % (16 + 8 * step), torch.randn(6, 4, 1), torch.randn(6, 1, 8))
            for _ in range(3)
        ]
        for t in (plain, cached):
            for indices, scores, grad_out in lookups:
                (t.lookup_reduce(indices, scores, None, 1) * grad_out).sum().backward()
            t.weight.grad = t.storage.take_grad()
        cache.grad = cache.take_grad()
        full = plain.weight.grad.to_dense()
        parts = cached.weight.grad.to_dense() + (0 if cache.grad is None else cache.grad.to_dense())
        assert torch.equal(parts, full)
        if cache.grad is not None:
            assert not torch.equal(cached.weight.grad.to_dense(), full)  # the cached rows' stayed
            assert torch.equal(cache.grad_sq_norm(cached.weight.grad), square_sum(plain.weight.grad.values()))
        for o in opts:
            launch_host_steps(o)
        settle_all([plain, cached])
        assert torch.equal(plain.weight, cached.weight)
        for name, value in opts[0].state[plain.weight].items():
            other = opts[1].state[cached.weight][name]
            assert torch.equal(other, value) if torch.is_tensor(value) else other == value
    assert evicted > 0
    counts = cache.pop_counts()
    assert counts["row_hits"] > 0 and counts["lookups"] == 3 * 3 * 6 * 4
    for phase in ("forward", "backward"):
        for name, nbytes in plain.storage.link.phases[phase].items():
            assert cached.storage.link.phases[phase][name] + cache.saved.phases[phase][name] == nbytes
    assert cache.saved.forward == {"d2h_indices": 8 * counts["row_hits"], "h2d_rows": row * counts["row_hits"]}
    assert cache.saved.backward == {"d2h_row_grads": row * counts["row_hits"]}


def test_cache_stats_and_device_bytes():
    """The hit fractions a layer logs, and the device bytes: rows, state and index."""
    table = _host(cache_rows=4)
    cache = table.storage.cache
    opt = SparseAdam([table.weight], lr=0.1)
    (table.lookup_reduce(torch.tensor([[1, 2], [1, 3]]), torch.ones(2, 2, 1), None, 1)).sum().backward()
    table.weight.grad, cache.grad = table.storage.take_grad(), cache.take_grad()
    launch_host_steps(opt)
    table.storage.refresh()
    assert cache.rows.sorted_rows.tolist() == [1, 2, 3]
    assert cache.device_bytes == 4 * (8 * 4 + 2 * 8 * 4) + 33 * 4 - 16 * (4 - 3)
    table.pop_cache_stats()
    (table.lookup_reduce(torch.tensor([[1, 5], [1, 2]]), torch.ones(2, 2, 1), None, 1)).sum().backward()
    stats = table.pop_cache_stats()
    assert stats == {"host_cache_hit_fraction": 2 / 3, "host_cache_lookup_hit_fraction": 3 / 4}
    assert table.pop_cache_stats() == {"host_cache_hit_fraction": 0.0, "host_cache_lookup_hit_fraction": 0.0}
    with torch.no_grad():  # an evaluation's lookups are not counted
        table.lookup_reduce(torch.tensor([[1, 5]]), torch.ones(1, 2, 1), None, 1)
    assert cache.pop_counts()["lookups"] == 0


def test_cache_larger_than_the_shard_holds_it_all():
    assert _host(cache_rows=1000).storage.cache.capacity == 64


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["memory.value_optimizer=sparse_adam", "memory.host_cache_rows=8"],
            "^memory.host_cache_rows caches rows of value tables held in host memory on the device: "
            "it needs memory.table_location 'host', got 'device'$",
        ),
        (HOST + ["memory.value_optimizer=sparse_adam", "memory.host_cache_rows=-1"], "^memory.host_cache_rows must be"),
        (
            HOST + ["memory.value_optimizer=sparse_adam", "memory.host_cache_refresh=0"],
            "^memory.host_cache_refresh must",
        ),
    ],
)
def test_bad_cache_settings_are_rejected(cache_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides(cache_dir, extra)), world_size=1)


@pytest.mark.slow
def test_cache_without_host_tables_is_one_sentence_and_exit_2():
    proc = rmt_train(
        ["--config", "configs/ultramem_tiny.yaml", "--check"]
        + ["memory.value_optimizer=sparse_adam", "memory.host_cache_rows=8"],
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "rmt-train: error: memory.host_cache_rows caches rows of value tables held in host memory on the "
        "device: it needs memory.table_location 'host', got 'device'\n"
    )


def assert_same_states(ref, got):
    for rank_ref, rank_got in zip(ref["table_states"], got["table_states"]):
        assert sorted(rank_got) == sorted(rank_ref)
        for name, state in rank_ref.items():
            for key, value in state.items():
                other = rank_got[name][key]
                assert torch.equal(other, value) if torch.is_tensor(value) else other == value, f"{name} {key}"


def assert_link_is_uncached_less_hits(uncached, cached):
    """Per rank and table: the cached run's forward and backward link bytes plus what its hits
    saved are the uncached run's; its refreshes admitted and evicted rows."""
    evicted = 0
    for rank_ref, rank_got in zip(uncached["host"], cached["host"]):
        for name, ref in rank_ref.items():
            got = rank_got[name]
            saved = got["cache"]["saved"]
            assert saved["forward"]["h2d_rows"] > 0
            for phase in ("forward", "backward"):
                for key, nbytes in ref[phase].items():
                    assert got[phase][key] + saved[phase][key] == nbytes, f"{name} {phase} {key}"
            evicted += got["other"]["refresh"]["d2h_evicted_indices"]
    assert evicted > 0


CASES = {
    "sparse-adam": ["memory.value_optimizer=sparse_adam"],
    "rowwise-adagrad-async": ["memory.value_optimizer=rowwise_adagrad", "memory.async_stream=true"],
    "bf16": ["memory.value_optimizer=sparse_adam", "memory.value_dtype=bf16", "train.precision=bf16"],
    "ultramem-v2": [
        "memory.value_optimizer=sparse_adam",
        "memory.type=ultramem_v2",
        "memory.placement=''",
        "memory.value_dim=16",
        "memory.pre_value_dim=8",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_host_table_equals_uncached_and_device_table(cache_dir, tmp_path, case):
    """Four steps, the cache refreshed at every step: equal to the uncached host table and the
    device table bit for bit (tables and optimizer states too, the cache written back at the
    end), and the link bytes are the uncached ones less the hits'."""
    extra = CASES[case]
    runs = {
        name: (tmp_path / f"{name}.pt", overrides(cache_dir, extra + more, steps=4))
        for name, more in (("device", []), ("host", HOST), ("cached", HOST + CACHE))
    }
    got = train_runs(dict(runs.values()))
    device, host, cached = (got[path] for path, _ in runs.values())
    assert_equal(device, cached)
    assert_equal(host, cached)
    assert_same_states(host, cached)
    assert_link_is_uncached_less_hits(host, cached)


def test_checkpoint_with_cache_is_the_uncached_one(cache_dir, tmp_path):
    """A step-2 checkpoint of the cached run has the uncached run's table files byte for byte
    (written back first), and a run resumed from it with the cache ends where the cached run
    did."""
    opt = ["memory.value_optimizer=sparse_adam"]

    def save(name):
        return [f"train.save={tmp_path / name}", "train.save_interval=2"]

    runs = {
        "host": overrides(cache_dir, opt + HOST + save("host")),
        "cached": overrides(cache_dir, opt + HOST + CACHE + save("cached")),
    }
    got = train_runs({tmp_path / f"{name}.pt": o for name, o in runs.items()})
    cached = got[tmp_path / "cached.pt"]
    tables = [os.path.join(tmp_path / name, "iter_0000002", "tables") for name in runs]
    compared = filecmp.dircmp(*tables)
    files = []
    for root, _, names in os.walk(tables[0]):
        files += [os.path.relpath(os.path.join(root, n), tables[0]) for n in names]
    assert files and not compared.left_only and not compared.right_only
    _, mismatch, errors = filecmp.cmpfiles(*tables, files, shallow=False)
    assert not mismatch and not errors
    resumed = train_runs(
        {
            tmp_path / "resumed.pt": overrides(
                cache_dir, opt + HOST + CACHE + [f"train.load={tmp_path / 'cached'}/iter_0000002"]
            )
        }
    )[tmp_path / "resumed.pt"]
    assert resumed["losses"] == cached["losses"][2:]
    for key, value in cached["params"].items():
        assert torch.equal(resumed["params"][key], value), key
    assert_same_states(cached, resumed)


PARALLEL = {
    # name: (optimizer, processes, overrides, ranks caching the same rows)
    "dp2-local-async": ("sparse_adam", 2, ["memory.async_stream=true"], [(0, 1)]),
    "dp2-dimension": ("sparse_adam", 2, ["memory.partition=dimension"], [(0, 1)]),  # each sees every lookup
    "tp2xdp2-number-owner-reduce-replicas": (
        "rowwise_adagrad",
        4,
        [
            "parallel.tensor_model_parallel_size=2",
            "memory.partition=number",
            "memory.owner_reduce=true",
            "memory.group_size=2",
        ],
        [(0, 2), (1, 3)],  # the replicas of each owner's shard
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PARALLEL))
def test_parallel_cached_host_tables_equal_uncached(cache_dir, tmp_path, layout):
    """Under DP=2 (local on the async stream; dimension-wise) and TP=2 x DP=2 (number-wise with
    owner-side pooling over groups of 2, so every shard has a replica), four steps refreshing
    every step, in one launch: the cached run equals the uncached host table and the device table
    of the same layout bit for bit, every rank's tables and optimizer states included; the
    replicas of a shard cache the same rows."""
    optimizer, nproc, extra, alike = PARALLEL[layout]
    extra = [f"memory.value_optimizer={optimizer}"] + extra
    runs = {
        name: (tmp_path / f"{name}.pt", overrides(cache_dir, extra + more, steps=4))
        for name, more in (("device", []), ("host", HOST), ("cached", HOST + CACHE))
    }
    got = train_runs(dict(runs.values()), nproc)
    device, host, cached = (got[path] for path, _ in runs.values())
    assert_equal(device, cached)
    assert_equal(host, cached)
    assert_same_states(host, cached)
    assert_link_is_uncached_less_hits(host, cached)
    for a, b in alike:
        tables = cached["host"][a]
        assert tables and all(t["cache"]["rows"] == cached["host"][b][n]["cache"]["rows"] for n, t in tables.items())
