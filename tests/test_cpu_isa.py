"""The RMT's CPU kernels (csrc/matrix_rmsnorm_cpu.cpp, csrc/matrix_write_cpu.cpp) give the same
bits whatever x86-64 they are built for: their register tiles (csrc/key_tiles.h) use 16 lanes
where the build targets AVX-512 and 8 elsewhere, and each output element is one lane summing in
a fixed order. A build for AVX2 and FMA only (``-mavx2 -mfma``) is compared with this host's
build on shapes that reach every tile size and remainder, both layouts, forward and backward.
The fused retrieval's selection (csrc/retrieval_select_cpu.cpp) is compared the same way."""

import pytest
import torch

from rmt.ops import extensions
from rmt.ops.extensions import EXTENSIONS
from rmt.ops.matrix_rmsnorm import _ext as norm_ext
from rmt.ops.matrix_write import _ext as write_ext


def _cpu_flags():
    return set(extensions._cpu_flags().split())


pytestmark = pytest.mark.skipif(
    not {"avx2", "fma"} <= _cpu_flags() or norm_ext() is None or write_ext() is None,
    reason="needs a CPU that runs AVX2 builds, and the extensions built",
)

# (tokens, Dv, Dk, keys): 16-lane tiles of 8 and 4 (half) keys or rows at Dk 16, of 4 and 2 at
# Dk 32; 8-lane tiles of 4 and 2 at Dk 16, of 2 at Dk 32; and remainders of one.
SHAPES = [
    (150, 32, 16, 4),
    (151, 7, 32, 5),
    (130, 32, 16, 12),
    (77, 12, 16, 3),
    (64, 32, 32, 8),
    (33, 5, 16, 6),
    (40, 3, 32, 7),
]


def _avx2_build(name):
    flags = [
        f
        for flag in EXTENSIONS[name]["extra_cflags"]
        for f in (["-mavx2", "-mfma"] if flag == "-march=native" else [flag])
    ]
    spec = dict(EXTENSIONS[name], extra_cflags=flags)
    module = extensions.load_extension(f"{name}_avx2", spec)
    assert module is not None, f"{name} did not build for AVX2"
    return module


def test_an_avx2_build_gives_this_hosts_bits():
    norm_avx2, write_avx2 = _avx2_build("rmt_matrix_rmsnorm_cpu"), _avx2_build("rmt_matrix_write_cpu")
    gen = torch.Generator().manual_seed(0)
    compared = 0
    for T, dv, dk, heads in SHAPES:
        x = torch.randn(T, dv * dk, generator=gen)
        gain = 1 + 0.1 * torch.randn(dv * dk, generator=gen)
        keys = torch.randn(heads, dk, generator=gen)
        for key_major in (False, True):
            here = norm_ext().norm_read_forward(x, gain, keys, 1e-5, key_major)
            there = norm_avx2.norm_read_forward(x, gain, keys, 1e-5, key_major)
            grad = torch.randn(here[0].shape, generator=gen)
            residual = torch.randn(T, dv * dk, generator=gen)
            here += norm_ext().norm_read_backward(grad, x, gain, keys, here[1], key_major, True, True, residual)
            there += norm_avx2.norm_read_backward(grad, x, gain, keys, here[1], key_major, True, True, residual)
            for a, b in zip(here, there):
                assert torch.equal(a, b), (T, dv, dk, heads, key_major)
                compared += 1
        data = torch.randn(T * dv, heads, generator=gen)
        write_keys = torch.randn(dk, heads, generator=gen)
        residual = torch.randn(T * dv, dk, generator=gen)
        for layout in (data, data.t().contiguous().t()):
            grad = torch.randn(T * dv, dk, generator=gen)
            here = [
                write_ext().forward(layout, write_keys, residual),
                *write_ext().backward(grad, layout, write_keys, True, True),
            ]
            there = [
                write_avx2.forward(layout, write_keys, residual),
                *write_avx2.backward(grad, layout, write_keys, True, True),
            ]
            for a, b in zip(here, there):
                assert torch.equal(a, b), (T, dv, dk, heads, layout.is_contiguous())
                compared += 1
    assert compared == len(SHAPES) * (2 * 5 + 2 * 3)


@pytest.mark.slow
def test_an_avx2_build_selects_the_hosts_retrieval():
    """The fused retrieval's selection (csrc/retrieval_select_cpu.cpp, no ISA-specific code):
    the AVX2 build returns the host build's addresses and side scores, bit for bit, for product
    keys and TDQKR in every dtype it covers."""
    from rmt.memory.retrieval import rank1_selector
    from rmt.ops.retrieval_cpu import _ext as select_ext

    avx2 = _avx2_build("rmt_retrieval_select_cpu")
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for r, n, m in ((1, 300, 7), (2, 513, 16), (2, 20, 16)):
            q = torch.randn(37, 2, 2, r, 24, generator=gen).to(dtype)
            keys = torch.randn(2, 2, r, n, 24, generator=gen).to(dtype)
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            cores = torch.randn(2, 2, r, r, generator=gen).to(dtype)
            selector = [x.to(acc) for x in rank1_selector(cores)] if r > 1 else (None,) * 3
            args = (q[:, :, 0], q[:, :, 1], keys, m, *selector, 64, 16)
            for a, b in zip(select_ext().select(*args), avx2.select(*args)):
                assert torch.equal(a, b), (dtype, r, n)
