"""The planner counts the fused retrieval's bytes (rmt.planner.memory.fused_retrieval_bytes) on
the path the runtime takes: what the op's backward keeps equals, byte for byte, what its autograd
graph saves; its forward and backward peaks, as torch's allocator records them, stay within the
counted ones; ``memory.retrieval_kernel`` chooses the path by the runtime's own rule."""

import pytest
import torch

from rmt.planner.memory import TablePlan, components, fused_retrieval_bytes, retrieval_saved_bytes
from rmt.retrieval_backends import takes_fused

# product keys; TDQKR with a candidate list of 2m per side; TDQKR keeping all n keys (2m >= n)
CASES = {"product": (1, 16, 1024), "tucker": (2, 16, 1024), "tucker_all_keys": (2, 16, 24)}


def _plan(r, m, n, precision, T=256, H=2, Ds=32, threads=1):
    return TablePlan(
        slots=n * n,
        dim=8,
        tokens=T,
        heads=H,
        topk=m,
        key_dim=r * Ds,
        tucker_rank=r,
        ive_blocks=1,
        precision=precision,
        retrieval_kernel="fused",
        threads=threads,
    )


def _inputs(plan, dtype):
    from rmt.memory.retrieval import rank1_selector

    T, H, r, n, Ds = plan.tokens, plan.heads, plan.tucker_rank, plan.grid_side, plan.key_dim // plan.tucker_rank
    g = torch.Generator().manual_seed(0)
    q_row, q_col = (torch.randn(T, H, r, Ds, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    keys = torch.randn(H, 2, r, n, Ds, generator=g, dtype=dtype).requires_grad_()
    cores = selector = None
    if r > 1:
        cores = torch.randn(H, 2, r, r, generator=g, dtype=dtype).requires_grad_()
        selector = rank1_selector(cores.float())
    return q_row, q_col, keys, cores, selector


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_backward_keeps_exactly_the_counted_bytes(case, precision):
    """Every tensor the op's autograd graph saves that is not an input (the queries, keys and
    cores are the caller's): the addresses, and for TDQKR the selected side scores, ``T H m (8 +
    2 r b)`` (product keys' sum keeps no operand)."""
    from rmt.ops.fused_retrieval import fused_retrieval

    plan = _plan(*CASES[case], precision)
    q_row, q_col, keys, cores, selector = _inputs(plan, torch.bfloat16 if precision == "bf16" else torch.float32)
    inputs = {t.untyped_storage().data_ptr() for t in (q_row, q_col, keys, cores) if t is not None}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_retrieval(q_row, q_col, keys, plan.topk, cores, selector, backend="cpu")
    assert sum(saved.values()) == fused_retrieval_bytes(plan)["saved"] == retrieval_saved_bytes(plan)
    T, H, m, r, b = plan.tokens, plan.heads, plan.topk, plan.tucker_rank, 2 if precision == "bf16" else 4
    assert retrieval_saved_bytes(plan) == T * H * m * (8 + (2 * r * b if r > 1 else 0))


@pytest.mark.parametrize("case", CASES)
def test_measured_peaks_stay_within_the_counted_ones(case):
    """Forward and backward of the CPU op: the peak of torch's allocation events
    (rmt.profiling.step_peak_bytes) is at most the counted forward and backward (the count is an
    upper bound: the profiler does not see every allocation of the extension's worker threads,
    nor the lookup-reduce backward's pooled buffers once drawn), and the forward at least the
    outputs the backward keeps."""
    from rmt.ops.fused_retrieval import fused_retrieval
    from rmt.profiling import step_peak_bytes

    plan = _plan(*CASES[case], "fp32", threads=torch.get_num_threads())
    counted = fused_retrieval_bytes(plan)
    q_row, q_col, keys, cores, selector = _inputs(plan, torch.float32)
    box = {}
    cpu = torch.device("cpu")
    forward = step_peak_bytes(
        lambda: box.update(out=fused_retrieval(q_row, q_col, keys, plan.topk, cores, selector, backend="cpu")), cpu
    )
    scores = box.pop("out")[1]
    backward = step_peak_bytes(lambda: scores.backward(torch.ones_like(scores)), cpu)
    assert counted["saved"] <= forward <= counted["forward"]
    assert 0 < backward <= counted["backward"]


def test_the_counted_terms():
    """The stated formula, term by term, for TDQKR at rank 2 in bf16 on one CPU thread."""
    plan = _plan(2, 16, 1024, "bf16", T=256, H=2, Ds=32)
    T, H, m, r, n, Ds, b, c = 256, 2, 16, 2, 1024, 32, 2, 32
    task = 4 * (r * 128 * (Ds + 256) + 256 * Ds + 256) + 8 * 256 + 128 * 2 * m * (4 * (1 + r) + 8)
    assert fused_retrieval_bytes(plan) == {
        "saved": T * H * m * (8 + 2 * r * b),
        "forward": T * H * 2 * c * (8 + 4 * r) + T * H * m * (8 + 2 * r * b) + task,
        "backward": 2 * T * H * 2 * r * m * b
        + T * H * 2 * r * m * 8
        + T * H * 2 * m * 8
        + 2 * T * H * 2 * r * Ds * b
        + H * 2 * r * n * Ds * b,
    }
    on_gpu = fused_retrieval_bytes(TablePlan(**{**plan.__dict__, "device": "gpu"}))
    assert on_gpu["forward"] == fused_retrieval_bytes(plan)["forward"] - task  # tiles in shared memory


def test_the_path_follows_the_runtime_rule():
    """``auto`` counts the fused op where a backend other than the reference declares the device
    and dtype (rmt.retrieval_backends.takes_fused, what rmt.ops.fused_retrieval.choose_backend
    obeys), ``unfused`` the score tensors, ``fused`` the op everywhere."""
    from rmt.ops.fused_retrieval import choose_backend

    base = dict(slots=1024**2, dim=8, tokens=4096, heads=2, topk=16, key_dim=64, tucker_rank=2, ive_blocks=4)
    for device in ("cpu", "gpu"):
        for precision in ("fp32", "bf16"):
            for kernel in ("auto", "fused", "unfused"):
                plan = TablePlan(**base, device=device, precision=precision, retrieval_kernel=kernel)
                dtype = "bfloat16" if precision == "bf16" else "float32"
                fused = takes_fused(kernel, "cuda" if device == "gpu" else "cpu", dtype)
                assert plan.fused_retrieval == fused
                scores = 4096 * 2 * 2 * 2 * 2048 * (2 if precision == "bf16" else 4)
                want = max(fused_retrieval_bytes(plan)["forward"], fused_retrieval_bytes(plan)["backward"])
                assert components(plan)["retrieval_activations"] == (want if fused else 2 * scores)
    assert TablePlan(**base, retrieval_kernel="auto").fused_retrieval  # the CPU backend declares float32
    dtype = torch.float32
    assert (choose_backend("auto", "cpu", dtype) is not None) == takes_fused("auto", "cpu", dtype)
    assert choose_backend("unfused", "cpu", dtype) is None
    with pytest.raises(ValueError, match="^retrieval kernel must be one of auto, fused, unfused, got 'fast'.$"):
        components(TablePlan(**base, retrieval_kernel="fast"))
