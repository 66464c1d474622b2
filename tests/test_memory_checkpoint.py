"""Checkpoint round trip of memory parameters through the trainer: a transformer + UltraMem
trained 3 steps and saved (dist_checkpointing) loads back with every parameter identical (memory
keys, values, cores, projectors included; they differ from a fresh init), the AdamW moments of
the memory values restored, and the same validation loss (``Trainer(load) + evaluate()``, what ``--eval-only`` runs)."""

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.parallel.sharding import gather_full
from rmt.training.trainer import Trainer

from conftest import tiny_overrides, train_steps

pytestmark = pytest.mark.slow

MEMORY = [
    "memory.type=ultramem",
    "memory.placement='1:2'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
]


def test_memory_checkpoint_round_trip(cache_dir, tmp_path, monkeypatch):
    ckpt, out = tmp_path / "ckpt", tmp_path / "trained.pt"
    common = tiny_overrides(cache_dir) + MEMORY + ["train.eval_iters=2", "train.eval_interval=3", "data.split=80,20,0"]
    trained = train_steps(out, common + [f"train.save={ckpt}"])
    monkeypatch.delenv("MASTER_PORT", raising=False)
    config = validate(load_config(None, common + [f"train.load={ckpt}"]), world_size=1)
    parallel.initialize(config)
    try:
        fresh = gather_full(Trainer(validate(load_config(None, common), world_size=1)).chunks)
        trainer = Trainer(config)
        loaded = gather_full(trainer.chunks)
        assert trainer.iteration == 3
        val_loss = trainer.evaluate()
        values = trainer.chunks[0].module.memory[0].values.weight
        moments = trainer.optimizer.state[values]
    finally:
        parallel.destroy()
    assert sorted(loaded) == sorted(trained["params"])
    memory = [k for k in loaded if k.startswith("memory.")]
    assert {"memory.0.values.weight", "memory.0.keys", "memory.0.cores", "memory.0.proj"} <= set(memory)
    for key in loaded:
        assert torch.equal(loaded[key], trained["params"][key]), key
    for key in ("memory.0.values.weight", "memory.0.cores", "memory.0.query.weight"):
        assert not torch.equal(loaded[key], fresh[key]), key
    assert moments["exp_avg"].abs().max() > 0 and moments["exp_avg_sq"].abs().max() > 0
    assert val_loss == pytest.approx(trained["val"][-1], abs=1e-5)
