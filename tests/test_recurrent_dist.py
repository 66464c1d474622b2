"""Data parallelism: recurrent transformer and mixer under torchrun (gloo, 2 ranks) give the
single-process losses and gradients."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "dist", "recurrent_dp.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out, nproc):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, SCRIPT, out] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), SCRIPT, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_data_parallel_equals_single_process(tmp_path):
    single = run(str(tmp_path / "one.pt"), 1)
    dp = run(str(tmp_path / "two.pt"), 2)
    for arch in ("recurrent", "mixer"):
        assert dp[arch]["losses"] == pytest.approx(single[arch]["losses"], abs=1e-5)
        assert single[arch]["grads"].keys() == dp[arch]["grads"].keys()
        for key, grad in single[arch]["grads"].items():
            torch.testing.assert_close(dp[arch]["grads"][key], grad, rtol=1e-4, atol=1e-5)
