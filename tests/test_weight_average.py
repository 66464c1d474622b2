"""The weight average (``train.ema_decay``, :mod:`rmt.training.weight_average`): the EMA formula
step by step in the trainer, memory value tables left out, the swap that evaluates it, its restart
at a curriculum's doubling, and its way through checkpoints (exact resume; a checkpoint made
without it) and into ``rmt-generate --average``. Layouts: test_parallel_equivalence and test_memory_tp_dp compare the averages of
TP / PP / DP runs with the single process; test_checkpoint reloads one saved under TP=2 at TP=1."""

import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.memory.descriptor import TableDescriptor, describe
from rmt.training.weight_average import WeightAverage

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
    "train.lr=1e-2",
    "train.lr_decay_style=constant",
    "train.micro_batch_size=2",
    "train.eval_interval=1",
    "train.eval_iters=1",
    "train.progress=false",
]


def test_average_follows_the_formula_leaves_tables_out_and_swaps_back():
    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Embedding(5, 3))
    describe(chunk[1].weight, TableDescriptor(5, 3))  # a memory value table
    average = WeightAverage([chunk], 0.75)
    assert average.params == [chunk[0].weight, chunk[0].bias]
    expected = [p.detach().clone() for p in average.params]
    for _ in range(3):
        with torch.no_grad():
            for p in chunk.parameters():
                p.add_(torch.randn_like(p))
        average.update()
        expected = [0.75 * e + 0.25 * p.detach() for e, p in zip(expected, average.params)]
    for got, want in zip(average.averages, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    trained = [p.detach().clone() for p in chunk.parameters()]
    with pytest.raises(RuntimeError, match="inside"):
        with average.swapped_in():
            assert torch.equal(chunk[0].weight, average.averages[0])
            assert torch.equal(chunk[1].weight, trained[2])  # the table is the trained one
            raise RuntimeError("inside")
    assert all(torch.equal(p, t) for p, t in zip(chunk.parameters(), trained))
    average.restart()
    assert all(torch.equal(a, p) for a, p in zip(average.averages, average.params))


def trainer_for(overrides):
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, TASK + overrides), 1)
    parallel.initialize(config)
    return Trainer(config)


def test_trainer_steps_the_average_after_every_optimizer_step():
    trainer = trainer_for(["train.steps=4", "train.ema_decay=0.6"])
    try:
        expected = [p.detach().clone() for p in trainer.average.params]
        for _ in range(4):
            trainer.train_step()
            expected = [0.6 * e + 0.4 * p.detach() for e, p in zip(expected, trainer.average.params)]
        for got, want in zip(trainer.average.averages, expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        weights = [p.detach().clone() for p in trainer.params]
        with_average = trainer.evaluate_average()
        assert all(torch.equal(p, w) for p, w in zip(trainer.params, weights))  # put back
        assert with_average != trainer.evaluate()
    finally:
        parallel.destroy()


def test_a_curriculum_doubling_restarts_the_average():
    trainer = trainer_for(
        ["train.steps=2", "train.ema_decay=0.9", "data.curriculum_threshold=100", "data.curriculum_target=32"]
    )
    try:
        history = trainer.train()
        assert [m["noise_length"] for m in history] == [8, 16]  # a doubling at every evaluation
        assert all(torch.equal(a, p) for a, p in zip(trainer.average.averages, trainer.average.params))
    finally:
        parallel.destroy()


def run(overrides):
    trainer = trainer_for(overrides)
    try:
        return trainer.train()
    finally:
        parallel.destroy()


def test_resume_continues_the_average_exactly(tmp_path):
    base = ["train.steps=6", "train.ema_decay=0.5"]
    straight = [m["val_loss_ema"] for m in run(base)]
    first = run(base + [f"train.save={tmp_path}", "train.exit_interval=3"])
    second = run(base + [f"train.save={tmp_path}"])
    assert [m["val_loss_ema"] for m in first + second] == straight
    assert straight[-1] != second[-1]["val_loss"]  # the average is not the trained weights


def test_a_checkpoint_without_average_starts_it_at_the_loaded_weights(tmp_path, capsys):
    run(["train.steps=4", f"train.save={tmp_path}", "train.exit_interval=2"])
    trainer = trainer_for(["train.steps=4", "train.ema_decay=0.5", f"train.save={tmp_path}"])
    try:
        assert (
            "the checkpoint has no weight average (train.ema_decay): it starts at the loaded weights"
            in capsys.readouterr().out
        )
        assert trainer.iteration == 2
        assert all(torch.equal(a, p) for a, p in zip(trainer.average.averages, trainer.average.params))
    finally:
        parallel.destroy()


def test_generate_loads_the_average_on_request(tmp_path, capsys):
    from rmt.generate import load_model, main

    trainer = trainer_for(["train.steps=3", "train.ema_decay=0.5", f"train.save={tmp_path}/ema"])
    try:
        trainer.train()
        averages = {
            n: a.clone()
            for (n, p) in trainer.chunks[0].module.named_parameters()
            for q, a in trainer.average.by_param().items()
            if q is p
        }
        trained = {n: p.detach().clone() for n, p in trainer.chunks[0].module.named_parameters()}
    finally:
        parallel.destroy()
    assert averages and any(not torch.equal(averages[n], trained[n]) for n in averages)
    for average, expected in ((True, averages), (False, trained)):
        try:
            model = load_model(str(tmp_path / "ema"), [], average=average)[0]
            got = dict(model.named_parameters())
            assert all(torch.equal(got[n], expected[n]) for n in expected)
        finally:
            parallel.destroy()
    run(["train.steps=1", f"train.save={tmp_path}/plain"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", str(tmp_path / "plain"), "--average"])
    assert err.value.code == 2
    assert (
        f"'{tmp_path}/plain/iter_0000001' has no weight average (it was trained without train.ema_decay); "
        "leave out --average" in capsys.readouterr().err
    )
