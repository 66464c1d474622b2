"""The tree passes the linter and is formatted: ``ruff check`` and ``ruff format --check`` with
the configuration in pyproject.toml ([tool.ruff]), at the version setup.py's dev extra pins
(rules and formatting change between ruff releases)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def _pinned_version():
    with open(os.path.join(ROOT, "setup.py")) as f:
        return re.search(r'"ruff==([^"]+)"', f.read()).group(1)


def _ruff():
    """The command that runs ruff here, or skip."""
    if importlib.util.find_spec("ruff") is not None:
        command = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        command = [shutil.which("ruff")]
    else:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    found = subprocess.run(command + ["--version"], capture_output=True, text=True).stdout.split()[-1]
    if found != _pinned_version():
        pytest.skip(
            f"ruff {found} is installed; the tree is checked with ruff {_pinned_version()} "
            f"(setup.py's dev extra), whose rules and formatting it may not share"
        )
    return command


def _run(args):
    return subprocess.run(_ruff() + args, cwd=ROOT, capture_output=True, text=True)


def test_ruff_check():
    result = _run(["check", "--no-cache", "--output-format", "concise", "."])
    assert result.returncode == 0, (
        f"`ruff check .` found problems (`ruff check --fix .` fixes those marked [*]):\n"
        f"{result.stdout[-6000:]}{result.stderr[-2000:]}"
    )


def test_ruff_format():
    result = _run(["format", "--check", "--no-cache", "."])
    assert result.returncode == 0, (
        f"files are not formatted; run `ruff format .`:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
    )


def test_ruff_reads_the_projects_configuration(tmp_path):
    """The checks above run with pyproject.toml's settings: an unused import is reported and a
    rule it ignores is not; a line of 113 characters is formatted as it stands (line length 120),
    one of 125 is wrapped."""
    config = ["--no-cache", "--config", os.path.join(ROOT, "pyproject.toml")]
    lint = tmp_path / "lint.py"
    lint.write_text("import os\n\nfor l in range(3):\n    print(l)\n")
    result = subprocess.run(
        _ruff() + ["check", "--output-format", "concise"] + config + [str(lint)], capture_output=True, text=True
    )
    assert "F401" in result.stdout and "E741" not in result.stdout, result.stdout
    for terms, formatted in ((27, True), (30, False)):
        sample = tmp_path / f"line_{terms}.py"
        sample.write_text("x = " + "1 + " * terms + "1\n")
        result = subprocess.run(
            _ruff() + ["format", "--check"] + config + [str(sample)], capture_output=True, text=True
        )
        assert (result.returncode == 0) == formatted, (len(sample.read_text()) - 1, result.stdout, result.stderr)
