"""rmt.setup_process() before torch makes torch's OpenMP threads wait passively (rmt.process): libgomp
itself reports no spinning (OMP_DISPLAY_ENV; its default spins 300,000 times before it sleeps);
a user's own OMP_WAIT_POLICY is kept."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("user, spin_count", [(None, "0"), ("ACTIVE", "30000000000")])
def test_openmp_wait_policy_reaches_torch(user, spin_count):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(PYTHONPATH=ROOT, OMP_DISPLAY_ENV="VERBOSE", OMP_NUM_THREADS="2")
    if user:
        env["OMP_WAIT_POLICY"] = user
    proc = subprocess.run(
        [sys.executable, "-c", "import rmt; rmt.setup_process(); import torch; torch.ones(1 << 16).sum()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"GOMP_SPINCOUNT = '{spin_count}'" in proc.stderr
