"""The one configuration schema of rmt.

Dataclasses hold every default; a YAML file sets some keys and dotted ``section.key=value``
overrides set others (OmegaConf does the merging and type checking). :func:`validate` rejects
every impossible combination with one clear sentence before any process group exists.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rmt.errors import ConfigError


@dataclass
class ModelConfig:
    """Architecture and shape. ``arch`` picks a builder registered in :mod:`rmt.models.build`."""

    arch: str = "transformer"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    seq_length: int = 128
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    position: str = "learned"
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    init_std: float = 0.02
    dropout: float = 0.0
    # Recurrent transformer (arch: recurrent) and masked / repeat mixer (arch: mixer).
    block_width: int = 32
    recurrent_alpha: float = 0.5
    recurrent_alpha_learned: bool = True
    mixer_kind: str = "mixed"
    mixer_decay: bool = False
    mixer_decay_scale: float = 1.0
    # Residual Matrix Transformer (arch: rmt): a Dk x Dv residual matrix per token, rank R
    # (= attention heads = FF reads/writes = embedding/unembedding keys). position: 'alibi'
    # or 'learned' for rmt.
    dk: int = 16
    dv: int = 16
    rank: int = 4


@dataclass
class ParallelConfig:
    """Megatron-core 3D parallelism: tensor x pipeline x data = world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    data_parallel_size: Optional[int] = None
    # MoE experts (memory.type: moe) split over expert_model_parallel_size data x tensor
    # parallel ranks, each expert's MLP over expert_tensor_parallel_size ranks (None: the
    # tensor-parallel size); megatron-core's expert groups.
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    backend: str = "auto"
    timeout_minutes: int = 10


@dataclass
class DataConfig:
    """Training data: an indexed dataset prefix (``.bin``/``.idx``) or the default corpus."""

    path: Optional[str] = None
    tokenizer: str = "byte"
    bpe_vocab_size: int = 2048
    split: str = "98,2,0"
    cache_dir: str = ".rmt_cache"
    max_documents: Optional[int] = None
    # Synthetic tasks (rmt.data.tasks) and their noise-length curriculum; task "none" = corpus.
    task: str = "none"
    task_tokens: int = 16
    task_alphabet: int = 16
    noise_length: int = 128
    curriculum_threshold: Optional[float] = None
    curriculum_target: Optional[int] = None


@dataclass
class TrainConfig:
    """Optimisation, schedule, precision, logging and checkpointing."""

    steps: int = 300
    micro_batch_size: int = 8
    global_batch_size: Optional[int] = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    z_loss: float = 0.0
    precision: str = "fp32"
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    save: Optional[str] = None
    save_interval: int = 0
    exit_interval: Optional[int] = None
    load: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    log_file: Optional[str] = None
    progress: bool = True
    threads: Optional[int] = None


@dataclass
class MemoryConfig:
    """Sparse memory layers added to the dense model (``type: none`` adds none)."""

    type: str = "none"
    # --- UltraMem / PKM / MoE memory layers (rmt/memory; UltraMem arXiv 2411.12364) ---
    # type: none | ultramem | pkm | moe. placement "i:j/k:l": input after layer i, output added
    # after layer j (1-based global layer numbers, i <= j).
    placement: str = ""
    num_heads: int = 2
    topk: int = 16
    key_dim: int = 64
    num_keys: int = 32
    retrieval: str = "tucker"
    tucker_rank: int = 2
    num_cores: int = 2
    ive_blocks: int = 4
    ive_shuffle: bool = True
    softmax: bool = False
    half_value_dim: bool = True
    share_query: bool = True
    query_key_norm: bool = True
    query_conv: bool = True
    conv_kernel: int = 3
    improved_init: bool = True
    init_samples: int = 4
    aux_loss_weight: float = 0.001
    aux_loss_margin: float = 0.15
    value_lr_mult: float = 10.0
    # value_optimizer: adamw (dense table gradients, in the AdamW step with the other
    # parameters) | sparse_adam (torch's SparseAdam, lazy Adam on the touched rows) |
    # rowwise_adagrad (one accumulator per row); the last two take the touched rows' sparse
    # gradients, never a table-sized one (rmt/ops/sparse_optim.py).
    value_optimizer: str = "adamw"
    # --- MoE (megatron-core's MoELayer; rmt/memory/moe.py) ---
    # moe_placement: mlp (the MoE replaces the MLP of the layers listed in placement, e.g.
    # "1-12" or "2/4/6") | skip (beside the dense model at i:j placements, like UltraMem).
    # expert_hidden_size: None = ffn / moe_topk (granularity moe_topk: activated expert width
    # equals the dense MLP's). balance_loss_weight: the Switch load-balancing loss coefficient.
    # moe_token_dispatcher_type: alltoall | allgather. moe_expert_capacity_factor: None (no
    # token dropping) or the capacity per expert in units of its balanced share (an expert over
    # capacity keeps the routing slots of largest weight).
    num_experts: int = 8
    moe_topk: int = 2
    expert_hidden_size: Optional[int] = None
    balance_loss_weight: float = 0.01
    moe_placement: str = "skip"
    moe_token_dispatcher_type: str = "alltoall"
    moe_expert_capacity_factor: Optional[float] = None
    # --- Memory-parallel tables (UltraMem Appendix C/D; rmt/memory/sharded_table.py) ---
    # partition: local (whole table per rank) | number (rows split) | dimension (columns
    # split) | auto (planner's choice). group_size: ranks per memory-parallel group, 0 = all
    # DP x TP ranks of the stage; smaller groups are replicas. owner_reduce: number-wise
    # owners pool and send partial sums. async_stream: run the memory layer (retrieval,
    # lookup, collectives) from layer i's output alongside layers i+1..j, and its backward
    # alongside the dense backward of layers j..i+1.
    partition: str = "local"
    group_size: int = 0
    owner_reduce: bool = False
    async_stream: bool = False


@dataclass
class RMTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


def _check_known(node, schema_obj, origin: str, prefix: str = "") -> None:
    """Reject keys the schema does not have, listing the valid ones of that section."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if not hasattr(schema_obj, key):
            if prefix:
                section = sorted(f.name for f in dataclasses.fields(schema_obj))
                raise ConfigError(
                    f"unknown config key '{prefix}{key}' in {origin}; valid keys of "
                    f"'{prefix[:-1]}' are: {', '.join(section)}"
                )
            raise ConfigError(
                f"unknown config section '{key}' in {origin}; valid sections are: "
                f"{', '.join(f.name for f in dataclasses.fields(schema_obj))}"
            )
        child = getattr(schema_obj, key)
        if dataclasses.is_dataclass(child):
            if not isinstance(value, dict):
                raise ConfigError(f"config section '{prefix}{key}' in {origin} must be a mapping")
            _check_known(value, child, origin, f"{prefix}{key}.")
        elif isinstance(value, dict):
            raise ConfigError(f"config key '{prefix}{key}' in {origin} is a value, not a section")


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> RMTConfig:
    """Defaults <- YAML file ``path`` <- ``overrides`` (``["train.steps=50", ...]``)."""
    defaults = RMTConfig()
    merged = OmegaConf.structured(RMTConfig)
    layers = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            layers.append((OmegaConf.load(path), f"config file '{path}'"))
        except Exception as err:  # yaml.YAMLError and OmegaConf errors alike
            raise ConfigError(f"config file '{path}' is not valid YAML ({err})".replace("\n", " "))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must have the form section.key=value")
        try:
            layers.append((OmegaConf.from_dotlist([item]), f"override '{item}'"))
        except OmegaConfBaseException as err:
            raise ConfigError(f"override '{item}' could not be parsed ({err})".replace("\n", " "))
    for layer, origin in layers:
        container = OmegaConf.to_container(layer) if layer is not None else None
        if container is None:
            continue
        if not isinstance(container, dict):
            raise ConfigError(f"{origin} must be a mapping of sections")
        _check_known(container, defaults, origin)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", "") or ""
            msg = str(err).splitlines()[0]
            raise ConfigError(f"{origin}: bad value for '{key}' ({msg})")
    return OmegaConf.to_object(merged)


def to_dict(config: RMTConfig) -> dict:
    """Plain nested dict (for checkpoints, logs and TensorBoard)."""
    return dataclasses.asdict(config)


def from_dict(data: dict) -> RMTConfig:
    """Rebuild a config saved with :func:`to_dict` (unknown keys rejected as in YAML)."""
    _check_known(data, RMTConfig(), "saved config")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RMTConfig), data))


def _positive(config: RMTConfig, names: List[str]) -> None:
    for name in names:
        section, key = name.split(".")
        value = getattr(getattr(config, section), key)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")


def world_size_from_env() -> int:
    """The launcher's world size (torchrun or SLURM), 1 when launched as a plain process."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def data_parallel_size(config: RMTConfig, world_size: int) -> int:
    p = config.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def validate(config: RMTConfig, world_size: Optional[int] = None) -> RMTConfig:
    """Reject impossible settings with one sentence (:class:`ConfigError`). Returns ``config``."""
    from rmt.models.build import registered_archs, validate_arch

    world_size = world_size_from_env() if world_size is None else world_size
    m, p, d, t = config.model, config.parallel, config.data, config.train
    _positive(config, [
        "model.num_layers", "model.hidden_size", "model.num_attention_heads",
        "model.ffn_hidden_size", "model.seq_length", "model.vocab_size",
        "model.make_vocab_size_divisible_by", "model.init_std", "model.layernorm_epsilon",
        "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
        "parallel.virtual_pipeline_model_parallel_size", "parallel.data_parallel_size",
        "parallel.timeout_minutes", "parallel.expert_model_parallel_size",
        "parallel.expert_tensor_parallel_size", "data.bpe_vocab_size", "train.steps",
        "train.micro_batch_size", "train.global_batch_size", "train.lr", "train.log_interval",
        "train.eval_interval", "train.threads", "train.exit_interval",
    ])
    archs = registered_archs()
    if m.arch not in archs:
        raise ConfigError(f"model.arch '{m.arch}' is not a known architecture; choose one of: {', '.join(archs)}")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"model.normalization must be 'LayerNorm' or 'RMSNorm', got '{m.normalization}'")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must lie in [0, 1), got {m.dropout}")
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"{tp} x {pp} = {tp * pp}")
    dp = world_size // (tp * pp)
    if p.data_parallel_size is not None and p.data_parallel_size != dp:
        raise ConfigError(
            f"parallel.data_parallel_size={p.data_parallel_size} but world size {world_size} = "
            f"tp {tp} x pp {pp} x dp {dp}")
    vpp = p.virtual_pipeline_model_parallel_size
    stages = pp * (vpp or 1)
    if vpp is not None and pp < 2:
        raise ConfigError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
    if m.num_layers % stages:
        raise ConfigError(
            f"model.num_layers ({m.num_layers}) must be divisible by the number of pipeline "
            f"stages ({pp} x virtual {vpp or 1} = {stages})")
    if p.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"parallel.backend must be 'auto', 'gloo' or 'nccl', got '{p.backend}'")
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size ({gbs}) must be a multiple of micro_batch_size x "
            f"data-parallel size ({t.micro_batch_size} x {dp})")
    if vpp is not None and (gbs // (t.micro_batch_size * dp)) % pp:
        raise ConfigError(
            f"interleaved pipelining needs the number of microbatches ({gbs // (t.micro_batch_size * dp)}) "
            f"to be a multiple of pipeline_model_parallel_size ({pp})")
    if t.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision must be 'fp32' or 'bf16', got '{t.precision}'")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"train.lr_decay_style must be 'cosine', 'linear' or 'constant', got '{t.lr_decay_style}'")
    if t.warmup_steps < 0 or t.warmup_steps >= t.steps:
        raise ConfigError(f"train.warmup_steps ({t.warmup_steps}) must lie in [0, train.steps={t.steps})")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
    if t.z_loss < 0 or t.weight_decay < 0 or t.clip_grad < 0:
        raise ConfigError("train.z_loss, train.weight_decay and train.clip_grad must not be negative")
    if t.eval_iters < 0:
        raise ConfigError(f"train.eval_iters must not be negative, got {t.eval_iters} (0 disables validation)")
    if t.save_interval < 0:
        raise ConfigError(f"train.save_interval must not be negative, got {t.save_interval}")
    if t.save_interval and not t.save:
        raise ConfigError("train.save_interval is set but train.save (the checkpoint directory) is not")
    if t.load is not None and not os.path.isdir(t.load):
        raise ConfigError(f"train.load directory '{t.load}' does not exist")
    if d.path is not None:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(d.path + ext):
                raise ConfigError(f"data.path '{d.path}' has no '{d.path}{ext}' (run rmt-preprocess first)")
    if d.tokenizer not in ("byte", "bpe") and not os.path.exists(d.tokenizer):
        raise ConfigError(
            f"data.tokenizer must be 'byte', 'bpe' or a path to a HF tokenizer; '{d.tokenizer}' does not exist")
    try:
        split = [float(x) for x in d.split.split(",")]
    except ValueError:
        split = []
    if len(split) != 3 or any(x < 0 for x in split) or split[0] <= 0:
        raise ConfigError(f"data.split must be three non-negative weights 'train,valid,test', got '{d.split}'")
    if t.eval_iters and split[1] <= 0:
        raise ConfigError("data.split gives no validation data but train.eval_iters > 0")
    validate_arch(config)
    if d.task != "none":
        from rmt.data.tasks import validate_task

        validate_task(config)
    from rmt.memory.validate import validate_memory

    validate_memory(config, world_size)
    return config
