"""Weight initialisation: ``model.embedding_init_std`` scales the embedding tables of every
architecture and nothing else."""

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.models.build import build
from rmt.models.init import EMBEDDING_TABLES

ARCHS = {"transformer": [], "rmt": [], "recurrent": ["model.block_width=8"], "mixer": []}


def weights(arch: str, extra: list) -> dict:
    config = validate(
        load_config(
            None,
            [
                f"model.arch={arch}",
                "model.vocab_size=64",
                "model.hidden_size=32",
                "model.num_attention_heads=4",
                "model.num_layers=2",
                "model.seq_length=16",
                "model.init_std=0.02",
            ]
            + ARCHS[arch]
            + extra,
        ),
        1,
    )
    parallel.initialize(config)
    try:
        return {k: v.detach().clone() for k, v in build(config)[0].state_dict().items() if torch.is_tensor(v)}
    finally:
        parallel.destroy()


@pytest.mark.parametrize("arch", ARCHS)
def test_embedding_init_std_scales_only_the_embedding_tables(arch):
    base, scaled = weights(arch, []), weights(arch, ["model.embedding_init_std=0.5"])
    tables = [k for k in base if k.endswith(EMBEDDING_TABLES)]
    assert tables, f"{arch} has no embedding table"
    for key, value in base.items():
        if key in tables:
            # the same draw of the key's generator, times 0.5 instead of 0.02
            torch.testing.assert_close(scaled[key], value * 25, rtol=1e-6, atol=0)
            assert abs(float(scaled[key].std()) - 0.5) < 0.05
        else:
            assert torch.equal(scaled[key], value), key
