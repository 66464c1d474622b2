"""UltraMemV2 (memory.type ultramem_v2: a memory beside the FFN of every layer, with value and
pre-value tables) under 2 gloo ranks == the single-process run (fp32, 1e-5): sharded tables
number-wise (saved at step 2 and resumed as a local table; and pooled at the owners) and
dimension-wise with the async stream, the fused sparse-Adam value optimizer, tensor and pipeline
parallelism (also with full recomputation on the async stream); three training
steps through the trainer (tests/dist/train_steps.py), equal losses, gradients and weights."""

import pytest
import torch

from conftest import TINY_ULTRAMEM_V2, tiny_overrides, train_cases, train_steps

pytestmark = pytest.mark.slow

V2 = TINY_ULTRAMEM_V2 + ["train.clip_grad=1.0"]
FUSED = ["memory.value_optimizer=sparse_adam", "memory.fused_value_optimizer=true"]
CASES = {
    "dp2-number": (["memory.partition=number"], "local"),
    "dp2-number-owner-reduce": (["memory.partition=number", "memory.owner_reduce=true"], "local"),
    "dp2-dimension-async": (["memory.partition=dimension", "memory.async_stream=true"], "local"),
    "dp2-number-fused-sparse-adam": (["memory.partition=number"] + FUSED, "fused"),
    "tp2": (["parallel.tensor_model_parallel_size=2"], "local"),
    "pp2": (["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size=1"], "local-mb1"),
    "pp2-full-recompute-async": (
        ["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size=1", "memory.async_stream=true"]
        + ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
        "local-mb1",
    ),
}
REFERENCES = {"local": [], "fused": FUSED, "local-mb1": ["train.micro_batch_size=1"]}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    common = tiny_overrides(cache_dir) + V2
    cases = {ref: (common + extra, 1) for ref, extra in REFERENCES.items()}
    cases.update({name: (common + extra, 2) for name, (extra, _) in CASES.items()})
    return train_cases(tmp_path_factory, "memory_v2_layouts", cases)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_single_process(case, runs):
    ref, got = runs[CASES[case][1]], runs[case]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    memory = {k for k in ref["params"] if k.startswith("memory.")}
    assert {
        f"memory.{k}.{n}"
        for k in (0, 1)
        for n in (
            "values.weight",
            "pre_values.weight",
            "keys",
            "cores",
            "query.weight",
            "pre_proj.weight",
            "proj.weight",
        )
    } <= memory
    assert sorted(got["params"]) == sorted(ref["params"])
    for key in ref["params"]:
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["losses"][2] < ref["losses"][0]


def test_sharded_checkpoint_resumes_as_a_local_table(cache_dir, tmp_path):
    """The step-2 checkpoint of a number-wise run (P=2; value and pre-value tables and their
    AdamW moments as shards of the global tables) resumes in one process with local tables, and
    its third step lands on the weights of the uninterrupted run."""
    common = tiny_overrides(cache_dir) + V2
    ckpt = tmp_path / "ckpt"
    sharded = train_steps(
        tmp_path / "sharded.pt", common + ["memory.partition=number", f"train.save={ckpt}", "train.save_interval=2"], 2
    )
    resumed = train_steps(tmp_path / "resumed.pt", common + [f"train.load={ckpt}/iter_0000002"])
    assert resumed["losses"] == pytest.approx(sharded["losses"][2:], rel=1e-5)
    for key, value in sharded["params"].items():
        torch.testing.assert_close(resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=key)
