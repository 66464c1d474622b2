"""The docs: every config field has a docstring, docs/config.md is what the schema generates,
every relative link in README.md, CONTRIBUTING.md and docs/ points at a file (and heading) that
exists, and the tool commands and config keys the pages show exist."""

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
    assert not missing, (
        f"config fields without a docstring in rmt/config.py: {', '.join(missing)}; "
        f"add one on the line after each field, then run `{REGENERATE}`"
    )


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
        f"docs/config.md is out of date with rmt/config.py; run `{REGENERATE}` and commit the result"
    )


def test_config_reference_lists_every_key_with_its_default():
    from rmt.config import RMTConfig

    text = _generator().render()
    config = RMTConfig()
    for section in ("model", "parallel", "data", "train", "memory"):
        for key, value in vars(getattr(config, section)).items():
            assert re.search(rf"^\| `{section}\.{key}` \| `[^`]+` \| `", text, re.M), f"{section}.{key}"
    assert "| `model.ffn_hidden_size` | `Optional[int]` | `null` |" in text
    assert '| `memory.placement` | `str` | `""` |' in text
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
# and the pages the README's map does not list itself
LINKED = (
    DOCS
    + ["CONTRIBUTING.md"]
    + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*", "*.md")))
)


@pytest.mark.parametrize("doc", LINKED)
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


# The pages whose commands and keys are checked: README, CONTRIBUTING and every page under docs/
# (docs/config.md is generated from the schema, checked above).
PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    if not p.endswith(os.path.join("docs", "config.md"))
)
SECTIONS = ("model", "parallel", "data", "train", "memory")
FILE_SUFFIXES = {"md", "py", "yaml", "yml", "json", "jsonl", "txt", "sh", "bin", "idx", "pt", "safetensors"}
# docs/cli.md's example of the error an unknown key gives
DELIBERATELY_UNKNOWN = {"model.heads"}


def _code(path: str):
    """The text of every inline code span and fenced or indented code block of a page, a span
    that wraps over lines joined into one line."""
    with open(path) as f:
        text = f.read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    blocks += re.findall(r"(?:^    \S[^\n]*\n)+", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose)]
    return [line for block in blocks for line in block.splitlines()] + spans


def config_keys(code):
    """``section.key`` for every dotted config key a code line names."""
    keys = set()
    for line in code:
        for section, key in re.findall(rf"(?<![\w./-])({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_]*)\b(?![./\w-])", line):
            if key not in FILE_SUFFIXES:
                keys.add(f"{section}.{key}")
    return keys


def tool_commands(code):
    """``(tool path, [--options])`` for every ``python tools/X.py ...`` command a code line holds."""
    found = []
    for line in code:
        for match in re.finditer(r"python3? (tools/[\w/]+\.py)((?: [^|;&`]*)?)", line):
            found.append((match.group(1), re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", match.group(2))))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_documented_config_keys_exist(page):
    from rmt.config import RMTConfig

    config = RMTConfig()
    named = config_keys(_code(os.path.join(ROOT, page))) - DELIBERATELY_UNKNOWN
    unknown = sorted(key for key in named if key.split(".")[1] not in vars(getattr(config, key.split(".")[0])))
    assert not unknown, f"{page} names config keys that rmt/config.py does not have: {', '.join(unknown)}"


@pytest.mark.parametrize("page", PAGES)
def test_documented_tool_commands_exist(page):
    """Every ``python tools/X.py`` command of a page names a tool that exists and options that
    its argument parser declares."""
    wrong = []
    for tool, options in tool_commands(_code(os.path.join(ROOT, page))):
        path = os.path.join(ROOT, tool)
        if not os.path.exists(path):
            wrong.append(f"{tool} (no such file)")
            continue
        with open(path) as f:
            source = f.read()
        wrong += [f"{tool} {option}" for option in options if f'"{option}"' not in source]
    assert not wrong, f"{page}: commands with a tool or an option that does not exist: {', '.join(wrong)}"


def test_the_command_and_key_checks_find_mistakes():
    code = [
        "python tools/bench_rmt.py --quick --no-such-flag model.arch=rmt model.no_such_key=1",
        "see docs/data.md, rmt/data/tasks.py and model.safetensors, `train.steps`",
        "python tools/bench_missing.py",
    ]
    assert config_keys(code) == {"model.arch", "model.no_such_key", "train.steps"}
    assert tool_commands(code) == [
        ("tools/bench_rmt.py", ["--quick", "--no-such-flag"]),
        ("tools/bench_missing.py", []),
    ]


DIARY = [
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
    (re.compile(r"\b(tried|not) kept\b", re.I), "a list of what was not kept"),
    (re.compile(r"\bVMs?\b"), "a development machine"),
]


@pytest.mark.parametrize("page", PAGES)
def test_pages_are_reference_not_a_diary(page):
    """The docs say what is true now; git keeps the history (CONTRIBUTING.md): no dates, no lists
    of what was tried and dropped, no development machines (a benchmark names its machine)."""
    with open(os.path.join(ROOT, page)) as f:
        found = [f"line {n}: {what}" for n, line in enumerate(f, 1) for pattern, what in DIARY if pattern.search(line)]
    assert not found, f"{page} reads as a diary ({'; '.join(found)}); condense it into docs/notes/ or drop it"


def test_the_diary_check_finds_dates_and_machines():
    lines = ["On 2026-11-28 the sort got faster.", "Tried and not kept: a wider tile.", "on the 2-core VM"]
    assert [[what for pattern, what in DIARY if pattern.search(line)] for line in lines] == [
        ["a date"],
        ["a list of what was not kept"],
        ["a development machine"],
    ]
    assert not [what for pattern, what in DIARY if pattern.search("Machine: a 2-core Intel Xeon, kept idle")]
