"""tools/bench_retrieval.py end to end at a tiny shape (its real code path: both methods timed,
each peak measured in a fresh process) and its command line's refusals."""

import json

import pytest

from conftest import load_script, run_python


@pytest.mark.slow
def test_bench_smoke_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--tokens", "32", "--keys", "64,256", "--width", "16", "--topm", "4", "--reps", "1", "--json", str(out)]
    run_python(["tools/bench_retrieval.py"] + args)
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_retrieval" and doc["machine"]["load_average"]
    assert [(r["keys_per_side"], r["method"]) for r in doc["rows"]] == [
        (64, "unfused"),
        (64, "fused"),
        (256, "unfused"),
        (256, "fused"),
    ]
    for row in doc["rows"]:
        assert row["same_addresses"] == 1.0
        assert row["time_s"] > 0 and row["peak_bytes"] >= 0
        assert row["unfused_score_bytes"] == 32 * 2 * 2 * 2 * row["keys_per_side"] * 4
    assert {"fused_peak_over_unfused_256", "fused_time_over_unfused_64", "fused_peak_growth"} <= set(doc["summary"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--keys", "10,x"], "--keys takes comma-separated integers; got '10,x'"),
        (["--keys", "8", "--topm", "16"], "--keys must all be at least --topm (16); got 8"),
        (["--tokens", "0"], "--tokens must be at least 1; got 0"),
        (
            ["--backend", "triton"],
            "backend 'triton' does not run cpu tensors of torch.float32 here (backends: cuda, triton, cpu, reference)",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_sentence(argv, message, capsys):
    bench = load_script("tools/bench_retrieval.py")
    assert bench.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"bench_retrieval: {message}"
