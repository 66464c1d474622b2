"""tools/bench_export.py at its smallest: the streamed export's peak memory does not grow with
the memory table (the plain path's does, by about twice the table), in the JSON every
benchmark writes."""

import json

import pytest

from conftest import run_python

pytestmark = pytest.mark.slow


def test_bench_export_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_python(["tools/bench_export.py", "--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_export" and doc["machine"] and len(doc["rows"]) == 4
    s = doc["summary"]
    # 14 MiB more table: the streamed peak within a quarter of it (allocator noise), the whole
    # one above the table itself (loaded, then copied into the weights)
    assert abs(s["streamed_rss_per_table_byte"]) < 0.25 and s["whole_rss_per_table_byte"] > 1.0
