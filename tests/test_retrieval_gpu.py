"""The fused retrieval's GPU backends (CUDA: rmt.ops.retrieval_cuda; Triton:
rmt.ops.retrieval_triton) against the unfused path on the device: every case of
tests/retrieval_cases.py, addresses, scores and every gradient (bit for bit on integer values,
within the rounding bound on random ones), other tiles, and ``auto`` choosing them. Skipped
without CUDA; ``tools/gpu_checks.sh`` runs it."""

import pytest
import torch

from rmt.ops import dispatch

from retrieval_cases import CASES, check, fused, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["cuda", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
    "dtype,values", [(torch.float32, "integer"), (torch.bfloat16, "integer"), (torch.float32, "random")]
)
def test_gpu_backend_equals_unfused(backend, name, dtype, values):
    check(name, dtype, values, backend, device="cuda", key_tile=8, token_block=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_tiles_do_not_change_the_result(backend):
    leaves, views, _ = make_case("tucker", torch.float32, "integer", seed=3, device="cuda")
    want = fused(*views, leaves[1], 4, leaves[2], backend="reference", key_tile=1000)
    for key_tile, token_block in ((1, None), (16, 16), (37, 100), (256, 64)):
        got = fused(*views, leaves[1], 4, leaves[2], backend=backend, key_tile=key_tile, token_block=token_block)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_backends_agree_at_scale(backend):
    """Many tokens and keys (many tiles, lists that fill and refill): the same addresses and side
    scores as the reference, on integer values (every order of summation exact)."""
    from rmt.memory.retrieval import rank1_selector

    gen = torch.Generator().manual_seed(5)
    T, H, r, D, n, m = 300, 2, 2, 32, 5000, 16
    q_row, q_col = (torch.randint(-1, 2, (T, H, r, D), generator=gen).float().cuda() for _ in range(2))
    keys = torch.randint(-1, 2, (H, 2, r, n, D), generator=gen).float().cuda()
    selector = rank1_selector(torch.randint(-1, 2, (H, 2, r, r), generator=gen).float().cuda())
    want = dispatch.retrieval_module("reference").select(q_row, q_col, keys, m, selector)
    got = dispatch.retrieval_module(backend).select(q_row, q_col, keys, m, selector)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_auto_picks_a_gpu_backend():
    assert dispatch.select_retrieval_backend("cuda", torch.bfloat16) in BACKENDS
    assert dispatch.select_retrieval_backend("cuda", torch.float32) == "cuda"
