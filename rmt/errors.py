"""Errors a user or operator acts on: one clear sentence on stderr, never a traceback.

* :class:`UserError` (and :class:`ConfigError`): a mistake in the input (config, data,
  checkpoint, command line). Every rank of a job meets the same mistake, so only global rank 0
  prints it; the exit status is 2 (argparse's convention for usage errors), and the launcher
  (``rmt.parallel.launcher``) does not restart workers that exit with it.
* :class:`JobError`: the job cannot go on for a reason outside its input that a rank sees on
  its own (a rank that never joined, an unreachable rendezvous). Every rank that meets it prints
  it, prefixed with its rank; the exit status is 1, so a launcher may restart the job.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in the user's input (config, data, checkpoint, command line)."""


class ConfigError(UserError):
    """An impossible or unknown configuration setting."""


class CheckpointMismatch(UserError):
    """A checkpoint (rmt's or a Hugging Face directory) that is intact but of another model
    (shapes or keys differ): every checkpoint of that run would fail the same way, so nothing
    falls back past it."""


class JobError(Exception):
    """A failure of the job's environment, seen by one rank (exit status 1)."""


def global_rank() -> int:
    """This process's rank as its launcher (torchrun or srun) set it; 0 for a plain process."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _is_multi_rank() -> bool:
    return any(int(os.environ.get(v, "1") or 1) > 1 for v in ("WORLD_SIZE", "SLURM_NTASKS"))


class _ReaderMayLeave:
    """stdout that goes quiet when its reader leaves (``rmt-plan ... | head``): the rest of the
    output is discarded, the command finishes its work (a training run is not cut short), and no
    "Broken pipe" error appears. Python ignores SIGPIPE, so a closed pipe surfaces as
    BrokenPipeError on a write or flush; from then on file descriptor 1 is /dev/null."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def reader_may_leave():
    """Within: stdout discards what its reader no longer takes (:class:`_ReaderMayLeave`)."""
    original = sys.stdout
    sys.stdout = _ReaderMayLeave(original)
    try:
        yield
    finally:  # also on SystemExit (argparse's --help) and errors: the buffered rest goes now
        sys.stdout.flush()
        sys.stdout = original


def cli_entry(prog: str):
    """Wrap a console-script ``main``: a :class:`UserError` prints ``prog: error: msg`` once
    (global rank 0) and exits 2; a :class:`JobError` prints on the rank that met it and exits 1.
    Output piped into a reader that stops early (``| head``) is cut off quietly."""

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                with reader_may_leave():
                    return main(*args, **kwargs)
            except UserError as err:
                if global_rank() == 0:
                    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
                raise SystemExit(USER_ERROR_EXIT) from None
            except JobError as err:
                where = f"rank {global_rank()}: " if _is_multi_rank() else ""
                print(f"{prog}: {where}error: {err}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None

        return run

    return wrap
