"""tools/bench_recurrent.py: a seconds-long selective-copy run end to end (curriculum rows with
wall and CPU seconds, the summary of the task that ran) and the rejection of bad input (exit status 2, one sentence)."""

import json

import pytest

from conftest import run_python


def test_quick_selective_copy_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_python(["tools/bench_recurrent.py", "--quick", "--tasks", "selective_copy", "--no-decode",
                "--max-steps", "4", "--eval-interval", "2", "--eval-samples", "4", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_recurrent" and doc["machine"]["quick"] is True
    curriculum = [r for r in doc["rows"] if r["part"] == "curriculum"]
    assert [r["step"] for r in curriculum] == [2, 4]
    assert all(r["task"] == "selective_copy" and r["cpu_s"] > 0 and r["noise_length"] == 8 for r in curriculum)
    result = next(r for r in doc["rows"] if r["part"] == "result")
    assert result["steps"] == 4 and result["train_cpu_s"] >= curriculum[-1]["cpu_s"]
    summary = doc["summary"]
    assert sorted(summary) == ["max_noise_tokens", "selective_copy_accuracy"]
    assert 0.0 <= summary["selective_copy_accuracy"] <= 1.0 and summary["max_noise_tokens"] in (8, 16)


def test_lr_cooldown_falls_linearly_over_the_budgets_last_fraction(tmp_path):
    """Over the last half of 8 steps the learning rate of 1e-3 falls linearly toward the floor:
    the step that starts at 5/8 of the budget runs at 1e-3 x (3/8) / (1/2) = 7.5e-4, and so on."""
    out = tmp_path / "bench.json"
    run_python(["tools/bench_recurrent.py", "--quick", "--tasks", "selective_copy", "--no-decode",
                "--max-steps", "8", "--eval-interval", "1", "--eval-samples", "4", "--lr-cooldown", "0.5",
                "--json", str(out), "train.warmup_steps=0"])
    rows = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "curriculum"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["lr"] for r in rows] == pytest.approx([1e-3] * 5 + [7.5e-4, 5e-4, 2.5e-4], rel=1e-12)


@pytest.mark.parametrize("args, message", [
    (["--lr-cooldown", "1"], "--lr-cooldown must lie in [0, 1), got 1.0"),
    (["--tasks", "copy,sort"], "--tasks must name copy and/or selective_copy, got 'copy,sort'"),
    (["--tasks", "copy", "model.recurrent_alpha=2"], "model.recurrent_alpha must lie in [0, 1], got 2.0"),
])
def test_bad_input_is_rejected(args, message):
    proc = run_python(["tools/bench_recurrent.py"] + args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"bench_recurrent: {message}"
