"""User-facing errors: one clear sentence on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """A mistake in the user's input (config, data, checkpoint, command line)."""


class ConfigError(UserError):
    """An impossible or unknown configuration setting."""


def cli_entry(prog: str):
    """Wrap a console-script ``main`` so a :class:`UserError` prints ``prog: error: msg`` on
    stderr and exits with status 2 (argparse's convention for usage errors)."""

    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except UserError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                raise SystemExit(2) from None

        return run

    return wrap
