"""tools/bench_recurrent.py: a seconds-long selective-copy run end to end (curriculum rows with
wall and CPU seconds, the summary of the task that ran), several seeds in processes of their own,
and the rejection of bad input (exit status 2, one sentence)."""

import json
import os

import pytest
import torch

from conftest import load_script, run_python

pytestmark = pytest.mark.slow


def _bench():
    return load_script("tools/bench_recurrent.py")


def run_bench(args):
    """``tools/bench_recurrent.py ARGS`` in this process (a subprocess would spend seconds importing
    torch and megatron-core); the thread count its runs set is put back. The command line itself
    is tested below."""
    threads = torch.get_num_threads()
    try:
        assert _bench().main(args) == 0
    finally:
        torch.set_num_threads(threads)


def test_quick_selective_copy_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_bench(
        [
            "--quick",
            "--tasks",
            "selective_copy",
            "--no-decode",
            "--max-steps",
            "4",
            "--eval-interval",
            "2",
            "--eval-samples",
            "4",
            "--json",
            str(out),
        ]
    )
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


def test_accuracy_by_block_and_the_saved_model(tmp_path):
    """Copy puts the 16 data tokens at positions 0-15, blocks 0 and 1 of width 8: 8 recall tokens
    of each of the 4 samples per block, and the task's accuracy is their mean. Selective copy
    scatters them, but the counts still add up to 16 per sample. With --ema-decay 0 the saved state
    dict is the trained model's (its alpha is the last evaluation's). ``--eval-noise`` measures the same
    samples again at the noise length trained (the curriculum held at 8), and at a longer one."""
    out = tmp_path / "bench.json"
    run_bench(
        [
            "--quick",
            "--tasks",
            "copy,selective_copy",
            "--no-decode",
            "--max-steps",
            "4",
            "--eval-interval",
            "2",
            "--eval-samples",
            "4",
            "--save-model",
            str(tmp_path / "m"),
            "--eval-noise",
            "8,40",
            "--ema-decay",
            "0",
            "--json",
            str(out),
            "data.curriculum_threshold=0",
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    result = {r["task"]: r for r in rows if r["part"] == "result"}
    by_block = result["copy"]["accuracy_by_block"]
    assert [(b, n) for b, _, n in by_block] == [(0, 32), (1, 32)]
    assert result["copy"]["accuracy"] == pytest.approx((by_block[0][1] + by_block[1][1]) / 2, rel=1e-6)
    scattered = result["selective_copy"]["accuracy_by_block"]
    assert sum(n for _, _, n in scattered) == 64 and all(0 <= b < 3 for b, _, _ in scattered)
    assert result["selective_copy"]["accuracy"] == pytest.approx(sum(a * n for _, a, n in scattered) / 64, rel=1e-6)
    for task in ("copy", "selective_copy"):
        assert result[task]["noise_length"] == 8 and sorted(result[task]["accuracy_at_noise"]) == ["40", "8"]
        assert result[task]["accuracy_at_noise"]["8"] == result[task]["accuracy"]
        assert 0.0 <= result[task]["accuracy_at_noise"]["40"] <= 1.0
        state = torch.load(tmp_path / "m" / f"{task}_seed1234.pt")
        last = [r for r in rows if r["part"] == "curriculum" and r["task"] == task][-1]
        assert state["layers.0.alpha"].item() == last["alpha"]


@pytest.mark.parametrize(
    "flags, learned", [(["--alpha", "0.07", "--no-learn-alpha"], False), (["--alpha", "0.07", "--learn-alpha"], True)]
)
def test_alpha_is_fixed_unless_learned(tmp_path, flags, learned):
    """``--alpha`` sets the accumulation scalar's start; with ``--no-learn-alpha`` every evaluation
    reports exactly that value (float32), with ``--learn-alpha`` the optimizer has moved it."""
    out = tmp_path / "bench.json"
    run_bench(
        [
            "--quick",
            "--tasks",
            "selective_copy",
            "--no-decode",
            "--max-steps",
            "4",
            "--eval-interval",
            "2",
            "--eval-samples",
            "4",
            "--json",
            str(out),
        ]
        + flags
    )
    alphas = [r["alpha"] for r in json.loads(out.read_text())["rows"] if r["part"] == "curriculum"]
    start = torch.tensor(0.07, dtype=torch.float32).item()
    assert len(alphas) == 2
    assert all(a != start for a in alphas) if learned else alphas == [start, start]


def test_lr_cooldown_falls_linearly_over_the_budgets_last_fraction(tmp_path):
    """Over the last half of 8 steps the learning rate of 1e-3 falls linearly toward the floor:
    the step that starts at 5/8 of the budget runs at 1e-3 x (3/8) / (1/2) = 7.5e-4, and so on."""
    out = tmp_path / "bench.json"
    run_bench(
        [
            "--quick",
            "--tasks",
            "selective_copy",
            "--no-decode",
            "--max-steps",
            "8",
            "--eval-interval",
            "1",
            "--eval-samples",
            "4",
            "--lr-cooldown",
            "0.5",
            "--json",
            str(out),
            "train.warmup_steps=0",
        ]
    )
    rows = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "curriculum"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["lr"] for r in rows] == pytest.approx([1e-3] * 5 + [7.5e-4, 5e-4, 2.5e-4], rel=1e-12)


def test_lr_cooldown_from_target_falls_linearly_from_the_arrival(tmp_path):
    """With ``--lr-cooldown-from target`` the decay starts where the curriculum reaches the target:
    a threshold of 100 doubles 8 -> 16 at the first evaluation, so step 2 (1/8 of the budget
    spent) runs at 1e-3 x 0.8 (the doubling's factor) and step i after it at 8e-4 x (8 - (i-1)) / 7."""
    out = tmp_path / "bench.json"
    run_bench(
        [
            "--quick",
            "--tasks",
            "selective_copy",
            "--no-decode",
            "--max-steps",
            "8",
            "--eval-interval",
            "1",
            "--eval-samples",
            "4",
            "--lr-cooldown-from",
            "target",
            "--json",
            str(out),
            "train.warmup_steps=0",
            "data.curriculum_threshold=100",
        ]
    )
    rows = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "curriculum"]
    assert [r["noise_length"] for r in rows] == [8] + [16] * 7
    assert [r["lr"] for r in rows] == pytest.approx([1e-3] + [8e-4 * (9 - i) / 7 for i in range(2, 9)], rel=1e-12)


def test_seeds_run_in_processes_of_their_own_and_are_summarized(tmp_path):
    """Three seeds, two at a time: each seed's run is the single run of that seed (the same
    rows), and the summary's accuracies are theirs."""
    out = tmp_path / "bench.json"
    quick = [
        "tools/bench_recurrent.py",
        "--quick",
        "--tasks",
        "selective_copy",
        "--no-decode",
        "--max-steps",
        "4",
        "--eval-interval",
        "2",
        "--eval-samples",
        "4",
        "--threads",
        "1",
    ]
    run_python(quick + ["--seeds", "1,2,3", "--jobs", "2", "--json", str(out)])
    doc = json.loads(out.read_text())
    single = tmp_path / "seed2.json"
    run_bench(quick[1:] + ["--json", str(single), "train.seed=2"])
    one = json.loads(single.read_text())
    curriculum = [r for r in doc["rows"] if r["part"] == "curriculum"]
    assert sorted((r["seed"], r["step"]) for r in curriculum) == [(s, i) for s in (1, 2, 3) for i in (2, 4)]
    losses = {s: [r["val_loss"] for r in curriculum if r["seed"] == s] for s in (1, 2, 3)}
    assert len({tuple(v) for v in losses.values()}) == 3  # the seeds differ
    assert losses[2] == [r["val_loss"] for r in one["rows"] if r["part"] == "curriculum"]
    results = {r["seed"]: r["accuracy"] for r in doc["rows"] if r["part"] == "result"}
    summary = doc["summary"]
    assert summary["seeds"] == [1, 2, 3] and doc["machine"]["jobs"] == 2
    assert summary["selective_copy_accuracy_per_seed"] == [results[1], results[2], results[3]]
    assert results[2] == one["summary"]["selective_copy_accuracy"]
    assert summary["selective_copy_accuracy"] == pytest.approx(sum(results.values()) / 3, rel=1e-12)
    assert summary["selective_copy_accuracy_min"] == min(results.values())


@pytest.mark.parametrize("init_std", [None, 0.03])
def test_init_std_sets_the_weights_scale(tmp_path, init_std):
    """The model starts from N(0, --init-std) weights (default 0.06): after one step at a learning
    rate of 1e-9 the saved token embedding still has that scale and the residual branch's output
    projection that scale / sqrt(2). The sample standard deviation of n normal draws has a relative
    standard error of 1 / sqrt(2n): 1.1% for the embedding's 4,096, 2.2% for the projection's
    1,024; the bounds are five of those."""
    extra = [] if init_std is None else ["--init-std", str(init_std)]
    run_bench(
        [
            "--quick",
            "--tasks",
            "copy",
            "--no-decode",
            "--max-steps",
            "1",
            "--eval-interval",
            "1",
            "--eval-samples",
            "4",
            "--lr",
            "1e-9",
            "--save-model",
            str(tmp_path / "m"),
            "--json",
            str(tmp_path / "bench.json"),
        ]
        + extra
    )
    state = torch.load(tmp_path / "m" / "copy_seed1234.pt")
    std = init_std or 0.06
    assert state["embedding.weight"].shape == (128, 32)
    assert state["embedding.weight"].std().item() == pytest.approx(std, rel=0.055)
    proj = state["layers.0.layer.self_attention.linear_proj.weight"]
    assert proj.std().item() == pytest.approx(std / 2**0.5, rel=0.11)


QUICK_STOP = [
    "--quick",
    "--tasks",
    "selective_copy",
    "--no-decode",
    "--noise-target",
    "8",
    "--max-steps",
    "6",
    "--eval-interval",
    "2",
    "--eval-samples",
    "4",
    "--stop-loss",
    "100",
    "--threads",
    "1",
]


@pytest.mark.parametrize("confirm", [300, 0])
def test_the_stop_rule_is_confirmed_on_heldout_samples(tmp_path, confirm):
    """At the target (8 noise tokens from the start) an evaluation below --stop-loss 100 ends the
    run at step 2 once the held-out check agrees (--stop-accuracy 0: any accuracy does; logged as a
    ``stop_check`` row over --stop-confirm samples, in batches of 256 and 44 here: the saved model's
    accuracy on all 300, up to the rounding of the batches' fp32 fractions); with --stop-confirm 0
    the evaluation alone ends it."""
    out = tmp_path / "bench.json"
    run_bench(
        QUICK_STOP
        + [
            "--stop-confirm",
            str(confirm),
            "--stop-accuracy",
            "0",
            "--save-model",
            str(tmp_path / "m"),
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows if r["part"] == "curriculum"] == [2]
    assert next(r for r in rows if r["part"] == "result")["steps"] == 2
    checks = [r for r in rows if r["part"] == "stop_check"]
    if not confirm:
        assert checks == []
        return
    assert [(c["step"], c["samples"], c["stop"]) for c in checks] == [(2, 300, True)]
    # the same accuracy from the saved model on validation samples 30,000..30,299
    bench = _bench()
    args, _, _ = bench.parse_args(QUICK_STOP + ["--stop-confirm", str(confirm)])
    from rmt import parallel
    from rmt.data.tasks import recall_accuracy
    from rmt.training.trainer import Trainer

    config = bench.task_config("selective_copy", args)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        model = trainer.chunks[0].module
        model.load_state_dict(torch.load(tmp_path / "m" / "selective_copy_seed1234.pt"))
        logits, batch = bench.validation_logits(model.eval(), trainer.valid_ds, 8, 30_000, 300)
        assert checks[0]["heldout_accuracy"] == pytest.approx(
            recall_accuracy(logits, batch["labels"], batch["loss_mask"], 16), rel=1e-6
        )
    finally:
        parallel.destroy()


@pytest.mark.parametrize("decay", [0.5, 0])
def test_the_run_delivers_the_weight_average(tmp_path, decay):
    """With --ema-decay the curriculum rows carry the average's validation loss beside the trained
    weights', and the saved model is the average: evaluated again it gives the last row's
    ``val_loss_ema`` (the validation batch is the same fixed samples); with 0 it is the trained
    weights and gives ``val_loss``."""
    out = tmp_path / "bench.json"
    run_bench(
        QUICK_STOP
        + [
            "--stop-loss",
            "0",
            "--max-steps",
            "4",
            "--ema-decay",
            str(decay),
            "--save-model",
            str(tmp_path / "m"),
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    last = [r for r in rows if r["part"] == "curriculum"][-1]
    result = next(r for r in rows if r["part"] == "result")
    bench = _bench()
    args, _, _ = bench.parse_args(QUICK_STOP + ["--ema-decay", str(decay)])
    from rmt import parallel
    from rmt.training.trainer import Trainer

    config = bench.task_config("selective_copy", args)
    assert config.train.ema_decay == (decay or None)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        trainer.chunks[0].module.load_state_dict(torch.load(tmp_path / "m" / "selective_copy_seed1234.pt"))
        reloaded = trainer.evaluate()
    finally:
        parallel.destroy()
    if decay:
        assert last["val_loss_ema"] != last["val_loss"]
        assert reloaded == pytest.approx(last["val_loss_ema"], rel=1e-6)
    else:
        assert last["val_loss_ema"] is None
        assert reloaded == pytest.approx(last["val_loss"], rel=1e-6)
        assert result["accuracy"] == result["accuracy_trained_weights"]


def test_a_failed_check_keeps_the_run_going(tmp_path):
    """Six steps do not take the quick model to a perfect recall: with --stop-accuracy 1 every
    evaluation below --stop-loss is checked, fails, and the run goes on to its step budget."""
    out = tmp_path / "bench.json"
    run_bench(QUICK_STOP + ["--stop-accuracy", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows if r["part"] == "curriculum"] == [2, 4, 6]
    checks = [r for r in rows if r["part"] == "stop_check"]
    assert [(c["step"], c["samples"], c["stop"]) for c in checks] == [
        (2, 1024, False),
        (4, 1024, False),
        (6, 1024, False),
    ]
    assert all(0 <= c["heldout_accuracy"] < 1 for c in checks)
    assert next(r for r in rows if r["part"] == "result")["steps"] == 6


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seeds", "1,x"], "--seeds must be distinct comma-separated integers, got '1,x'"),
        (["--seeds", "1,1"], "--seeds must be distinct comma-separated integers, got '1,1'"),
        (["--lr-cooldown", "1"], "--lr-cooldown must lie in [0, 1), got 1.0"),
        (["--eval-noise", "64,x"], "--eval-noise must list non-negative noise lengths, got '64,x'"),
        (
            ["--quick", "--eval-noise", "64", "model.position=learned"],
            "--eval-noise above --noise-target (16) needs "
            "model.position=block (a learned position table has no rows past the longest training sample)",
        ),
        (["--tasks", "copy,sort"], "--tasks must name copy and/or selective_copy, got 'copy,sort'"),
        (["--stop-confirm", "-1"], "--stop-confirm must be a non-negative sample count, got -1"),
        (["--stop-accuracy", "1.5"], "--stop-accuracy must lie in [0, 1], got 1.5"),
        (["--ema-decay", "1"], "--ema-decay must lie in [0, 1), got 1.0"),
        (
            ["--tasks", "copy", "model.recurrent_alpha=2"],
            "model.recurrent_alpha must be a finite number in [0, 1], got 2.0",
        ),
        (["--tasks", "copy", "--alpha", "-0.1"], "model.recurrent_alpha must be a finite number in [0, 1], got -0.1"),
        (
            ["--tasks", "copy", "--alpha-min", "0.6"],
            "model.recurrent_alpha_min must lie in [0, model.recurrent_alpha = 0.5], got 0.6",
        ),
        (["--tasks", "copy", "--init-std", "0"], "model.init_std must be a finite number > 0, got 0.0"),
    ],
)
def test_bad_input_is_rejected(args, message, capsys):
    """In process (each subprocess would spend seconds importing torch and megatron-core before
    parsing); the command line itself is tested once below."""
    assert _bench().main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"bench_recurrent: {message}"


def test_bad_input_on_the_command_line_exits_2_with_one_sentence():
    proc = run_python(["tools/bench_recurrent.py", "--tasks", "copy", "--init-std", "0"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1] == "bench_recurrent: model.init_std must be a finite number > 0, got 0.0"
    )


def test_more_jobs_than_cores_is_rejected(capsys):
    cores = len(os.sched_getaffinity(0))
    assert _bench().main(["--seeds", "1,2", "--jobs", str(cores + 1), "--threads", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bench_recurrent: --jobs x --threads must lie in [1, {cores}] (the cores this process may use), "
        f"got {cores + 1} x 1"
    )
