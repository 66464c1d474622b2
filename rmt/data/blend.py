"""Dataset blends: what ``data.path`` (and ``data.train_path`` / ``data.valid_path``) name.

A setting is megatron's blend in one of these forms:

* ``P``: one indexed dataset prefix (``P.bin``/``P.idx``);
* ``"0.3 A 0.7 B"`` or the list ``[0.3, A, 0.7, B]``: weights and prefixes, alternating (the
  form of Megatron-LM's ``--data-path``); the weights need not sum to 1;
* ``"A B"`` or ``[A, B]``: prefixes without weights, each drawn in proportion to its size;
* ``FILE.blend``: a text file holding one of the above (``rmt-preprocess --per-input`` writes
  one); its relative prefixes are taken relative to the file's directory.

:func:`parse_blend` turns a setting into a :class:`Blend` (megatron-core's
``(prefixes, weights)``), :func:`data_blends` gives the blend of each split. Plain string and
file handling only (no torch, no megatron): this runs inside ``rmt.config_checks.validate``. (Not
megatron-core's ``get_blend_from_list``: importing it imports torch, and it accepts a mix of
numbers and prefixes silently as prefixes, where a mistyped weight should be an error.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from rmt.errors import ConfigError

BLEND_SUFFIX = ".blend"


@dataclass(frozen=True)
class Blend:
    """megatron-core's blend: dataset prefixes and their weights (None: in proportion to size)."""

    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]] = None

    def as_megatron(self) -> Tuple[List[str], Optional[List[float]]]:
        return list(self.prefixes), (list(self.weights) if self.weights is not None else None)


def _number(item) -> Optional[float]:
    if isinstance(item, bool):
        return None
    if isinstance(item, (int, float)):
        return float(item)
    try:
        return float(item)
    except (TypeError, ValueError):
        return None


def parse_blend(value, key: str = "data.path") -> Blend:
    """The blend a ``data.path``-style setting names (module docstring); raises ConfigError."""
    base = ""
    if isinstance(value, str) and value.strip().endswith(BLEND_SUFFIX) and len(value.split()) == 1:
        path = value.strip()
        if not os.path.isfile(path):
            raise ConfigError(f"{key} blend file '{path}' does not exist")
        with open(path) as f:
            items = f.read().split()
        base, origin = os.path.dirname(os.path.abspath(path)), f"blend file '{path}'"
    elif isinstance(value, str):
        items, origin = value.split(), f"{key} '{value}'"
    elif isinstance(value, (list, tuple)):
        items, origin = list(value), f"{key} {list(value)}"
    else:
        raise ConfigError(f"{key} must be a dataset prefix, a blend 'W1 P1 W2 P2 ...' or a list, got {value!r}")
    if not items:
        raise ConfigError(f"{origin} names no dataset")
    numbers = [_number(x) for x in items]
    if numbers[0] is None:
        bad = [str(x) for x, n in zip(items, numbers) if n is not None]
        if bad:
            raise ConfigError(
                f"{origin} mixes prefixes with the number {bad[0]}: give a weight before "
                f"every prefix ('W1 P1 W2 P2 ...') or none at all"
            )
        weights = None
        prefixes = [str(x) for x in items]
    else:
        if len(items) % 2:
            raise ConfigError(
                f"{origin} has {len(items)} items: weights and prefixes must alternate ('W1 P1 W2 P2 ...')"
            )
        for i in range(0, len(items), 2):
            if numbers[i] is None:
                raise ConfigError(
                    f"{origin}: '{items[i]}' stands where a weight belongs; weights and "
                    f"prefixes must alternate ('W1 P1 W2 P2 ...')"
                )
            if numbers[i + 1] is not None:
                raise ConfigError(
                    f"{origin}: '{items[i + 1]}' stands where a prefix belongs; weights and "
                    f"prefixes must alternate ('W1 P1 W2 P2 ...')"
                )
            if not math.isfinite(numbers[i]) or numbers[i] <= 0:
                raise ConfigError(f"{origin}: the weight of '{items[i + 1]}' must be a positive number, got {items[i]}")
        weights, prefixes = numbers[0::2], items[1::2]
        prefixes = [str(p) for p in prefixes]
    if base:
        prefixes = [p if os.path.isabs(p) else os.path.join(base, p) for p in prefixes]
    dup = [p for i, p in enumerate(prefixes) if p in prefixes[:i]]
    if dup:
        raise ConfigError(f"{origin} names '{dup[0]}' twice; give each dataset once with its total weight")
    if len(prefixes) == 1:
        weights = None  # one dataset whatever its weight: the very samples of the prefix alone
    return Blend(tuple(prefixes), tuple(weights) if weights is not None else None)


def data_blends(d) -> Optional[Dict[str, Blend]]:
    """``{"all": blend}`` for ``data.path`` (split by ``data.split``), ``{"train": .., "valid":
    ..}`` for per-split paths, None for the default corpus (``d``: the DataConfig)."""
    per_split = {name: getattr(d, f"{name}_path") for name in ("train", "valid")}
    if d.path is not None:
        if any(v is not None for v in per_split.values()):
            raise ConfigError(
                "data.path and data.train_path / data.valid_path exclude each other: "
                "either one blend split by data.split, or a blend per split"
            )
        return {"all": parse_blend(d.path)}
    if per_split["train"] is None:
        if per_split["valid"] is not None:
            raise ConfigError("data.valid_path needs data.train_path")
        return None
    return {name: parse_blend(v, f"data.{name}_path") for name, v in per_split.items() if v is not None}


def blend_prefixes(blends: Optional[Dict[str, Blend]]) -> List[str]:
    """Every prefix of the blends once, in order of appearance."""
    out: List[str] = []
    for blend in (blends or {}).values():
        out += [p for p in blend.prefixes if p not in out]
    return out


def format_blend(weights: List[int], prefixes: List[str]) -> str:
    """The text of a ``.blend`` file: one ``weight prefix`` pair per line."""
    return "".join(f"{w} {p}\n" for w, p in zip(weights, prefixes))
