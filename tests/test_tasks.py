"""Copy / selective copy layouts, determinism, validation, and the curriculum in the trainer."""

import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.data.tasks import TaskDataset, make_sample, recall_accuracy, validate_task
from rmt.errors import ConfigError

warnings.filterwarnings("ignore")


def sample(task, noise):
    return make_sample(task, torch.Generator().manual_seed(3), 16, 16, noise)


def test_copy_layout():
    s = sample("copy", 40)
    tokens, labels, mask = s["tokens"], s["labels"], s["loss_mask"]
    assert tokens.shape == (16 + 40 + 16,)
    assert (tokens[:16] < 14).all()
    assert (tokens[16:56] == 14).all() and (tokens[56:] == 15).all()
    assert torch.equal(labels[56:], tokens[:16])
    assert mask.sum() == 16 and (mask[56:] == 1).all()
    assert torch.equal(s["position_ids"], torch.arange(72))


def test_selective_copy_layout():
    s = sample("selective_copy", 40)
    tokens, labels = s["tokens"], s["labels"]
    prefix = tokens[:56]
    data = prefix[prefix != 14]
    assert data.numel() == 16 and (data < 14).all()
    assert (tokens[56:] == 15).all()
    assert torch.equal(labels[56:], data)  # recalled in their original order
    assert not torch.equal(prefix[:16], data)  # scattered, not a copy prefix (for this seed)


def test_dataset_is_deterministic_and_follows_noise_length():
    config = load_config(None, ["data.task=selective_copy", "data.noise_length=8", "model.seq_length=40"])
    ds = TaskDataset(config, "train", 100)
    assert torch.equal(ds[5]["tokens"], TaskDataset(config, "train", 100)[5]["tokens"])
    assert not torch.equal(ds[5]["tokens"], ds[6]["tokens"])
    assert not torch.equal(ds[5]["tokens"], TaskDataset(config, "valid", 100)[5]["tokens"])
    ds.noise_length = 16
    assert ds[5]["tokens"].shape == (48,)


def test_noise_min_fraction_draws_one_length_per_step_in_every_layout():
    """Each global batch of 4 gets one noise length from 32..64; validation stays at 64; the
    microbatches of 2 data-parallel ranks x 2 samples and of one rank x 4 see the same lengths."""
    from rmt.data.gpt_data import microbatches

    config = load_config(
        None, ["data.task=selective_copy", "data.noise_length=64", "model.seq_length=96", "data.noise_min_fraction=0.5"]
    )
    ds = TaskDataset(config, "train", 400, global_batch=4)
    lengths = [{ds[4 * step + i]["tokens"].numel() - 32 for i in range(4)} for step in range(100)]
    assert all(len(one) == 1 for one in lengths)
    drawn = [one.pop() for one in lengths]
    assert min(drawn) >= 32 and max(drawn) <= 64 and len(set(drawn)) > 10
    assert {TaskDataset(config, "valid", 400, global_batch=4)[i]["tokens"].numel() for i in range(8)} == {96}
    for first in (0, 8, 396):
        whole = microbatches(ds, first, 4, 1, 0, 1)[0]["tokens"]
        split = torch.cat([microbatches(ds, first, 2, 1, rank, 2)[0]["tokens"] for rank in (0, 1)])
        assert torch.equal(whole, split)
    config.data.noise_min_fraction = 1.0
    assert {TaskDataset(config, "train", 400, global_batch=4)[i]["tokens"].numel() for i in range(40)} == {96}


def test_noise_mix_step_varies_only_the_block_count_from_a_stage_on():
    """noise_mix_step=32: the lengths of a step are N, N - 32, .. >= N/2, so the recall tokens keep
    their places in a block of 32; below noise_mix_from every step trains at N. Step 1 is the
    whole range, the draws of the plain mix unchanged."""
    config = load_config(
        None,
        [
            "data.task=selective_copy",
            "data.noise_length=256",
            "model.seq_length=288",
            "data.noise_min_fraction=0.5",
            "data.noise_mix_step=32",
            "data.noise_mix_from=256",
        ],
    )
    ds = TaskDataset(config, "train", 400, global_batch=2)
    drawn = [ds.step_noise_length(2 * step) for step in range(200)]
    assert set(drawn) == {128, 160, 192, 224, 256}
    assert all(ds[2 * step + 1]["tokens"].numel() == 32 + n for step, n in enumerate(drawn))
    ds.noise_length = 128  # an earlier stage, below noise_mix_from
    assert {ds.step_noise_length(i) for i in range(0, 400, 2)} == {128}
    plain = TaskDataset(
        load_config(
            None,
            [
                "data.task=selective_copy",
                "data.noise_length=256",
                "model.seq_length=288",
                "data.noise_min_fraction=0.5",
            ],
        ),
        "train",
        400,
        global_batch=2,
    )
    config.data.noise_mix_step, config.data.noise_mix_from = 1, 0
    assert [TaskDataset(config, "train", 400, 2).step_noise_length(i) for i in range(0, 400, 2)] == [
        plain.step_noise_length(i) for i in range(0, 400, 2)
    ]
    assert len({plain.step_noise_length(i) for i in range(0, 400, 2)}) > 50


def test_recall_accuracy():
    labels = torch.tensor([[0, 3, 5]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    logits = torch.zeros(1, 3, 8)
    logits[0, 1, 3] = 1
    logits[0, 2, 7] = 5  # outside the alphabet of 6: ignored, argmax falls back to id 0
    assert recall_accuracy(logits, labels, mask, 6) == 0.5


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.task=paste"], "data.task must be"),
        (["data.task=copy", "model.seq_length=40"], "must hold the longest task sample"),
        (["data.task=copy", "data.curriculum_target=512", "model.seq_length=1024"], "set both"),
        (
            [
                "data.task=copy",
                "data.noise_length=64",
                "data.curriculum_target=32",
                "data.curriculum_threshold=0.3",
                "model.seq_length=1024",
            ],
            "is below data.noise_length",
        ),
        (
            ["data.task=copy", "data.noise_min_fraction=1.5", "model.seq_length=1024"],
            r"data.noise_min_fraction must be a finite number in \[0, 1\], got 1.5",
        ),
        (
            ["data.task=copy", "data.noise_mix_step=0", "model.seq_length=1024"],
            "data.noise_mix_step must be an integer >= 1, got 0",
        ),
    ],
)
def test_validate_task(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_task(load_config(None, overrides))


@pytest.mark.parametrize("arch", ["recurrent", "transformer"])
def test_curriculum_doubles_noise_in_trainer(arch):
    from rmt.training.trainer import Trainer

    config = validate(
        load_config(
            None,
            [
                f"model.arch={arch}",
                "model.num_layers=1",
                "model.hidden_size=16",
                "model.num_attention_heads=2",
                "model.seq_length=48",
                "model.block_width=8",
                "data.task=copy",
                "data.task_tokens=4",
                "data.task_alphabet=8",
                "data.noise_length=4",
                "data.curriculum_threshold=100",
                "data.curriculum_target=32",
                "train.steps=5",
                "train.warmup_steps=0",
                "train.micro_batch_size=2",
                "train.eval_interval=1",
                "train.eval_iters=1",
                "train.progress=false",
            ],
        ),
        1,
    )
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        history = trainer.train()
    finally:
        parallel.destroy()
    assert config.model.vocab_size == 8
    assert [m["noise_length"] for m in history] == [8, 16, 32, 32, 32]
    assert trainer.batch_tokens == 2 * (2 * 4 + 32)  # tok/s counts the samples run, not seq_length
    assert all(torch.isfinite(torch.tensor(m["lm loss"])) for m in history)


def test_curriculum_position_survives_resume(tmp_path):
    from rmt.training.trainer import Trainer

    base = [
        "model.arch=transformer",
        "model.num_layers=1",
        "model.hidden_size=16",
        "model.num_attention_heads=2",
        "model.seq_length=48",
        "data.task=copy",
        "data.task_tokens=4",
        "data.task_alphabet=8",
        "data.noise_length=4",
        "data.curriculum_threshold=100",
        "data.curriculum_target=32",
        "train.steps=4",
        "train.warmup_steps=0",
        "train.micro_batch_size=2",
        "train.eval_interval=1",
        "train.eval_iters=1",
        "train.progress=false",
        f"train.save={tmp_path}",
    ]
    config = validate(load_config(None, base + ["train.exit_interval=2"]), 1)
    parallel.initialize(config)
    try:
        first = Trainer(config).train()
    finally:
        parallel.destroy()
    assert [m["noise_length"] for m in first] == [8, 16]
    config = validate(load_config(None, base + [f"train.load={tmp_path}"]), 1)
    parallel.initialize(config)
    try:
        resumed = Trainer(config)
        assert resumed.train_ds.noise_length == 16 and resumed.valid_ds.noise_length == 16
        assert [m["noise_length"] for m in resumed.train()] == [32, 32]
    finally:
        parallel.destroy()
