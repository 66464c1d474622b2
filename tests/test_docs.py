"""The docs: every config field has a docstring, docs/config.md is what the schema generates, and
every relative link in README.md and docs/*.md points at a file (and heading) that exists."""

import glob
import os
import re

import pytest

from conftest import ROOT, load_script

REGENERATE = "python tools/gen_config_docs.py"


def _generator():
    return load_script("tools/gen_config_docs.py")


def test_every_config_field_has_a_docstring():
    missing = _generator().undocumented()
    assert not missing, (f"config fields without a docstring in rmt/config.py: {', '.join(missing)}; "
                         f"add one on the line after each field, then run `{REGENERATE}`")


def test_a_field_without_docstring_is_reported():
    gen = _generator()
    with open(os.path.join(ROOT, "rmt", "config.py")) as f:
        source = f.read()
    field = '    arch: Literal["transformer", "rmt", "recurrent", "mixer"] = "transformer"\n'
    start = source.index(field) + len(field)
    end = source.index('"""\n', source.index('"""', start) + 3) + 4
    assert gen.undocumented(source[:start] + source[end:]) == ["model.arch"]
    assert gen.undocumented(source.replace('    """Architecture and shape."""\n', "")) == ["model"]


def test_config_reference_is_up_to_date():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        committed = f.read()
    assert committed == _generator().render(), (
        f"docs/config.md is out of date with rmt/config.py; run `{REGENERATE}` and commit the result")


def test_config_reference_lists_every_key_with_its_default():
    from rmt.config import RMTConfig

    text = _generator().render()
    config = RMTConfig()
    for section in ("model", "parallel", "data", "train", "memory"):
        for key, value in vars(getattr(config, section)).items():
            assert re.search(rf"^\| `{section}\.{key}` \| `[^`]+` \| `", text, re.M), f"{section}.{key}"
    assert "| `model.ffn_hidden_size` | `Optional[int]` | `null` |" in text
    assert "| `memory.placement` | `str` | `\"\"` |" in text
    assert "| `train.progress` | `bool` | `true` |" in text
    assert "| `model.dropout` | `float` | `0.0` | a finite number in [0, 1) |" in text
    assert "| `train.precision` | `str` | `fp32` | one of 'fp32', 'bf16' |" in text


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set:
    anchors, seen, fenced = set(), {}, False
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith("#"):
                slug = _slug(line.lstrip("#"))
                anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
                seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: str):
    fenced = False
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced:
                yield from re.findall(r"\]\(([^)\s]+)\)", line)


DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    path = os.path.join(ROOT, doc)
    broken = []
    for link in _links(path):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(target):
            broken.append(f"{link} (no such file)")
        elif anchor and target.endswith(".md") and anchor not in _anchors(target):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{doc}: broken links: {', '.join(broken)}"


def test_readme_maps_every_doc():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(DOCS) > 1
    for doc in DOCS[1:]:
        assert f"]({doc})" in readme, f"README.md's Documentation map does not link {doc}"
