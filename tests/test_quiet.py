"""Normal commands print no warning a user cannot act on (rmt.quiet): megatron-core's Apex /
Transformer Engine notices, its "full scope is deprecated", torch's deprecations in checkpoint
loading, CUDA_DEVICE_MAX_CONNECTIONS advice on CPU, the profiler's USDT lines."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, _env, run_python, tiny_overrides

pytestmark = pytest.mark.slow

NOISE = re.compile(r"Apex|Transformer Engine|deprecat|CUDA_DEVICE_MAX_CONNECTIONS|USDT:|STAGE:|Warning", re.IGNORECASE)


def _loud_env():
    """The test harness's environment without its blanket PYTHONWARNINGS=ignore."""
    env = _env()
    env.pop("PYTHONWARNINGS", None)
    return env


def _run(args, nproc=1):
    cmd = (
        [sys.executable] + args
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=_loud_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _assert_quiet(stderr, what):
    noisy = [line for line in stderr.splitlines() if NOISE.search(line)]
    assert not noisy, f"{what} printed: {noisy[:5]}"


def test_commands_print_no_unactionable_warnings(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(8)))
    _assert_quiet(
        _run(["-m", "rmt.data.preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "data")]),
        "rmt-preprocess",
    )
    ckpt = tmp_path / "ckpt"
    # tensor parallelism: megatron's linear layers give their CUDA_DEVICE_MAX_CONNECTIONS advice
    train = (
        ["-m", "rmt.training.cli"]
        + tiny_overrides(tmp_path / "cache", steps=2)
        + ["parallel.tensor_model_parallel_size=2", f"train.save={ckpt}", "train.save_interval=2"]
    )
    _assert_quiet(_run(train, nproc=2), "rmt-train")
    _assert_quiet(
        _run(["-m", "rmt.generate", "--checkpoint", str(ckpt), "--max-new-tokens", "2"]),
        "rmt-generate (a checkpoint load)",
    )


def test_profiler_lines_dropped_and_other_output_kept():
    code = (
        "import os, sys, torch\n"
        "from torch.profiler import ProfilerActivity, profile\n"
        "from rmt.quiet import profiler_lines_dropped\n"
        "with profiler_lines_dropped(), profile(activities=[ProfilerActivity.CPU]):\n"
        "    torch.ones(4).sum()\n"
        "    os.write(2, b'native line\\n')\n"
        "    print('python line', file=sys.stderr)\n"
        "print('after', file=sys.stderr)\n"
    )
    proc = run_python(["-c", code])
    assert proc.stderr.splitlines() == ["native line", "python line", "after"]
