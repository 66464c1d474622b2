"""tools/bench_optimizer.py runs end to end (--quick): torch's foreach and fused AdamW and
DeepSpeed's CPU Adam step the same parameters to the same values, and the JSON has the figures
the README quotes (DeepSpeed's op is built by ``python -m rmt.ops.extensions`` in the setup). A lock
file that a killed DeepSpeed build left behind (torch's FileBaton: every later build waited for it
forever) is removed, and said so."""

import json
import math
from pathlib import Path

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


def test_bench_quick_writes_json_and_optimizers_agree(tmp_path):
    from torch.utils.cpp_extension import _get_build_directory

    stale = Path(_get_build_directory("cpu_adam", verbose=False)) / "lock"
    stale.write_text("")  # as a build killed between taking and releasing torch's lock leaves it
    out = tmp_path / "bench.json"
    proc = run_python(["tools/bench_optimizer.py", "--quick", "--threads", "1", "--json", str(out)], timeout=900)
    assert f"removing the lock file '{stale}' that a killed build of DeepSpeed's cpu_adam left behind" in proc.stderr
    assert not stale.exists()
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_optimizer" and len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert row["threads"] == 1 and row["params"] > 0
    assert all(row[f"{name}_ms"] > 0 for name in ("torch_foreach", "torch_fused", "deepspeed_cpu_adam"))
    assert set(doc["summary"]) == {
        "deepspeed_over_torch_foreach",
        "torch_fused_over_torch_foreach",
        "max_param_difference",
    }
    assert all(math.isfinite(v) for v in doc["summary"].values())
    # The same AdamW update three ways (weights ~0.02, four steps of lr 3e-3): float rounding only.
    assert doc["summary"]["max_param_difference"] < 1e-6
