"""``memory.fused_value_optimizer``: the value tables stepped inside their lookups' backward,
through the trainer, against the unfused path (sparse gradient, then the optimizer step) and
across layouts. Two micro-batches per step in the single process (the last one's backward steps
the table with both), one per rank at DP 2. What changes is checked as stated in
rmt/ops/fused_update.py: the value rows step unclipped, everything else is the unfused run's."""

import pytest
import torch
from test_memory_sparse_optim import overrides

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError

from conftest import train_steps

VALUES = "memory.0.values.weight"


def assert_same(ref, got, tol=1e-5, skip=()):
    assert got["losses"] == pytest.approx(ref["losses"], rel=tol, abs=tol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol)
    for key, value in ref["params"].items():
        if key not in skip:
            torch.testing.assert_close(got["params"][key], value, rtol=tol, atol=tol, msg=key)


def fused_args(cache_dir, optimizer, extra=(), steps=3):
    warmup = ["train.warmup_steps=0"] if steps == 1 else []
    return overrides(cache_dir, [f"memory.value_optimizer={optimizer}", *warmup, *extra], steps=steps)


@pytest.fixture(scope="module")
def unfused(cache_dir, tmp_path_factory):
    tmp, runs = tmp_path_factory.mktemp("fused_ref"), {}

    def get(optimizer, extra=(), steps=3):
        key = (optimizer, tuple(extra), steps)
        if key not in runs:
            runs[key] = train_steps(tmp / f"{len(runs)}.pt", fused_args(cache_dir, optimizer, extra, steps))
        return runs[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sparse_adam", "rowwise_adagrad"])
def test_fused_training_equals_unfused_without_clipping(unfused, cache_dir, tmp_path, optimizer):
    """Clipping off (grad_norm still reported): losses, grad norms (the fused kernel's squared
    norm) and every parameter equal the unfused run over three steps of two micro-batches; the
    fused tables end with no gradient."""
    extra = ["train.clip_grad=0"]
    ref = unfused(optimizer, extra)
    got = train_steps(
        tmp_path / "fused.pt", fused_args(cache_dir, optimizer, extra + ["memory.fused_value_optimizer=true"])
    )
    assert_same(ref, got)
    assert not torch.equal(got["params"][VALUES], unfused(optimizer, extra, steps=1)["params"][VALUES])
    assert float(got["grads"][VALUES].abs().sum()) == 0.0 and float(ref["grads"][VALUES].abs().sum()) > 0


@pytest.mark.slow
def test_clipping_with_fused_values(unfused, cache_dir, tmp_path):
    """Clipping on and active: grad_norm and every other parameter are the unfused run's; the value
    rows step with their unclipped gradient, i.e. as in the unfused run without clipping."""
    clip = ["train.clip_grad=0.01"]
    clipped, unclipped = unfused("sparse_adam", clip, steps=1), unfused("sparse_adam", ["train.clip_grad=0"], steps=1)
    assert clipped["grad_norms"][0] > 0.01  # clipping acts
    got = train_steps(
        tmp_path / "fused.pt",
        fused_args(cache_dir, "sparse_adam", clip + ["memory.fused_value_optimizer=true"], steps=1),
    )
    assert_same(clipped, got, skip=(VALUES,))
    torch.testing.assert_close(got["params"][VALUES], unclipped["params"][VALUES], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer,nproc,extra",
    [
        ("sparse_adam", 2, []),
        ("rowwise_adagrad", 4, ["parallel.tensor_model_parallel_size=2", "memory.partition=number"]),
        ("sparse_adam", 2, ["memory.partition=dimension"]),
        ("sparse_adam", 2, ["memory.partition=number", "memory.owner_reduce=true"]),
    ],
    ids=["dp2-local-adam", "tp2xdp2-number-adagrad", "dp2-dimension-adam", "dp2-owner-reduce-adam"],
)
def test_parallel_fused_training_equals_single_unfused(unfused, cache_dir, tmp_path, optimizer, nproc, extra):
    """The data-parallel sum of a replicated table (its lookups all-gathered over DP before the
    step) and the sharded routes' gradient collectives (the owners' fused lookups), with a
    checkpoint written by the fused run and resumed unfused: == the single unfused process."""
    base = ["train.clip_grad=0"]
    ref = unfused(optimizer, base)
    ckpt = tmp_path / "ckpt"
    got = train_steps(
        tmp_path / "got.pt",
        fused_args(
            cache_dir,
            optimizer,
            base + extra + ["memory.fused_value_optimizer=true", f"train.save={ckpt}", "train.save_interval=2"],
        ),
        nproc,
    )
    assert_same(ref, got)
    resumed = train_steps(
        tmp_path / "resumed.pt", fused_args(cache_dir, optimizer, base + [f"train.load={ckpt}/iter_0000002"])
    )
    assert resumed["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
    for key, value in ref["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_fused_value_optimizer_needs_a_row_wise_optimizer(cache_dir):
    with pytest.raises(ConfigError, match="needs memory.value_optimizer 'sparse_adam' or 'rowwise_adagrad'"):
        validate(load_config(None, overrides(cache_dir, ["memory.fused_value_optimizer=true"])), world_size=1)
