"""Distributed == single process: the same tiny model trained 3 steps in one process and
under TP=2, PP=2, DP=2 and interleaved PP=2 x VPP=2 gives equal losses, gradients and weights."""

import pytest
import torch

from conftest import run_python, tiny_overrides

LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "dp2": [],
    "pp2_vpp2": ["model.num_layers=4", "parallel.pipeline_model_parallel_size=2",
                 "parallel.virtual_pipeline_model_parallel_size=2"],
}


def _train(tmp_path, name, overrides, nproc):
    out = tmp_path / f"{name}.pt"
    run_python(["tests/dist/train_steps.py", str(out)] + overrides, nproc=nproc)
    return torch.load(out)


@pytest.fixture(scope="module")
def single(cache_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {layers: _train(tmp, f"single{layers}", tiny_overrides(cache_dir) + [f"model.num_layers={layers}"], 1)
            for layers in (2, 4)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, single, cache_dir, tmp_path):
    overrides = tiny_overrides(cache_dir) + LAYOUTS[layout]
    ref = single[4 if "model.num_layers=4" in overrides else 2]
    got = _train(tmp_path, layout, overrides, 2)
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
    assert ref["losses"][2] < ref["losses"][0]
