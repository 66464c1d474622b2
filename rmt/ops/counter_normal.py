"""Counter-based normal draws: the value of element ``e`` of a stream depends on ``(key, e)`` only.

Memory tables are initialised shard by shard with this, so every rank draws exactly its own
elements of the same global table whatever the partition, group size or parallel layout, and no
rank ever materialises the whole table (issue #14). torch offers no random-access generator on
the CPU (its CPU generator is a sequential Mersenne Twister, and the CUDA Philox offsets depend on
the launch configuration), hence this module.

Specification. The bits are SplitMix64's (Steele, Lea and Flood 2014, with Stafford's "Mix13"
finaliser ``mix64``) used with random access; the normal is Box-Muller evaluated with fixed
float64 operations, so that every implementation computes the same IEEE operations in the same
order and produces the same bits (no libm: its ``log``/``cos`` differ between libraries and
between vector and scalar code)::

    z  = mix64(key + (e + 1) * 0x9E3779B97F4A7C15)                 (mod 2**64)
    a  = (z >> 32) + 1  in [1, 2**32]      ->  u1 = a / 2**32  in (0, 1]
    b  = z & 0xFFFFFFFF                     ->  u2 = b / 2**32  in [0, 1)
    ln u1:  a = m * 2**k exactly (m in [1, 2), from the float64 bits of a); if m >= SQRT2:
            m = m / 2, k = k + 1; s = (m - 1) / (m + 1);
            ln u1 = (k - 32) * LN2 + s * P(s*s),  P = Horner of 2/1, 2/3, ..., 2/13
    cos(2 pi u2): q = b >> 30, x = (b & 0x3FFFFFFF) * 2**-30 * (pi / 2) in [0, pi/2);
            S = x * Horner(x*x; (-1)^j / (2j+1)!, j < 8), C = Horner(x*x; (-1)^j / (2j)!, j < 8);
            cos(q pi/2 + x) = (C, -S, -C, S)[q]
    value = sqrt(-2 ln u1) * cos(2 pi u2),   then * std, rounded once to the output dtype.

Horner's rule is ``p = c[-1]; p = p * t + c[j]`` down to ``j = 0``, each product and sum rounded
(no fused multiply-add). The polynomials are within 5e-13 (log) and 7e-11 (sin, cos) of the exact
functions; the largest value drawn is sqrt(64 ln 2) = 6.66.

:func:`fill_normal_` fills a ``[rows, cols]`` block of a global ``[*, global_cols]`` matrix:
element ``(r, c)`` of the block is element ``(row0 + r) * global_cols + col0 + c`` of the stream.
Backends: the C++/OpenMP kernel (``csrc/counter_normal_cpu.cpp``, compiled without FMA
contraction) on CPU tensors, else the plain torch formulation :func:`reference_fill_normal_`
(which also runs on a GPU, so a GPU shard is generated on the device), in chunks of at most
:data:`CHUNK_ELEMENTS` elements. Both give identical bits.
"""

from __future__ import annotations

import math
import os
import zlib

import torch

from .extensions import load_extension

GAMMA = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
LN2, SQRT2, PIO2 = math.log(2.0), math.sqrt(2.0), math.pi / 2
LOG_COEFFS = [2.0 / (2 * j + 1) for j in range(7)]
SIN_COEFFS = [(-1) ** j / math.factorial(2 * j + 1) for j in range(8)]
COS_COEFFS = [(-1) ** j / math.factorial(2 * j) for j in range(8)]
CHUNK_ELEMENTS = 1 << 20  # reference path: ~8 int64/float64 temporaries of this many elements
ENV_BACKEND = "RMT_COUNTER_NORMAL_BACKEND"  # "reference" forces the torch formulation


def as_signed64(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, name: str) -> int:
    """The 64-bit stream of the tensor called ``name`` in a run seeded ``seed``."""
    return mix64(mix64(seed) ^ zlib.crc32(name.encode()))


def shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _horner(t: torch.Tensor, coeffs) -> torch.Tensor:
    p = torch.full_like(t, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p.mul_(t).add_(c)
    return p


def reference_normals(key: int, elements: torch.Tensor) -> torch.Tensor:
    """float64 standard normals at the int64 stream positions ``elements`` (any shape)."""
    z = (elements + 1) * as_signed64(GAMMA) + as_signed64(key)
    z ^= shift_right(z, 30)
    z *= as_signed64(MIX1)
    z ^= shift_right(z, 27)
    z *= as_signed64(MIX2)
    z ^= shift_right(z, 31)
    bits = (shift_right(z, 32) + 1).double().view(torch.int64)  # a = m * 2**k
    k = (bits >> 52) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)
    big = m >= SQRT2
    m = torch.where(big, m * 0.5, m)
    k = (k + big.long() - 32).double()
    s = (m - 1.0) / (m + 1.0)
    ln_u1 = (k * LN2).add_(s * _horner(s * s, LOG_COEFFS))
    q = shift_right(z, 30) & 3
    x = (z & 0x3FFFFFFF).double().mul_(2.0**-30).mul_(PIO2)
    x2 = x * x
    sin, cos = x * _horner(x2, SIN_COEFFS), _horner(x2, COS_COEFFS)
    trig = torch.where(q % 2 == 0, cos, sin)
    trig = torch.where((q == 1) | (q == 2), -trig, trig)
    return ln_u1.mul_(-2.0).sqrt_().mul_(trig)


@torch.no_grad()
def reference_fill_normal_(
    out: torch.Tensor, key: int, row0: int, col0: int, global_cols: int, std: float
) -> torch.Tensor:
    """Plain torch :func:`fill_normal_`, chunk by chunk of whole rows (at least one row)."""
    rows, cols = out.shape
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    col_ids = torch.arange(col0, col0 + cols, device=out.device)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        row_ids = torch.arange(row0 + r, row0 + r + n, device=out.device)
        elements = (row_ids * global_cols).unsqueeze(1) + col_ids
        out[r : r + n].copy_(reference_normals(key, elements).mul_(std))
    return out


def extension():
    """The C++ fill kernel (built on first use), or None where it cannot be built."""
    return load_extension("rmt_counter_normal_cpu")


@torch.no_grad()
def fill_normal_(
    out: torch.Tensor, key: int, row0: int = 0, col0: int = 0, global_cols: int | None = None, std: float = 1.0
) -> torch.Tensor:
    """Fill the 2-D block ``out`` of a global ``[*, global_cols]`` matrix (default: ``out``'s own
    width) with ``std`` times the stream ``key``'s normals at the block's global positions."""
    if out.dim() != 2:
        raise ValueError(f"fill_normal_: out must be 2-D, got shape {tuple(out.shape)}")
    global_cols = out.shape[1] if global_cols is None else global_cols
    if row0 < 0 or not 0 <= col0 <= global_cols - out.shape[1]:
        raise ValueError(
            f"fill_normal_: a block at ({row0}, {col0}) of width {out.shape[1]} does not fit "
            f"a global width of {global_cols}"
        )
    fast = (
        out.device.type == "cpu"
        and out.is_contiguous()
        and os.environ.get(ENV_BACKEND) != "reference"
        and out.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    )
    ext = extension() if fast else None
    if ext is None:
        return reference_fill_normal_(out, key, row0, col0, global_cols, std)
    ext.fill_normal(out, as_signed64(key), row0, col0, global_cols, float(std))
    return out
