"""``argparse`` types of ``rmt-plan``'s options: numbers with their sign checked, so a bad value is
one line and exit status 2 (:func:`rmt.planner.cli.main`)."""

from __future__ import annotations

import argparse
from typing import Callable


def _number(parse: Callable, ok: Callable, what: str) -> Callable:
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    check.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return check


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
positive_float = _number(float, lambda v: v > 0, "a positive number")
non_negative_float = _number(float, lambda v: v >= 0, "a non-negative number")
