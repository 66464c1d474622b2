"""The at-scale example (``configs/ultramem_7b_tp8.yaml``: a 7B-class transformer with a
10^9-slot UltraMem table, TP 8, distributed optimizer, bf16, selective recomputation, sequence
parallelism) validates for its 512 ranks (on this machine only with ``train.ignore_memory_plan``:
a CPU rank here cannot hold its plan) and is planned without running; its tiny twin trains
with every one of those switches on 4 gloo ranks, saves, and resumes."""

import json
import os

import pytest

from conftest import _env, rmt_train, run_python

pytestmark = pytest.mark.slow

SCALE = "configs/ultramem_7b_tp8.yaml"
TINY = "configs/ultramem_7b_tp8_tiny.yaml"


def test_at_scale_config_validates_for_its_world_and_is_planned():
    import subprocess
    import sys

    import torch

    from conftest import ROOT

    env = dict(_env(), WORLD_SIZE="512")

    def check(*overrides):
        command = [sys.executable, "-m", "rmt.training.cli", "--config", SCALE, "--check", *overrides]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    # a rank of this machine (its CPU memory, not an 80 GiB GPU) cannot hold the plan: refused
    refused = check()
    assert torch.cuda.is_available() or (
        refused.returncode == 2 and "so it would run out of memory" in refused.stderr
    ), refused.stderr[-3000:]
    valid = check("train.ignore_memory_plan=true")
    assert valid.returncode == 0, valid.stderr[-3000:]
    assert "config OK" in valid.stdout + valid.stderr
    plan = run_python(["-m", "rmt.planner.cli", "memory", "--config", SCALE, "--world-size", "512", "--device", "gpu"])
    assert "1,001,595,904 slots (31,648^2) x 2048, bf16, rowwise_adagrad, number-wise over P=512" in plan.stdout


def test_tiny_twin_trains_and_resumes_on_four_ranks(cache_dir, tmp_path):
    common = [
        "--config",
        TINY,
        f"data.cache_dir={cache_dir}",
        "data.max_documents=60",
        "train.progress=false",
        f"train.save={tmp_path / 'ckpt'}",
        "train.steps=6",
        "train.eval_interval=3",
        "train.log_interval=1",
    ]
    first = rmt_train(common + ["train.exit_interval=3", "--json", str(tmp_path / "a.json")], nproc=4)
    assert "stopped at step 3 of 6" in first.stdout
    second = rmt_train(common + ["--json", str(tmp_path / "b.json")], nproc=4)
    assert "resumed from iteration 3 of 6" in second.stdout
    losses = [m["lm loss"] for name in ("a", "b") for m in json.load(open(tmp_path / f"{name}.json"))["history"]]
    assert len(losses) == 6 and all(l == l for l in losses)
    assert losses[-1] < losses[0]
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000006")
