"""Fused memory ops: ``lookup_reduce`` (see rmt/ops/lookup_reduce.py) and its reference."""

from .lookup_reduce import (BACKENDS, ENV_BACKEND, LookupReduceFunction, available_backends,
                            lookup_reduce, select_backend)
from .reference import reference_backward, reference_forward

__all__ = ["BACKENDS", "ENV_BACKEND", "LookupReduceFunction", "available_backends",
           "lookup_reduce", "reference_backward", "reference_forward", "select_backend"]
