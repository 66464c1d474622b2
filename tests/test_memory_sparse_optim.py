"""Memory value tables trained with sparse (touched-row) gradients and a row-wise optimizer
(``memory.value_optimizer``), through the trainer: the first SparseAdam step equals the dense
AdamW step, and data-parallel / sharded runs (with a checkpoint resharded on reload) equal the
single process (fp32, 1e-5)."""

import pytest
import torch

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError

from conftest import TINY_ULTRAMEM, tiny_overrides, train_steps


def overrides(cache_dir, extra=(), steps=3):
    return tiny_overrides(cache_dir, steps) + TINY_ULTRAMEM + list(extra)


def assert_same(ref, got, tol=1e-5):
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol, abs=tol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol)
    for kind in ("params", "grads"):
        assert sorted(got[kind]) == sorted(ref[kind])
        for key, value in ref[kind].items():
            torch.testing.assert_close(got[kind][key], value, rtol=tol, atol=tol, msg=f"{kind} {key}")


@pytest.mark.slow
def test_first_sparse_adam_step_equals_adamw(cache_dir, tmp_path):
    """Step 1 of Adam is lr * g / (|g| + eps') on every element with a gradient and nothing
    elsewhere, lazy or not (SparseAdam adds eps before the bias correction, AdamW after it, so
    eps is made negligible): SparseAdam on the touched rows must land where AdamW does."""
    one_step = ["train.warmup_steps=0", "train.adam_eps=1e-30"]
    dense = train_steps(tmp_path / "dense.pt", overrides(cache_dir, one_step, steps=1))
    sparse = train_steps(
        tmp_path / "sparse.pt", overrides(cache_dir, one_step + ["memory.value_optimizer=sparse_adam"], steps=1)
    )
    grad = sparse["grads"]["memory.0.values.weight"]
    touched = grad.abs().sum(1) > 0
    assert 0 < int(touched.sum()) < grad.shape[0]  # some rows untouched: the sparse path matters
    assert_same(dense, sparse, tol=1e-6)


@pytest.fixture(scope="module")
def single(cache_dir, tmp_path_factory):
    tmp, runs = tmp_path_factory.mktemp("sparse_single"), {}

    def get(optimizer):
        if optimizer not in runs:
            runs[optimizer] = train_steps(
                tmp / f"{optimizer}.pt", overrides(cache_dir, [f"memory.value_optimizer={optimizer}"])
            )
        return runs[optimizer]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer,nproc,extra,reload,reload_nproc",
    [
        ("sparse_adam", 2, [], [], 1),
        (
            "rowwise_adagrad",
            4,
            ["parallel.tensor_model_parallel_size=2", "memory.partition=number"],
            ["memory.partition=number"],
            2,
        ),
        ("sparse_adam", 2, ["memory.partition=dimension"], [], 1),
    ],
    ids=["dp2-local-sparse-adam", "tp2xdp2-number-rowwise-adagrad-reload-P2", "dp2-dimension-sparse-adam"],
)
def test_parallel_sparse_value_training_equals_single_process(
    single, cache_dir, tmp_path, optimizer, nproc, extra, reload, reload_nproc
):
    """Three steps (clipping on): sparse gradients summed over the data-parallel group (local
    tables) or arriving through the shard collectives == the single process. The step-2
    checkpoint (table, moments or per-row accumulators as shards of global tensors) reloads
    under another layout and its third step lands on the same weights."""
    ref = single(optimizer)
    opt = [f"memory.value_optimizer={optimizer}"]
    ckpt = tmp_path / "ckpt"
    got = train_steps(
        tmp_path / "got.pt", overrides(cache_dir, opt + extra + [f"train.save={ckpt}", "train.save_interval=2"]), nproc
    )
    assert_same(ref, got)
    assert ref["losses"][2] < ref["losses"][0]
    resumed = train_steps(
        tmp_path / "resumed.pt", overrides(cache_dir, opt + reload + [f"train.load={ckpt}/iter_0000002"]), reload_nproc
    )
    assert resumed["losses"] == pytest.approx(got["losses"][2:], rel=1e-5)
    for key, value in got["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_value_optimizer_validation(cache_dir):
    with pytest.raises(
        ConfigError, match="memory.value_optimizer must be one of 'adamw', 'sparse_adam', 'rowwise_adagrad'"
    ):
        validate(load_config(None, overrides(cache_dir, ["memory.value_optimizer=sgd"])), world_size=1)
    with pytest.raises(ConfigError, match="needs memory.partition 'local' or 'number', got 'dimension'"):
        validate(
            load_config(
                None, overrides(cache_dir, ["memory.value_optimizer=rowwise_adagrad", "memory.partition=dimension"])
            ),
            world_size=2,
        )
    with pytest.raises(ConfigError, match="MoE experts are dense"):
        validate(
            load_config(None, overrides(cache_dir, ["memory.type=moe", "memory.value_optimizer=sparse_adam"])),
            world_size=1,
        )
