"""lookup_reduce: reference and CPU-extension backends against the plain-torch reference, for
every (table, scores) dtype pair of the op's contract."""

import dataclasses

import pytest
import torch

from rmt.ops import cpu_backend, extensions, lookup_reduce, reference_backward, reference_forward, select_backend

from conftest import run_python
from kernel_checks import CASES, DTYPE_PAIRS, check_backend, check_narrow_table, make_case, run_op

PAIRS = DTYPE_PAIRS + [(torch.float64, torch.float64)]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("table_dtype,dtype", PAIRS, ids=[f"{str(t)[6:]}-{str(s)[6:]}" for t, s in PAIRS])
def test_backend_matches_reference(backend, case, table_dtype, dtype):
    check_backend(backend, case, dtype, table_dtype=table_dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_narrow_table_is_the_fp32_computation_rounded_once(backend, table_dtype, sparse_grad):
    """A bf16/fp16 table with fp32 scores: output and score gradients are the fp32 computation on
    the table's values bit for bit, the table gradient the fp32 one rounded once, and all lie
    within the derived fp32-accumulation bound of the exact result (tests/kernel_checks.py)."""
    for case in CASES:
        check_narrow_table(backend, case, table_dtype, sparse_grad=sparse_grad)


def test_narrow_table_output_and_gradient_dtypes():
    """The op's dtype contract through autograd: output and score gradient of the scores' dtype,
    the table gradient (dense or sparse) of the table's."""
    table, indices, scores, block_ids, grad_out = make_case(40, 12, 5, 6, 2, 3, table_dtype=torch.bfloat16)
    for sparse_grad in (False, True):
        t, s = table.clone().requires_grad_(True), scores.clone().requires_grad_(True)
        out = lookup_reduce(t, indices, s, block_ids, 3, backend="cpu", sparse_grad=sparse_grad)
        out.backward(grad_out)
        assert out.dtype == torch.float32 and s.grad.dtype == torch.float32
        assert t.grad.dtype == torch.bfloat16 and t.grad.is_sparse == sparse_grad


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sparse_grad_matches_dense(backend):
    for case in CASES:
        check_backend(backend, case, torch.float32, sparse_grad=True)


def test_sparse_grad_is_coalesced_touched_rows():
    table, indices, scores, block_ids, grad_out = make_case(100, 12, 5, 7, 2, 4)
    table.requires_grad_(True)
    out = lookup_reduce(table, indices, scores, block_ids, 4, backend="cpu", sparse_grad=True)
    (g,) = torch.autograd.grad(out, [table], grad_out)
    assert g.is_sparse and g.is_coalesced()
    assert torch.equal(g.indices()[0], torch.unique(indices))


def test_reference_backward_matches_autograd():
    table, indices, scores, block_ids, grad_out = make_case(40, 12, 6, 9, 3, 2, torch.float64)
    rows, values, g_scores = reference_backward(grad_out, table, indices, scores, block_ids, 2)
    t, s = table.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    want_table, want_scores = torch.autograd.grad(reference_forward(t, indices, s, block_ids, 2), [t, s], grad_out)
    dense = torch.zeros_like(table).index_copy_(0, rows, values)
    torch.testing.assert_close(dense, want_table)
    torch.testing.assert_close(g_scores, want_scores)


def test_cpu_table_grad_is_deterministic():
    table, indices, scores, block_ids, grad_out = make_case(50, 24, 64, 32, 2, 4)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (threads, 1, threads, 3):
            torch.set_num_threads(n)
            results.append(
                cpu_backend.backward(grad_out, table, indices, scores, block_ids, 4)
                + cpu_backend.backward_dense(grad_out, table, indices, scores, block_ids, 4)
            )
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        for g, want in zip(got, results[0]):
            assert torch.equal(g, want)
    rows, values, g_scores, dense, dense_g_scores = results[0]
    assert torch.equal(dense, torch.zeros_like(table).index_copy_(0, rows, values))
    assert torch.equal(dense_g_scores, g_scores)


def _edge_case(N, T, K, fill, D=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(N, D, generator=gen)
    indices = torch.randint(0, N, (T, K), generator=gen) if fill is None else torch.full((T, K), fill)
    return table, indices, torch.randn(T, K, 1, generator=gen), torch.randn(T, 1, D, generator=gen)


@pytest.mark.parametrize(
    "N,T,K,fill",
    [
        (1, 1, 1, None),  # one lookup, one-row table
        (5, 1, 1, 4),  # one lookup of the last row
        (37, 8, 6, 0),  # every lookup the same row (one run of 48)
        (37, 8, 6, 36),  # every lookup the max row N-1
        (2, 64, 8, None),  # two rows, long runs
        ((1 << 23) + 3, 16, 8, None),  # 24-bit rows: five radix passes (an odd count)
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_cpu_radix_sort_edge_cases(N, T, K, fill, index_dtype):
    """Sorted backward (radix sort of the lookups by row) against the reference at the edges."""
    table, indices, scores, grad_out = _edge_case(N, T, K, fill, D=1 if N > 1000 else 3)
    if fill is None and N > 1000:
        indices[0, 0] = N - 1
    want = run_op(reference_forward, table, indices, scores, None, 1, grad_out)
    for sparse_grad in (True,) if N > 1000 else (True, False):  # no 32 MB dense gradient
        got = run_op(
            lookup_reduce,
            table,
            indices.to(index_dtype),
            scores,
            None,
            1,
            grad_out,
            backend="cpu",
            sparse_grad=sparse_grad,
        )
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=5e-6)


@pytest.mark.parametrize("N", [1000, (1 << 23) + 3])  # many long runs, 2 radix passes; 5 passes
def test_cpu_parallel_radix_sort_is_thread_count_independent(N):
    """65536 lookups: the sort runs in up to 4 per-thread slices per pass; 1, 2 and 3 threads
    give bit-identical gradients, equal to the reference."""
    table, indices, scores, grad_out = _edge_case(N, 2048, 32, None, D=1 if N > 1000 else 5)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_backend.backward(grad_out, table, indices, scores, None, 1))
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        for g, want in zip(got, results[0]):
            assert torch.equal(g, want)
    rows, values, g_scores = results[0]
    # At N=1000 each row sums ~65 lookups: fp32 rounding of such sums reaches ~1e-5, and torch's
    # own fp32 reference sums them in an order that changes with its threads, so the reference
    # is computed in float64 (exact at that level) and the row gradients get that allowance.
    want = run_op(reference_forward, table.double(), indices, scores.double(), None, 1, grad_out.double())
    dense = torch.zeros_like(table).index_copy_(0, rows, values)
    torch.testing.assert_close(dense.double(), want[1], rtol=1e-6, atol=3e-5)
    torch.testing.assert_close(g_scores.double(), want[2], rtol=1e-6, atol=5e-6)


@pytest.mark.parametrize("N", [1, 2])
def test_cpu_runs_when_a_thread_slice_holds_no_run_start(N):
    """65536 lookups of 1 or 2 rows: with 3 threads the run finder's second and third slices (2
    rows: the third) lie inside one run and start none. The runs (rows and gradients of the sparse
    backward) are those of 1 thread and of the reference. fp64, so that a run of 32768-65536
    lookups sums to within about n * 2^-53 of the reference, relatively: far inside the default
    fp64 tolerance."""
    table, indices, scores, grad_out = _edge_case(N, 2048, 32, None, D=3)
    table, scores, grad_out = table.double(), scores.double(), grad_out.double()
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(cpu_backend.backward(grad_out, table, indices, scores, None, 1))
    finally:
        torch.set_num_threads(threads)
    for g, want in zip(results[1], results[0]):
        assert torch.equal(g, want)
    rows, values, g_scores = results[0]
    assert torch.equal(rows, torch.arange(N))
    want = run_op(reference_forward, table, indices, scores, None, 1, grad_out)
    torch.testing.assert_close(values, want[1])
    torch.testing.assert_close(g_scores, want[2])


@pytest.mark.parametrize("N", [1000, 1 << 17, (1 << 23) + 3])
def test_cpu_radix_sort_is_the_stable_sort_at_every_digit_width(N):
    """The backward's sort (csrc/lookup_reduce_cpu.cpp, sort_lookups; by default digits of 10
    bits on several threads, written through line buffers, and of 5 bits, 10 on AMD CPUs, on one)
    at widths 1, 5, 7, 10 and 16 and 1 or 3 threads: the packed (row << 32 | position) pairs equal
    torch's stable sort of the rows, with the lookups' own positions and with given ascending ones
    (the token order's repeated lookups). 65536 lookups; 1000 rows: long runs, 2^23 + 3: up to 24
    passes; at 16 bits most buckets hold a line's part."""
    gen = torch.Generator().manual_seed(N)
    indices = torch.randint(0, N, (65536,), generator=gen)
    given = torch.randperm(1 << 20, generator=gen)[:65536].sort().values * 4096  # up to 2^32 - 4096
    rows, order = torch.sort(indices, stable=True)
    ext = cpu_backend._ext()
    assert ext.sort_digit_bits() in (5, 10) and ext.sort_digit_bits(2) == 10
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for bits in (0, 1, 5, 7, 10, 16):
                assert torch.equal(ext.sorted_lookups(indices, N, bits), (rows << 32) | order), (n, bits)
                assert torch.equal(ext.sorted_lookups(indices, N, bits, given), (rows << 32) | given[order]), (n, bits)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match=r"sorted_lookups: indices must lie in \[0, num_rows\)"):
        ext.sorted_lookups(indices, indices.max().item(), 0)
    with pytest.raises(RuntimeError, match="sorted_lookups: positions must ascend"):
        ext.sorted_lookups(indices, N, 0, given.flip(0))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("7", "7"),
        ("16", "16"),
        ("17", "RMT_SORT_DIGIT_BITS must be an integer in [1, 16], got '17'"),
        ("5x", "RMT_SORT_DIGIT_BITS must be an integer in [1, 16], got '5x'"),
    ],
)
def test_sort_digit_width_from_the_environment(monkeypatch, value, expected):
    """RMT_SORT_DIGIT_BITS replaces the CPU vendor's digit width, or is rejected with one sentence."""
    monkeypatch.setenv("RMT_SORT_DIGIT_BITS", value)
    code = (
        "from rmt.ops import cpu_backend\n"
        "try:\n    print(cpu_backend._ext().sort_digit_bits())\n"
        "except RuntimeError as err:\n    print(str(err).splitlines()[0])"
    )
    proc = run_python(["-c", code])
    assert proc.stdout.strip().splitlines()[-1] == expected


def _bad_inputs():
    table, indices, scores, block_ids, _ = make_case(10, 8, 3, 4, 2, 3)
    yield "indices must lie in \\[0, 10\\); got max 10", (table, indices.clone().fill_(10), scores, block_ids, 3)
    yield "indices must lie in \\[0, 10\\); got min -1", (table, indices.clone().fill_(-1), scores, block_ids, 3)
    yield "block_ids must lie in \\[0, 3\\)", (table, indices, scores, block_ids.clone().fill_(3), 3)
    yield "scores must be \\[T, K, C\\]", (table, indices, scores[:2], block_ids, 3)
    yield (
        "scores dtype torch.float64 must equal table dtype torch.float32, or be torch.float32 for a bfloat16 "
        "or float16 table",
        (table, indices, scores.double(), block_ids, 3),
    )
    yield "scores dtype torch.bfloat16", (table, indices, scores.bfloat16(), block_ids, 3)
    yield (
        "scores dtype torch.float16 must equal table dtype torch.bfloat16",
        (table.bfloat16(), indices, scores.half(), block_ids, 3),
    )
    yield "indices dtype", (table, indices.float(), scores, block_ids, 3)
    yield "divisible", (table, indices, torch.zeros(3, 4, 3), block_ids, 3)
    yield "num_blocks must be 1", (table, indices, scores, None, 3)
    yield "block_ids shape", (table, indices, scores, block_ids[:, :2], 3)
    yield "table must be 2-D", (table[None], indices, scores, block_ids, 3)


@pytest.mark.parametrize("message,args", list(_bad_inputs()))
def test_invalid_inputs_rejected_before_kernels(monkeypatch, message, args):
    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before validation")

    monkeypatch.setattr(cpu_backend, "forward", no_kernel)
    with pytest.raises(ValueError, match="^lookup_reduce: .*" + message):
        lookup_reduce(*args, backend="cpu")


def test_cpu_extension_rejects_unsupported_dtype_pairs():
    """The C++ entry points check the (table, scores) pair themselves (no out-of-bounds reads when
    called around the validating Python wrapper)."""
    table, indices, scores, block_ids, grad_out = make_case(10, 8, 3, 4, 2, 3)
    with pytest.raises(RuntimeError, match="need one dtype, or a bf16/fp16 table with fp32 scores"):
        cpu_backend.forward(table.half(), indices, scores.bfloat16(), block_ids, 3)
    with pytest.raises(RuntimeError, match="need one dtype"):
        cpu_backend.backward(grad_out, table, indices, scores.double(), block_ids, 3)


def test_validation_can_skip_range_check():
    table, indices, scores, _, _ = make_case(10, 8, 3, 4, 1, 1)
    bad = indices.clone().fill_(10)
    with pytest.raises(ValueError):
        lookup_reduce(table, bad, scores, backend="reference")
    out = lookup_reduce(table, indices, scores, backend="reference", validate=False)
    assert out.shape == (3, 1, 8)


def test_dispatch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("RMT_LOOKUP_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend(cpu) == "cpu"
    assert select_backend(cpu, "reference") == "reference"
    assert select_backend(cpu, dtype=torch.float64) == "cpu"
    monkeypatch.setenv("RMT_LOOKUP_BACKEND", "reference")
    assert select_backend(cpu) == "reference"
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend(cpu, "fast")
    with pytest.raises(RuntimeError, match="not available"):
        select_backend(cpu, "triton")
    with pytest.raises(ValueError, match="float64"):
        select_backend(cpu, "triton", torch.float64)


def test_forward_prepared_sort_reaches_the_backward_and_is_freed_by_it(monkeypatch):
    """A backend's declared ``forward_for_backward`` (CUDA: the sort by row, on a side stream) hands its
    result to the backward as ``prep``, only when a gradient is needed; the backward then drops it,
    so it does not live as long as the output's graph (a training loop holds the loss until the
    next step)."""
    import weakref

    from rmt.ops import dispatch, reference

    class Prep:
        pass

    preps, received = [], []

    def forward_for_backward(*args):
        preps.append(Prep())
        return reference.reference_forward(*args), preps[-1]

    def backward(*args, prep=None):
        received.append(prep)
        return reference.reference_backward(*args)

    monkeypatch.setattr(reference, "forward_for_backward", forward_for_backward, raising=False)
    monkeypatch.setattr(reference, "backward", backward)
    spec = dispatch.REGISTRY["reference"]  # the reference, declared with a forward-prepared sort
    monkeypatch.setitem(
        dispatch.REGISTRY, "reference", dataclasses.replace(spec, kernels=spec.kernels | {"forward_for_backward"})
    )
    table, indices, scores, block_ids, grad_out = make_case(20, 8, 6, 4, 2, 3)
    lookup_reduce(table, indices, scores, block_ids, 3, backend="reference")
    assert not preps
    table.requires_grad_(True)
    out = lookup_reduce(table, indices, scores, block_ids, 3, backend="reference", sparse_grad=True)
    alive = weakref.ref(preps[0])
    del preps[0]
    out.backward(grad_out)
    assert len(received) == 1 and received[0] is alive()
    received.clear()
    assert alive() is None and out.grad_fn is not None
    want = run_op(reference_forward, table, indices, scores, block_ids, 3, grad_out)
    torch.testing.assert_close(table.grad.to_dense(), want[1])


def test_failed_build_falls_back_to_reference(monkeypatch):
    monkeypatch.delenv("RMT_LOOKUP_BACKEND", raising=False)
    monkeypatch.setitem(extensions._cache, cpu_backend.NAME, None)
    assert select_backend(torch.device("cpu")) == "reference"


def test_cpu_row_gradient_buffers_reused_only_when_free():
    """Pooled [U, D] buffers: a freed gradient's buffer is reused, a live one is never overwritten."""
    cases = [(300, 16, 40, 8, 1, 1), (50, 12, 5, 7, 2, 4), (2000, 16, 64, 16, 1, 2), (300, 16, 40, 8, 1, 1)]
    args = [make_case(*case, seed=i) for i, case in enumerate(cases)]

    def run(i):
        table, indices, scores, block_ids, grad_out = args[i]
        return cpu_backend.backward(grad_out, table, indices, scores, block_ids, cases[i][5])

    def check(i, got):
        table, indices, scores, block_ids, grad_out = args[i]
        want = reference_backward(grad_out, table, indices, scores, block_ids, cases[i][5])
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=5e-6)

    first = run(0)
    check(0, first)
    ptr = first[1].data_ptr()
    del first
    again = run(3)  # same shape, buffer freed: the pooled storage comes back
    assert again[1].data_ptr() == ptr
    held = [again, run(1), run(2)]  # live gradients of several shapes, one growing past the pool
    snapshot = [tuple(x.clone() for x in h) for h in held]
    more = [run(i) for i in range(4)]  # must not write into any live buffer
    for h, s in zip(held, snapshot):
        assert all(torch.equal(a, b) for a, b in zip(h, s))
    for i, got in enumerate(more):
        check(i, got)
    assert len({h[1].data_ptr() for h in held + more}) == len(held + more)


def test_cpu_dense_gradient_buffers_reused_only_when_free():
    """The one-pass dense gradient: a freed gradient's buffer is reused, a live one never overwritten."""
    args = [make_case(300, 16, 40, 8, 1, 1, seed=i) for i in range(3)]

    def run(i):
        table, indices, scores, block_ids, grad_out = args[i]
        return cpu_backend.backward_dense(grad_out, table, indices, scores, block_ids, 1)

    def want(i):
        table, indices, scores, block_ids, grad_out = args[i]
        rows, values, g_scores = reference_backward(grad_out, table, indices, scores, block_ids, 1)
        return torch.zeros_like(table).index_copy_(0, rows, values), g_scores

    first = run(0)
    ptr = first[0].data_ptr()
    del first
    held = run(1)
    assert held[0].data_ptr() == ptr
    snapshot = held[0].clone()
    other = run(2)
    assert other[0].data_ptr() != ptr and torch.equal(held[0], snapshot)
    for i, got in ((1, held), (2, other)):
        for g, w in zip(got, want(i)):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=5e-6)


def test_every_backend_implements_its_declaration():
    """Each backend of the registry has the required kernels and every optional one it declares
    (binding checks it), and a declaration naming a kernel the module lacks is refused."""
    from rmt.ops import dispatch

    for name in dispatch.BACKENDS:
        bound = dispatch.get_backend(name)
        assert bound.sorts_in_forward == (name == "cuda")
    bad = dispatch.BackendSpec("reference", "rmt.ops.reference", frozenset({"backward_dense"}))
    with pytest.raises(TypeError, match=r"missing \['backward_dense'\]"):
        dispatch.Backend(bad)
