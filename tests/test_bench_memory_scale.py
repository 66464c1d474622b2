"""tools/bench_memory_scale.py runs end to end on the smallest shapes (2 ranks, a 2 and an 8 MiB
table, one step) and writes the JSON the figures in docs/benchmarks.md come from: every phase
measured against rmt-plan memory's prediction, every checkpoint resumed. (Resharding loads are
tested exactly in test_memory_scale.py.)"""

import json
import math

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


def test_bench_smoke_writes_json(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_scale.py",
            "--sizes",
            "8",
            "--base-mib",
            "2",
            "--ranks",
            "2",
            "--partitions",
            "number",
            "--optimizers",
            "sparse_adam",
            "--steps",
            "1",
            "--cache-dir",
            cache_dir,
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_memory_scale"
    base, run = doc["rows"]
    assert base["base"] and not run["base"] and run["P"] == 2 and run["partition"] == "number"
    assert run["whole_bytes"] == 2 * run["shard_bytes"] > base["whole_bytes"]
    assert set(run["growth"]) == {"init", "step", "save", "load"}
    for phase, g in run["growth"].items():
        # 3.6 to 11 MiB of growth per rank, where allocator rounding and the index caches the first run builds
        # move it by up to ~1 MiB (peaks above each process's own start); a phase holding a tensor the
        # planner does not count (e.g. SparseAdam's moments created at start-up) is off by >= 100%.
        assert g["predicted"] > 0 and abs(g["error"]) < 0.5, (phase, g)
    assert run["loaded_iteration"] == 1 and run["init_gbps"] > 0
    assert math.isfinite(doc["summary"]["max_abs_phase_error"])
    # An interrupted run leaves its measured runs in .partial (one per line, in the order measured);
    # the same command reuses them, in its runs' order, and measures only the others (here none:
    # each measured run costs two launches of 2 processes, and the measuring path ran above).
    assert not (tmp_path / "bench.json.partial").exists()
    (tmp_path / "bench.json.partial").write_text("".join(json.dumps(r) + "\n" for r in doc["rows"][::-1]))
    proc = run_python(
        [
            "tools/bench_memory_scale.py",
            "--sizes",
            "8",
            "--base-mib",
            "2",
            "--ranks",
            "2",
            "--partitions",
            "number",
            "--optimizers",
            "sparse_adam",
            "--steps",
            "1",
            "--cache-dir",
            cache_dir,
            "--workdir",
            str(tmp_path / "work2"),
            "--json",
            str(out),
        ]
    )
    assert "reusing 2 runs measured before" in proc.stderr and "measuring " not in proc.stderr
    again = json.loads(out.read_text())
    assert again["rows"][0]["peak"] == base["peak"] and again["rows"][1]["num_keys"] == run["num_keys"]
    assert not (tmp_path / "bench.json.partial").exists()
    # --repredict measures nothing: the same rows against the planner as it is now
    proc = run_python(["tools/bench_memory_scale.py", "--repredict", str(out), "--json", str(tmp_path / "re.json")])
    re_doc = json.loads((tmp_path / "re.json").read_text())
    assert "measuring" not in proc.stderr
    assert [r["peak"] for r in re_doc["rows"]] == [r["peak"] for r in again["rows"]]
    assert [r["predicted"] for r in re_doc["rows"]] == [r["predicted"] for r in again["rows"]]
    # a file written before above_start existed is compared on its absolute peaks
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(dict(again, rows=[{k: v for k, v in r.items() if k != "above_start"} for r in again["rows"]]))
    )
    run_python(["tools/bench_memory_scale.py", "--repredict", str(old), "--json", str(tmp_path / "re_old.json")])
    old_base, old_run = json.loads((tmp_path / "re_old.json").read_text())["rows"]
    assert {p: g["measured"] for p, g in old_run["growth"].items()} == {
        p: old_run["peak"][p] - old_base["peak"][p] for p in ("init", "step", "save", "load")
    }
