"""Sharded memory tables (UltraMem Appendix C/D) under torchrun gloo against the local table."""

import pytest
import torch

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError

from conftest import TINY_ULTRAMEM, run_python, tiny_overrides, train_steps


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_table_equals_local_and_sends_planned_bytes(nproc):
    out = run_python(["tests/dist/memory_parallel_table.py"], nproc=nproc).stdout
    for name in ("number", "number+owner_reduce", "dimension"):
        assert out.count(f"OK {name} P={nproc} ") == 3, out  # balanced, ragged, tensor_parallel=2
        assert out.count(f"OK {name} bf16 P={nproc} ") == 1, out  # 2-byte rows, 4-byte scores
        assert out.count(f"OK {name} bf16-scores P={nproc} ") == 1, out  # autocast's scores, widened


def memory_overrides(cache_dir):
    return tiny_overrides(cache_dir) + TINY_ULTRAMEM


@pytest.fixture(scope="module")
def local_run(cache_dir, tmp_path_factory):
    return train_steps(tmp_path_factory.mktemp("memory_parallel") / "local.pt", memory_overrides(cache_dir))


def assert_same_training(ref, got):
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert "memory.0.values.weight" in got["params"]
    for kind in ("params", "grads"):
        for key, value in ref[kind].items():
            torch.testing.assert_close(got[kind][key], value, rtol=1e-5, atol=1e-5, msg=f"{kind} {key}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc,extra,reload,reload_nproc",
    [
        (
            4,
            [
                "parallel.tensor_model_parallel_size=2",
                "memory.partition=number",
                "memory.owner_reduce=true",
                "memory.group_size=2",
            ],
            ["memory.partition=number"],
            1,
        ),
        (2, ["memory.partition=dimension", "memory.async_stream=true"], [], 1),
        (
            4,
            ["memory.partition=number", "train.micro_batch_size=1"],
            ["memory.partition=number", "train.micro_batch_size=1"],
            2,
        ),
    ],
    ids=["tp2xdp2-number-owner-reduce-groups-of-2", "dp2-dimension-async", "dp4-number-P4-reload-P2"],
)
def test_sharded_training_equals_single_process(cache_dir, tmp_path, local_run, nproc, extra, reload, reload_nproc):
    """Three AdamW steps (clipping on) with the sharded table (outside DDP, gradients through
    the collectives, replicas all-reduced; async memory stream in the second case) == the
    single-process local synchronous table. The step-2 checkpoint (table and AdamW moments
    as shards of the global table) loads under another group size (P=2 -> 1, P=4 -> 2) or as
    the local table, and its third step lands on the same weights."""
    ckpt = tmp_path / "ckpt"
    sharded = train_steps(
        tmp_path / "sharded.pt",
        memory_overrides(cache_dir) + extra + [f"train.save={ckpt}", "train.save_interval=2"],
        nproc,
    )
    assert_same_training(local_run, sharded)
    resumed = train_steps(
        tmp_path / "resumed.pt",
        memory_overrides(cache_dir) + reload + [f"train.load={ckpt}/iter_0000002"],
        reload_nproc,
    )
    assert resumed["losses"] == pytest.approx(sharded["losses"][2:], rel=1e-5)
    for key, value in sharded["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)


def _config(cache_dir, extra):
    return load_config(None, memory_overrides(cache_dir) + extra)


def test_validation_rejects_bad_memory_parallel_settings(cache_dir):
    tp2 = ["parallel.tensor_model_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"memory.group_size \(3\) must divide the data x tensor parallel size \(4\)"):
        validate(_config(cache_dir, tp2 + ["memory.partition=number", "memory.group_size=3"]), world_size=4)
    with pytest.raises(ConfigError, match=r"slot count \(9\) to be divisible by the memory-parallel group size \(2\)"):
        validate(_config(cache_dir, ["memory.partition=number", "memory.num_keys=3", "memory.topk=2"]), world_size=2)
    with pytest.raises(ConfigError, match="memory.partition must be one of"):
        validate(_config(cache_dir, ["memory.partition=rows"]), world_size=1)
    with pytest.raises(ConfigError, match="memory.owner_reduce needs"):
        validate(_config(cache_dir, ["memory.partition=dimension", "memory.owner_reduce=true"]), world_size=2)
    validate(_config(cache_dir, tp2 + ["memory.partition=auto", "memory.group_size=2"]), world_size=4)


def test_auto_partition_is_the_planners_training_step_choice():
    """``auto`` picks the partition with fewer bytes per step (forward + backward): wide values
    and many lookups favour dimension-wise, narrow values number-wise (Appendix D, Fig. 9)."""
    from rmt.memory.comm_volume import plan_comm
    from rmt.memory.distribution import resolve_partition

    plan = {"tokens": 64, "topm": 32, "ive": 4, "cores": 2}
    for dim, slots, expected in (
        (512, 1 << 20, "dimension"),
        (4, 1 << 20, "number"),
        (32, 1 << 20, "dimension"),
        (32, 256, "number"),
    ):
        choice = plan_comm(
            64, 32, dim, 4, phase="forward_backward", ive=4, cores=2, value_bytes=4, dedup=True, slots=slots
        )["choice"]
        assert choice == expected
        assert resolve_partition("auto", slots, dim, 4, plan, False, 4) == expected
    # a small table repeats rows, so dedup makes number-wise win where it otherwise loses
    assert plan_comm(64, 32, 32, 4, phase="forward_backward", ive=4, cores=2, value_bytes=4)["choice"] == "dimension"
    # a bf16 table trained in fp32: 2-byte rows, 4-byte scores and pooled slices; counting the
    # scores at the table's 2 bytes would pick dimension-wise, which sends more
    mixed = dict(plan, activation_bytes=4)
    for dim in (16, 24):
        assert resolve_partition("auto", 1 << 20, dim, 4, plan, False, 2) == "dimension"
        assert resolve_partition("auto", 1 << 20, dim, 4, mixed, False, 2) == "number"
        costs = plan_comm(
            64,
            32,
            dim,
            4,
            phase="forward_backward",
            ive=4,
            cores=2,
            value_bytes=2,
            activation_bytes=4,
            dedup=True,
            slots=1 << 20,
        )
        assert costs["number_bytes"] < costs["dimension_bytes"]
    assert resolve_partition("number", 1 << 20, 512, 4, None, False, 4) == "number"
    with pytest.raises(ValueError, match="partition 'auto' needs plan"):
        resolve_partition("auto", 1 << 20, 512, 4, None, False, 4)
