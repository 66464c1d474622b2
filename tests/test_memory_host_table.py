"""Value tables in host memory (``memory.table_location: host``, :mod:`rmt.memory.host_table`)
against the device table: on the CPU both locations are CPU memory and run the same arithmetic
(the same row gradients, summed in the same order, stepped by the same kernels), so the single
process is equal bit for bit; the parallel layouts equal the single-process device run (fp32,
1e-5, as every sharded table does). Plus the host mechanics: what crosses the link, what the
device holds, and that no lookup reads a row before the previous step's update of it."""

import threading
import time

import pytest
import torch

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.memory.descriptor import descriptor
from rmt.memory.table import MemoryTable
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam

from conftest import TINY_ULTRAMEM, tiny_overrides, train_runs, train_steps

HOST = ["memory.table_location=host"]


def overrides(cache_dir, extra=(), steps=3):
    """The tiny UltraMem run, its memory scalars (slot usage) logged every step."""
    return tiny_overrides(cache_dir, steps) + TINY_ULTRAMEM + ["train.log_interval=1"] + list(extra)


# On a GPU (tools/gpu_checks.sh) the device table is stepped by the CUDA kernels and the host
# table by the CPU's, each rounding its own way: the runs agree to fp32 rounding there.
ON_GPU = torch.cuda.is_available()


def assert_equal(ref, got):
    """Equal bit for bit: losses, gradient norms, parameters, gradients, and the memory scalars
    ``ref`` logs (the slot usage a host table counts in host memory; ``got`` may log more). On
    a GPU, equal to fp32 rounding (:data:`ON_GPU`)."""
    if ON_GPU:
        assert_close(ref, got)
        return
    assert got["losses"] == ref["losses"]
    assert got["grad_norms"] == ref["grad_norms"]
    assert ref["memory_stats"] and all(ref["memory_stats"])
    for mine, theirs in zip(ref["memory_stats"], got["memory_stats"]):
        assert {k: theirs[k] for k in mine} == mine
    for kind in ("params", "grads"):
        assert sorted(got[kind]) == sorted(ref[kind])
        for key, value in ref[kind].items():
            assert torch.equal(got[kind][key], value), f"{kind} {key}"


def assert_close(ref, got, tol=1e-5):
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol)
    for kind in ("params", "grads"):
        assert sorted(got[kind]) == sorted(ref[kind])
        for key, value in ref[kind].items():
            torch.testing.assert_close(got[kind][key], value, rtol=tol, atol=tol, msg=f"{kind} {key}")


@pytest.mark.parametrize(
    "extra",
    [
        ["memory.value_optimizer=sparse_adam"],
        ["memory.value_optimizer=rowwise_adagrad", "memory.async_stream=true"],
        ["memory.value_optimizer=sparse_adam", "memory.value_dtype=bf16", "train.precision=bf16"],
        ["memory.value_optimizer=sparse_adam", "memory.type=pkm"],
        [
            "memory.value_optimizer=sparse_adam",
            "memory.type=ultramem_v2",
            "memory.placement=''",
            "memory.value_dim=16",
            "memory.pre_value_dim=8",
        ],
        [
            "memory.value_optimizer=rowwise_adagrad",
            "train.recompute_granularity=full",
            "train.recompute_method=uniform",
            "train.recompute_num_layers=2",
        ],
    ],
    ids=["sparse-adam", "rowwise-adagrad-async", "bf16", "pkm", "ultramem-v2", "full-recompute"],
)
def test_host_table_equals_device_table(cache_dir, tmp_path, extra):
    ref = train_steps(tmp_path / "device.pt", overrides(cache_dir, extra))
    got = train_steps(tmp_path / "host.pt", overrides(cache_dir, extra + HOST))
    assert_equal(ref, got)
    assert ref["losses"][2] < ref["losses"][0]
    (tables,) = got["host"]
    assert tables and all(t["staged_now"] == 0 for t in tables.values())


def test_next_lookup_waits_for_the_host_step(cache_dir, tmp_path, monkeypatch):
    """A host step slowed to 0.3 s (it runs on its own thread, beside the dense step and the next
    step's start) still lands before the next step's lookup reads the rows: the run equals the
    device table's."""
    extra = ["memory.value_optimizer=sparse_adam"]
    ref = train_steps(tmp_path / "device.pt", overrides(cache_dir, extra))
    threads = []
    step_param = SparseAdam.step_param

    def slow(self, group, p, grad):
        threads.append(threading.current_thread().name)
        time.sleep(0.3)
        step_param(self, group, p, grad)

    monkeypatch.setattr(SparseAdam, "step_param", slow)
    got = train_steps(tmp_path / "host.pt", overrides(cache_dir, extra + HOST))
    assert threads and all(name.startswith("rmt-host-step") for name in threads)
    assert_equal(ref, got)


def test_device_holds_one_micro_batch_of_staged_rows(cache_dir, tmp_path, monkeypatch):
    """Two micro-batches a step, one in flight at a time: each table's staged rows peak at its
    largest single lookup's, so every micro-batch's rows are released by its backward."""
    from rmt.memory.storage import HostStorage

    sizes = {}
    fetch = HostStorage.fetch

    def recorded(self, rows):
        out = fetch(self, rows)
        sizes.setdefault(id(self), []).append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(HostStorage, "fetch", recorded)
    got = train_steps(tmp_path / "host.pt", overrides(cache_dir, ["memory.value_optimizer=sparse_adam"] + HOST))
    ((table,),) = [list(rank.values()) for rank in got["host"]]
    ((fetched),) = sizes.values()
    assert len(fetched) == 3 * 2  # three steps of two micro-batches
    assert table["staged_peak"] == max(fetched) < sum(fetched[:2])
    assert table["forward"]["h2d_rows"] == table["backward"]["d2h_row_grads"] == sum(fetched)


def _host_table(num_slots=64, dim=8):
    return MemoryTable(num_slots, dim, 0.02, sparse_grad=True, location="host", device="cpu", init_key=3)


def test_lookup_reads_the_rows_after_the_launched_step():
    table = _host_table()
    before = table.weight.detach().clone()

    def step():
        time.sleep(0.2)
        table.weight.data.add_(1.0)

    table.storage.launch_step(step)
    rows = table.storage.gather(torch.tensor([5, 1, 5]))
    torch.testing.assert_close(rows, before[[5, 1, 5]] + 1.0, rtol=0, atol=0)


def test_link_bytes_and_staged_rows():
    """What crosses the link per lookup: the distinct rows' int64 indices and rows forward, their
    gradient backward; the device holds each lookup's staged rows until its backward."""
    torch.manual_seed(0)
    table = _host_table()
    indices = [torch.randint(0, 64, (10, 4)), torch.randint(0, 64, (10, 4))]
    outs = [table.lookup_reduce(i, torch.randn(10, 4, 1), None, 1) for i in indices]
    unique = [int(torch.unique(i).numel()) for i in indices]
    row = 8 * 4  # fp32 rows of 8
    assert table.storage.link.forward == {"d2h_indices": 8 * sum(unique), "h2d_rows": row * sum(unique)}
    assert table.storage.staged_bytes == table.storage.staged_peak == row * sum(unique)
    sum(o.sum() for o in outs).backward()
    del outs
    assert table.storage.link.backward == {"d2h_row_grads": row * sum(unique)}
    assert table.storage.staged_bytes == 0 and table.storage.staged_peak == row * sum(unique)
    grad = table.storage.take_grad()
    assert grad.is_sparse and grad.device.type == "cpu"
    assert grad.indices()[0].tolist() == torch.unique(torch.cat([i.reshape(-1) for i in indices])).tolist()


def test_host_gradient_and_step_equal_the_device_tables():
    """One lookup's sparse gradient, and RowWiseAdagrad's step with it, on both locations."""
    torch.manual_seed(1)
    host, device = _host_table(), MemoryTable(64, 8, 0.02, sparse_grad=True, device="cpu", init_key=3)
    assert torch.equal(host.weight, device.weight)
    indices, scores, blocks = torch.randint(0, 64, (12, 6)), torch.randn(12, 6, 2), torch.randint(0, 2, (12, 6))
    grad_out = torch.randn(12, 2, 8)
    for t in (host, device):
        (t.lookup_reduce(indices, scores, blocks, 2) * grad_out).sum().backward()
    host.weight.grad = host.storage.take_grad()
    assert torch.equal(host.weight.grad.to_dense(), device.weight.grad.to_dense())
    for t in (host, device):
        RowWiseAdagrad([t.weight], lr=0.1).step()
    assert torch.equal(host.weight, device.weight)


def test_host_table_stays_on_the_host_when_the_module_moves():
    table = _host_table()
    weight = table.weight
    table.to(torch.float64)
    assert table.weight is weight and weight.dtype == torch.float32 and weight.device.type == "cpu"
    device_table = MemoryTable(64, 8, 0.02, sparse_grad=True, device="cpu")
    assert device_table.to(torch.float64).weight.dtype == torch.float64


@pytest.mark.parametrize("cache_rows", [0, 6])
def test_slot_counters_live_on_the_host(cache_rows):
    """A host table's slot-hit counters are host memory (the device holds no byte per slot),
    marked from the staged rows (and, with a device cache, from the rows it served): the slot
    usage is the device table's, training lookups only."""
    host = MemoryTable(
        64, 8, 0.02, sparse_grad=True, location="host", device="cpu", init_key=3, host_cache_rows=cache_rows
    )
    device = MemoryTable(64, 8, 0.02, sparse_grad=True, device="cpu", init_key=3)
    host.to("meta")  # a move of the module leaves the counters where they are
    assert host.hits.device.type == "cpu" and host.hits.numel() == 64
    if cache_rows:
        opt = SparseAdam([host.weight], lr=0.1)
        host.storage.cache.optimizer = opt  # a stepped table: the refresh caches rows
        opt.state[host.weight].update(SparseAdam.initial_state(host.weight))
        host.storage.cache.rows.record(torch.zeros(0, dtype=torch.int64), torch.arange(6))
        host.storage.refresh()
        assert host.storage.cache.rows.sorted_rows.tolist() == list(range(6))
    for t in (host, device):
        t.lookup_reduce(torch.tensor([[1, 9], [9, 40]]), torch.ones(2, 2, 1), None, 1)
        t.eval()
        t.lookup_reduce(torch.tensor([[50, 51]]), torch.ones(1, 2, 1), None, 1)  # not counted
        t.train()
        t.lookup_reduce(torch.tensor([[3, 63]]), torch.ones(1, 2, 1), None, 1)
    assert host.pop_hit_fraction() == device.pop_hit_fraction() == 5 / 64
    assert host.pop_hit_fraction() == device.pop_hit_fraction() == 0.0


def test_union_count_in_chunks_equals_the_whole():
    import torch.distributed as dist

    from rmt.memory.distribution.local import union_count

    flags = (torch.arange(10) % 3 == 0).to(torch.uint8)
    owned = not dist.is_initialized()  # a one-process group (an earlier test's, or this one)
    if owned:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        counts = [union_count(flags, None, "cpu", chunk) for chunk in (3, 4, 10, 64)]
    finally:
        if owned:
            dist.destroy_process_group()
    assert [int(c) for c in counts] == [4] * 4 and flags.sum() == 4


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "memory.table_location 'host' steps the touched rows on the host: it needs memory.value_optimizer"),
        (
            ["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"],
            "memory.fused_value_optimizer never forms",
        ),
        (["memory.type=moe"], "memory.type 'moe' has none"),
    ],
)
def test_bad_host_settings_are_rejected(cache_dir, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides(cache_dir, HOST + extra)), world_size=1)


@pytest.fixture(scope="module")
def single(cache_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_single")
    runs = {name: tmp / f"{name}.pt" for name in ("sparse_adam", "rowwise_adagrad")}
    got = train_runs({path: overrides(cache_dir, [f"memory.value_optimizer={name}"]) for name, path in runs.items()})
    return {name: got[path] for name, path in runs.items()}


LAYOUTS = {
    # name: (optimizer, processes, overrides of the host run, reload overrides, reload processes)
    "dp2-local-async-reload-device": (
        "sparse_adam",
        2,
        ["memory.async_stream=true"],
        ["memory.table_location=device"],
        1,
    ),
    "dp2-dimension-reload-local-host": ("sparse_adam", 2, ["memory.partition=dimension"], HOST, 1),
    "tp2xdp2-number-owner-reduce-reload-P2": (
        "rowwise_adagrad",
        4,
        ["parallel.tensor_model_parallel_size=2", "memory.partition=number", "memory.owner_reduce=true"],
        HOST + ["memory.partition=number"],
        2,
    ),
    "pp2xdp2-number": (
        "sparse_adam",
        4,
        [
            "model.num_layers=4",
            "memory.placement='1:2/3:4'",
            "parallel.pipeline_model_parallel_size=2",
            "memory.partition=number",
        ],
        None,
        None,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_host_tables_equal_single_process(single, cache_dir, tmp_path, layout):
    """Three steps with host shards (DP, TP, PP; number-, dimension-wise, local; the async
    stream) == the single-process device table; the step-2 checkpoint, written from the host
    shards, reloads under another layout or location and its third step lands on the same
    weights."""
    optimizer, nproc, extra, reload, reload_nproc = LAYOUTS[layout]
    opt = [f"memory.value_optimizer={optimizer}"]
    if "parallel.pipeline_model_parallel_size=2" in extra:
        ref = train_steps(tmp_path / "ref.pt", overrides(cache_dir, opt + extra[:2]))
    else:
        ref = single[optimizer]
    ckpt = tmp_path / "ckpt"
    save = [f"train.save={ckpt}", "train.save_interval=2"] if reload is not None else []
    got = train_steps(tmp_path / "got.pt", overrides(cache_dir, opt + HOST + extra + save), nproc)
    assert_close(ref, got)
    tables = [t for rank in got["host"] for t in rank.values()]
    assert tables and all(t["staged_now"] == 0 and t["forward"]["h2d_rows"] > 0 for t in tables)
    if reload is None:
        return
    resumed = train_steps(
        tmp_path / "resumed.pt", overrides(cache_dir, opt + reload + [f"train.load={ckpt}/iter_0000002"]), reload_nproc
    )
    assert resumed["losses"] == pytest.approx(got["losses"][2:], rel=1e-5)
    for key, value in got["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("location,cache_rows", [("device", 0), ("host", 0), ("host", 16)])
def test_table_reads_a_weight_a_loader_put_in_its_place(location, cache_rows):
    """A loader that puts a new Parameter in the table's place (transformers' ``from_pretrained``,
    ``load_state_dict(assign=True)``) is read by the next lookup, and the new Parameter carries the
    table's descriptor: the lookup equals a table built with those values."""
    table = MemoryTable(64, 8, 0.02, sparse_grad=True, location=location, device="cpu", host_cache_rows=cache_rows)
    values = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    table.load_state_dict({"weight": values.clone()}, assign=True)
    want = MemoryTable(64, 8, 0.02, sparse_grad=True, device="cpu")
    want.weight.data.copy_(values)
    idx = torch.randint(0, 64, (5, 3), generator=torch.Generator().manual_seed(5))
    scores = torch.rand(5, 3, 1)
    assert torch.equal(table.lookup_reduce(idx, scores, None, 1), want.lookup_reduce(idx, scores, None, 1))
    assert descriptor(table.weight) is not None and descriptor(table.weight).storage is table.storage
