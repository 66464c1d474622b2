"""tools/bench_memory_train.py: a seconds-long run end to end (the variants share the backbone,
the sparse modules have matched parameters and activated FLOPs, one seed claims no ordering), the
ordering rule, and the backbone check."""

import importlib.util
import json
import os

import pytest

from conftest import ROOT, run_python


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory_train", os.path.join(ROOT, "tools",
                                                                                       "bench_memory_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_matches_sizes_and_claims_nothing(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    proc = run_python(["tools/bench_memory_train.py", "--quick", "--steps", "2", "--eval-iters", "1",
                       "--json", str(out), f"data.cache_dir={cache_dir}", "data.max_documents=60"])
    assert "No ordering is claimed" in proc.stdout and "Orderings" not in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_memory_train"
    rows = {r["model"]: r for r in doc["rows"]}
    assert sorted(rows) == ["dense", "moe", "pkm", "ultramem"] and all(r["phase"] == "final" for r in doc["rows"])
    dense = rows["dense"]
    extra = {k: (r["params"] - dense["params"], r["flops_per_token"] - dense["flops_per_token"])
             for k, r in rows.items() if k != "dense"}
    for kind, (params, flops) in extra.items():  # matched to UltraMem's sparse module within 10%
        assert abs(params / extra["ultramem"][0] - 1) < 0.1, (kind, params)
        assert abs(flops / extra["ultramem"][1] - 1) < 0.1, (kind, flops)
    assert set(doc["summary"]["orderings"].values()) == {"not claimed (quick run)"}
    assert doc["summary"]["tuned_value_lr_mult"] == {"pkm": 1.0, "ultramem": 10.0}


def test_orderings_need_separated_seeds():
    bench = _bench()
    pairs = {p["pair"]: p for p in bench.orderings({"dense": [2.10, 2.12], "ultramem": [1.95, 1.99],
                                                    "pkm": [2.05, 2.11]})}
    assert pairs["ultramem vs dense"]["verdict"] == "ultramem < dense" and pairs["ultramem vs dense"]["agrees"]
    assert pairs["pkm vs dense"]["verdict"] == "not separated" and pairs["pkm vs dense"]["agrees"] is None
    assert pairs["ultramem vs pkm"]["verdict"] == "ultramem < pkm"
    assert pairs["ultramem vs dense"]["difference"] == pytest.approx(-0.14)
    assert pairs["ultramem vs dense"]["per_seed"] == pytest.approx([-0.15, -0.13])
    assert pairs["pkm vs dense"]["per_seed"] == pytest.approx([-0.05, -0.01])  # paired: reported only
    assert "moe vs dense" not in pairs
    quick = bench.orderings({"dense": [2.10, 2.12], "ultramem": [1.95, 1.99]}, quick=True)
    assert [p["verdict"] for p in quick] == ["not claimed (quick run)"] and quick[0]["agrees"] is None
    one_seed = bench.orderings({"dense": [2.10], "ultramem": [1.95, 1.99]})
    assert [p["verdict"] for p in one_seed] == ["not claimed (one seed)"]


def test_backbone_mismatch_rejected(tmp_path):
    from rmt.errors import ConfigError

    bench = _bench()
    configs = {k: bench.variant_config(k, 10, 1, 1, []) for k in ("dense", "ultramem")}
    configs["ultramem"].model.hidden_size = 64
    with pytest.raises(ConfigError, match=r"^variant 'ultramem' \(configs/ultramem_tiny.yaml\) differs from the "
                                          r"dense backbone in model.hidden_size; only memory.\* may differ$"):
        bench.check_backbone(configs)


def test_one_variant_without_sweep_for_ablations(tmp_path, cache_dir):
    """``--variants ultramem --value-lr-mults none``: one run per seed at the config's value LR
    (after the overrides), the backbone still checked against dense, no dense-relative summary."""
    out = tmp_path / "bench.json"
    run_python(["tools/bench_memory_train.py", "--steps", "2", "--seeds", "1", "--eval-iters", "1",
                "--variants", "ultramem", "--value-lr-mults", "none", "--json", str(out),
                f"data.cache_dir={cache_dir}", "data.max_documents=60", "memory.value_lr_mult=3"])
    doc = json.loads(out.read_text())
    assert [(r["model"], r["phase"], r["value_lr_mult"]) for r in doc["rows"]] == [("ultramem", "final", 3.0)]
    assert "ultramem_minus_dense_val_loss" not in doc["summary"]
    assert doc["summary"]["tuned_value_lr_mult"] == {"ultramem": 3.0}
    bad = run_python(["tools/bench_memory_train.py", "--variants", "ultramem,lstm"], check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("bench_memory_train: --variants must name some of dense, pkm, moe, ultramem; "
                                  "got ultramem,lstm")
