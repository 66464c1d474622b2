"""The fused retrieval op (rmt.ops.fused_retrieval) against the unfused path: the tie rule, the
streaming reference's selection, scores and gradients for every retrieval (product keys shared
and separate, TDQKR with multi-core scoring, UltraMemV2's per-rank queries, the all-candidates
grid), the bytes its backward keeps, and its input checks."""

import pytest
import torch

from rmt.memory.retrieval import rank1_selector
from rmt.ops import dispatch
from rmt.ops.fused_retrieval import fused_retrieval
from rmt.ops.topm import ordered_topm

from retrieval_cases import CASES, check, fused, make_case, unfused


def test_ordered_topm_takes_the_lower_position_among_equal_values():
    """Against Python's sort by (value descending, position ascending) on rows full of ties."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (40, 25), generator=gen).float()
    for m in (1, 4, 13, 25):
        values, positions = ordered_topm(x, m)
        for row in range(x.shape[0]):
            want = sorted(range(25), key=lambda i: (-x[row, i].item(), i))[:m]
            assert positions[row].tolist() == want
            assert torch.equal(values[row], x[row, want])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
    "dtype,values",
    [(torch.float32, "integer"), (torch.bfloat16, "integer"), (torch.float64, "random"), (torch.float32, "random")],
)
def test_backend_equals_unfused(backend, name, dtype, values):
    """Tiles of 8 keys and blocks of 4 tokens, neither dividing the shapes."""
    check(name, dtype, values, backend, key_tile=8, token_block=4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_tiles_do_not_change_the_result(backend):
    leaves, views, _ = make_case("tucker", torch.float32, "integer", seed=3)
    want = fused(*views, leaves[1], 4, leaves[2], backend="reference", key_tile=1000)
    for key_tile, token_block in ((1, None), (5, 1), (36, 2), (37, 100)):
        got = fused(*views, leaves[1], 4, leaves[2], backend=backend, key_tile=key_tile, token_block=token_block)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _select(backend, name, dtype, seed=0, **tiles):
    leaves, (q_row, q_col), _ = make_case(name, dtype, "random", seed)
    cores = leaves[2]
    selector = None if cores is None else rank1_selector(cores.detach())
    m = CASES[name][5]
    with torch.no_grad():
        return dispatch.retrieval_module(backend).select(q_row, q_col, leaves[1], m, selector, **tiles)


def test_cpu_gives_the_same_bits_on_any_thread_count():
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_select("cpu", "tucker", torch.float32, key_tile=7, token_block=2))
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        assert torch.equal(got[0], results[0][0]) and torch.equal(got[1], results[0][1])


def test_autocast_runs_the_op_in_its_dtype():
    """Under CPU autocast to bf16, float32 inputs are cast as the unfused path's product casts
    them: the same addresses and scores as the op on bf16 inputs, and as the unfused path."""
    leaves, views, _ = make_case("tucker", torch.float32, "integer", seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused(*views, leaves[1], 4, leaves[2])
        want = unfused(*views, leaves[1], 4, leaves[2])
    low = [x.detach().to(torch.bfloat16) for x in (*views, leaves[1], leaves[2])]
    plain = fused(*low[:3], 4, low[3])
    assert got[1].dtype == torch.bfloat16
    for other in (want, plain):
        assert torch.equal(got[0], other[0]) and torch.equal(got[1], other[1].to(got[1].dtype))


def test_all_equal_scores_select_the_lowest_addresses():
    """Every side score equal: product keys take rows 0..m-1 and columns 0..m-1, the grid the
    lowest addresses, best (all equal) first in address order."""
    T, H, n, m = 3, 2, 10, 5
    q = torch.ones(T, H, 1, 4)
    keys = torch.ones(H, 2, 1, n, 4)
    addr, scores = fused_retrieval(q, q, keys, m, backend="reference", key_tile=3)
    grid = sorted(i * n + j for i in range(m) for j in range(m))[:m]
    assert addr.tolist() == [[grid] * H] * T
    assert torch.equal(scores, torch.full((T, H, m, 1), 8.0))


def test_backward_keeps_what_the_contract_states():
    """Beyond its inputs the graph keeps the addresses (8 bytes each) and the selected side scores
    (Eq. 16's operands), nothing that grows with the keys per side."""
    T, H, r, D, n, m, C, _ = CASES["tucker"]
    leaves, views, _ = make_case("tucker", torch.float32)
    inputs = {t.untyped_storage().data_ptr() for t in leaves if t is not None}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused(*views, leaves[1], m, leaves[2], backend="reference")
    assert {(tuple(t.shape), t.dtype) for t in saved} == {((T, H, m), torch.int64), ((T, H, 2, r, m), torch.float32)}
    assert len(saved) == 2


def test_backends_and_selection():
    assert dispatch.select_retrieval_backend("cpu", torch.float16) is None  # only the reference covers fp16
    with pytest.raises(ValueError, match="backend 'cuda' does not run cpu tensors"):
        dispatch.select_retrieval_backend("cpu", torch.float32, "cuda")
    with pytest.raises(ValueError, match="backend 'reference' does not run cpu tensors of torch.int64"):
        dispatch.select_retrieval_backend("cpu", torch.int64, "reference")
    assert dispatch.fused_retrieval_backends("cuda", torch.bfloat16) == ["cuda", "triton"]
    assert dispatch.fused_retrieval_backends("cuda", torch.float64) == []
    assert dispatch.fused_retrieval_backends("cpu", torch.bfloat16) == ["cpu"]
    assert dispatch.select_retrieval_backend("cpu", torch.float32) == "cpu"


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(keys=torch.zeros(2, 3, 1, 8, 4)), r"keys must be \[H, 2, r, n, D\]"),
        (dict(q_row=torch.zeros(5, 2, 1, 3)), r"q_row must be \[T, 2, 1, 4\]"),
        (dict(q_col=torch.zeros(4, 2, 1, 4)), "must hold the same tokens"),
        (dict(q_row=torch.zeros(5, 2, 1, 4, dtype=torch.float64)), "must share dtype and device"),
        (dict(m=9), r"m \(9\) must lie in \[1, 8\]"),
        (dict(cores=torch.zeros(2, 1, 1, 1)), "needs both cores and selector"),
    ],
)
def test_bad_inputs_are_refused_in_one_sentence(change, message):
    args = dict(q_row=torch.zeros(5, 2, 1, 4), q_col=torch.zeros(5, 2, 1, 4), keys=torch.zeros(2, 2, 1, 8, 4), m=3)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        fused_retrieval(**args)


def test_tucker_cores_must_match():
    q, keys = torch.zeros(5, 2, 2, 4), torch.zeros(2, 2, 2, 8, 4)
    sel = (torch.zeros(2, 2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"cores must be \[2, C, 2, 2\]"):
        fused_retrieval(q, q, keys, 3, torch.zeros(2, 2, 3, 3), sel)
    with pytest.raises(ValueError, match=r"product keys take rank-1"):
        fused_retrieval(q, q, keys, 3)
