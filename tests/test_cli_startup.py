"""``--help`` and argument errors of every console script answer before torch, megatron-core,
HF datasets or the C++ extensions are imported (each costs seconds)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, _env

HEAVY = ("torch", "megatron", "datasets", "triton", "deepspeed", "transformer_engine", "apex")

PROBE = """
import json, sys
from {module} import main
try:
    code = main({argv!r})
except SystemExit as exit:
    code = exit.code
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
print(json.dumps({{"code": code, "heavy": heavy}}))
"""


def _run(module, argv):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module, argv=argv, heavy=HEAVY)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.parametrize(
    "module,argv,code,message",
    [
        ("rmt.data.preprocess", ["--help"], 0, None),
        ("rmt.generate", ["--help"], 0, None),
        ("rmt.training.cli", ["--help"], 0, None),
        ("rmt.planner.cli", ["--help"], 0, None),
        ("rmt.planner.cli", ["memory", "--help"], 0, None),
        ("rmt.evaluation.cli", ["--help"], 0, None),
        ("rmt.export.cli", ["--help"], 0, None),
        ("rmt.export.cli", ["--checkpoint", "ckpt", "--out", "setup.py"], 2, "is not an empty directory"),
        ("rmt.evaluation.cli", ["--checkpoint", "ckpt", "--tasks", "x", "--batch-size", "0"], 2, "--batch-size"),
        ("rmt.data.preprocess", ["--output-prefix", "x"], 2, "the following arguments are required: --input"),
        ("rmt.data.preprocess", ["--input", "setup.py", "--output-prefix", "x"], 2, "is not .jsonl"),
        ("rmt.data.preprocess", ["--input", "missing.jsonl", "--output-prefix", "x"], 2, "does not exist"),
        ("rmt.generate", ["--checkpoint", "ckpt", "--max-new-tokens", "0"], 2, "--max-new-tokens"),
        ("rmt.generate", ["--checkpoint", "ckpt", "--temperature", "hot"], 2, "invalid float value"),
        ("rmt.training.cli", ["--config", "configs/missing.yaml"], 2, "missing.yaml"),
        ("rmt.training.cli", ["--config", "configs/tiny.yaml", "model.hidden_size=-1"], 2, "hidden_size"),
        ("rmt.planner.cli", ["comm", "--tokens", "-1"], 2, "must be a positive integer"),
    ],
)
def test_help_and_argument_errors_import_nothing_heavy(module, argv, code, message):
    result, stderr = _run(module, argv)
    assert result["code"] in ((code, None) if code == 0 else (code,)), stderr
    assert result["heavy"] == [], f"{module} {' '.join(argv)} imported {result['heavy']}"
    if message:
        assert message in stderr
