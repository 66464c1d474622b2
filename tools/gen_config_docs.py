"""Write docs/config.md, the reference of every config key, from the schema in rmt/config.py.

Each field's description is its attribute docstring (the string literal right after the field,
as in megatron-core's ``TransformerConfig``), read with ``ast`` because Python keeps no such
docstrings at run time; types, defaults and the values each key allows (its ``Literal`` choices
or ``Range`` bounds, :func:`rmt.config.schema_fields`) come from the dataclasses themselves.

    python tools/gen_config_docs.py           # rewrite docs/config.md
    python tools/gen_config_docs.py --check   # exit 1 if a field is undocumented or the file is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rmt import config as schema  # noqa: E402

OUTPUT = os.path.join(ROOT, "docs", "config.md")
COMMAND = "python tools/gen_config_docs.py"

PREAMBLE = f"""# Configuration keys

<!-- Generated from rmt/config.py by `{COMMAND}`; edit the field docstrings there, not this file. -->

One schema (`rmt/config.py`, dataclasses) holds every default; a YAML file (`--config`) sets
some keys and dotted overrides (`section.key=value`) set others, merged and type-checked by
OmegaConf. The values a key allows (the *allowed* column; every float must be finite) are
declared in its type and checked when a config is loaded; `rmt.config_checks.validate()` then
rejects impossible combinations before any process group exists. Either answers a mistake with
one sentence and exit status 2 from the command-line tools. What the models and the memory
layers do is in [models.md](models.md) and [memory.md](memory.md).
"""


def field_docstrings(source: Optional[str] = None) -> Dict[str, Dict[str, str]]:
    """``{class name: {field name: docstring}}`` for every class in ``source`` (default: the text
    of rmt/config.py); a field without a docstring is absent."""
    if source is None:
        with open(schema.__file__) as f:
            source = f.read()
    tree = ast.parse(source)
    docs: Dict[str, Dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for stmt, following in zip(node.body, node.body[1:] + [None]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                fields[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def sections() -> List[Tuple[str, type]]:
    """The config sections in schema order: ``[("model", ModelConfig), ...]``."""
    return [(f.name, f.default_factory) for f in dataclasses.fields(schema.RMTConfig)]


def undocumented(source: Optional[str] = None) -> List[str]:
    """Dotted names (``section.key``, or the section itself) of the schema's fields that have no
    docstring in ``source`` (default: rmt/config.py)."""
    docs = field_docstrings(source)
    missing = [name for name, _ in sections() if name not in docs["RMTConfig"]]
    for name, cls in sections():
        missing += [f"{name}.{f.name}" for f in dataclasses.fields(cls) if f.name not in docs.get(cls.__name__, {})]
    return missing


def _default(value) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def _cell(text: str) -> str:
    """One line of Markdown from reStructuredText-style docstring text (``x`` and :mod:`x`)."""
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", " ".join(text.split()))
    return text.replace("``", "`").replace("|", "\\|")


def render() -> str:
    """The text of docs/config.md."""
    docs = field_docstrings()
    allowed = schema.schema_fields()
    out = [PREAMBLE]
    for name, cls in sections():
        out.append(f"## `{name}`\n")
        out.append(_cell(inspect.cleandoc(cls.__doc__ or "")) + "\n")
        out.append("| key | type | default | allowed | description |")
        out.append("|---|---|---|---|---|")
        for f in dataclasses.fields(cls):
            a = allowed[f"{name}.{f.name}"]
            kind = getattr(a.kind, "__name__", "any").lower()
            kind = f"Optional[{kind}]" if a.nullable else kind
            out.append(
                f"| `{name}.{f.name}` | `{kind}` | {_default(f.default)} | {_cell(a.describe())} | "
                f"{_cell(docs[cls.__name__].get(f.name, ''))} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a field has no docstring or docs/config.md is stale",
    )
    args = parser.parse_args()
    missing = undocumented()
    if missing:
        print(
            f"gen_config_docs: config fields without a docstring in rmt/config.py: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    text = render()
    if args.check:
        current = open(OUTPUT).read() if os.path.isfile(OUTPUT) else None
        if current != text:
            print(
                f"gen_config_docs: docs/config.md is out of date with rmt/config.py; run `{COMMAND}`", file=sys.stderr
            )
            return 1
        return 0
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    with open(OUTPUT, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUTPUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
