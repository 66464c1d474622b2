"""Sequence parallelism (``parallel.sequence_parallel``) == the single-process run (fp32, 1e-5).

A 4-layer transformer with an UltraMem layer trained 3 steps through the trainer
(tests/dist/train_steps.py) under TP=2 with sequence parallelism: with number-wise sharded
tables on the async stream and full recompute; with a skip-placed MoE and with MoE MLPs; with
UltraMemV2 beside every FFN (its input the pre-MLP norm's sequence-sharded output): synchronous,
on the async stream, with full recompute, and number-wise on the async stream with full
recompute; TP=2 x DP=2 (local tables, synchronous); TP=2 x PP=2 and TP=2 x PP=2 x VPP=2 (async
stream, recompute, the memory layers' links replayed per model chunk): equal losses, and
equal full gradients and weights afterwards, memory parameters included. The rejections are
ConfigErrors of ``validate``, which every entry point runs before any process group exists
(exit status 2, tests/test_config.py). The memory layers gather the sequence
before they run and keep their own tokens' output (docs/memory.md), so their lookups and
gradients are those of TP without sequence parallelism.
"""

import json
import os

import pytest
import torch

from conftest import TINY_ULTRAMEM_V2, tiny_overrides, train_cases

ULTRAMEM = ["memory.type=ultramem", "memory.key_dim=8", "memory.num_keys=4", "memory.topk=3", "memory.init_samples=2"]
MEMORY = {
    "ultramem": ULTRAMEM + ["memory.placement='1:3'"],
    "ultramem-stage2": ULTRAMEM + ["memory.placement='3:4'"],  # inside the second of 2 pipeline stages
    # 8 layers in 4 chunks of 2 (PP=2 x VPP=2): memory layers in both virtual stages of rank 0
    "ultramem-interleaved": ULTRAMEM + ["model.num_layers=8", "memory.placement='1:2/5:6'"],
    "skip-moe": ["memory.type=moe", "memory.placement='1:3'", "memory.num_experts=4"],
    "mlp-moe": ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=2-3", "memory.num_experts=4"],
    "ultramem-v2": TINY_ULTRAMEM_V2,  # beside the FFN of every layer, from the pre-MLP norm's output
}
SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
RECOMPUTE = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
# case: (memory, layout and settings, processes)
CASES = {
    "tp2-number-async-recompute": (
        "ultramem",
        SP + ["memory.partition=number", "memory.async_stream=true"] + RECOMPUTE,
        2,
    ),
    "tp2-skip-moe": ("skip-moe", SP, 2),
    "tp2-v2": ("ultramem-v2", SP, 2),
    "tp2-v2-async": ("ultramem-v2", SP + ["memory.async_stream=true"], 2),
    "tp2-v2-recompute": ("ultramem-v2", SP + RECOMPUTE, 2),
    "tp2-v2-number-async-recompute": (
        "ultramem-v2",
        SP + ["memory.partition=number", "memory.async_stream=true"] + RECOMPUTE,
        2,
    ),
    "tp2-mlp-moe": ("mlp-moe", SP, 2),
    "dp2xtp2": ("ultramem", SP, 4),
    "pp2xtp2-async-recompute": (
        "ultramem-stage2",
        SP + ["parallel.pipeline_model_parallel_size=2", "memory.async_stream=true"] + RECOMPUTE,
        4,
    ),
    "pp2xvpp2xtp2-async-recompute": (
        "ultramem-interleaved",
        SP
        + [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "memory.async_stream=true",
        ]
        + RECOMPUTE,
        4,
    ),
}


def _checkpoint_dir(tmp_path_factory):
    """Where the dp2xtp2 run saves (shared by pytest-xdist workers, like train_cases' records)."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "sequence_parallel_checkpoint"


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The single-process references in this process, the layouts in one launch per process count."""
    common = tiny_overrides(cache_dir) + ["model.num_layers=4"]
    cases = {memory: (common + MEMORY[memory], 1) for memory in MEMORY}
    cases.update({case: (common + MEMORY[memory] + settings, n) for case, (memory, settings, n) in CASES.items()})
    cases["dp2xtp2"][0].append(f"train.save={_checkpoint_dir(tmp_path_factory)}")
    return train_cases(tmp_path_factory, "sequence_parallel", cases)


@pytest.mark.slow
def test_generate_from_a_sequence_parallel_checkpoint(runs, tmp_path_factory, tmp_path):
    """rmt-generate runs the checkpoint on one process (TP = 1, so without sequence parallelism)."""
    from rmt.generate import main

    out = tmp_path / "g.json"
    assert (
        main(
            [
                "--checkpoint",
                str(_checkpoint_dir(tmp_path_factory)),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    ids = json.loads(out.read_text())["samples"][0]["ids"]
    assert len(ids) == 7 and ids[:3] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_matches_single_process(case, runs):
    memory = CASES[case][0]
    ref, got = runs[memory], runs[case]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    own = [k for k in ref["grads"] if k.startswith("memory.") or ".mlp.experts." in k or ".mlp.router." in k]
    assert own
    for key in own:
        assert ref["grads"][key].abs().max() > 0, key
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["parallel.sequence_parallel=true"],
            1,
            "parallel.sequence_parallel shards the sequence over the tensor-parallel ranks and needs "
            "parallel.tensor_model_parallel_size >= 2",
        ),
        (
            SP + ["model.arch=rmt", "model.rank=4"],
            2,
            "parallel.sequence_parallel needs model.arch 'transformer' (megatron's GPTModel): the rmt's layers have no "
            "sequence-parallel all-gather / reduce-scatter mappings",
        ),
        (SP + ["model.arch=mixer"], 2, "parallel.sequence_parallel needs model.arch 'transformer'"),
        (SP + ["model.arch=recurrent"], 2, "parallel.sequence_parallel needs model.arch 'transformer'"),
        (
            SP + ["model.seq_length=33"],
            2,
            "model.seq_length (33) must be divisible by parallel.tensor_model_parallel_size (2) with "
            "parallel.sequence_parallel",
        ),
    ],
)
def test_sequence_parallel_rejected_in_one_sentence(overrides, world, message):
    from rmt.config import ConfigError, load_config
    from rmt.config_checks import validate

    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=world)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
