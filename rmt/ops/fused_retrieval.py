"""Fused retrieval: the memory layers' top-m over their keys without the ``[T, H, r, n]`` score
tensors (UltraMem arXiv 2411.12364 Eq. 2-3, 4-10, 16; PKM; UltraMemV2).

The unfused path (:mod:`rmt.memory.retrieval`) builds each grid side's scores ``S [T, H, r, n]``
(Eq. 4) as one tensor, selects from it, and its backward holds a dense score gradient of that
size. This op streams the keys instead: for a block of tokens it reads the keys of a side in
tiles, scores a tile (``q . k``), and keeps per token, head and side only the running candidates
the selection needs, then finishes the exact grid top-m. Its backward touches only the selected
keys.

Contract (every backend; :mod:`rmt.ops.retrieval_reference` is its plain statement)
---------------------------------------------------------------------------------------
Inputs (one floating dtype, one device):

* ``q_row``, ``q_col`` ``[T, H, r, D]``: each token's queries per head and Tucker rank (``r = 1``
  for product keys). Any strides with a unit last stride: a shared query passes one tensor twice;
  UltraMemV2's per-rank queries are one query expanded over ``r`` (stride 0).
* ``keys`` ``[H, 2, r, n, D]``: the normalised keys (side 0 rows, side 1 columns; ``n`` keys per
  side, the IVE grid ``num_keys * sqrt(E)``). Their normalisation is the caller's, once per step.
* ``m``: addresses per token and head, ``1 <= m <= n`` (and ``m <= min(2m, n)^2`` for TDQKR).
* ``cores`` ``[H, C, r, r]`` and ``selector = (C_sum [H, r, r], u [H, r], t [H, r])`` for TDQKR
  with multi-core scoring (``selector``: :func:`rmt.memory.retrieval.rank1_selector`, the
  aggregated core and its leading singular vectors, Eq. 6-7, no gradient); both None for product
  keys.

Selection (the backends' ``select``), per token and head:

1. side scores ``S[a, j] = q_side[a] . keys[side, a, j]``, accumulated in fp32 (fp64 for fp64)
   and rounded once to the inputs' dtype, as the unfused ``einsum`` rounds them (in an order the
   matrix product chooses: for bfloat16 inputs torch's product on a CPU may round a score to the
   neighbouring value, where the backends here widen the inputs and use the float32 product);
2. per side, the candidates: product keys, the m best ``S[0, j]``; TDQKR, the m largest and the m
   smallest rank-1 objectives ``u^T S`` / ``t^T S`` (Eq. 8-9; all n keys while ``2m >= n``),
   each kept with its r side scores;
3. the exact top-m of the candidate grid: ``s_row + s_col`` (Eq. 2-3) or ``S_row^T C_sum S_col``
   (Eq. 10), in the accumulation dtype in the order :func:`rmt.ops.topm.grid_topm` states.

Tie rule (:mod:`rmt.ops.topm`): among equal scores the lower key index, or the lower grid
address, wins; TDQKR's m smallest are the last m of that order. The unfused path obeys it too,
so both select the same addresses wherever their side scores carry the same bits (float32 and
float64 on a CPU, where both products are MKL's; where the products sum in another order, an
address whose score ties another's within that rounding may swap with it).

Outputs: ``addr [T, H, m]`` int64 grid addresses ``row * n + col``, best first; ``scores [T, H,
m, C]`` in the inputs' dtype: ``s_row + s_col`` (C = 1) or each core's ``S_row^T C^(i) S_col``
(Eq. 16), computed from the selected side scores by :func:`rmt.ops.topm.selected_scores`
(differentiable, so the cores' gradient is torch's, as in the unfused path).

Saved for the backward: ``addr`` (8 bytes per token, head and selected address) and, through
:func:`~rmt.ops.topm.selected_scores`'s graph, the side scores at the selected pairs, ``[T, H, 2,
r, m]`` in the inputs' dtype; the queries and keys are the caller's tensors (no copy).

Backward, from the side-score gradients ``g [T, H, 2, r, m]``: the query's gradient is the sum
over the selected keys ``dq_side[a] = sum_k g[side, a, k] keys[side, a, j_k]``, and the keys'
gradient is added at the selected rows only, ``dkeys[side, a, j_k] += g[side, a, k] q_side[a]``.
Both are exactly lookup-reduce (:mod:`rmt.ops.lookup_reduce`) over the keys as a table of ``H 2 r
n`` rows, with ``T H 2 r`` lookers-up of m rows each: its forward gives the query gradient, its
dense table gradient the keys' (sorted by row, no atomics: bit-identical from run to run), so
the backward runs on the lookup-reduce backend of the device and a retrieval backend implements
only ``select``.

Under autocast the queries and keys are cast to its dtype first, as the unfused path's product
is.

Tiles: ``key_tile`` keys per tile, ``token_block`` tokens per block (None: the backend's
defaults). They set the working memory, ``token_block x H x r x key_tile`` scores per block in
flight, not the result.

Backends (:data:`rmt.retrieval_backends.RETRIEVAL_REGISTRY`): ``cuda``
(``csrc/retrieval_select_cuda_kernels.cu``, :mod:`rmt.ops.retrieval_cuda`) and ``triton``
(:mod:`rmt.ops.retrieval_triton`) on CUDA tensors of float32 and bfloat16; ``cpu`` (C++/OpenMP,
``csrc/retrieval_select_cpu.cpp``: float32, bfloat16, float64); ``reference`` (this contract in
plain torch, every device and dtype). Force one with ``backend=`` or ``$RMT_RETRIEVAL_BACKEND``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from rmt.retrieval_backends import takes_fused

from .dispatch import get_backend, retrieval_module, select_backend, select_retrieval_backend
from .topm import selected_scores


def _check(q_row, q_col, keys, m, cores, selector) -> None:
    def fail(message):
        raise ValueError(f"fused_retrieval: {message}")

    if keys.dim() != 5 or keys.shape[1] != 2:
        fail(f"keys must be [H, 2, r, n, D]; got {list(keys.shape)}")
    H, _, r, n, D = keys.shape
    for name, q in (("q_row", q_row), ("q_col", q_col)):
        if q.dim() != 4 or q.shape[1:] != (H, r, D):
            fail(f"{name} must be [T, {H}, {r}, {D}] to match keys [H, 2, r, n, D]; got {list(q.shape)}")
        if q.dtype != keys.dtype or q.device != keys.device:
            fail(f"{name} ({q.dtype}, {q.device}) and keys ({keys.dtype}, {keys.device}) must share dtype and device")
    if q_row.shape[0] != q_col.shape[0]:
        fail(f"q_row and q_col must hold the same tokens; got {q_row.shape[0]} and {q_col.shape[0]}")
    if not keys.is_floating_point():
        fail(f"keys must be floating point; got {keys.dtype}")
    if (cores is None) != (selector is None):
        fail("TDQKR needs both cores and selector; product keys neither")
    if cores is None:
        if r != 1:
            fail(f"product keys take rank-1 queries and keys; got r = {r} (pass cores and selector for TDQKR)")
        if not 1 <= m <= n:
            fail(f"m ({m}) must lie in [1, {n}] (keys per side)")
        return
    if cores.dim() != 4 or cores.shape[0] != H or cores.shape[2:] != (r, r):
        fail(f"cores must be [{H}, C, {r}, {r}]; got {list(cores.shape)}")
    c = min(2 * m, n)
    if not 1 <= m <= c * c:
        fail(f"m ({m}) must lie in [1, {c * c}] (the candidate grid of {n} keys per side)")


class FusedRetrievalFunction(torch.autograd.Function):
    """The selection (a backend's ``select``) with the sparse backward of the module docstring.
    Outputs ``addr`` (not differentiable) and the selected side scores ``sel [T, H, 2, r, m]``."""

    @staticmethod
    def forward(ctx, q_row, q_col, keys, m, selector, backend, key_tile, token_block):
        addr, sel = retrieval_module(backend).select(q_row, q_col, keys, m, selector, key_tile, token_block)
        ctx.mark_non_differentiable(addr)
        ctx.save_for_backward(q_row, q_col, keys, addr)
        return addr, sel

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_addr, grad_sel):
        q_row, q_col, keys, addr = ctx.saved_tensors
        grad_q, grad_keys = selected_keys_backward(
            q_row,
            q_col,
            keys,
            addr,
            grad_sel,
            ctx.needs_input_grad[0] or ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],
        )
        grad_q_row = grad_q[:, :, 0] if grad_q is not None and ctx.needs_input_grad[0] else None
        grad_q_col = grad_q[:, :, 1] if grad_q is not None and ctx.needs_input_grad[1] else None
        return grad_q_row, grad_q_col, grad_keys, None, None, None, None, None


def selected_keys_backward(q_row, q_col, keys, addr, grad_sel, want_q: bool, want_keys: bool):
    """``(dq [T, H, 2, r, D] or None, dkeys [H, 2, r, n, D] or None)`` from the selected side
    scores' gradient ``grad_sel [T, H, 2, r, m]``, through lookup-reduce's kernels (module
    docstring): the lookups of token (t, h, side, a) are its m selected keys of that side and rank,
    rows ``((h * 2 + side) * r + a) * n + j`` of the keys as one ``[H 2 r n, D]`` table."""
    T, H, r, D = q_row.shape
    n = keys.shape[3]
    m = addr.shape[-1]
    picked = torch.stack([addr // n, addr % n], 2).unsqueeze(3)  # [T, H, 2, 1, m]
    base = torch.arange(H * 2 * r, device=addr.device).view(1, H, 2, r, 1) * n
    indices = (base + picked).reshape(T * H * 2 * r, m)
    table = keys.reshape(H * 2 * r * n, D)
    weights = grad_sel.to(keys.dtype).reshape(T * H * 2 * r, m, 1).contiguous()
    impl = get_backend(select_backend(keys.device, None, keys.dtype))
    grad_q = grad_keys = None
    if want_q:
        grad_q = impl.forward(table, indices, weights, None, 1).view(T, H, 2, r, D)
    if want_keys:
        queries = torch.stack([q_row, q_col], 2).reshape(T * H * 2 * r, 1, D)
        grad_keys = impl.backward_dense(queries, table, indices, weights, None, 1)[0].view(keys.shape)
    return grad_q, grad_keys


def choose_backend(kernel: str, device, dtype) -> Optional[str]:
    """The fused op's backend for a layer's retrieval under ``memory.retrieval_kernel`` =
    ``kernel``, or None for the unfused path: where
    :func:`~rmt.retrieval_backends.takes_fused` (the rule the planner counts by) says fused,
    the backend :func:`~rmt.ops.dispatch.select_retrieval_backend` picks; ``auto`` takes the
    unfused path where none is available, ``fused`` raises (validation refuses the configurations
    without a declared backend before training; this is an extension that failed to build)."""
    device = torch.device(device)
    if not takes_fused(kernel, device.type, dtype):
        return None
    name = select_retrieval_backend(device, dtype)
    if name is None and kernel == "fused":
        raise RuntimeError(
            f"memory.retrieval_kernel 'fused' has no backend running {device.type} tensors of "
            f"{dtype} here (its extension did not build); use 'auto' or 'unfused'"
        )
    return name


def fused_retrieval(
    q_row: torch.Tensor,
    q_col: torch.Tensor,
    keys: torch.Tensor,
    m: int,
    cores: Optional[torch.Tensor] = None,
    selector: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    *,
    backend: Optional[str] = None,
    key_tile: Optional[int] = None,
    token_block: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Grid addresses ``[T, H, m]`` and scores ``[T, H, m, C]`` of the top-m retrieval, fused
    (the module docstring states the contract). ``backend``: None ($RMT_RETRIEVAL_BACKEND, else
    the fastest declared and available one, else the reference) or a name of
    :data:`rmt.retrieval_backends.RETRIEVAL_REGISTRY`."""
    if torch.is_autocast_enabled(keys.device.type):  # the unfused path's products run in its dtype
        low = torch.get_autocast_dtype(keys.device.type)
        q_row, q_col, keys = (x.to(low) for x in (q_row, q_col, keys))
    _check(q_row, q_col, keys, m, cores, selector)
    name = select_retrieval_backend(keys.device, keys.dtype, backend) or "reference"
    if selector is not None:
        selector = tuple(s.detach() for s in selector)
    addr, sel = FusedRetrievalFunction.apply(q_row, q_col, keys, m, selector, name, key_tile, token_block)
    return addr, selected_scores(sel, cores)
