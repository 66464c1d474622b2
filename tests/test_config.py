"""Config: YAML + dotted overrides, and validate() rejecting impossible settings with one
sentence (exit status 2 from the CLI, no traceback)."""

import pytest

from conftest import ROOT, rmt_train
from rmt.config import ConfigError, from_dict, load_config, to_dict, validate


def test_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 4\ntrain:\n  steps: 9\n")
    cfg = load_config(str(path), ["train.steps=50", "model.position=rope", "train.save=null"])
    assert cfg.model.num_layers == 4 and cfg.train.steps == 50 and cfg.model.position == "rope"
    assert cfg.train.save is None and cfg.model.hidden_size == 64
    assert from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize("overrides, world, message", [
    (["model.hidden_sz=3"], 1, "unknown config key 'model.hidden_sz' in override 'model.hidden_sz=3'; valid keys of 'model' are: activation, arch,"),
    (["optim.lr=3"], 1, "unknown config section 'optim'"),
    (["train.steps=abc"], 1, "bad value for 'train.steps'"),
    (["train.steps"], 1, "must have the form section.key=value"),
    (["model.num_attention_heads=3", "model.hidden_size=96", "parallel.tensor_model_parallel_size=2"], 2,
     "model.num_attention_heads (3) must be divisible by parallel.tensor_model_parallel_size (2)"),
    (["parallel.tensor_model_parallel_size=2"], 3, "world size 3 is not divisible by tensor x pipeline parallel size 2 x 1 = 2"),
    (["parallel.data_parallel_size=4"], 2, "parallel.data_parallel_size=4 but world size 2"),
    (["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"], 2, "model.num_layers (3) must be divisible by the number of pipeline stages"),
    (["model.hidden_size=0"], 1, "model.hidden_size must be positive, got 0"),
    (["model.embedding_init_std=0"], 1, "model.embedding_init_std must be positive, got 0"),
    (["train.micro_batch_size=-1"], 1, "train.micro_batch_size must be positive, got -1"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], 1, "train.global_batch_size (6) must be a multiple"),
    (["data.path=/nonexistent/ds"], 1, "data.path '/nonexistent/ds' has no '/nonexistent/ds.bin'"),
    (["train.load=/nonexistent/ckpt"], 1, "train.load directory '/nonexistent/ckpt' does not exist"),
    (["data.tokenizer=/nonexistent/tok.json"], 1, "data.tokenizer must be 'byte', 'bpe' or a path"),
    (["model.arch=gpt5"], 1, "model.arch 'gpt5' is not a known architecture; choose one of:"),
    (["model.position=alibi"], 1, "model.position must be 'learned' or 'rope' for the transformer"),
    (["train.precision=fp8"], 1, "train.precision must be 'fp32' or 'bf16'"),
    (["train.warmup_steps=-1"], 1, "train.warmup_steps must not be negative, got -1"),
    (["train.ema_decay=1"], 1, "train.ema_decay must lie in (0, 1) or be null, got 1.0"),
    (["data.split=1,2"], 1, "data.split must be three non-negative weights"),
    (["train.save_interval=5"], 1, "train.save_interval is set but train.save"),
    (["parallel.virtual_pipeline_model_parallel_size=2"], 1, "needs pipeline_model_parallel_size >= 2"),
    (["data.task=cpy"], 1, "data.task must be 'none' or one of copy, selective_copy, got 'cpy'"),
    (["model.arch=rmt", "model.rank=3", "parallel.tensor_model_parallel_size=2"], 2,
     "model.rank (3) must be divisible by parallel.tensor_model_parallel_size (2)"),
])
def test_validate_rejects(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(bad))
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  lr:\n    value: 1\n")
    with pytest.raises(ConfigError, match="'train.lr' .* is a value, not a section"):
        load_config(str(nested))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.slow
def test_cli_exits_2_with_one_sentence(tmp_path):
    proc = rmt_train(["--config", f"{ROOT}/configs/tiny.yaml", "model.heads=4"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("rmt-train: error: unknown config key 'model.heads'")
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = rmt_train(["--config", f"{ROOT}/configs/tiny.yaml", "--eval-only"], check=False)
    assert proc.returncode == 2 and "--eval-only needs train.load" in proc.stderr


def test_shipped_configs_validate():
    import glob

    for path in sorted(glob.glob(f"{ROOT}/configs/*.yaml")):
        cfg = load_config(path)
        p = cfg.parallel
        validate(cfg, world_size=p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                 * (p.data_parallel_size or 1))
