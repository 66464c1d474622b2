"""tools/bench_lookup_reduce.py runs end to end (CPU, --quick, one repeat) and writes the JSON
the README's figures come from; a GPU-only clock on the CPU is one clear error, exit 2."""

import json
import math

from conftest import run_python

SUMMARY_KEYS = {"speedup_vs_embedding_bag_sparse", "speedup_vs_embedding_bag_dense", "fraction_of_bandwidth",
                "step_speedup_sparse_adam_vs_embedding_bag_sparse_adam", "step_speedup_sparse_adam_vs_dense_adamw"}


def test_bench_quick_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    run_python(["tools/bench_lookup_reduce.py", "--quick", "--repeats", "1", "--device", "cpu",
                "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_lookup_reduce" and doc["machine"]["device"] == "cpu"
    assert doc["machine"]["backends"] == ["cpu"] and doc["machine"]["clock"] == "wall"
    shapes = {(r["K"], r["C"], r["E"]) for r in doc["rows"]}
    assert shapes == {(32, 1, 1), (128, 2, 4)}
    headline = {r["method"] for r in doc["rows"] if (r["K"], r["C"], r["E"]) == (32, 1, 1)}
    assert headline == {"lookup_reduce[cpu] sparse grad", "lookup_reduce[cpu] dense grad", "embedding_bag dense",
                        "embedding_bag sparse", "naive gather+sum"}
    assert len(doc["step_rows"]) == 5
    assert set(doc["summary"]) == SUMMARY_KEYS
    assert all(math.isfinite(v) and v > 0 for v in doc["summary"].values())


def test_bench_gpu_clock_on_cpu_is_rejected():
    proc = run_python(["tools/bench_lookup_reduce.py", "--device", "cpu", "--clock", "device"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--clock device times CUDA events: it needs --device cuda")
