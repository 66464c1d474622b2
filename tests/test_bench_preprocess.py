"""tools/bench_preprocess.py runs end to end (--quick): the baseline and every worker count
tokenize the same corpus into the same number of tokens, and the JSON has the figures
docs/benchmarks.md quotes."""

import json
import math

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


def test_bench_quick_writes_json(cache_dir, tmp_path):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_preprocess.py",
            "--quick",
            "--mib",
            "0.5",
            "--byte-mib",
            "0.5",
            "--workers",
            "1,2",
            "--cache-dir",
            cache_dir,
            "--json",
            str(out),
        ],
        timeout=900,
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_preprocess"
    assert [(r["tokenizer"], r["workers"]) for r in doc["rows"]] == [
        (t, w) for t in ("byte", "bpe") for w in ("baseline", 1, 2)
    ]
    for name in ("byte", "bpe"):
        tokens = {r["tokens"] for r in doc["rows"] if r["tokenizer"] == name}
        assert len(tokens) == 1 and tokens.pop() > 0
    assert set(doc["summary"]) == {
        "byte_speedup_1_to_2",
        "byte_1_worker_over_baseline",
        "bpe_speedup_1_to_2",
        "bpe_1_worker_over_baseline",
        "bpe_1_worker_tokens_per_s",
    }
    assert all(math.isfinite(v) and v > 0 for v in doc["summary"].values())
