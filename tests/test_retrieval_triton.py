"""The fused retrieval's Triton backend (rmt.ops.retrieval_triton) in the interpreter against the
unfused path (tests/retrieval_cases.py: addresses, scores and every gradient), and its kernels
compiled for a GPU without one.

TRITON_INTERPRET=1 must be set before Triton is first imported, so the checks run in a fresh
process (``python tests/test_retrieval_triton.py [full]``). The interpreter runs the kernels on
CPU tensors, which the backend declares only in the interpreter: the subprocess widens its
registry entry to them. The interpreter multiplies bfloat16 operands of ``tl.dot`` as their raw
bits, so there the candidates' scores widen them first (``WIDEN``); on a GPU they do not.
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def run_checks(full: bool) -> None:
    import torch

    from rmt.retrieval_backends import RETRIEVAL_REGISTRY

    from retrieval_cases import CASES, check, fused, make_case

    RETRIEVAL_REGISTRY["triton"] = dataclasses.replace(RETRIEVAL_REGISTRY["triton"], device_type=None)
    # tiles of 8 keys and blocks of 4 tokens, rounded up by the backend to 16 (neither divides
    # the shapes): several tiles per side, both TDQKR lists merged across them
    if not full:
        check("tucker", torch.float32, "integer", "triton", key_tile=8, token_block=4)
        return
    for name in sorted(CASES):
        for dtype, values in ((torch.float32, "integer"), (torch.float32, "random"), (torch.bfloat16, "integer")):
            check(name, dtype, values, "triton", key_tile=8, token_block=4)
    leaves, views, _ = make_case("tucker", torch.float32, "integer", seed=3)
    want = fused(*views, leaves[1], 4, leaves[2], backend="reference", key_tile=1000)
    for key_tile, token_block in ((16, 16), (64, 32)):
        got = fused(*views, leaves[1], 4, leaves[2], backend="triton", key_tile=key_tile, token_block=token_block)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (key_tile, token_block)


def _run(*argv):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    cmd = [sys.executable, __file__, *argv]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_triton
def test_triton_interpreter_equals_unfused():
    """TDQKR with both candidate lists, float32 values that tie constantly: bit for bit."""
    _run()


@needs_triton
@pytest.mark.slow
def test_triton_interpreter_equals_unfused_every_case():
    """Every case of tests/retrieval_cases.py, float32 (integer and random) and bfloat16, and
    other tiles."""
    _run("full")


KERNELS = {
    # kernel: (pointer arguments, constexprs); every other argument an int32
    "candidates_kernel": (
        dict(q="*bf16", keys="*bf16", weights="*fp32", cand="*i32"),
        dict(R=2, TUCKER=True, FP32=False, WIDEN=False, BT=32, BN=128, BD=64, M=16),
    ),
    "candidate_scores_kernel": (
        dict(q_row="*fp32", q_col="*fp32", keys="*fp32", cand="*i32", scores="*fp32"),
        dict(R=2, FP32=True, BC=32, BD=64),
    ),
    "grid_topm_kernel": (
        dict(cand="*i32", scores="*fp32", core="*fp32", addr="*i64", sel="*bf16"),
        dict(R=2, TUCKER=True, BI=32, BJ=32, MP=16),
    ),
}


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernels_compile_for_a_gpu(kernel):
    """Each kernel through Triton's whole compiler to a cubin for sm_90, without a GPU (the
    interpreter checks the semantics, not what only the compiler rejects)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rmt.ops import retrieval_triton_kernels

    fn = getattr(retrieval_triton_kernels, kernel)
    pointers, constexprs = KERNELS[kernel]
    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in params}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    assert compiled.asm["cubin"]


if __name__ == "__main__":
    run_checks(full=sys.argv[1:] == ["full"])
