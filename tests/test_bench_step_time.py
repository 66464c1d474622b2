"""tools/bench_step_time.py runs end to end on one layout (a quick calibration of one rank, one
timed step) and writes its JSON: the measured steps, the prediction from the calibrated profile,
the error between them and how steady the machine was around them; a bad layout name is one sentence and exit status 2."""

import json
import statistics

import pytest

from conftest import run_python


@pytest.mark.slow
def test_bench_smoke_writes_json(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_step_time.py",
            "--quick",
            "--only",
            "dp1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--cache-dir",
            cache_dir,
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_step_time" and set(doc) == {"benchmark", "machine", "rows", "summary"}
    (row,) = doc["rows"]
    assert row["layout"] == "dp1" and row["ranks"] == 1 and len(row["step_s"]) == 2
    assert row["measured_s"] == statistics.median(row["step_s"]) > 0
    assert row["predicted_s"] == row["prediction"]["step_s"] > 0
    assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert "calibrated, 1 rank(s)" in row["prediction"]["hardware"]
    assert row["attempts"] == 1 and row["speed_spread"] >= 0  # --quick: one attempt
    assert doc["summary"]["layouts"] == 1 and doc["summary"]["median_abs_error"] == abs(row["error"])
    assert doc["summary"]["unsteady"] == (row["speed_spread"] > 0.10)


def test_unknown_layout_exits_2(capsys):
    from tools.bench_step_time import main

    assert main(["--only", "nonesuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown layout 'nonesuch'" in err
