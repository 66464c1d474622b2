"""Memory layers under tensor and data parallelism == the single-process run (fp32, 1e-5): a tiny
transformer + UltraMem under TP=2 and DP=2, and the RMT + UltraMem under TP=2, trained 3 steps
through the trainer (tests/dist/train_steps.py): equal losses, and equal full gradients, weights
and weight averages (``train.ema_decay``; the value tables, never averaged, are their weights)
afterwards, memory parameters included."""

import pytest
import torch

from conftest import TINY_RMT, tiny_overrides, train_cases

pytestmark = pytest.mark.slow

MEMORY = [
    "memory.type=ultramem",
    "memory.placement='1:2'",
    "memory.key_dim=8",
    "memory.num_keys=4",
    "memory.topk=3",
    "memory.init_samples=2",
]
ARCHS = {
    "transformer": [],
    "rmt": TINY_RMT,
}
LAYOUTS = {"tp2": ["parallel.tensor_model_parallel_size=2"], "dp2": []}


CASES = [("transformer", "tp2"), ("transformer", "dp2"), ("rmt", "tp2")]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The references in this process, the layouts in one launch of 2 processes."""
    common = tiny_overrides(cache_dir) + MEMORY + ["train.ema_decay=0.5"]
    cases = {arch: (common + ARCHS[arch], 1) for arch in ARCHS}
    cases.update({f"{arch}-{layout}": (common + ARCHS[arch] + LAYOUTS[layout], 2) for arch, layout in CASES})
    return train_cases(tmp_path_factory, "memory_layouts", cases)


@pytest.mark.parametrize("arch,layout", CASES)
def test_memory_layout_matches_single_process(arch, layout, runs):
    ref, got = runs[arch], runs[f"{arch}-{layout}"]
    assert len(got["losses"]) == 3
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    memory = [k for k in ref["grads"] if k.startswith("memory.")]
    assert {"memory.0.values.weight", "memory.0.keys", "memory.0.cores", "memory.0.proj"} <= set(memory)
    for key in memory:
        assert ref["grads"][key].abs().max() > 0, key
    for key in ref["grads"]:
        torch.testing.assert_close(got["grads"][key], ref["grads"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["params"][key], ref["params"][key], atol=1e-5, rtol=0, msg=key)
        torch.testing.assert_close(got["averages"][key], ref["averages"][key], atol=1e-5, rtol=0, msg=key)
    assert torch.equal(ref["averages"]["memory.0.values.weight"], ref["params"]["memory.0.values.weight"])
    assert not torch.equal(ref["averages"]["memory.0.keys"], ref["params"]["memory.0.keys"])
    assert ref["losses"][2] < ref["losses"][0]
