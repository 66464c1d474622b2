"""Messages a user cannot act on, silenced in one place, each matched narrowly (its text and the
module that emits it) so that every other warning still shows:

* megatron-core announcing, on import, that NVIDIA Apex / Transformer Engine are absent (rmt
  uses the torch equivalents by design: neither is on the package index);
* megatron-core's "full scope is deprecated" (its own ``TransformerConfig`` default
  ``cuda_graph_scope="full"`` rewrites itself; rmt never sets the field);
* torch's deprecations inside megatron-core's checkpoint loader (``ShardedTensor``,
  ``load_state_dict``), raised on every checkpoint load, and of the collectives its distributed
  optimizer calls; that optimizer reading ``.grad`` of its shard views;
* on a machine without CUDA, megatron-core's advice to set ``CUDA_DEVICE_MAX_CONNECTIONS``
  (:func:`on_cpu`, called by :func:`rmt.parallel.compat.apply`);
* the profiler's ``USDT:``/``STAGE:`` lines, which Kineto writes straight to file descriptor 2
  (:func:`profiler_lines_dropped`);
* megatron-core's "Unknown MLP type" while it builds layers whose feed-forward module is rmt's
  subclass of its own (:func:`quiet_mlp_type_warning`).

:func:`install` is part of :func:`rmt.setup_process`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

_FILTERS = [
    # (category, message regex, module regex)
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\."),
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),
    (
        FutureWarning,
        r".*(deprecating ShardedTensor|`load_state_dict` is deprecated)",
        r"(torch\.distributed\.checkpoint|megatron\.core\.dist_checkpointing)\.",
    ),
    # megatron's distributed optimizer: its bucket collectives under torch's new names, and its
    # zero_grad reading .grad of the main parameters' shards (views, hence not leaves)
    (
        FutureWarning,
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
    ),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor", r"megatron\.core\.optimizer\."),
    # selective recomputation: advice for Transformer Engine's fused attention, which rmt never uses
    (
        UserWarning,
        r"If you are using transformer_engine as the transformer implementation",
        r"megatron\.core\.transformer\.transformer_config",
    ),
]

_CPU_FILTERS = [
    (
        UserWarning,
        r"When using .* recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel\.layers",
    ),
]

# Kineto's log line: "USDT:2026-01-01 10:00:00 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start"
_PROFILER_LINE = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


def _add(filters) -> None:
    for category, message, module in filters:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def install() -> None:
    """Add the filters above (idempotent: ``warnings`` drops duplicates)."""
    _add(_FILTERS)


def on_cpu() -> None:
    """Also silence the advice that only concerns CUDA devices."""
    _add(_CPU_FILTERS)


@contextlib.contextmanager
def profiler_lines_dropped():
    """Run the block with file descriptor 2 captured, then write what it wrote to the real stderr
    without the profiler's ``USDT:``/``STAGE:`` log lines (Kineto logs from C++ with no switch
    to turn these off: ``KINETO_LOG_LEVEL`` leaves the ``USDT`` ones)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [
                line
                for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                if not _PROFILER_LINE.match(line)
            ]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


class _UnknownMLPType(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def quiet_mlp_type_warning():
    """While megatron builds layers whose MLP is a subclass of its own (rmt's MoE, the gated
    layer): its TransformerLayer warns "Unknown MLP type" for any class but its own (the subclass
    runs on megatron's default process groups, which is what that warning is about). Nothing for
    a user to act on."""
    log = logging.getLogger("megatron.core.transformer.transformer_layer")
    quiet = _UnknownMLPType()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)
