"""Input checks for ``lookup_reduce`` (one clear ``ValueError`` before any kernel runs) and the
layout its kernels take."""

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Table dtypes that may be paired with float32 scores (storage narrower than the computation).
NARROW_TABLE_DTYPES = (torch.bfloat16, torch.float16)


def dtypes_supported(table_dtype, scores_dtype):
    """True for the (table, scores) dtype pairs the op takes: one floating dtype for both, or a
    bfloat16/float16 table with float32 scores (the output and score gradients follow the scores,
    the table gradient the table)."""
    if table_dtype not in FLOAT_DTYPES:
        return False
    return scores_dtype == table_dtype or (table_dtype in NARROW_TABLE_DTYPES and scores_dtype == torch.float32)


def contiguous_as(x, dtype):
    """``x`` as a contiguous tensor of ``dtype``: ``x`` itself when it is one already. Checked
    here because ``x.to(dtype).contiguous()`` costs two dispatches even when both are no-ops
    (twice the time of this check on a cold cache), once in the forward and once in the backward."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


def _fail(message):
    raise ValueError(f"lookup_reduce: {message}")


def _check_range(name, tensor, upper):
    """Reject entries outside ``[0, upper)`` using a single min/max reduction."""
    if tensor.numel() == 0:
        return
    lo, hi = torch.aminmax(tensor)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        which = "min" if lo < 0 else "max"
        _fail(f"{name} must lie in [0, {upper}); got {which} {bad}")


def check_inputs(table, indices, scores, block_ids, num_blocks, check_range=True):
    """Validate shapes, dtypes, devices and (optionally) index ranges of the op's inputs.

    ``check_range=False`` skips the min/max reductions over ``indices`` and ``block_ids``
    (the only data-dependent checks) for hot paths whose indices are known to be valid.
    """
    for name, t in (("table", table), ("indices", indices), ("scores", scores)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if table.dim() != 2:
        _fail(f"table must be 2-D [N, D]; got shape {tuple(table.shape)}")
    if indices.dim() != 2:
        _fail(f"indices must be 2-D [T, K]; got shape {tuple(indices.shape)}")
    if scores.dim() != 3 or scores.shape[:2] != indices.shape:
        _fail(f"scores must be [T, K, C] with [T, K] = {tuple(indices.shape)}; got shape {tuple(scores.shape)}")
    if table.dtype not in FLOAT_DTYPES:
        _fail(f"table dtype must be one of float32, bfloat16, float16, float64; got {table.dtype}")
    if not dtypes_supported(table.dtype, scores.dtype):
        _fail(
            f"scores dtype {scores.dtype} must equal table dtype {table.dtype}, or be torch.float32 for a "
            f"bfloat16 or float16 table"
        )
    if indices.dtype not in INDEX_DTYPES:
        _fail(f"indices dtype must be int32 or int64; got {indices.dtype}")
    n, d = table.shape
    c = scores.shape[2]
    if c < 1 or d % c != 0:
        _fail(f"table dim D={d} must be divisible by the score column count C={c}")
    if not isinstance(num_blocks, int) or num_blocks < 1:
        _fail(f"num_blocks must be a positive int; got {num_blocks!r}")
    devices = {table.device, indices.device, scores.device}
    if block_ids is None:
        if num_blocks != 1:
            _fail(f"block_ids is None, so num_blocks must be 1; got {num_blocks}")
    else:
        if not isinstance(block_ids, torch.Tensor):
            _fail(f"block_ids must be a torch.Tensor or None; got {type(block_ids).__name__}")
        if block_ids.shape != indices.shape:
            _fail(f"block_ids shape {tuple(block_ids.shape)} must equal indices shape {tuple(indices.shape)}")
        if block_ids.dtype not in INDEX_DTYPES:
            _fail(f"block_ids dtype must be int32 or int64; got {block_ids.dtype}")
        devices.add(block_ids.device)
    if len(devices) != 1:
        _fail(f"all inputs must be on one device; got {sorted(str(x) for x in devices)}")
    if check_range:
        _check_range("indices", indices, n)
        if block_ids is not None:
            _check_range("block_ids", block_ids, num_blocks)
