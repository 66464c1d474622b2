"""Where a command writes, checked before it works, and JSON written whole or not at all.

Every command that writes uses :func:`check_output` on each place it will write before it starts
its work: ``rmt-train`` (``train.save``, ``train.log_file``, ``train.tensorboard_dir``,
``--json``), ``rmt-preprocess`` (``--output-prefix``), ``rmt-export --out``, ``rmt-eval --json``,
``rmt-plan``'s ``--json``, ``--plot`` and ``--out`` (:data:`rmt.planner.cli.OUTPUT_OPTIONS`) and
the benchmarks' ``--json`` (:mod:`rmt.bench_report`). A problem is one sentence
(:class:`rmt.errors.UserError`: exit status 2), and nothing has been written.

A path is checked without creating anything: its nearest existing ancestor must be a directory in
which a file can be created, tried with a real file removed at once (permission bits do not bind
root, and say nothing of ACLs or of read-only and virtual file systems such as ``/proc``); an
existing output must be of the kind the command writes (a file, or a directory) and, for a file,
open for writing; and the file system must have ``need`` bytes free, what the command can predict
it writes (0 where it cannot).

:func:`write_json` writes a document into a temporary file beside ``path`` and renames it over
``path``: a full disk or a kill leaves the old file or none, never a torn one.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from rmt.errors import UserError


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _nearest_existing(path: str) -> str:
    """The closest ancestor of ``path`` (itself excluded) that exists."""
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent) and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent


def _creatable_in(directory: str) -> Optional[str]:
    """None when a file can be created in ``directory``, else the system's reason."""
    probe = os.path.join(directory, f".rmt-write-test-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.remove(probe)
    return None


def output_problem(path: str, what: str, need: int = 0, directory: bool = False, hint: str = "") -> Optional[str]:
    """A sentence saying why ``what`` (the option or key that names it, e.g. ``--json``) cannot be
    written at ``path`` (a file, or with ``directory`` a directory that receives files) with
    ``need`` bytes, else None; ``hint`` follows a lack of room."""
    here = f"{what} '{path}'"
    path = os.path.abspath(path)
    if os.path.isdir(path):
        if not directory:
            return f"{here} is a directory; {what} names a file"
        base = path
    elif os.path.lexists(path):
        if directory:
            return f"{here} is a file; {what} names a directory"
        try:
            with open(path, "ab"):
                pass
        except OSError as err:
            return f"{here} cannot be written ({err.strerror or err})"
        base = os.path.dirname(path)
    else:
        base = _nearest_existing(path)
        if not os.path.isdir(base):
            return f"{here} cannot be created: '{base}' is a file, not a directory"
    reason = _creatable_in(base)
    if reason is not None:
        return f"{here} cannot be written: no file can be created in '{base}' ({reason})"
    free = shutil.disk_usage(base).free
    if free < need:
        return (
            f"not enough free space for {here}: it needs about {_mib(need)}, the file system of "
            f"'{base}' has {_mib(free)} free" + (f" ({hint})" if hint else "")
        )
    return None


def check_output(path: str, what: str, need: int = 0, directory: bool = False, hint: str = "") -> None:
    """Raise :class:`UserError` with :func:`output_problem`'s sentence when there is one."""
    problem = output_problem(path, what, need, directory, hint)
    if problem is not None:
        raise UserError(problem)


def write_json(path: str, doc, **dump_options) -> None:
    """``doc`` as JSON in ``path`` (``json.dump``'s options, default ``indent=1``), atomically."""
    dump_options.setdefault("indent", 1)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, **dump_options)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
