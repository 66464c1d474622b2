"""tools/bench_lookup_reduce.py runs end to end (CPU, --quick, one repeat, fp32 and bf16 tables)
and writes the JSON the figures in docs/benchmarks.md come from; a GPU-only clock on the CPU is
one clear error, exit 2."""

import json
import math

import pytest

from conftest import run_python

SUMMARY_KEYS = {"speedup_vs_embedding_bag_sparse", "speedup_vs_embedding_bag_dense", "fraction_of_bandwidth",
                "step_speedup_sparse_adam_vs_embedding_bag_sparse_adam", "step_speedup_sparse_adam_vs_dense_adamw",
                "gather_gbps", "best_case_speedup_vs_embedding_bag_sparse", "best_case_speedup_vs_embedding_bag_dense"}


@pytest.mark.parametrize("table_dtype,table_elem", [("fp32", 4), ("bf16", 2)])
def test_bench_quick_writes_json(tmp_path, table_dtype, table_elem):
    out = tmp_path / "bench.json"
    run_python(["tools/bench_lookup_reduce.py", "--quick", "--repeats", "1", "--device", "cpu",
                "--table-dtype", table_dtype, "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_lookup_reduce" and doc["machine"]["device"] == "cpu"
    assert doc["machine"]["table_dtype"] == table_dtype
    assert doc["machine"]["backends"] == ["cpu"] and doc["machine"]["clock"] == "wall"
    shapes = {(r["K"], r["C"], r["E"]) for r in doc["rows"]}
    assert shapes == {(32, 1, 1), (128, 2, 4)}
    headline = {r["method"] for r in doc["rows"] if (r["K"], r["C"], r["E"]) == (32, 1, 1)}
    assert headline == {"lookup_reduce[cpu] sparse grad", "lookup_reduce[cpu] dense grad", "embedding_bag dense",
                        "embedding_bag sparse", "naive gather+sum"}
    assert len(doc["step_rows"]) == 5
    assert set(doc["summary"]) == SUMMARY_KEYS
    assert all(math.isfinite(v) and v > 0 for v in doc["summary"].values())
    # the ideal implementation of the model: the fastest forward, then the touched rows read once
    # more at that forward's rate and their gradients written at copy bandwidth
    head = [r for r in doc["rows"] if (r["K"], r["C"], r["E"]) == (32, 1, 1)]
    fastest = min(head, key=lambda r: r["fwd_s"])
    touched = fastest["unique_rows"] * fastest["D"] * table_elem
    best = (fastest["fwd_s"] + touched / (fastest["fwd_gbps"] * 1e9)
            + touched / (doc["machine"]["copy_bandwidth_gbps"] * 1e9))
    bag = next(r for r in head if r["method"] == "embedding_bag sparse")
    assert math.isclose(doc["summary"]["best_case_speedup_vs_embedding_bag_sparse"], bag["fwd_bwd_s"] / best)
    assert doc["summary"]["gather_gbps"] == fastest["fwd_gbps"]


def test_bench_gpu_clock_on_cpu_is_rejected():
    proc = run_python(["tools/bench_lookup_reduce.py", "--device", "cpu", "--clock", "device"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--clock device times CUDA events: it needs --device cuda")
