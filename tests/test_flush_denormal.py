"""``train.flush_denormal`` (rmt/config.py): the trainer sets the CPU's flush-to-zero mode for the
whole process, the intra-op threads included, and leaves IEEE gradual underflow with ``false``."""

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate

from conftest import tiny_overrides

DENORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


@pytest.mark.parametrize("flush", [True, False])
def test_trainer_sets_denormal_flushing_on_every_thread(cache_dir, flush):
    """Half of a denormal is 0 when flushed and 5e-40 (rounded to float32) otherwise, in every
    element of a product that two intra-op threads compute. The mode is set against the mode
    before it: the other value is set first."""
    from rmt.training.trainer import Trainer

    torch.set_flush_denormal(not flush)
    config = validate(load_config(None, tiny_overrides(cache_dir) + [f"train.flush_denormal={flush}"]), 1)
    threads = torch.get_num_threads()
    parallel.initialize(config)
    try:
        Trainer(config)
        torch.set_num_threads(2)
        half = torch.full((1 << 20,), DENORMAL) * 0.5
    finally:
        torch.set_num_threads(threads)
        parallel.destroy()
    want = 0.0 if flush else torch.tensor(DENORMAL / 2).item()
    assert torch.equal(half, torch.full_like(half, want)), half.unique()
