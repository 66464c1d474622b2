"""Triton backend in the interpreter: runs this file in a subprocess with TRITON_INTERPRET=1.

The variable must be set before Triton is first imported, so the checks run in a fresh process
(``python tests/test_ops_triton.py``) rather than in the pytest process.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_checks():
    import torch

    from rmt.ops import lookup_reduce, triton_backend
    from rmt.ops.testing import CASES, check_backend, make_case

    for case in CASES:
        check_backend("triton", case, torch.float32)
        check_backend("triton", case, torch.float32, sparse_grad=True)
    for dtype in (torch.bfloat16, torch.float16):
        check_backend("triton", CASES[1], dtype)
    table, indices, scores, block_ids, grad_out = make_case(9, 12, 6, 8, 2, 3)
    first = triton_backend.backward(grad_out, table, indices, scores, block_ids, 3)
    second = triton_backend.backward(grad_out, table, indices, scores, block_ids, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "table gradient not deterministic"
    try:
        lookup_reduce(table, indices.clone().fill_(-3), scores, block_ids, 3, backend="triton")
    except ValueError as exc:
        assert "got min -3" in str(exc)
    else:
        raise AssertionError("negative indices were not rejected")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_interpreter_matches_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


if __name__ == "__main__":
    run_checks()
