"""Data parallelism: recurrent transformer and mixer under torchrun (gloo, 2 ranks) give the
single-process losses and gradients."""

import pytest
import torch

from conftest import train_runs

pytestmark = pytest.mark.slow

COMMON = [
    "model.num_layers=1",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.seq_length=24",
    "model.block_width=4",
    "data.task=copy",
    "data.task_tokens=4",
    "data.task_alphabet=8",
    "data.noise_length=8",
    "train.steps=2",
    "train.warmup_steps=0",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_iters=1",
    "train.progress=false",
]
ARCHS = ("recurrent", "mixer")


def test_data_parallel_equals_single_process(tmp_path):
    def runs(name):
        return {tmp_path / f"{arch}-{name}.pt": COMMON + [f"model.arch={arch}"] for arch in ARCHS}

    single = list(train_runs(runs("one")).values())
    dp = list(train_runs(runs("two"), nproc=2).values())
    for one, two in zip(single, dp):
        assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert one["grads"].keys() == two["grads"].keys()
        for key, grad in one["grads"].items():
            torch.testing.assert_close(two["grads"][key], grad, rtol=1e-4, atol=1e-5)
