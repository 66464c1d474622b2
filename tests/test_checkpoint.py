"""Checkpoints: exact resume, resume under a different data-parallel size, resharding TP=2 ->
TP=1, atomic layout on disk, and clear errors for missing or corrupt checkpoints."""

import json
import os

import pytest

from conftest import rmt_train, tiny_overrides


def _losses(path):
    with open(path) as f:
        return [m["lm loss"] for m in json.load(f)["history"]]


@pytest.fixture(scope="module")
def six_steps(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("six") / "six.json"
    rmt_train(tiny_overrides(cache_dir, steps=6) + ["--json", str(out)])
    return _losses(out)


def test_resume_gives_identical_loss_sequence(six_steps, cache_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.save={ckpt}", "train.exit_interval=3",
                                                    "--json", str(first)])
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "latest"]
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.load={ckpt}", "--json", str(second)])
    assert _losses(first) + _losses(second) == six_steps


def test_resume_under_different_data_parallel_size(six_steps, cache_dir, tmp_path):
    """Samples are ordered globally, so DP=1 -> DP=2 with the same global batch continues on
    exactly the same data; only reduction order differs."""
    ckpt = tmp_path / "ckpt"
    second = tmp_path / "b.json"
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.save={ckpt}", "train.exit_interval=3"])
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.load={ckpt}", "--json", str(second)], nproc=2)
    assert _losses(second) == pytest.approx(six_steps[3:], abs=1e-5)


def test_save_tp2_load_tp1_same_validation_loss(cache_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    trained, evaluated = tmp_path / "a.json", tmp_path / "b.json"
    common = tiny_overrides(cache_dir, steps=2) + ["train.eval_iters=2", "train.eval_interval=2",
                                                   "data.split=80,20,0"]
    rmt_train(common + ["parallel.tensor_model_parallel_size=2", f"train.save={ckpt}",
                        "--json", str(trained)], nproc=2)
    rmt_train(common + [f"train.load={ckpt}", "--eval-only", "--json", str(evaluated)])
    with open(trained) as f:
        at_save = json.load(f)["history"][-1]["val_loss"]
    with open(evaluated) as f:
        reloaded = json.load(f)
    assert reloaded["iteration"] == 2
    assert reloaded["val_loss"] == pytest.approx(at_save, abs=1e-5)


def test_missing_and_corrupt_checkpoints_exit_2(cache_dir, tmp_path):
    missing = rmt_train(tiny_overrides(cache_dir) + [f"train.load={tmp_path}/nope"], check=False)
    assert missing.returncode == 2
    assert "train.load directory" in missing.stderr and "does not exist" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = rmt_train(tiny_overrides(cache_dir) + [f"train.load={empty}"], check=False)
    assert bad.returncode == 2
    assert "is not a checkpoint directory" in bad.stderr
    assert "Traceback" not in bad.stderr
