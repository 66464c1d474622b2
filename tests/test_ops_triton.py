"""Triton backend (lookup-reduce and the row-wise optimizer steps) in the interpreter: runs this
file in a subprocess with TRITON_INTERPRET=1.

The variable must be set before Triton is first imported, so the checks run in a fresh process
(``python tests/test_ops_triton.py``) rather than in the pytest process.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_checks():
    import torch

    from rmt.ops import lookup_reduce, triton_backend

    from kernel_checks import CASES, check_backend, check_narrow_table, make_case

    for case in CASES:
        check_backend("triton", case, torch.float32)
        check_backend("triton", case, torch.float32, sparse_grad=True)
    for dtype in (torch.bfloat16, torch.float16):
        check_backend("triton", CASES[1], dtype)
    # A bf16/fp16 table with fp32 scores: the interpreter rounds fp32 -> bf16 toward zero (a GPU
    # to nearest even, tests/test_ops_gpu.py), so the bf16 table gradient is checked against that.
    for table_dtype, rounding in ((torch.bfloat16, "rtz"), (torch.float16, "rne")):
        for case, sparse_grad in ((CASES[1], False), (CASES[2], True)):
            check_backend("triton", case, torch.float32, sparse_grad=sparse_grad, table_dtype=table_dtype)
            check_narrow_table("triton", case, table_dtype, sparse_grad=sparse_grad, rounding=rounding)
    table, indices, scores, block_ids, grad_out = make_case(9, 12, 6, 8, 2, 3)
    first = triton_backend.backward(grad_out, table, indices, scores, block_ids, 3)
    second = triton_backend.backward(grad_out, table, indices, scores, block_ids, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "table gradient not deterministic"
    rows, values, g_scores = first
    dense, dense_scores = triton_backend.backward_dense(grad_out, table, indices, scores, block_ids, 3)
    assert torch.equal(dense, torch.zeros_like(table).index_copy_(0, rows, values)), "dense != sparse scattered"
    assert torch.equal(dense_scores, g_scores)
    try:
        lookup_reduce(table, indices.clone().fill_(-3), scores, block_ids, 3, backend="triton")
    except ValueError as exc:
        assert "got min -3" in str(exc)
    else:
        raise AssertionError("negative indices were not rejected")
    check_sparse_optim()
    check_fused_update()


def check_fused_update():
    """The Triton backward with the optimizer fused in against the torch formulation (reference
    backward, then the torch updates), over two micro-batches accumulated into one step and a
    second step; SparseAdam and row-wise Adagrad; fp32 and bf16 tables (fp32 state and scores).
    Bounds as for the CPU kernel (tests/test_ops_fused_update.py); the interpreter rounds the
    bf16 rows toward zero."""
    import torch

    from rmt.ops import lookup_reduce
    from rmt.ops.fused_update import FusedValueUpdate
    from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam

    from kernel_checks import ADAM_REL, adagrad_rel, assert_rounded_within, check_fused_zero_decay

    N, D, T, K, C, E = 60, 20, 6, 5, 2, 3
    gen = torch.Generator().manual_seed(3)
    steps = [
        [
            (
                torch.randint(0, N, (T, K), generator=gen),
                torch.randn(T, K, C, generator=gen),
                torch.randint(0, E, (T, K), generator=gen),
                torch.randn(T, E, D, generator=gen),
            )
            for _ in range(2)
        ]
        for _ in range(2)
    ]
    makers = {
        "sparse_adam": lambda p: SparseAdam([p], lr=2e-2, betas=(0.8, 0.95), eps=1e-6),
        "rowwise_adagrad": lambda p: RowWiseAdagrad([p], lr=0.1, weight_decay=0.01),
    }
    for kind, make in makers.items():
        for dtype, rounding in ((torch.float32, "rne"), (torch.bfloat16, "rtz")):
            table = torch.randn(N, D, generator=gen).to(dtype)
            got = {}
            for backend in ("triton", "reference"):
                p = torch.nn.Parameter(table.clone())
                opt = make(p)
                update = FusedValueUpdate(p, opt)
                grads = []
                for step in steps:
                    for i, (indices, scores, blocks, grad_out) in enumerate(step):
                        update.final = i == len(step) - 1
                        s = scores.clone().requires_grad_(True)
                        lookup_reduce(p, indices, s, blocks, E, backend=backend, update=update).backward(grad_out)
                        grads.append(s.grad)
                got[backend] = (p.data, [v for v in opt.state[p].values() if torch.is_tensor(v)], grads, update)
            (p_t, st_t, g_t, u_t), (p_r, st_r, _, u_r) = got["triton"], got["reference"]
            assert u_t.updates == 2 and p.grad is None
            x = p_r.float()
            rel = ADAM_REL if kind == "sparse_adam" else adagrad_rel(D)
            # two steps, each rounding a bf16 row toward zero here and to nearest in the reference:
            # up to 1.5 ulps (2^-7 relative) of that step's row apart per step; the rows in between
            # are bounded by |start| + |x - start| (steps of one sign) or |x| + |x - start|
            bound = 4 * (rel + 2.0**-20) * (x - table.float()).abs() + 2.0**-20 * x.abs()
            if dtype == torch.bfloat16:
                bound = bound + 3 * 2.0**-7 * (x.abs() + table.float().abs() + (x - table.float()).abs())
            assert_rounded_within(p_t, x, bound, rounding, f"triton fused {kind} {dtype}")
            for a, b in zip(st_t, st_r):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(g_t[0], got["reference"][2][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(u_t.pop_sq_norm(), u_r.pop_sq_norm(), rtol=1e-5, atol=0)
    check_fused_zero_decay("triton")


def check_sparse_optim():
    """The Triton row-wise optimizer steps against torch's SparseAdam and the torch row-wise
    Adagrad reference, over two steps on the same rows, D not a power of two included; and on
    narrow tables (kernel_checks.check_row_optimizer_kernels)."""
    import torch

    from rmt.ops import triton_sparse_optim
    from rmt.ops.sparse_optim import rowwise_adagrad_update_

    from kernel_checks import check_row_optimizer_kernels

    gen = torch.Generator().manual_seed(5)
    rows = torch.tensor([0, 3, 17, 49])
    for D in (20, 64):
        table = torch.randn(50, D, generator=gen)
        ours, m, v = table.clone(), torch.zeros(50, D), torch.zeros(50, D)
        ref = torch.nn.Parameter(table.clone())
        opt = torch.optim.SparseAdam([ref], lr=0.01, betas=(0.8, 0.95), eps=1e-6)
        ada, ada_sum = table.clone(), torch.zeros(50)
        want, want_sum = table.clone(), torch.zeros(50)
        for step in (1, 2):
            values = torch.randn(4, D, generator=gen)
            triton_sparse_optim.sparse_adam_step(ours, m, v, rows, values, 0.01, 0.8, 0.95, 1e-6, step)
            ref.grad = torch.sparse_coo_tensor(rows[None], values, table.shape).coalesce()
            opt.step()
            triton_sparse_optim.rowwise_adagrad_step(ada, ada_sum, rows, values, 0.1, 1e-10, 0.01)
            rowwise_adagrad_update_(want, want_sum, rows, values, 0.1, 1e-10, 0.01)
        torch.testing.assert_close(ours, ref.data, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ada, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ada_sum, want_sum, rtol=1e-6, atol=1e-7)
        assert not torch.equal(ours, table) and torch.equal(ours[1], table[1])
    # fp32/bf16/fp16 tables with fp32 state against the torch references, and a narrow step against
    # the fp32 one (the interpreter truncates fp32 -> bf16: rounding "rtz")
    for dtype, rounding in ((torch.float32, "rne"), (torch.bfloat16, "rtz"), (torch.float16, "rne")):
        check_row_optimizer_kernels(triton_sparse_optim, dtype, rounding=rounding)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


if __name__ == "__main__":
    run_checks()
