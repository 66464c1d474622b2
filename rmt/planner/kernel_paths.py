"""What a layer's kernels run on a device, as the planner prices and counts them.

``model.attention_kernel`` names a kernel, but what runs also depends on the device: torch's
``scaled_dot_product_attention`` keeps dropout inside its fused kernel on a GPU, and on a CPU
under dropout takes its unfused math path, which materializes the scores and keeps the
probabilities, the dropout's noise and the dropped probabilities for the backward. A dropout
keeps a one-byte mask on a GPU and its noise on a CPU."""

from __future__ import annotations

from rmt.memory.byte_sizes import DTYPE_BYTES


def attention_path(config, device: str) -> str:
    """``rmt`` (the RMT's fused kernel), ``none`` (the mixer), ``sdpa`` (torch's fused kernel),
    ``math`` (torch's unfused path: ``sdpa`` under ``model.dropout`` on a CPU), or megatron's
    (``megatron``, ``megatron_fused``) for a run on ``device`` (``cpu`` or ``gpu``)."""
    m = config.model
    if m.arch in ("rmt", "mixer"):
        return "rmt" if m.arch == "rmt" else "none"
    if m.attention_kernel == "sdpa" and m.dropout > 0 and device == "cpu":
        return "math"
    return m.attention_kernel


def materializes_scores(path: str) -> bool:
    """Whether the path builds the ``s x s`` scores and keeps their probabilities."""
    return path in ("math", "megatron", "megatron_fused")


def dropout_mask_bytes(config, device: str) -> int:
    """Bytes a dropout keeps per element for its backward: none without ``model.dropout``; one
    on a GPU (CUDA's fused dropout keeps a bool mask); on a CPU the input's (torch's CPU dropout
    multiplies by a scaled noise tensor of the input's dtype and keeps it)."""
    if config.model.dropout == 0:
        return 0
    return 1 if device == "gpu" else DTYPE_BYTES[config.train.precision]


def drops_embedding(config) -> bool:
    """Whether the embedding's output goes through a dropout: megatron-core's embedding under
    ``model.dropout`` (the transformer and the recurrent transformer); the RMT has no dropout and
    the mixer drops only inside its layers."""
    return config.model.dropout > 0 and config.model.arch in ("transformer", "recurrent")
