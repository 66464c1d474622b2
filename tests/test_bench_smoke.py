"""Seconds-long smoke runs, at their smallest shapes, of the benchmarks that have no test of
their own (bench_lookup_reduce, bench_memory_scale, bench_optimizer, bench_memory_train and
bench_recurrent have theirs): each runs its real code path end to end and writes the JSON
document every benchmark writes, with finite headline figures."""

import json
import math

import pytest

from conftest import load_script, run_python


def _doc(path, name, summary_keys):
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == name and doc["rows"] and doc["machine"]
    assert set(summary_keys) <= set(doc["summary"])
    assert all(math.isfinite(doc["summary"][k]) and doc["summary"][k] > 0 for k in summary_keys)
    return doc


@pytest.mark.slow
def test_bench_memory_inference_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_inference.py",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--layers",
            "2",
            "--kv-len",
            "8",
            "--batches",
            "1,2",
            "--reps",
            "1",
            "--expansion",
            "2",
            "--topk",
            "2",
            "--json",
            str(out),
        ]
    )
    doc = _doc(
        out,
        "bench_memory_inference",
        [
            "ultramem_over_dense_latency_b64",
            "moe_over_ultramem_latency_b64",
            "ultramem_latency_growth_10x_slots",
            "ultramem_v2_over_dense_latency_b64",
            "ultramem_v2_over_ultramem_latency_b64",
            "moe_over_ultramem_v2_latency_b64",
        ],
    )
    assert [r["batch"] for r in doc["rows"]] == [1, 2]
    for row in doc["rows"]:
        # every model touches at least the dense layers' weights; MoE and the memories more
        assert row["dense_bytes"] > 0
        assert row["ultramem_bytes"] > row["dense_bytes"] and row["moe_bytes"] > row["dense_bytes"]
        assert row["ultramem_v2_bytes"] > row["dense_bytes"]


def test_bench_memory_inference_refuses_a_bad_memory_setting(capsys, tmp_path):
    """A memory setting rmt-train would refuse is one sentence and exit status 2, nothing written."""
    from tools.bench_memory_inference import main

    out = tmp_path / "bench.json"
    assert main(["--hidden", "64", "--heads", "2", "--layers", "2", "--topk", "0", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_memory_inference: ") and "memory.topk" in err
    assert not out.exists()


@pytest.mark.slow
def test_bench_memory_parallel_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_parallel.py",
            "--steps",
            "3",
            "--hidden",
            "32",
            "--seq",
            "16",
            "--batch",
            "2",
            "--keys",
            "8",
            "--documents",
            "5",
            "--json",
            str(out),
        ]
    )
    doc = _doc(out, "bench_memory_parallel", ["async_over_sync_step_time"])
    assert {(r["partition"], r["async"]) for r in doc["rows"]} == {
        ("local", False),
        ("number", False),
        ("number", True),
        ("dimension", False),
        ("dimension", True),
    }
    for row in doc["rows"]:
        assert row["step_s"] > 0 and 0 <= row["hidden_fraction"] <= 1
        assert (row["memory_backward_s"] is not None) == row["async"]


@pytest.mark.slow
def test_bench_rmt_smoke(tmp_path):
    out = tmp_path / "bench.json"
    run_python(
        ["tools/bench_rmt.py", "--sizes", "tiny", "--steps", "3", "--json", str(out), "model.attention_kernel=megatron"]
    )
    doc = _doc(out, "bench_rmt", ["step_time_ratio_rmt_over_transformer", "peak_mem_ratio"])
    (row,) = doc["rows"]
    assert row["size"] == "tiny" and len(row["rmt"]["step_s_all"]) == 3
    assert row["overrides"] == ["model.attention_kernel=megatron"]
    for name in ("rmt", "transformer"):
        assert row[name]["persistent_bytes"] > 0 and row[name]["params"] > 0
        # the step's activations are all alive at the end of its forward; the planner's figure is
        # within 10% of what autograd saves (test_flops)
        step = row[name]["peak_bytes"] - row[name]["persistent_bytes"]
        assert step >= 0.9 * row[name]["planned_activation_bytes"] > 0


@pytest.mark.slow
def test_bench_rmt_bad_override_is_one_sentence():
    proc = run_python(["tools/bench_rmt.py", "model.attention_kernel=flash", "--sizes", "tiny"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == "bench_rmt: model.attention_kernel must be one of 'sdpa', 'megatron', 'megatron_fused', got 'flash'"
    )


@pytest.mark.slow
def test_bench_memory_stream_smoke(tmp_path):
    """Every variant trains in its own process; the async stream computes the synchronous
    layers' numbers, so each pair ends at the same loss, bit for bit."""
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_stream.py",
            "--quick",
            "--fused",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--documents",
            "20",
            "--profile",
            "1",
            "--json",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_memory_stream" and doc["machine"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["dense", "sync", "async", "sync_fused", "async_fused"]
    assert rows["sync"]["loss"] == rows["async"]["loss"] != rows["dense"]["loss"]
    assert rows["sync_fused"]["loss"] == rows["async_fused"]["loss"]
    assert all(r["step_s"] > 0 for r in rows.values())
    summary = doc["summary"]
    assert summary["async_over_sync_step_time"] == rows["async"]["median_step_s"] / rows["sync"]["median_step_s"]
    assert math.isfinite(summary["memory_s_fused"]) and "hidden_fraction_fused" in summary
    # the CPU's audit of what would wait on a GPU: the trainer's one read of losses and norm
    callers = rows["sync_fused"]["host_wait_callers_on_gpu"]
    assert len(callers) == 1 and callers[0].endswith(" train_step")


@pytest.mark.slow
def test_bench_memory_stream_bad_input_is_one_sentence():
    proc = run_python(["tools/bench_memory_stream.py", "--quick", "--variants", "sync,fast"], check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "bench_memory_stream: --variants takes names from dense, sync, async, sync_fused, async_fused, "
        "async_sparse, sync_host, async_host, async_host_cache, got 'sync,fast'"
    )


@pytest.mark.slow
def test_bench_memory_stream_host_smoke(tmp_path):
    """The host-memory tables beside the device table with the same value optimizer: the same
    losses, bit for bit (on the CPU both are CPU memory), and each host row's link bytes per step."""
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_stream.py",
            "--quick",
            "--host",
            "--variants",
            "async_sparse,sync_host,async_host,async_host_cache",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--documents",
            "20",
            "--json",
            str(out),
            "memory.host_cache_refresh=1",
        ]
    )
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["async_sparse"]["loss"] == rows["sync_host"]["loss"] == rows["async_host"]["loss"]
    assert rows["async_host_cache"]["loss"] == rows["async_host"]["loss"]
    assert "link_forward_bytes" not in rows["async_sparse"]
    # 256 of ultramem_tiny's 1,024 rows of 64 cached with their Adam moments, from step 2 on
    assert rows["async_host_cache"]["cache_device_bytes"] == 256 * (3 * 64 * 4 + 33)
    assert 0 < rows["async_host_cache"]["cache_hit_fraction"] < 1
    for name in ("sync_host", "async_host", "async_host_cache"):
        assert rows[name]["link_forward_bytes"] > rows[name]["link_backward_bytes"] > 0
        assert rows[name]["staged_peak_bytes"] > 0 and rows[name]["link_gbps"] is None
    assert rows["sync_host"]["link_forward_bytes"] == rows["async_host"]["link_forward_bytes"]
    assert doc["summary"]["host_over_device_step_time"] == (
        rows["async_host"]["median_step_s"] / rows["async_sparse"]["median_step_s"]
    )


@pytest.mark.slow
def test_bench_host_cache_smoke(tmp_path, cache_dir):
    """A short run's access pattern replayed through the cache's policy gives the run's own
    counters; a row per cache size and refresh interval."""
    out = tmp_path / "bench.json"
    run_python(
        ["tools/bench_host_cache.py", "--quick", "--steps", "6", "--refresh", "2,1", "--json", str(out)]
        + [f"data.cache_dir={cache_dir}", "memory.num_keys=64", "data.max_documents=20"]
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_host_cache" and doc["machine"] and doc["summary"]["replay_matches_run"]
    assert [(r["cache_rows"], r["refresh"]) for r in doc["rows"]] == [(256, 2), (256, 1), (1024, 2), (1024, 1)]
    assert all(0 <= r["hit_fraction"] <= 1 and r["uniform"] == r["cache_rows"] / 4096 for r in doc["rows"])


def test_bench_host_cache_replays_the_refreshes():
    """Two rows a step, one cached from the first refresh on: the tie goes to the lower row."""
    import torch

    bench = load_script("tools/bench_host_cache.py")
    lookups = [(0, torch.tensor([1, 2])), (1, torch.tensor([1, 2])), (2, torch.tensor([1, 3]))]
    got = bench.replay(lookups, shard_rows=8, capacity=1, refresh=1, steps=3)
    assert got == {"hits": 2, "rows": 6, "warm_hits": 2, "warm_rows": 4}
    assert bench.replay(lookups, shard_rows=8, capacity=1, refresh=2, steps=3)["hits"] == 1


def test_device_busy_time_counts_overlapping_kernels_once():
    bench = load_script("tools/bench_memory_stream.py")
    assert bench.busy_union([(5, 6), (0, 2), (1, 3), (2.5, 2.75)]) == 4
    assert bench.busy_union([]) == 0


@pytest.mark.slow
def test_bench_dense_switches_smoke(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_dense_switches.py",
            "--quick",
            "--variants",
            "fp32,bf16,recompute_full,all",
            "--json",
            str(out),
            f"data.cache_dir={cache_dir}",
            "data.max_documents=60",
        ]
    )
    doc = _doc(
        out,
        "bench_dense_switches",
        ["bf16_over_fp32_step_time", "bf16_over_fp32_peak", "recompute_full_over_none_peak", "all_over_fp32_peak"],
    )
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["fp32", "bf16", "recompute_full", "all"]
    assert rows["bf16"]["params"] == rows["fp32"]["params"]
    # full recomputation keeps one hidden state per layer for the backward instead of all of them
    assert rows["recompute_full"]["step_peak_bytes"] < rows["fp32"]["step_peak_bytes"]


@pytest.mark.slow
def test_bench_dense_switches_loss_band_smoke(tmp_path, cache_dir):
    out = tmp_path / "band.json"
    run_python(
        [
            "tools/bench_dense_switches.py",
            "--loss-band",
            "configs/tiny.yaml",
            "--seeds",
            "1,2",
            "--json",
            str(out),
            f"data.cache_dir={cache_dir}",
            "data.max_documents=60",
            "train.steps=2",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "model.seq_length=32",
        ]
    )
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_dense_switches_loss_band"
    (row,) = doc["rows"]
    assert row["seeds"] == [1, 2] and len(row["fp32_val_loss"]) == 2
    assert row["band"] == [min(row["fp32_val_loss"]), max(row["fp32_val_loss"])]
    assert row["bf16_in_band"] == (row["band"][0] <= row["bf16_val_loss"] <= row["band"][1])
    assert math.isfinite(doc["summary"]["max_abs_bf16_minus_fp32"])
