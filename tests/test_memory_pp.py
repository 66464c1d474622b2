"""Memory layers under pipeline parallelism == the single-process run (fp32, 1e-5): a 4-layer
transformer + UltraMem with one placement inside each of the two stages ('1:2/3:4'), trained 3
steps through the trainer (tests/dist/train_steps.py) with PP=2 (and PP=2 x TP=2 with number-wise
sharded tables in each stage): equal losses, and equal full
gradients and weights afterwards, memory parameters of both stages included (the aux loss of
the first stage's memory layer reaches backward through the activation). Placements crossing
a stage boundary are rejected."""

import pytest
import torch

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.errors import ConfigError

from conftest import tiny_overrides, train_cases

MEMORY = [
    "model.num_layers=4",
    "memory.type=ultramem",
    "memory.placement='1:2/3:4'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
    "memory.aux_loss_weight=0.05",
]


VPP = ["model.num_layers=8", "memory.placement='1:2/3:3/7:8'", "parallel.virtual_pipeline_model_parallel_size=2"]


LAYOUTS = {  # name: (overrides besides PP=2, processes, the reference's overrides)
    "pp2-local-tables": ([], 2, []),
    "pp2xtp2-number-wise-tables-async": (
        ["parallel.tensor_model_parallel_size=2", "memory.partition=number", "memory.async_stream=true"],
        4,
        [],
    ),
    "pp2xvpp2-async": (VPP + ["memory.async_stream=true"], 2, VPP[:2]),
}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The references in this process, the layouts in one launch per process count."""
    base = tiny_overrides(cache_dir) + MEMORY
    cases = {"ref": (base, 1), "ref-vpp": (base + VPP[:2], 1)}
    cases.update(
        {
            name: (base + ["parallel.pipeline_model_parallel_size=2"] + extra, nproc)
            for name, (extra, nproc, _) in LAYOUTS.items()
        }
    )
    return train_cases(tmp_path_factory, "memory_pp", cases)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_pipeline_matches_single_process(layout, runs):
    """Second case: each stage shards its tables number-wise over its two TP ranks, which
    split the shared tokens between them, and runs its memory layer forward and backward on
    the async stream (the first stage's aux loss then reaches backward through the stream).
    Third: the interleaved schedule, 8 layers in 4 model chunks of 2, memory layers in chunks
    0 and 3 (rank 0's first, rank 1's second) and 1 (rank 1's first), one async stream per rank."""
    extra, _, ref_extra = LAYOUTS[layout]
    ref, got = runs["ref-vpp" if ref_extra else "ref"], runs[layout]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for k in range(3 if VPP[1] in extra else 2):
        assert {f"memory.{k}.values.weight", f"memory.{k}.keys", f"memory.{k}.cores"} <= set(ref["grads"])
    for key in ref["grads"]:
        if key.startswith("memory."):
            assert ref["grads"][key].abs().max() > 0, key
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)


def test_memory_placement_crossing_stage_rejected():
    overrides = MEMORY[:2] + ["memory.placement='2:3'", "parallel.pipeline_model_parallel_size=2"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=2)
    assert str(err.value) == (
        "memory.placement '2:3' crosses the pipeline stage boundary after layer 2; with 2 "
        "stages of 2 layers each placement must lie within layers 1-2 or 3-4"
    )
    validate(
        load_config(None, overrides[:2] + ["memory.placement='3:4'", "parallel.pipeline_model_parallel_size=2"]),
        world_size=2,
    )


def test_memory_placement_crossing_virtual_stage_rejected():
    overrides = (
        MEMORY[1:2]
        + VPP[:1]
        + VPP[2:]
        + ["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size=2", "train.global_batch_size=4"]
    )
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides + ["memory.placement='2:3'"]), world_size=2)
    assert str(err.value) == (
        "memory.placement '2:3' crosses the pipeline stage boundary after layer 2; with 4 model "
        "chunks (virtual stages) of 2 layers each placement must lie within layers 1-2, 3-4, "
        "5-6 or 7-8"
    )
    validate(load_config(None, overrides + ["memory.placement='5:6'"]), world_size=2)
