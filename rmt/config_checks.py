"""The checks across keys of a config: every impossible combination rejected with one sentence
(:class:`ConfigError`) before any process group exists.

The schema (:mod:`rmt.config`) declares each key's own choices and bounds and checks them
(:func:`rmt.config.check_fields`, the first step of :func:`validate`); what needs the other
packages (the data on disk, the architectures' and memory layers' own rules) is checked here.
Nothing here changes the config: settings the data decides are filled in by the named step
:func:`rmt.data.resolution.resolve_from_data`, which the entry points call after this one.
"""

from __future__ import annotations

import os
from typing import Optional

from rmt.config import RMTConfig, check_fields
from rmt.data.blend import blend_prefixes, data_blends
from rmt.data.metadata import dataset_tokenizer
from rmt.errors import ConfigError
from rmt.memory.config_checks import validate_memory
from rmt.parallel.launch_env import world_size_from_env


def validate_documents(config: RMTConfig) -> None:
    """The document keys (``data.reset_position_ids``, ``reset_attention_mask``,
    ``eod_mask_loss``) need a corpus with end-of-document tokens and, for position resets,
    absolute positions."""
    d, m = config.data, config.model
    keys = [k for k in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(d, k)]
    if not keys:
        return
    if d.task != "none":
        raise ConfigError(f"data.{keys[0]} needs documents; the synthetic task '{d.task}' has none")
    if d.reset_position_ids and not d.reset_attention_mask:
        relative = {"transformer": "rope", "rmt": "alibi"}.get(m.arch)
        if m.arch == "mixer" or m.position == relative:
            what = (
                "the mixer has no position ids"
                if m.arch == "mixer"
                else (f"model.position '{m.position}' depends on token distances only")
            )
            raise ConfigError(
                f"data.reset_position_ids has no effect here ({what}); set "
                f"data.reset_attention_mask to compute every document as if alone"
            )


def validate_recompute(config: RMTConfig, stages: int) -> None:
    """``train.recompute_*``: megatron's rules (``TransformerConfig.__post_init__``), checked
    before any process group exists, plus the span sizes its uniform method needs."""
    t, m = config.train, config.model
    if t.recompute_granularity != "full":
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(t, key) is not None:
                raise ConfigError(
                    f"train.{key} applies to train.recompute_granularity 'full' only "
                    f"(got '{t.recompute_granularity}'); set it to null"
                )
        if t.recompute_granularity == "selective" and m.arch == "mixer":
            raise ConfigError(
                "train.recompute_granularity 'selective' recomputes core attention, which the mixer "
                "does not have; use 'full'"
            )
        return
    if t.recompute_method is None:
        raise ConfigError(
            f"train.recompute_granularity 'full' needs train.recompute_method 'uniform' or 'block', "
            f"got {t.recompute_method!r}"
        )
    per_chunk = m.num_layers // stages
    n = t.recompute_num_layers
    if n is None or not 1 <= n <= per_chunk:
        raise ConfigError(
            f"train.recompute_num_layers must lie in [1, {per_chunk}] (the layers per model chunk) "
            f"with train.recompute_granularity 'full', got {n}"
        )
    if t.recompute_method == "uniform" and per_chunk % n:
        raise ConfigError(
            f"train.recompute_num_layers ({n}) must divide the layers per model chunk ({per_chunk}) "
            f"with train.recompute_method 'uniform'"
        )


def validate_attention_variants(config: RMTConfig) -> None:
    """Grouped-query attention, the gated feed-forward layer and bias-free linears: the
    transformer's (megatron-core layers; not MoE experts'), with groups that split the heads and
    the tensor-parallel ranks evenly."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    variants = {
        "num_query_groups": m.num_query_groups is not None,
        "gated_linear_unit": m.gated_linear_unit,
        "add_bias_linear": not m.add_bias_linear,
    }
    for key, on in variants.items():
        if on and m.arch != "transformer":
            raise ConfigError(f"model.{key} applies to model.arch 'transformer', not '{m.arch}'")
    for key in ("gated_linear_unit", "add_bias_linear"):
        if variants[key] and config.memory.type == "moe":
            raise ConfigError(f"model.{key} applies to the dense layers, not to memory.type 'moe'")
    g = m.num_query_groups
    if g is not None and m.num_attention_heads % g:
        raise ConfigError(
            f"model.num_query_groups ({g}) must divide model.num_attention_heads ({m.num_attention_heads})"
        )
    if g is not None and g % tp:
        raise ConfigError(
            f"model.num_query_groups ({g}) must be divisible by parallel.tensor_model_parallel_size ({tp})"
        )


def validate_sequence_parallel(config: RMTConfig) -> None:
    """``parallel.sequence_parallel``: megatron's GPTModel shards the sequence between its TP
    linears; the other architectures' layers have no sequence-parallel mappings."""
    p, m = config.parallel, config.model
    if not p.sequence_parallel:
        return
    if p.tensor_model_parallel_size < 2:
        raise ConfigError(
            "parallel.sequence_parallel shards the sequence over the tensor-parallel ranks and needs "
            "parallel.tensor_model_parallel_size >= 2"
        )
    if m.arch != "transformer":
        raise ConfigError(
            f"parallel.sequence_parallel needs model.arch 'transformer' (megatron's GPTModel): the "
            f"{m.arch}'s layers have no sequence-parallel all-gather / reduce-scatter mappings"
        )
    if m.seq_length % p.tensor_model_parallel_size:
        raise ConfigError(
            f"model.seq_length ({m.seq_length}) must be divisible by "
            f"parallel.tensor_model_parallel_size ({p.tensor_model_parallel_size}) with "
            f"parallel.sequence_parallel"
        )


def validate(config: RMTConfig, world_size: Optional[int] = None) -> RMTConfig:
    """Reject impossible combinations of settings with one sentence (:class:`ConfigError`), for
    ``world_size`` ranks (default: the launcher's). First the schema's own constraints on each
    key (:func:`rmt.config.check_fields`), then the checks across keys; the model code (torch,
    megatron-core) is imported only for the architecture's own checks, after the others, so most
    mistakes are reported at once. ``config`` is read, never changed (what the data decides, such
    as its tokenizer, is :func:`rmt.data.resolution.resolve_from_data`'s); returns it."""
    check_fields(config)
    world_size = world_size_from_env() if world_size is None else world_size
    m, p, d, t = config.model, config.parallel, config.data, config.train
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size {tp} x {pp} = {tp * pp}"
        )
    dp = world_size // (tp * pp)
    if p.data_parallel_size is not None and p.data_parallel_size != dp:
        raise ConfigError(
            f"parallel.data_parallel_size={p.data_parallel_size} but world size {world_size} = "
            f"tp {tp} x pp {pp} x dp {dp}"
        )
    vpp = p.virtual_pipeline_model_parallel_size
    stages = pp * (vpp or 1)
    if vpp is not None and pp < 2:
        raise ConfigError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
    if m.num_layers % stages:
        raise ConfigError(
            f"model.num_layers ({m.num_layers}) must be divisible by the number of pipeline "
            f"stages ({pp} x virtual {vpp or 1} = {stages})"
        )
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size ({gbs}) must be a multiple of micro_batch_size x "
            f"data-parallel size ({t.micro_batch_size} x {dp})"
        )
    if vpp is not None and (gbs // (t.micro_batch_size * dp)) % pp:
        raise ConfigError(
            f"interleaved pipelining needs the number of microbatches ({gbs // (t.micro_batch_size * dp)}) "
            f"to be a multiple of pipeline_model_parallel_size ({pp})"
        )
    if t.overlap_param_gather and not (t.distributed_optimizer and t.overlap_grad_reduce):
        raise ConfigError(
            "train.overlap_param_gather needs train.distributed_optimizer and "
            "train.overlap_grad_reduce (megatron-core gathers the parameters only "
            "for its distributed optimizer, behind the gradient reduction)"
        )
    if t.overlap_param_gather and t.ema_decay is not None:
        raise ConfigError(
            "train.overlap_param_gather leaves the updated weights to be gathered during the "
            "next step's forward, but train.ema_decay averages them right after each step: "
            "set one of them only"
        )
    validate_recompute(config, stages)
    validate_sequence_parallel(config)
    validate_attention_variants(config)
    if t.decay_rmt_keys and m.arch != "rmt":
        raise ConfigError(f"train.decay_rmt_keys applies to model.arch 'rmt' (its key matrices), not '{m.arch}'")
    for key in ("lr_curriculum_decay", "lr_target_decay"):
        if getattr(t, key) < 1.0 and (d.task == "none" or d.curriculum_threshold is None):
            raise ConfigError(f"train.{key} needs a curriculum (data.task with data.curriculum_threshold)")
    if t.save_interval and not t.save:
        raise ConfigError("train.save_interval is set but train.save (the checkpoint directory) is not")
    # train.load equal to train.save is the resume directory itself, which a first start lacks.
    same = t.save is not None and t.load is not None and os.path.realpath(t.load) == os.path.realpath(t.save)
    if t.load is not None and not same and not os.path.isdir(t.load):
        raise ConfigError(f"train.load directory '{t.load}' does not exist")
    blends = data_blends(d)
    if blends is not None:
        for prefix in blend_prefixes(blends):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"data.path '{prefix}' has no '{prefix}{ext}' (run rmt-preprocess first)")
        dataset_tokenizer(d.tokenizer, blend_prefixes(blends))  # raises if the setting contradicts the data
    if d.tokenizer not in (None, "byte", "bpe") and not os.path.exists(d.tokenizer):
        raise ConfigError(
            f"data.tokenizer must be 'byte', 'bpe' or a path to a HF tokenizer; '{d.tokenizer}' does not exist"
        )
    try:
        split = [float(x) for x in d.split.split(",")]
    except ValueError:
        split = []
    if len(split) != 3 or any(x < 0 for x in split) or split[0] <= 0:
        raise ConfigError(f"data.split must be three non-negative weights 'train,valid,test', got '{d.split}'")
    if t.eval_iters and blends is not None and "train" in blends:
        if "valid" not in blends:
            raise ConfigError("train.eval_iters > 0 with data.train_path needs data.valid_path (or train.eval_iters=0)")
    elif t.eval_iters and split[1] <= 0:
        raise ConfigError("data.split gives no validation data but train.eval_iters > 0")
    from rmt.models.build import validate_arch

    validate_arch(config)
    validate_documents(config)
    if d.task != "none":
        from rmt.data.tasks import validate_task  # torch: imported only for a task

        validate_task(config)
    validate_memory(config, world_size)
    return config
