"""tools/bench_memory_train.py: a seconds-long run end to end (the variants share the backbone,
the sparse modules have matched parameters and activated FLOPs, one seed claims no ordering), the
ordering rule, and the backbone check."""

import json

import pytest

from conftest import load_script, run_python


def _bench():
    return load_script("tools/bench_memory_train.py")


@pytest.mark.slow
def test_quick_run_matches_sizes_and_claims_nothing(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    proc = run_python(
        [
            "tools/bench_memory_train.py",
            "--quick",
            "--steps",
            "2",
            "--eval-iters",
            "1",
            "--json",
            str(out),
            f"data.cache_dir={cache_dir}",
            "data.max_documents=60",
        ]
    )
    assert "No ordering is claimed" in proc.stdout and "Orderings" not in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_memory_train"
    rows = {r["model"]: r for r in doc["rows"]}
    assert sorted(rows) == ["dense", "moe", "pkm", "ultramem", "ultramem_v2"]
    assert all(r["phase"] == "final" for r in doc["rows"])
    dense = rows["dense"]
    extra = {
        k: (r["params"] - dense["params"], r["flops_per_token"] - dense["flops_per_token"])
        for k, r in rows.items()
        if k != "dense"
    }
    for kind, (params, flops) in extra.items():  # matched to UltraMem's sparse module within 10%
        assert abs(params / extra["ultramem"][0] - 1) < 0.1, (kind, params)
        assert abs(flops / extra["ultramem"][1] - 1) < 0.1, (kind, flops)
    assert set(doc["summary"]["orderings"].values()) == {"not claimed (quick run)"}
    assert doc["summary"]["tuned_value_lr_mult"] == {"pkm": 1.0, "ultramem": 10.0, "ultramem_v2": 4.0}


def test_orderings_need_separated_seeds():
    bench = _bench()
    pairs = {
        p["pair"]: p for p in bench.orderings({"dense": [2.10, 2.12], "ultramem": [1.95, 1.99], "pkm": [2.05, 2.11]})
    }
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
    assert [p["paired_verdict"] for p in one_seed + quick] == ["not claimed (one seed)", "not claimed (quick run)"]


def test_paired_orderings_use_the_per_seed_differences():
    bench = _bench()
    # the seeds move both variants together: the ranges overlap, every seed's difference is -0.04 +- 0.01
    pairs = {
        p["pair"]: p
        for p in bench.orderings(
            {"dense": [2.10, 2.12, 2.30], "pkm": [2.05, 2.08, 2.27], "ultramem": [2.13, 2.06, 2.31]}
        )
    }
    pkm = pairs["pkm vs dense"]
    assert pkm["verdict"] == "not separated" and pkm["agrees"] is None
    assert pkm["per_seed"] == pytest.approx([-0.05, -0.04, -0.03])
    # mean -0.04, sample standard deviation 0.01, Student's t at 0.975 with 2 degrees of freedom
    half = 4.302652729749462 * 0.01 / 3**0.5
    assert pkm["paired_ci95"] == pytest.approx((-0.04 - half, -0.04 + half))
    assert pkm["paired_verdict"] == "pkm < dense" and pkm["paired_agrees"]
    # differences +0.03, -0.06, +0.01: the interval holds 0
    assert pairs["ultramem vs dense"]["paired_verdict"] == "not separated"
    assert pairs["ultramem vs dense"]["paired_agrees"] is None
    # ultramem - pkm = +0.08, -0.02, +0.04: not separated either; the paper has ultramem below
    assert pairs["ultramem vs pkm"]["paired_verdict"] == "not separated"


@pytest.mark.slow
@pytest.mark.parametrize(
    "arg,message",
    [
        ("1,x", "--value-lr-mults takes numbers (1,3,10), KIND=MULT pairs (pkm=10,ultramem=30) or 'none'; got '1,x'"),
        ("pkm=10,moe=3", "--value-lr-mults: only pkm, ultramem and ultramem_v2 have value tables; got 'pkm=10,moe=3'"),
    ],
)
def test_bad_value_lr_mults_are_one_sentence(arg, message):
    bad = run_python(["tools/bench_memory_train.py", "--value-lr-mults", arg], check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == f"bench_memory_train: {message}"


def test_fixed_value_lr_mults_per_variant():
    assert _bench().parse_value_lr_mults("pkm=10,ultramem=30") == ([], {"pkm": 10.0, "ultramem": 30.0})
    assert _bench().parse_value_lr_mults("1,3") == ([1.0, 3.0], {})
    assert _bench().parse_value_lr_mults("none") == ([], {})


def test_backbone_mismatch_rejected(tmp_path):
    from rmt.errors import ConfigError

    bench = _bench()
    configs = {k: bench.variant_config(k, 10, 1, 1, []) for k in ("dense", "ultramem")}
    configs["ultramem"].model.hidden_size = 64
    with pytest.raises(
        ConfigError,
        match=r"^variant 'ultramem' \(configs/ultramem_tiny.yaml\) differs from the "
        r"dense backbone in model.hidden_size; only memory.\* may differ$",
    ):
        bench.check_backbone(configs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "value_lr", [["--value-lr-mults", "none", "memory.value_lr_mult=3"], ["--value-lr-mults", "ultramem=3"]]
)
def test_one_variant_without_sweep_for_ablations(tmp_path, cache_dir, value_lr):
    """``--variants ultramem --value-lr-mults none``: one run per seed at the config's value LR
    (after the overrides), or at the value ``ultramem=3`` fixes, the backbone still checked
    against dense, no dense-relative summary."""
    out = tmp_path / "bench.json"
    run_python(
        [
            "tools/bench_memory_train.py",
            "--steps",
            "2",
            "--seeds",
            "1",
            "--eval-iters",
            "1",
            "--variants",
            "ultramem",
            "--json",
            str(out),
        ]
        + value_lr
        + [f"data.cache_dir={cache_dir}", "data.max_documents=60"]
    )
    doc = json.loads(out.read_text())
    assert [(r["model"], r["phase"], r["value_lr_mult"]) for r in doc["rows"]] == [("ultramem", "final", 3.0)]
    assert "ultramem_minus_dense_val_loss" not in doc["summary"]
    assert doc["summary"]["tuned_value_lr_mult"] == {"ultramem": 3.0}
    bad = run_python(["tools/bench_memory_train.py", "--variants", "ultramem,lstm"], check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "bench_memory_train: --variants must name some of dense, pkm, moe, ultramem, ultramem_v2; got ultramem,lstm"
    )
