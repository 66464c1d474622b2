"""Config: YAML + dotted overrides, and validate() rejecting impossible settings with one
sentence (exit status 2 from the CLI, no traceback)."""

import pytest

from rmt.config import ConfigError, from_dict, load_config, to_dict
from rmt.config_checks import validate

from conftest import ROOT, rmt_train


def test_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 4\ntrain:\n  steps: 9\n")
    cfg = load_config(str(path), ["train.steps=50", "model.position=rope", "train.save=null"])
    assert cfg.model.num_layers == 4 and cfg.train.steps == 50 and cfg.model.position == "rope"
    assert cfg.train.save is None and cfg.model.hidden_size == 64
    assert from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["model.hidden_sz=3"],
            1,
            "unknown config key 'model.hidden_sz' in override 'model.hidden_sz=3'; valid keys of 'model' are: activation, add_bias_linear, arch,",
        ),
        (["optim.lr=3"], 1, "unknown config section 'optim'"),
        (["train.steps=abc"], 1, "bad value for 'train.steps'"),
        (["train.steps"], 1, "must have the form section.key=value"),
        (
            ["model.num_attention_heads=3", "model.hidden_size=96", "parallel.tensor_model_parallel_size=2"],
            2,
            "model.num_attention_heads (3) must be divisible by parallel.tensor_model_parallel_size (2)",
        ),
        (
            ["parallel.tensor_model_parallel_size=2"],
            3,
            "world size 3 is not divisible by tensor x pipeline parallel size 2 x 1 = 2",
        ),
        (["parallel.data_parallel_size=4"], 2, "parallel.data_parallel_size=4 but world size 2"),
        (
            ["model.num_layers=3", "parallel.pipeline_model_parallel_size=2"],
            2,
            "model.num_layers (3) must be divisible by the number of pipeline stages",
        ),
        (["model.hidden_size=0"], 1, "model.hidden_size must be an integer > 0, got 0"),
        (["model.embedding_init_std=0"], 1, "model.embedding_init_std must be a finite number > 0 or null, got 0.0"),
        (["train.micro_batch_size=-1"], 1, "train.micro_batch_size must be an integer > 0, got -1"),
        (
            ["train.global_batch_size=6", "train.micro_batch_size=4"],
            1,
            "train.global_batch_size (6) must be a multiple",
        ),
        (["data.path=/nonexistent/ds"], 1, "data.path '/nonexistent/ds' has no '/nonexistent/ds.bin'"),
        (["train.load=/nonexistent/ckpt"], 1, "train.load directory '/nonexistent/ckpt' does not exist"),
        (["data.tokenizer=/nonexistent/tok.json"], 1, "data.tokenizer must be 'byte', 'bpe' or a path"),
        (["model.arch=gpt5"], 1, "model.arch must be one of 'transformer', 'rmt', 'recurrent', 'mixer', got 'gpt5'"),
        (["model.position=alibi"], 1, "model.position must be 'learned' or 'rope' for the transformer"),
        (["train.precision=fp8"], 1, "train.precision must be one of 'fp32', 'bf16', got 'fp8'"),
        (["train.warmup_steps=-1"], 1, "train.warmup_steps must be an integer >= 0, got -1"),
        (["train.ema_decay=1"], 1, "train.ema_decay must be a finite number in (0, 1) or null, got 1.0"),
        (["data.split=1,2"], 1, "data.split must be three non-negative weights"),
        (["train.save_interval=5"], 1, "train.save_interval is set but train.save"),
        (["parallel.virtual_pipeline_model_parallel_size=2"], 1, "needs pipeline_model_parallel_size >= 2"),
        (["data.task=cpy"], 1, "data.task must be one of 'none', 'copy', 'selective_copy', got 'cpy'"),
        (
            ["model.arch=rmt", "model.rank=3", "parallel.tensor_model_parallel_size=2"],
            2,
            "model.rank (3) must be divisible by parallel.tensor_model_parallel_size (2)",
        ),
        (["model.num_query_groups=3"], 1, "model.num_query_groups (3) must divide model.num_attention_heads (4)"),
        (
            ["model.num_query_groups=1", "parallel.tensor_model_parallel_size=2"],
            2,
            "model.num_query_groups (1) must be divisible by parallel.tensor_model_parallel_size (2)",
        ),
        (
            ["model.arch=mixer", "model.gated_linear_unit=true"],
            1,
            "model.gated_linear_unit applies to model.arch 'transformer', not 'mixer'",
        ),
        (
            ["model.arch=recurrent", "model.num_query_groups=2"],
            1,
            "model.num_query_groups applies to model.arch 'transformer', not 'recurrent'",
        ),
        (
            ["model.gated_linear_unit=true", "memory.type=moe"],
            1,
            "model.gated_linear_unit applies to the dense layers, not to memory.type 'moe'",
        ),
        (
            ["model.arch=rmt", "model.add_bias_linear=false"],
            1,
            "model.add_bias_linear applies to model.arch 'transformer', not 'rmt'",
        ),
    ],
)
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
        validate(
            cfg, world_size=p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1)
        )


def test_validate_never_changes_the_config(tmp_path):
    """validate() reads: every shipped config, a synthetic task with its vocabulary unset and data
    whose tokenizer the metadata records are the same after it; what the data decides is
    resolve_from_data's, on a copy, with a note per setting."""
    import copy
    import glob
    import json

    from rmt.data.resolution import resolve_from_data

    prefix = tmp_path / "ds"
    for ext in (".bin", ".idx"):
        (tmp_path / f"ds{ext}").write_bytes(b"")
    (tmp_path / "ds.json").write_text(json.dumps({"tokenizer": "byte", "vocab_size": 257, "eod": 256}))
    configs = [load_config(path) for path in sorted(glob.glob(f"{ROOT}/configs/*.yaml"))]
    configs += [
        load_config(None, ["data.task=copy", "model.seq_length=256"]),
        load_config(None, [f"data.path={prefix}"]),
    ]
    for cfg in configs:
        p = cfg.parallel
        before = copy.deepcopy(cfg)
        validate(
            cfg, world_size=p.tensor_model_parallel_size * p.pipeline_model_parallel_size * (p.data_parallel_size or 1)
        )
        assert cfg == before
    task, data = configs[-2:]
    resolved, notes = resolve_from_data(task)
    assert (resolved.model.vocab_size, task.model.vocab_size) == (16, None)
    assert notes == ["model.vocab_size = 16 (data.task_alphabet)"]
    resolved, notes = resolve_from_data(data)
    assert (resolved.data.tokenizer, data.data.tokenizer) == ("byte", None) and len(notes) == 1
