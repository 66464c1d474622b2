"""megatron-core's import-time ``torch.compile``, deferred to the first call of what it compiles.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and a dozen modules decorate their fused
element-wise functions with it when they are imported (bias-GELU, SwiGLU, the MoE router's
helpers, ...). Decorating already imports torch's whole compiler stack (dynamo, inductor, sympy):
2.1 of the 6.8 CPU seconds that ``import rmt.training.trainer`` took on a 2-core AMD EPYC VM, paid
by every rank of every launch. rmt's configs turn those fusions off
(:mod:`rmt.models.megatron_config`); the one such function called on its paths is the MoE router's
``_apply_expert_bias`` (every forward; it does nothing unless expert bias is on), so MoE runs
still import the compiler stack, at their first step.

:func:`install` (part of :func:`rmt.setup_process`, which runs before megatron-core is imported) wraps ``jit_fuser`` as
megatron defines it: a function decorated with it is handed to ``torch.compile`` on its first
call, with the same arguments, and the compiled function is used from then on. ``torch.compile``
itself compiles nothing before the first call either, so what runs is unchanged; only the compiler
stack's import moves to the first call, which only MoE runs make. Written here because megatron-core
has no switch for it (``megatron.core.jit.disable_jit_fuser`` acts only after the decorators
have run). Where ``jit_fuser`` is not ``torch.compile`` (``torch.jit.script`` on older torch) it
is left as it is."""

from __future__ import annotations

import functools
import importlib.machinery
import sys

TARGET = "megatron.core.jit"


def deferred(compile_fn):
    """``compile_fn`` (``torch.compile``) with the compilation of each function moved to its first
    call. Used as a decorator with or without keyword arguments, as ``torch.compile`` is."""

    def compile_later(model=None, **kwargs):
        if model is None:
            return lambda fn: compile_later(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def run(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        return run

    return compile_later


class _JitFinder:
    """A ``sys.meta_path`` finder for :data:`TARGET` alone: it loads megatron's own module, then
    wraps its ``jit_fuser`` with :func:`deferred`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            torch = sys.modules.get("torch")
            if torch is not None and module.jit_fuser is torch.compile:
                module.jit_fuser = deferred(torch.compile)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); no effect if megatron-core's ``jit``
    module is imported already."""
    if TARGET not in sys.modules and not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
