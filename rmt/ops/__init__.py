"""Fused memory ops: ``lookup_reduce`` (see rmt/ops/lookup_reduce.py) and its reference."""

from .dispatch import BACKENDS, ENV_BACKEND, available_backends, select_backend
from .lookup_reduce import LookupReduceFunction, lookup_reduce
from .reference import reference_backward, reference_forward

__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "LookupReduceFunction",
    "available_backends",
    "lookup_reduce",
    "reference_backward",
    "reference_forward",
    "select_backend",
]
