"""The README's main-job command and the single-node launcher run (a few steps)."""

import json
import os
import subprocess

import pytest

from conftest import ROOT, _env, tiny_overrides

pytestmark = pytest.mark.slow


def test_quickstart_command_trains_with_falling_loss(cache_dir, tmp_path):
    proc = subprocess.run(
        [
            "bash",
            "launch/quickstart.sh",
            "train.steps=12",
            "train.warmup_steps=2",
            "train.eval_interval=6",
            "train.eval_iters=1",
            f"train.tensorboard_dir={tmp_path}/tb",
            f"data.cache_dir={cache_dir}",
            "data.max_documents=40",
            "data.split=90,10,0",
            "train.log_interval=6",
        ],
        cwd=ROOT,
        env=dict(_env()),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "train: 100%" in proc.stderr  # the progress bar
    logged = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert [int(w[1]) for w in logged] == [6, 12] and all("val_loss" in w for w in logged)
    assert float(logged[-1][3]) < float(logged[0][3]) < 6.0
    (run,) = os.listdir(tmp_path / "tb")  # the run's own TensorBoard subdirectory
    assert f"TensorBoard logs: '{tmp_path / 'tb' / run}'" in proc.stdout
    events = [f for f in os.listdir(tmp_path / "tb" / run) if f.startswith("events.out.tfevents")]
    assert events and "\nfinished: step 12 of 12; no checkpoint saved\n" in proc.stdout


def test_single_node_launcher_runs_two_processes(cache_dir, tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run(
        ["bash", "launch/torchrun_single_node.sh"]
        + tiny_overrides(cache_dir, steps=4)
        + ["parallel.tensor_model_parallel_size=2", "--json", str(out)],
        cwd=ROOT,
        env=dict(_env(), NPROC="2", MASTER_PORT=str(_port())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [m["lm loss"] for m in json.load(open(out))["history"]]
    assert len(losses) == 4 and losses[-1] < losses[0]


def _port():
    from conftest import free_port

    return free_port()
