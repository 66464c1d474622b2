"""Distributed == single process: the same tiny model trained 3 steps in one process and
under TP=2, PP=2, DP=2 and interleaved PP=2 x VPP=2 gives equal losses, gradients, weights and
weight averages (``train.ema_decay``, kept in every run: it does not change the training); so
does Llama's layer (grouped-query attention, SwiGLU, bias-free linears) under TP=2."""

import pytest
import torch

from conftest import LLAMA, tiny_overrides, train_cases

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "dp2": [],
    "pp2_vpp2": [
        "model.num_layers=4",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
    "tp2_gqa_swiglu": ["parallel.tensor_model_parallel_size=2"] + LLAMA,
}


def model_overrides(layout: str) -> list:
    """``layout``'s model: its overrides without the parallel settings."""
    return [x for x in LAYOUTS[layout] if not x.startswith("parallel.")]


def reference(layout: str) -> str:
    """The name of ``layout``'s single-process run (the first layout's of the same model)."""
    return "single_" + next(n for n in sorted(LAYOUTS) if model_overrides(n) == model_overrides(layout))


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """Every layout in one launch of 2 processes; the references in this process."""
    common = tiny_overrides(cache_dir) + ["train.ema_decay=0.5"]
    cases = {reference(name): (common + model_overrides(name), 1) for name in LAYOUTS}
    cases.update({name: (common + extra, 2) for name, extra in LAYOUTS.items()})
    return train_cases(tmp_path_factory, "layouts", cases)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, runs):
    ref = runs[reference(layout)]
    got = runs[layout]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["averages"][key], ref["averages"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["losses"][2] < ref["losses"][0]
    # the average trails the weights: after 3 steps at decay 0.5 it is not the last weights
    assert any(not torch.equal(ref["averages"][k], ref["params"][k]) for k in ref["params"])
