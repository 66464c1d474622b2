"""lookup_reduce and the row-wise optimizer steps on a CUDA GPU: the CUDA extension and the
Triton kernels against the plain-torch reference (run on the CPU), values and gradients.

Skipped where torch sees no GPU (the development and CI machines); run on a GPU machine with
``python -m pytest tests/test_ops_gpu.py``.
"""

import pytest
import torch

from rmt.ops import cuda_backend, lookup_reduce, reference_backward, select_backend, triton_backend

from kernel_checks import (
    CASES,
    DTYPE_PAIRS,
    check_backend,
    check_fused_zero_decay,
    check_narrow_table,
    check_row_optimizer_kernels,
    make_case,
    run_op,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

GPU_BACKENDS = ["cuda", "triton"]
# A wide D in chunks (D > 128, not a multiple of 32), a headline-sized table, and a small table
# whose rows are each looked up ~1300 times: fp32 sums of 1300 terms of size ~36 differ from the
# reference's summation order by up to ~2e-4.
LARGE_CASES = [
    ((100_003, 200, 300, 64, 2, 4), None),
    ((1 << 20, 64, 4096, 32, 1, 1), None),
    ((50, 64, 2048, 32, 1, 1), dict(rtol=1e-5, atol=1e-3)),
]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("table_dtype,dtype", DTYPE_PAIRS, ids=[f"{str(t)[6:]}-{str(s)[6:]}" for t, s in DTYPE_PAIRS])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_gpu_backend_matches_reference(backend, table_dtype, dtype, sparse_grad):
    for case in CASES:
        check_backend(backend, case, dtype, sparse_grad=sparse_grad, device="cuda", table_dtype=table_dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_gpu_narrow_table_is_the_fp32_computation_rounded_once(backend, table_dtype, sparse_grad):
    """bf16/fp16 table, fp32 scores: the fp32 kernels' results on the table's values, the table
    gradient rounded once to nearest even (kernel_checks.check_narrow_table), at the small
    cases and at a headline-sized one."""
    for case in CASES + [(1 << 20, 64, 4096, 32, 1, 1), (100_003, 200, 300, 64, 2, 4)]:
        check_narrow_table(backend, case, table_dtype, sparse_grad=sparse_grad, device="cuda")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("case,tolerance", LARGE_CASES)
def test_gpu_backend_matches_reference_at_scale(backend, case, tolerance):
    for sparse_grad in (False, True):
        check_backend(backend, case, torch.float32, sparse_grad=sparse_grad, device="cuda", seed=3, tolerance=tolerance)


def test_cuda_sort_matches_torch():
    """The backward's device-side sort: stable positions, unique rows, segment starts and U."""
    gen = torch.Generator().manual_seed(4)
    for N, M in ((7, 1000), (1 << 20, 131072), ((1 << 33) + 5, 5000), (3, 1)):
        indices = torch.randint(0, N, (M // 8 or 1, 8 if M >= 8 else M), generator=gen).cuda()
        table = torch.empty(1, 1).expand(N, 1)  # only its row count is read
        prep = cuda_backend.sort(table, indices)
        count = prep.count()
        keys, positions = torch.sort(indices.reshape(-1).cpu(), stable=True)
        rows, counts = torch.unique_consecutive(keys, return_counts=True)
        assert count == rows.numel() == int(prep.num_unique.cpu())
        assert torch.equal(prep.sorted_positions.cpu(), positions)
        assert torch.equal(prep.unique_rows[:count].cpu(), rows)
        assert torch.equal(
            prep.seg_start[: count + 1].cpu(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        )


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_cuda_backend_on_a_side_stream(sparse_grad):
    """Forward and backward issued on a non-default stream (as the async memory stream does),
    the sort on the backend's own stream: equal to the default stream's results."""
    table, indices, scores, block_ids, grad_out = make_case(5000, 64, 512, 32, 2, 4, device="cuda")
    want = run_op(lookup_reduce, table, indices, scores, block_ids, 4, grad_out, sparse_grad=sparse_grad)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run_op(lookup_reduce, table, indices, scores, block_ids, 4, grad_out, sparse_grad=sparse_grad)
    torch.cuda.current_stream().wait_stream(stream)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_table_gradient_is_deterministic_and_dense_equals_sparse(backend):
    """Many lookups of few rows (runs of ~1300): two backward passes give bit-identical table
    and score gradients, and the dense gradient is the sparse one scattered into zeros."""
    table, indices, scores, block_ids, grad_out = make_case(50, 72, 1024, 64, 2, 4, device="cuda")
    impl = {"cuda": cuda_backend, "triton": triton_backend}[backend]
    first = impl.backward(grad_out, table, indices, scores, block_ids, 4)
    second = impl.backward(grad_out, table, indices, scores, block_ids, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    rows, values, g_scores = first
    assert torch.equal(rows.cpu(), torch.unique(indices.cpu()))
    want = reference_backward(*(x.cpu() for x in (grad_out, table, indices, scores, block_ids)), 4)
    torch.testing.assert_close(values.cpu(), want[1], rtol=1e-5, atol=1e-4)
    dense, dense_scores = impl.backward_dense(grad_out, table, indices, scores, block_ids, 4)
    assert torch.equal(dense, torch.zeros_like(table).index_copy_(0, rows, values))
    assert torch.equal(dense_scores, g_scores)


def test_gpu_dispatch_prefers_cuda_extension(monkeypatch):
    monkeypatch.delenv("RMT_LOOKUP_BACKEND", raising=False)
    assert select_backend(torch.device("cuda")) == "cuda"
    with pytest.raises(ValueError, match="float64 runs only on the cpu and reference"):
        select_backend(torch.device("cuda"), "cuda", torch.float64)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_invalid_indices_rejected_before_kernels(monkeypatch, backend):
    impl = {"cuda": cuda_backend, "triton": triton_backend}[backend]

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(impl, "forward", no_kernel)
    table, indices, scores, block_ids, _ = make_case(10, 8, 3, 4, 2, 3, device="cuda")
    with pytest.raises(ValueError, match=r"^lookup_reduce: indices must lie in \[0, 10\); got max 10"):
        lookup_reduce(table, indices.clone().fill_(10), scores, block_ids, 3, backend=backend)
    with pytest.raises(ValueError, match=r"^lookup_reduce: block_ids must lie in \[0, 3\); got min -1"):
        lookup_reduce(table, indices, scores, block_ids.clone().fill_(-1), 3, backend=backend)


def test_gpu_empty_batch():
    table, indices, scores, block_ids, grad_out = make_case(30, 8, 0, 5, 1, 2, device="cuda")
    out, g_table, g_scores = run_op(lookup_reduce, table, indices, scores, block_ids, 2, grad_out)
    assert out.shape == (0, 2, 8) and out.is_cuda
    assert torch.count_nonzero(g_table) == 0 and g_scores.shape == (0, 5, 1)


def test_gpu_sparse_adam_and_rowwise_adagrad_match_torch():
    """The fused Triton optimizer steps on GPU tables (through rmt's SparseAdam and
    RowWiseAdagrad, fed by lookup_reduce's sparse gradient) against torch's SparseAdam and the
    plain-torch row-wise Adagrad, over three steps."""
    from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam, rowwise_adagrad_update_

    gen = torch.Generator().manual_seed(11)
    init = torch.randn(5000, 72, generator=gen)
    ours, theirs, ada = (torch.nn.Parameter(init.clone().cuda()) for _ in range(3))
    opt_ours = SparseAdam([ours], lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    opt_theirs = torch.optim.SparseAdam([theirs], lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    opt_ada = RowWiseAdagrad([ada], lr=0.1, eps=1e-10)
    want_ada, want_sum = init.clone(), torch.zeros(5000)
    for _ in range(3):
        indices = torch.randint(0, 5000, (256, 16), generator=gen).cuda()
        scores = torch.randn(256, 16, 1, generator=gen).cuda()
        grad_out = torch.randn(256, 1, 72, generator=gen).cuda()
        for param, opt in ((ours, opt_ours), (theirs, opt_theirs), (ada, opt_ada)):
            opt.zero_grad(set_to_none=True)
            lookup_reduce(param, indices, scores, sparse_grad=True).backward(grad_out)
            opt.step()
        grad = ada.grad.coalesce()
        rowwise_adagrad_update_(want_ada, want_sum, grad.indices()[0].cpu(), grad.values().cpu(), 0.1, 1e-10, 0.0)
    torch.testing.assert_close(ours.detach().cpu(), theirs.detach().cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        opt_ours.state[ours]["exp_avg_sq"].cpu(), opt_theirs.state[theirs]["exp_avg_sq"].cpu(), rtol=1e-6, atol=1e-9
    )
    torch.testing.assert_close(ada.detach().cpu(), want_ada, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours.detach().cpu(), init)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_row_optimizer_kernels_on_narrow_tables(dtype):
    """The Triton SparseAdam / row-wise Adagrad kernels on CUDA tables of fp32/bf16/fp16 with fp32
    state, against the torch references on the GPU: moments bit for bit, rows to the stated
    rounding, a narrow step == the fp32 step rounded once to nearest even."""
    from rmt.ops import triton_sparse_optim

    for seed in range(3):
        check_row_optimizer_kernels(triton_sparse_optim, dtype, device="cuda", seed=seed)


@pytest.mark.parametrize("cls", ["SparseAdam", "RowWiseAdagrad"])
def test_gpu_narrow_table_training_step(cls):
    """A bf16 GPU table with fp32 scores through lookup_reduce's sparse gradient and rmt's
    optimizer (fused Triton step): fp32 state, and the step equals the fp32 table's step on the
    same bf16 gradient, rounded once."""
    from rmt.ops import sparse_optim

    gen = torch.Generator().manual_seed(12)
    init = torch.randn(5000, 72, generator=gen).bfloat16().cuda()
    narrow, wide = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.float())
    opts = [getattr(sparse_optim, cls)([p], lr=0.01) for p in (narrow, wide)]
    indices = torch.randint(0, 5000, (256, 16), generator=gen).cuda()
    scores = torch.randn(256, 16, 1, generator=gen).cuda()
    grad_out = torch.randn(256, 1, 72, generator=gen).cuda()
    lookup_reduce(narrow, indices, scores, sparse_grad=True).backward(grad_out)
    assert narrow.grad.dtype == torch.bfloat16
    wide.grad = narrow.grad.float()
    for opt in opts:
        opt.step()
    state = opts[0].state[narrow]
    assert all(v.dtype == torch.float32 for v in state.values() if torch.is_tensor(v))
    assert torch.equal(narrow.detach(), wide.detach().bfloat16())
    assert not torch.equal(narrow.detach(), init)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kind", ["sparse_adam", "rowwise_adagrad"])
@pytest.mark.parametrize(
    "shape",
    [
        (300, 12, 10, 6, 3, 1),
        (500, 64, 16, 8, 2, 4),
        (5000, 200, 64, 16, 1, 1),
        (40, 96, 256, 16, 2, 4),
        (7, 512, 128, 16, 1, 1),
    ],
)
def test_gpu_fused_update_equals_the_cpu_step(backend, kind, shape):
    """The optimizer step fused into the GPU backward (CUDA kernel; Triton kernel), two steps of
    three micro-batches, against the fused CPU step (bit for bit the unfused CPU step, tested in
    test_ops_fused_update.py): equal up to the summation order of each row's gradient (the
    kernels may contract or order the sums differently; the CUDA kernel splits a row of more
    than 32 lookups into 16 slices, as the last two shapes' ~300 and ~900 lookups per row), as
    the CPU's micro-batches are; the score gradients' dot products to fp32 rounding of D-term
    sums. Two runs give the same bits."""
    from test_ops_fused_update import assert_steps_agree, batches, gradient_bound, make_table, run, state_tensors

    steps = [batches(shape, 3, seed=s) for s in range(2)]
    table = make_table(shape)
    p_c, opt_c, sg_c, _ = run(table, kind, steps, shape[5], fused=True)
    p_g, opt_g, sg_g, update = run(table, kind, steps, shape[5], fused=True, backend=backend, device="cuda")
    assert update.updates == 2 and p_g.grad is None and p_g.is_cuda
    assert_steps_agree(kind, p_g, opt_g, p_c, opt_c, *gradient_bound(shape, steps))
    for a, b in zip(sg_g, sg_c):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)
    again, opt_again, sg_again, _ = run(table, kind, steps, shape[5], fused=True, backend=backend, device="cuda")
    assert torch.equal(again, p_g) and all(torch.equal(a, b) for a, b in zip(sg_again, sg_g))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(opt_again, again), state_tensors(opt_g, p_g)))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_fused_rowwise_adagrad_without_weight_decay_adds_no_term(backend):
    """weight_decay 0 adds no decay term in the GPU kernels' fused row-wise Adagrad step: rows
    holding infinite weights keep finite gradients and sums (kernel_checks.check_fused_zero_decay)."""
    check_fused_zero_decay(backend, device="cuda")
