"""Ops/sample formulas of §5.1 against the paper's tables."""

import pytest

from rmt.planner.recurrent_ops import recurrent_ops_per_sample, transformer_ops_per_sample


def test_formulas_exact():
    assert transformer_ops_per_sample(2, 8, 16) == 2 * (16 * 16 * 8 + 16 * 8 * 8)
    assert recurrent_ops_per_sample(2, 8, 16, 4) == 2 * (4 * 8 * 16 * 4 + 2 * 16 * 8 * 8)


@pytest.mark.parametrize(
    "layers,d,l,k,regular,recurrent",
    [
        (1, 32, 1024, 32, 3.46e7, 6.29e6),  # Table 2 (long range image classification)
        (1, 384, 256, 16, 6.3e7, 8.2e7),  # Table 6 (Shakespeare)
    ],
)
def test_paper_tables(layers, d, l, k, regular, recurrent):
    assert transformer_ops_per_sample(layers, d, l) == pytest.approx(regular, rel=0.01)
    assert recurrent_ops_per_sample(layers, d, l, k) == pytest.approx(recurrent, rel=0.01)
    assert transformer_ops_per_sample(4, 32, 1024) == pytest.approx(1.38e8, rel=0.01)
    assert transformer_ops_per_sample(6, 384, 256) == pytest.approx(3.8e8, rel=0.01)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        recurrent_ops_per_sample(1, 8, 16, 32)
    with pytest.raises(ValueError, match="hidden must be positive"):
        transformer_ops_per_sample(1, 0, 16)


def test_rmt_plan_model_reports_recurrent_ops(tmp_path):
    import json
    import os

    from rmt.planner.cli import main

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "recurrent_tiny.yaml")
    out = tmp_path / "ops.json"
    assert main(["model", "--config", config, "--json", str(out)]) == 0
    doc = json.load(open(out))
    from rmt.config import load_config

    m = load_config(config).model
    r, d, l, k = m.num_layers, m.hidden_size, m.seq_length, m.block_width
    assert doc["ops_per_sample"] == r * (4 * d * l * k + 2 * l * d * d)
    assert doc["transformer_ops_per_sample"] == r * (l * l * d + l * d * d)
