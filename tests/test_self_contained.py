"""The repository is self-contained: no tracked file points at a path outside it (notes of the
machine it was developed on, sibling directories of the checkout), and every relative Markdown
link stays inside it. What the code relies on is written down in docs/."""

import os
import re
import subprocess

import pytest

from conftest import ROOT

# Spelled in pieces so that this file does not match itself.
OUTSIDE = [
    "REFERENCE" + "_NOTES",  # the development machine's notes on the public implementations
    ".." + "/shared",  # the directory beside the checkout that held them
    "/" + "work/",  # the development machine's work tree
]

# Directories of a checkout that are not the repository's own files.
_UNTRACKED = {".git", ".venv", "build", "dist", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}


def tracked_files():
    """The repository's files: git's (tracked, and untracked but not ignored) where this is a git
    checkout, else the tree without environments and build outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        files = [f for f in out.decode().split("\0") if f]
        if files:
            return [f for f in files if os.path.isfile(os.path.join(ROOT, f))]
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in _UNTRACKED and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(directory, n), ROOT) for n in names]
    return files


def _text(root, path):
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None  # binary


def outside_references(files, root=ROOT):
    """``path:line: pattern`` for every line of ``files`` that names a path outside the repo."""
    found = []
    for path in files:
        text = _text(root, path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path}:{number}: {pattern}" for pattern in OUTSIDE if pattern in line]
    return found


def escaping_links(files, root=ROOT):
    """``path: link`` for every relative Markdown link of ``files`` whose target lies outside the
    repository."""
    found = []
    for path in files:
        if not path.endswith(".md") or (text := _text(root, path)) is None:
            continue
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            target = link.partition("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            resolved = os.path.normpath(os.path.join(root, os.path.dirname(path), target))
            if os.path.relpath(resolved, root).startswith(".."):
                found.append(f"{path}: {link}")
    return found


def test_no_tracked_file_points_outside_the_repository():
    files = tracked_files()
    assert "rmt/__init__.py" in files and "tests/test_self_contained.py" in files
    found = outside_references(files)
    assert not found, (
        "files point at paths outside the repository (a clone does not have them; "
        "write what the code relies on into docs/ and cite that):\n" + "\n".join(found)
    )


def test_no_markdown_link_leaves_the_repository():
    found = escaping_links(tracked_files())
    assert not found, "Markdown links that leave the repository:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [f"see {OUTSIDE[0]}.md", f"cat {OUTSIDE[1]}/DESIGN.md", f"{OUTSIDE[2]}main/x"])
def test_an_outside_reference_is_found(tmp_path, line):
    (tmp_path / "notes.py").write_text(f"ok\n# {line}\n")
    assert outside_references(["notes.py"], str(tmp_path)) == [f"notes.py:2: {p}" for p in OUTSIDE if p in line]


def test_an_escaping_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("[in](../README.md) [out](../../elsewhere.md#x) [web](https://x.org/a)\n")
    assert escaping_links(["docs/a.md"], str(tmp_path)) == ["docs/a.md: ../../elsewhere.md#x"]
