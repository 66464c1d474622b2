"""The validation-driven learning-rate factor (train.lr_curriculum_decay, lr_target_decay, lr_plateau_decay):
its rules, its effect on the trainer's learning rate, its checkpointing, and config validation."""

import math
import warnings

import pytest

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError
from rmt.training.lr_control import ValidationLR

warnings.filterwarnings("ignore")

TASK = [
    "model.arch=transformer",
    "model.num_layers=1",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.seq_length=48",
    "data.task=copy",
    "data.task_tokens=4",
    "data.task_alphabet=8",
    "data.noise_length=4",
    "train.warmup_steps=0",
    "train.lr=1e-3",
    "train.lr_decay_style=constant",
    "train.micro_batch_size=2",
    "train.eval_interval=1",
    "train.eval_iters=1",
    "train.progress=false",
]


def control(**train):
    config = load_config(None, [f"train.{k}={v}" for k, v in train.items()])
    return ValidationLR(config)


def test_curriculum_advance_scales_and_forgets_the_best_loss():
    c = control(lr_curriculum_decay=0.5, min_lr_ratio=0.2)
    assert c.update(1.0, advanced=False, at_target=False) == 1.0
    assert c.best == math.inf  # before the target the plateau rule does not watch
    assert c.update(0.2, advanced=True, at_target=False) == 0.5
    assert c.update(0.2, advanced=True, at_target=True) == 0.25
    assert c.best == math.inf and c.waited == 0
    assert c.update(0.2, advanced=True, at_target=True) == 0.2  # floored at min_lr_ratio


def test_target_decay_cuts_once_more_at_the_doubling_that_reaches_the_target():
    c = control(lr_curriculum_decay=0.5, lr_target_decay=0.25, min_lr_ratio=0.0)
    assert c.update(1.0, advanced=True, at_target=False) == 0.5
    assert c.update(1.0, advanced=True, at_target=True) == 0.0625  # 0.5 * 0.5 * 0.25
    assert c.update(1.0, advanced=False, at_target=True) == 0.0625  # only at that doubling


def test_plateau_waits_patience_evaluations_then_counts_afresh():
    c = control(lr_plateau_decay=0.5, lr_plateau_patience=2, min_lr_ratio=0.0)
    scales = [c.update(v, advanced=False, at_target=True) for v in (1.0, 0.9, 0.95, 0.9, 0.8, 0.85, 0.85, 0.9, 0.9)]
    assert scales == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125]
    assert c.best == 0.8
    restored = control()
    restored.load_state_dict(c.state_dict())
    assert (restored.scale, restored.best, restored.waited) == (0.125, 0.8, 0)


def test_smoothed_plateau_judges_the_moving_average():
    # a level-to-rising loss whose dips are each a new low: the raw rule never reduces, the
    # average 0.9 * s + 0.1 * v never falls below its first value (1.0, 1.02, 1.038, 1.0242, ...)
    losses = (1.0, 1.2, 1.2, 0.9, 1.2, 1.2, 0.8, 1.2)
    raw = control(lr_plateau_decay=0.5, lr_plateau_patience=3, min_lr_ratio=0.0)
    assert [raw.update(v, advanced=False, at_target=True) for v in losses] == [1.0] * 8
    c = control(lr_plateau_decay=0.5, lr_plateau_patience=3, min_lr_ratio=0.0, lr_plateau_smoothing=0.9)
    smoothed, expected = None, []
    for v in losses:
        smoothed = v if smoothed is None else 0.9 * smoothed + 0.1 * v
        expected.append(smoothed)
    assert [c.update(v, advanced=False, at_target=True) for v in losses] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert c.smoothed == pytest.approx(expected[-1], rel=1e-15) and c.best == pytest.approx(min(expected), rel=1e-15)
    restored = control(lr_plateau_smoothing=0.9)
    restored.load_state_dict(c.state_dict())
    assert restored.state_dict() == c.state_dict()
    assert c.update(9.0, advanced=True, at_target=True) == 0.25  # a doubling restarts the average
    assert (c.smoothed, c.best, c.waited) == (None, math.inf, 0)
    c.update(2.0, advanced=False, at_target=True)
    assert c.smoothed == 2.0


def test_plateau_ignored_before_the_target():
    c = control(lr_plateau_decay=0.5, lr_plateau_patience=1)
    assert [c.update(1.0, advanced=False, at_target=False) for _ in range(4)] == [1.0] * 4


def train(overrides):
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, TASK + overrides), 1)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        return trainer, trainer.train()
    finally:
        parallel.destroy()


def test_trainer_lr_falls_at_each_doubling_and_survives_resume(tmp_path):
    base = [
        "data.curriculum_threshold=100",
        "data.curriculum_target=32",
        "train.steps=5",
        "train.lr_curriculum_decay=0.5",
        "train.min_lr_ratio=0.2",
        f"train.save={tmp_path}",
    ]
    _, first = train(base + ["train.exit_interval=2"])
    assert [m["noise_length"] for m in first] == [8, 16]
    assert [m["lr"] for m in first] == pytest.approx([1e-3, 5e-4])  # lr of the step, before its evaluation
    assert [m["lr_scale"] for m in first] == [0.5, 0.25]
    trainer, resumed = train(base + [f"train.load={tmp_path}"])
    assert [m["noise_length"] for m in resumed] == [32, 32, 32]
    assert [m["lr"] for m in resumed] == pytest.approx([2.5e-4, 2e-4, 2e-4])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)


def test_trainer_cuts_the_lr_once_more_on_reaching_the_target():
    _, history = train(
        [
            "data.curriculum_threshold=100",
            "data.curriculum_target=32",
            "train.steps=3",
            "train.lr_curriculum_decay=0.5",
            "train.lr_target_decay=0.5",
            "train.min_lr_ratio=0.01",
        ]
    )
    # noise 4 -> 8 -> 16 -> 32 (the target) at the three evaluations; the last doubling cuts twice
    assert [m["noise_length"] for m in history] == [8, 16, 32]
    assert [m["lr_scale"] for m in history] == [0.5, 0.25, 0.0625]
    assert [m["lr"] for m in history] == pytest.approx([1e-3, 5e-4, 2.5e-4])


def test_trainer_reduces_on_plateau():
    # an lr too small to move the weights keeps the validation loss exactly level
    _, history = train(
        [
            "train.lr=1e-12",
            "train.steps=5",
            "train.lr_plateau_decay=0.5",
            "train.lr_plateau_patience=1",
            "train.min_lr_ratio=0.1",
        ]
    )
    assert [m["lr_scale"] for m in history] == [1.0, 0.5, 0.25, 0.125, 0.1]
    assert history[-1]["lr"] == pytest.approx(1e-12 * 0.125)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.lr_plateau_decay=0"], r"^train.lr_plateau_decay must be a finite number in \(0, 1\], got 0.0$"),
        (
            ["train.lr_curriculum_decay=1.5"],
            r"^train.lr_curriculum_decay must be a finite number in \(0, 1\], got 1.5$",
        ),
        (["train.lr_plateau_patience=0"], "^train.lr_plateau_patience must be an integer > 0, got 0$"),
        (
            ["train.lr_plateau_smoothing=1"],
            r"^train.lr_plateau_smoothing must be a finite number in \[0, 1\), got 1.0$",
        ),
        (["train.lr_curriculum_decay=0.5"], "train.lr_curriculum_decay needs a curriculum"),
        (["train.lr_target_decay=0"], r"^train.lr_target_decay must be a finite number in \(0, 1\], got 0.0$"),
        (["train.lr_target_decay=0.5"], "train.lr_target_decay needs a curriculum"),
    ],
)
def test_bad_values_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, TASK + overrides), 1)
