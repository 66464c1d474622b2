"""tools/bench_lookup_reduce.py runs end to end (CPU, --quick, one repeat, a 16384-row table that
keeps it to seconds, fp32 and bf16 tables, the bf16 run beside a competing process) and writes the
JSON the figures in docs/benchmarks.md come from, FBGEMM's row-wise Adagrad step beside rmt's
where ``fbgemm-gpu-cpu`` is installed; bad options are one clear error, exit 2."""

import importlib.util
import json
import math

import pytest

from conftest import load_script, run_python

SUMMARY_KEYS = {
    "speedup_vs_embedding_bag_sparse",
    "speedup_vs_embedding_bag_dense",
    "fraction_of_bandwidth",
    "step_speedup_sparse_adam_vs_embedding_bag_sparse_adam",
    "step_speedup_sparse_adam_vs_dense_adamw",
    "gather_gbps",
    "best_case_speedup_vs_embedding_bag_sparse",
    "best_case_speedup_vs_embedding_bag_dense",
    "fwd_bwd_fraction_of_best_case",
}


FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
FUSED, UNFUSED, TBE = "rmt fused RowWiseAdagrad", "rmt sparse + RowWiseAdagrad", "FBGEMM TBE EXACT_ROWWISE_ADAGRAD"


def check_rowwise_peers(doc, table_dtype, proc):
    """The side-by-side row-wise Adagrad table: every method at K=32 and 128 on 1 and 2 threads, rmt's unfused step
    bit-identical to its fused one, FBGEMM's within fp32 rounding of it (fp32 tables)."""
    rows = doc["peer_rows"]
    with_tbe = FBGEMM and table_dtype == "fp32"  # FBGEMM's CPU kernels take no bf16 weights
    methods = {FUSED, UNFUSED} | ({TBE} if with_tbe else set())
    assert {(r["method"], r["threads"], r["K"]) for r in rows} == {
        (m, n, k) for m in methods for n in (1, 2) for k in (32, 128)
    }
    assert all(math.isfinite(r[k]) and r[k] > 0 for r in rows for k in ("fwd_s", "bwd_opt_s", "step_s"))
    keys = {f"fused_step_speedup_vs_unfused_t{n}" for n in (1, 2)} | {
        f"fused_step_fraction_of_best_case_t{n}" for n in (1, 2)
    }
    if with_tbe:
        keys |= {
            f"{k}_t{n}" for k in ("fused_step_over_fbgemm_step", "best_case_step_over_fbgemm_step") for n in (1, 2)
        }
    else:
        assert "FBGEMM skipped" in proc.stdout
    assert keys <= set(doc["summary"])
    # the ideal step: the fastest forward of the three at K=32, then each touched row read at that
    # forward's rate and written at copy bandwidth
    table_elem = 4 if table_dtype == "fp32" else 2
    for n in (1, 2):
        at = [r for r in rows if (r["K"], r["threads"]) == (32, n)]
        fastest = min(at, key=lambda r: r["fwd_s"])
        touched = fastest["unique_rows"] * fastest["D"] * table_elem
        best = (
            fastest["fwd_s"]
            + touched / (fastest["fwd_gbps"] * 1e9)
            + touched / (doc["machine"]["copy_bandwidth_gbps"] * 1e9)
        )
        fused = next(r for r in at if r["method"] == FUSED)
        assert math.isclose(doc["summary"][f"fused_step_fraction_of_best_case_t{n}"], best / fused["step_s"])
        if with_tbe:
            tbe = next(r for r in at if r["method"] == TBE)
            assert math.isclose(doc["summary"][f"best_case_step_over_fbgemm_step_t{n}"], best / tbe["step_s"])
    if table_dtype != "fp32":  # rmt's fused step does not round the gradient to bf16, the others do
        return
    for r in rows:
        if r["method"] == UNFUSED:
            assert r["max_diff_output"] == r["max_diff_score_grad"] == r["max_diff_table"] == 0.0
        if r["method"] == TBE:
            # sums of K (forward) and D=64 (score gradients) products of randn rows with
            # uniform scores and randn output gradients: fp32 accumulation in another order,
            # gamma_n * sum|terms| with sum|terms| < 2K (forward) and < 512 (score gradients)
            assert r["max_diff_output"] <= r["K"] * 2**-24 * 2 * r["K"]
            assert r["max_diff_score_grad"] <= 64 * 2**-24 * 512
            # one step of lr 1e-2: |update| <= lr * sqrt(D) per element, computed from those
            # gradients (relative error < 1e-4 of the update) and rounded once at |w| < 8
            assert r["max_diff_table"] <= 1e-2 * 8 * 1e-4 + 2**-21


@pytest.mark.slow
@pytest.mark.parametrize("table_dtype,table_elem,load,digit_bits", [("fp32", 4, 0, None), ("bf16", 2, 1, "7")])
def test_bench_quick_writes_json(tmp_path, monkeypatch, table_dtype, table_elem, load, digit_bits):
    """A seconds-long run writes the JSON, with the sort's digit width at the run's thread count (5
    or 10 bits), or RMT_SORT_DIGIT_BITS where set."""
    if digit_bits:
        monkeypatch.setenv("RMT_SORT_DIGIT_BITS", digit_bits)
    out = tmp_path / "bench.json"
    proc = run_python(
        [
            "tools/bench_lookup_reduce.py",
            "--quick",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--table-dtype",
            table_dtype,
            "--load",
            str(load),
            "--rows",
            "16384",
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert {r["N"] for r in doc["rows"] + doc["step_rows"] + doc["peer_rows"]} == {16384}
    assert doc["benchmark"] == "bench_lookup_reduce" and doc["machine"]["device"] == "cpu"
    assert doc["machine"]["table_dtype"] == table_dtype and doc["machine"]["load"] == load
    assert doc["machine"]["backends"] == ["cpu"] and doc["machine"]["clock"] == "wall"
    bits = doc["machine"]["sort_digit_bits"]
    assert bits == int(digit_bits) if digit_bits else bits in (5, 10)
    shapes = {(r["K"], r["C"], r["E"]) for r in doc["rows"]}
    assert shapes == {(32, 1, 1), (128, 2, 4)}
    headline = {r["method"] for r in doc["rows"] if (r["K"], r["C"], r["E"]) == (32, 1, 1)}
    assert headline == {
        "lookup_reduce[cpu] sparse grad",
        "lookup_reduce[cpu] dense grad",
        "embedding_bag dense",
        "embedding_bag sparse",
        "naive gather+sum",
    }
    assert len(doc["step_rows"]) == 7
    assert SUMMARY_KEYS <= set(doc["summary"])
    assert all(math.isfinite(v) and v > 0 for v in doc["summary"].values())
    # the ideal implementation of the model: the fastest forward, then the touched rows read once
    # more at that forward's rate and their gradients written at copy bandwidth
    head = [r for r in doc["rows"] if (r["K"], r["C"], r["E"]) == (32, 1, 1)]
    fastest = min(head, key=lambda r: r["fwd_s"])
    touched = fastest["unique_rows"] * fastest["D"] * table_elem
    best = (
        fastest["fwd_s"]
        + touched / (fastest["fwd_gbps"] * 1e9)
        + touched / (doc["machine"]["copy_bandwidth_gbps"] * 1e9)
    )
    bag = next(r for r in head if r["method"] == "embedding_bag sparse")
    assert math.isclose(doc["summary"]["best_case_speedup_vs_embedding_bag_sparse"], bag["fwd_bwd_s"] / best)
    ours = next(r for r in head if r["method"] == "lookup_reduce[cpu] sparse grad")
    assert math.isclose(doc["summary"]["fwd_bwd_fraction_of_best_case"], best / ours["fwd_bwd_s"])
    assert doc["summary"]["gather_gbps"] == fastest["fwd_gbps"]
    check_rowwise_peers(doc, table_dtype, proc)


@pytest.mark.slow
def test_bench_gpu_clock_on_cpu_is_rejected():
    proc = run_python(["tools/bench_lookup_reduce.py", "--device", "cpu", "--clock", "device"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--clock device times CUDA events: it needs --device cuda")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--threads", "1,x"], "--threads must be comma-separated positive integers; got '1,x'"),
        (["--load", "-1"], "--load must be >= 0; got -1"),
        (["--rows", "100"], "--rows must be at least 1024; got 100"),
    ],
)
def test_bench_bad_options_are_rejected(args, message):
    proc = run_python(["tools/bench_lookup_reduce.py", "--device", "cpu"] + args, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(message)


def test_interleaved_methods_start_one_later_each_repeat():
    """The side-by-side steps rotate their order by one method per repeat, so no method always
    runs right after the same other one."""
    bench = load_script("tools/bench_lookup_reduce.py")
    items = [("a", 1), ("b", 2), ("c", 3)]
    assert [[name for name, _ in bench.rotated(items, rep)] for rep in range(4)] == [
        list("abc"),
        list("bca"),
        list("cab"),
        list("abc"),
    ]
