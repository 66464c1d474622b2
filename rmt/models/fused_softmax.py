"""Whether this machine can run megatron-core's fused scale-mask-softmax
(``model.attention_kernel: megatron_fused``, :mod:`rmt.models.attention`): without importing
megatron-core, so a training command can refuse the setting before its slow imports."""

from __future__ import annotations

import importlib.util

from rmt.errors import ConfigError

FUSED_SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")
"""The compiled modules megatron-core imports for its fused softmax (causal, and with a mask)."""


def check_fused_softmax(config) -> None:
    """Refuse ``model.attention_kernel: megatron_fused`` under bf16 where megatron-core's fused
    softmax extensions are not installed: megatron-core would take the fused kernel for 16-bit
    scores and fail on its import in the first forward."""
    if config.model.attention_kernel != "megatron_fused" or config.train.precision == "fp32":
        return
    missing = [name for name in FUSED_SOFTMAX_EXTENSIONS if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"model.attention_kernel 'megatron_fused' under train.precision '{config.train.precision}' needs "
            f"megatron's fused softmax extension {missing[0]} (built by Megatron-LM's fused_kernels or Apex), "
            f"which is not installed here; use 'megatron' or 'sdpa'"
        )
