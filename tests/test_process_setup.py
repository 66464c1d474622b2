"""Importing rmt changes nothing in the process; rmt.setup_process() installs the process-wide
settings (issue 61 item 5), once however often it is called; rmt's CPU shim refuses a
megatron-core release it was not written for, in one sentence, exit status 2 at the entry points."""

import json
import subprocess
import sys

import pytest

from rmt import process

from conftest import ROOT, _env

SNAPSHOT = """
import json, os, sys, warnings
def snapshot():
    return {"environ": dict(os.environ), "filters": [repr(f) for f in warnings.filters],
            "meta_path": [type(f).__name__ for f in sys.meta_path]}
"""

IMPORTS = """
import rmt, rmt.config, rmt.config_checks, rmt.ops, rmt.memory, rmt.data.resolution, rmt.planner.cli
import rmt.training.cli, rmt.generate, rmt.evaluation.cli, rmt.export.cli, rmt.data.preprocess, rmt.parallel.launcher
import rmt.ops.lookup_reduce, rmt.ops.fused_update, rmt.memory.shapes, rmt.memory.config_checks, rmt.data.metadata
"""

HEAVY = """
import torch
import rmt.models.build, rmt.training.trainer, rmt.memory.attach
import megatron.core.jit as jit
from rmt.quiet import _FILTERS
"""


def _run(code):
    env = {k: v for k, v in _env().items() if k not in ("OMP_WAIT_POLICY", "PYTHONWARNINGS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_rmt_changes_nothing():
    """Every command's module, rmt.ops and rmt.memory leave os.environ, the warning filters and
    sys.meta_path exactly as they were (torch and numpy, which set filters of their own when
    imported, come first); with the models and the trainer imported too (megatron-core with
    them), no filter of rmt's and no finder of rmt's is installed, megatron-core's jit is its own
    and torch.cuda is torch's."""
    out = _run(
        SNAPSHOT
        + "import torch, numpy\nbefore = snapshot()\n"
        + IMPORTS
        + "after = snapshot()\n"
        + HEAVY
        + """
messages = {m for _, m, _ in _FILTERS}
print(json.dumps({"light": before == after, "omp": os.environ.get("OMP_WAIT_POLICY"),
                  "rmt_finders": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("rmt")],
                  "rmt_filters": [f[1].pattern for f in warnings.filters if f[1] is not None and f[1].pattern in messages],
                  "jit_is_compile": jit.jit_fuser is torch.compile,
                  "cuda_current_device": torch.cuda.current_device.__module__}))
"""
    )
    assert out == {
        "light": True,
        "omp": None,
        "rmt_finders": [],
        "rmt_filters": [],
        "jit_is_compile": True,
        "cuda_current_device": "torch.cuda",
    }


def test_setup_process_installs_once():
    out = _run(
        SNAPSHOT
        + """
import rmt
rmt.setup_process()
first = snapshot()
rmt.setup_process()
second = snapshot()
import torch, rmt.training.trainer
import megatron.core.jit as jit
print(json.dumps({"same": first == second, "omp": first["environ"].get("OMP_WAIT_POLICY"),
                  "finder": first["meta_path"][0], "filters": len(first["filters"]),
                  "jit_is_compile": jit.jit_fuser is torch.compile}))
"""
    )
    from rmt.quiet import _FILTERS

    assert out["same"] and out["omp"] == "PASSIVE" and out["finder"] == "_JitFinder"
    assert out["filters"] >= len(_FILTERS) and out["jit_is_compile"] is False


def test_untested_megatron_core_is_refused(monkeypatch):
    monkeypatch.setattr(process, "_megatron_core_version", lambda: "0.17.0")
    with pytest.raises(process.UserError) as err:
        process.require_tested_megatron_core()
    assert str(err.value) == (
        "rmt's CPU shim of megatron-core was written for megatron-core 0.16.1, but this "
        "environment has 0.17.0; install megatron-core==0.16.1"
    )
    monkeypatch.setattr(process, "_megatron_core_version", lambda: "0.16.1")
    process.require_tested_megatron_core()


def test_untested_megatron_core_exits_2_from_rmt_train_check():
    code = (
        "import sys\nfrom rmt import process\nprocess._megatron_core_version = lambda: '0.15.0'\n"
        "from rmt.training.cli import main\nsys.exit(main(['--check', '--config', 'configs/tiny.yaml']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "rmt-train: error: rmt's CPU shim of megatron-core was written for megatron-core 0.16.1, "
        "but this environment has 0.15.0; install megatron-core==0.16.1\n"
    )
