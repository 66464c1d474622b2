"""Feed-forward activations by name (``model.activation``), shared by every architecture.

``gelu`` is the exact erf form; ``gelu_tanh`` the tanh approximation
``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` that GPT-2 and the RMT authors' JAX code
(``hax.nn.gelu``) use: the two differ by at most 4.7e-4, enough to move trained logits by ~6e-4.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict

import torch.nn.functional as F

from rmt.config import RMTConfig

ACTIVATIONS: Dict[str, Callable] = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}

# The architectures' own activation when ``model.activation`` is null.
_DEFAULTS = {"mixer": "silu"}


def activation_name(config: RMTConfig) -> str:
    m = config.model
    return m.activation or _DEFAULTS.get(m.arch, "gelu")


def activation(config: RMTConfig) -> Callable:
    """The feed-forward activation function of ``config``'s model."""
    return ACTIVATIONS[activation_name(config)]
