"""Inputs and the comparison of a fused-retrieval backend (rmt.ops.fused_retrieval) with the unfused
path (rmt.memory.retrieval): the same addresses, scores and gradients. Every backend's tests use
it (CPU here; Triton and CUDA where they run).

Two kinds of inputs:

* ``integer``: queries, keys, cores and the scores' gradient drawn from {-1, 0, 1}. Every product
  and sum is then an integer small enough to be exact in the dtype, whatever the order of the
  operations, so both paths compute the same bits, and the side scores (a few distinct values
  over many keys) tie constantly: addresses, scores and gradients must be equal exactly, which
  tests the tie rule everywhere.
* ``random``: normal draws. The paths sum in different orders, so values agree to rounding: each
  compared value lies within ``gamma_k |x|`` of the exact one, with ``|x|`` the same computation
  on absolute values (in float64) and k the number of rounded operations along its longest chain
  (Higham's bound, doubled for the two paths); addresses are compared where the selection is not
  decided within that rounding.
"""

import torch

from rmt.memory.retrieval import product_topk, rank1_selector, tucker_topk
from rmt.ops.fused_retrieval import fused_retrieval

# name: (T, H, r, D, n, m, C, query). C None: product keys. query: separate row and column
# queries, one shared, or UltraMemV2's one query per side expanded over the ranks.
CASES = {
    "product": (9, 2, 1, 6, 37, 4, None, "separate"),
    "product_shared": (7, 3, 1, 5, 20, 5, None, "shared"),
    "tucker": (9, 2, 2, 6, 37, 4, 2, "separate"),
    "tucker_shared": (8, 2, 2, 4, 29, 3, 2, "shared"),
    "tucker_v2": (7, 1, 2, 5, 33, 4, 2, "expanded"),
    "tucker_rank3": (6, 2, 3, 4, 25, 3, 1, "separate"),
    "tucker_all_candidates": (6, 2, 2, 4, 6, 4, 2, "separate"),  # 2m >= n: every key a candidate
}


def make_case(name, dtype, values="random", seed=0, device="cpu"):
    """Leaves (q, keys, cores or None) with gradients, the (q_row, q_col) views of q the op takes,
    and the scores' gradient."""
    T, H, r, D, n, m, C, query = CASES[name]
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = (
            torch.randint(-1, 2, shape, generator=gen).double()
            if values == "integer"
            else torch.randn(*shape, generator=gen, dtype=torch.float64)
        )
        return x.to(dtype).to(device).requires_grad_()

    sides = {"separate": 2, "shared": 1, "expanded": 2}[query]
    q = draw(T, H, sides, 1 if query == "expanded" else r, D)
    keys = draw(H, 2, r, n, D)
    cores = draw(H, C, r, r) if C else None
    if query == "expanded":
        q_row, q_col = q[:, :, 0].expand(T, H, r, D), q[:, :, 1].expand(T, H, r, D)
    else:
        q_row, q_col = q[:, :, 0], q[:, :, sides - 1]
    grad = draw(T, H, m, C or 1).detach()
    return (q, keys, cores), (q_row, q_col), grad


def unfused(q_row, q_col, keys, m, cores):
    """The unfused path as the memory layers run it: the side scores as tensors, then the top-m."""
    s_row = torch.einsum("thrd,hrnd->thrn", q_row, keys[:, 0])
    s_col = torch.einsum("thrd,hrnd->thrn", q_col, keys[:, 1])
    if cores is None:
        return product_topk(s_row, s_col, m)
    return tucker_topk(s_row, s_col, cores, m, rank1_selector(cores))


def fused(q_row, q_col, keys, m, cores, **kwargs):
    return fused_retrieval(q_row, q_col, keys, m, cores, None if cores is None else rank1_selector(cores), **kwargs)


def _run(fn, leaves, views, grad, m):
    addr, scores = fn(*views, leaves[1], m, leaves[2])
    wanted = [x for x in leaves if x is not None]
    grads = torch.autograd.grad(scores, wanted, grad)
    return addr, scores.detach(), grads


def _abs_case(leaves, views, grad, name):
    """The same inputs as absolute values in float64 (the magnitudes of the rounding bound)."""
    q, keys, cores = leaves
    T, H, r, D, n, m, C, query = CASES[name]
    q = q.detach().double().abs().requires_grad_()
    if query == "expanded":
        views = (q[:, :, 0].expand(T, H, r, D), q[:, :, 1].expand(T, H, r, D))
    else:
        views = (q[:, :, 0], q[:, :, q.shape[2] - 1])
    absolute = (
        q,
        keys.detach().double().abs().requires_grad_(),
        None if cores is None else cores.detach().double().abs().requires_grad_(),
    )
    return absolute, views, grad.double().abs()


def _magnitudes(addr, leaves, views, grad, name):
    """Scores and gradients of the selected addresses ``addr`` computed on absolute values in
    float64: every term of a compared value counted positive."""
    from rmt.ops.topm import selected_scores

    (q, keys, cores), (q_row, q_col), g = _abs_case(leaves, views, grad, name)
    n = keys.shape[3]
    r = keys.shape[2]
    s_row = torch.einsum("thrd,hrnd->thrn", q_row, keys[:, 0])
    s_col = torch.einsum("thrd,hrnd->thrn", q_col, keys[:, 1])
    picked = [
        s.gather(-1, idx.unsqueeze(2).expand(-1, -1, r, -1)) for s, idx in ((s_row, addr // n), (s_col, addr % n))
    ]
    scores = selected_scores(torch.stack(picked, 2), cores)
    wanted = [x for x in (q, keys, cores) if x is not None]
    return scores.detach(), torch.autograd.grad(scores, wanted, g)


def check(name, dtype, values, backend, device="cpu", seed=0, **tiles):
    """The fused op on ``backend`` against the unfused path: addresses equal; scores and the
    gradients of queries, keys and cores equal (``integer``) or within the rounding bound of the
    module docstring (``random``)."""
    T, H, r, D, n, m, C, query = CASES[name]
    leaves, views, grad = make_case(name, dtype, values, seed, device)
    want = _run(unfused, leaves, views, grad, m)
    got = _run(lambda *a: fused(*a, backend=backend, **tiles), leaves, views, grad, m)
    assert got[0].dtype == torch.int64 and got[0].shape == (T, H, m)
    assert got[1].dtype == dtype and got[1].shape == (T, H, m, C or 1)
    if values == "integer":
        assert torch.equal(got[0], want[0]), f"{name}: addresses differ"
        assert torch.equal(got[1], want[1]), f"{name}: scores differ"
        for which, a, b in zip(("q", "keys", "cores"), got[2], want[2]):
            assert torch.equal(a, b), f"{name}: gradient of {which} differs"
        return
    u = torch.finfo(dtype).eps / 2
    chain = D + 2 * r * r + 2  # the side score's dot product, the grid's or Eq. 16's sums, the casts
    score_mag, grad_mags = _magnitudes(want[0], leaves, views, grad, name)
    bound = 2 * chain * u / (1 - chain * u) * score_mag
    # the selection: the same addresses, unless two grid scores tie within the bound (either path
    # may then take either): there the selected scores, best first, still agree within it
    same = (got[0] == want[0]).all(-1)
    agg = [x.double().sum(-1).sort(-1, descending=True).values for x in (got[1], want[1])]
    assert ((agg[0] - agg[1]).abs() <= bound.sum(-1).amax(-1, keepdim=True)).all(), f"{name}: selected scores differ"
    assert ((got[1] - want[1]).double().abs()[same] <= bound[same]).all(), f"{name}: scores beyond the rounding bound"
    terms = chain + T * m * C if C else chain + T * m  # the keys' gradient sums over every lookup
    for which, a, b, mag in zip(("q", "keys", "cores"), got[2], want[2], grad_mags):
        if not same.all():
            continue  # a different address moves a gradient term: compared where the selection agrees above
        limit = 2 * terms * u / (1 - terms * u) * mag
        assert ((a - b).double().abs() <= limit).all(), f"{name}: gradient of {which} beyond the rounding bound"
