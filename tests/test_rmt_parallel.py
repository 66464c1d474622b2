"""Tensor, pipeline and data parallel RMT == the single-process run (fp32, 1e-5): losses of two
train steps through the trainer (megatron-core schedules, DDP, clipping, AdamW), and every
gradient and weight afterwards. One launch of 2 gloo ranks runs all three layouts;
the TP=2 run's checkpoint then loads into TP=1 with the reference's weights."""

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.parallel.sharding import gather_full
from rmt.training.trainer import Trainer

from conftest import load_script, run_python

pytestmark = pytest.mark.slow

rmt_parallel = load_script("tests/dist/rmt_parallel.py")


def test_tp_pp_dp_equal_single_process(tmp_path):
    cache = str(tmp_path / "cache")
    try:
        ref = rmt_parallel.run_steps(rmt_parallel.tiny_overrides(cache), 1)
    finally:
        parallel.destroy()
    assert all(torch.isfinite(torch.tensor(ref["losses"])))
    assert any(g.abs().max() > 0 for g in ref["grads"].values())
    ref["cache_dir"], ref["save_dir"] = cache, str(tmp_path / "ckpt_tp2")
    path = tmp_path / "reference.pt"
    torch.save(ref, path)
    proc = run_python(["tests/dist/rmt_parallel.py", str(path), "tp", "pp", "dp"], nproc=2)
    assert "all layouts equal the single-process run" in proc.stdout

    overrides = rmt_parallel.tiny_overrides(cache) + [f"train.load={ref['save_dir']}"]
    config = validate(load_config(None, overrides), world_size=1)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        loaded = gather_full(trainer.chunks)
    finally:
        parallel.destroy()
    assert trainer.iteration == 2
    for key, value in ref["weights"].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=1e-5)
