"""The benchmarks' ``--json`` report: ``{"benchmark", "machine", ..., "rows", "summary"}``.

Every ``tools/bench_*.py`` checks its ``--json`` path with :func:`check_report` right after its
arguments are parsed, before it measures anything (a path that cannot be written is one sentence,
``bench_x: error: ...``, and exit status 2: :mod:`rmt.outputs`), refuses other bad input with
:func:`refuse` (``bench_x: sentence``, exit status 2), and writes the report with
:func:`write_report` (atomically: a kill or a full disk leaves no torn file).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Optional

from rmt.errors import USER_ERROR_EXIT
from rmt.outputs import output_problem, write_json


def refuse(benchmark: str, sentence: str) -> int:
    """Bad input to ``benchmark``: ``benchmark: sentence`` on stderr, once, and the exit status
    (2) for its ``main`` to return."""
    print(f"{benchmark}: {sentence}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def check_report(path: Optional[str], benchmark: str) -> None:
    """Exit with status 2 and one sentence when ``--json`` ``path`` cannot be written."""
    problem = output_problem(path, "--json") if path else None
    if problem is not None:
        print(f"{benchmark}: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT)


def machine(**extra) -> dict:
    """Where the rows were measured: the platform, processor, CPU count, torch release and the
    benchmark's command line, with the benchmark's own ``extra`` fields (threads, GPU, ...)."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        **extra,
    }


def write_report(
    path: Optional[str], benchmark: str, rows: list, summary: dict, where: Optional[dict] = None, **fields
) -> None:
    """Write the report to ``path`` (nothing without one): ``where`` the rows were measured
    (default :func:`machine`), then the benchmark's own ``fields`` (its settings), the rows and
    the summary."""
    if not path:
        return
    doc = {"benchmark": benchmark, "machine": machine() if where is None else where, **fields}
    write_json(path, dict(doc, rows=rows, summary=summary))
