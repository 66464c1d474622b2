"""Planner counts: exact parameters equal the built models; Table 7 differences add up; the
paper's §3.1 scaling claim; the ``rmt-plan model`` subcommand."""

import json
import os

import pytest

from rmt import parallel
from rmt.config import load_config, validate
from rmt.models.build import build
from rmt.planner.cli import main as plan_main
from rmt.planner.flops import plan_model, rmt_counts, transformer_counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["model.num_layers=3", "model.seq_length=20", "model.vocab_size=70",
          "model.make_vocab_size_divisible_by=16", "model.ffn_hidden_size=40"]
CASES = {
    "rmt_alibi": ["model.arch=rmt", "model.dk=6", "model.dv=4", "model.rank=3", "model.position=alibi"],
    "rmt_learned": ["model.arch=rmt", "model.dk=5", "model.dv=4", "model.rank=2", "model.position=learned"],
    "transformer_layernorm": ["model.hidden_size=24", "model.num_attention_heads=4"],
    "transformer_rmsnorm_rope": ["model.hidden_size=24", "model.num_attention_heads=4",
                                 "model.normalization=RMSNorm", "model.position=rope"],
}


@pytest.fixture(scope="module")
def single_process():
    parallel.initialize(validate(load_config(None, []), world_size=1))
    yield
    parallel.destroy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_params_equal_built_model(single_process, case):
    config = validate(load_config(None, COMMON + CASES[case]), world_size=1)
    built = sum(p.numel() for chunk in build(config) for p in chunk.parameters())
    doc = plan_model(config)
    assert doc["params"] == built
    assert doc["params"] - doc["paper_params"] == sum(d["count"] for d in doc["params_differences"])
    assert doc["flops_per_token"] - doc["paper_flops_per_token"] == pytest.approx(
        sum(d["count"] for d in doc["flops_differences"]))


# GPT2-medium (Radford et al.): L 24, D 1024, 16 heads of 64, D_FF 4096, V 50257; N 512 (the
# paper's training length). The RMT twin keeps Dv = 64, R = 16 and varies Dk (Dk Dv = D).
GPT2M = dict(L=24, Dff=4096, V=50257, N=512)


@pytest.mark.parametrize("exact", [True, False])
def test_paper_scaling_claim(exact):
    key_p, key_f = ("params", "flops_per_token") if exact else ("paper_params", "paper_flops_per_token")
    t1 = transformer_counts(D=1024, H=16, Dh=64, **GPT2M)
    t2 = transformer_counts(D=2048, H=16, Dh=64, **GPT2M)
    r1 = rmt_counts(Dk=16, Dv=64, R=16, **GPT2M)
    r2 = rmt_counts(Dk=32, Dv=64, R=16, **GPT2M)
    assert r2[key_p] / r1[key_p] - 1 < 0.01
    assert r2[key_f] / r1[key_f] - 1 < 0.01
    assert t2[key_p] / t1[key_p] - 1 == pytest.approx(1.00, abs=0.01)
    assert t2[key_f] / t1[key_f] - 1 == pytest.approx(0.94, abs=0.01)


def test_plan_model_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["model", "--config", os.path.join(ROOT, "configs", "rmt_tiny.yaml"),
                      "model.vocab_size=257", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["arch"] == "rmt" and doc["params"] > 0
    assert "parameters" in capsys.readouterr().out
    assert plan_main(["model", "--config", os.path.join(ROOT, "configs", "rmt_tiny.yaml"),
                      "model.vocab_size=null"]) == 2
    assert "model.vocab_size must be set" in capsys.readouterr().err
