"""The csrc/ extension cache (rmt.ops.extensions): one binary per environment, found again by
every later process without a rebuild, never shared between environments."""

import os
import subprocess
import sys

import pytest
import torch

from rmt.ops import extensions
from rmt.ops.extensions import EXTENSIONS, cache_key

from conftest import ROOT

SOURCE = """
#include <pybind11/pybind11.h>
int twice(int x) { return 2 * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


def _spec(tmp_path, text=SOURCE, flags=("-O1",)):
    src = tmp_path / "probe.cpp"
    src.write_text(text)
    return {"sources": [str(src)], "extra_cflags": list(flags)}


@pytest.mark.slow
def test_key_is_stable_within_an_environment_and_differs_across_them(tmp_path, monkeypatch):
    name, spec = "rmt_lookup_reduce_cpu", EXTENSIONS["rmt_lookup_reduce_cpu"]
    key = cache_key(name, spec)
    assert len(key) == 16 and cache_key(name, spec) == key
    code = f"from rmt.ops.extensions import EXTENSIONS, cache_key; print(cache_key({name!r}, EXTENSIONS[{name!r}]))"
    other_process = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
        check=True,
    )
    assert other_process.stdout.strip() == key
    # another interpreter environment, torch version, source text, flag set or compiler: another binary
    probe = _spec(tmp_path)
    base = cache_key("probe", probe)
    assert cache_key("probe", _spec(tmp_path, SOURCE + "// edited\n")) != base
    assert cache_key("probe", _spec(tmp_path, flags=("-O2",))) != base
    assert cache_key("probe", _spec(tmp_path)) == base
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert cache_key("probe", probe) != base
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cache_key("probe", probe) != base
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert cache_key("probe", probe) != base
    monkeypatch.undo()
    assert cache_key("probe", probe) == base


@pytest.mark.slow
def test_building_leaves_the_spec_and_its_key_unchanged(tmp_path, monkeypatch):
    """torch's load() appends its link flags to the extra_ldflags list it is given: a build must
    not change the spec it was asked for, or a later process looks for the binary under another
    key (built again) and the same process names another folder for it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(extensions, "_cache", {})
    spec = dict(_spec(tmp_path), extra_ldflags=["-lm"])
    key = cache_key("rmt_probe_ldflags", spec)
    assert extensions.load_extension("rmt_probe_ldflags", spec).twice(21) == 42
    assert spec["extra_ldflags"] == ["-lm"]
    assert cache_key("rmt_probe_ldflags", spec) == key


@pytest.mark.slow
def test_a_killed_builds_leftover_lock_does_not_stall_the_next_build(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's own lock file in the folder, which torch would wait on
    for ever; under rmt's lock no other build can be running, so the next build goes ahead."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(extensions, "_cache", {})
    spec = _spec(tmp_path)
    folder = extensions.build_dir("rmt_probe_stale", spec)
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    assert extensions.load_extension("rmt_probe_stale", spec).twice(21) == 42


@pytest.mark.slow
def test_second_process_loads_without_rebuilding(tmp_path):
    spec = _spec(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    code = (
        f"import torch; from rmt.ops.extensions import load_extension; "
        f"print(load_extension('rmt_probe', {spec!r}).twice(21))"
    )

    def run():
        return subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=600
        )

    first = run()
    assert first.stdout.strip() == "42"
    assert "rmt: building C++ extension rmt_probe" in first.stderr and "rmt: built rmt_probe in" in first.stderr
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    binary = next(folder.glob("rmt_probe.*so"))
    stamp = binary.stat().st_mtime_ns
    second = run()
    assert second.stdout.strip() == "42"
    assert "building" not in second.stderr
    assert binary.stat().st_mtime_ns == stamp
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == [folder]
    # a binary without its completion mark is one being linked: never imported, built again
    (folder / "complete").unlink()
    assert "rmt: building C++ extension rmt_probe" in run().stderr


def test_failed_build_warns_once_and_returns_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.delitem(extensions._cache, "rmt_broken", raising=False)
    spec = _spec(tmp_path, "this is not C++")
    with pytest.warns(RuntimeWarning, match="building extension rmt_broken failed"):
        assert extensions.load_extension("rmt_broken", spec) is None
    assert extensions.load_extension("rmt_broken", spec) is None  # not retried
    monkeypatch.delitem(extensions._cache, "rmt_broken")
