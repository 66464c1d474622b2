"""The one configuration schema of rmt: sections, keys, defaults, the values each key allows,
and loading and merging. It imports nothing else of rmt but :mod:`rmt.errors`.

Dataclasses hold every default; a YAML file sets some keys and dotted ``section.key=value``
overrides set others (OmegaConf does the merging and type checking). What a key allows is
declared in its type, beside its docstring: ``Literal[...]`` for a choice, ``Annotated[T,
Range(...)]`` for numeric bounds; every float must be finite. :func:`check_fields` is the one
check of those declarations (run by :func:`load_config` and first by
:func:`rmt.config_checks.validate`), answering a bad value with one sentence naming the key, the
value and what is allowed; the generated ``docs/config.md`` shows them. Combinations of keys are
checked in :mod:`rmt.config_checks`.

The declarations are checked by hand over the dataclass type hints rather than by pydantic:
OmegaConf already merges and types these dataclasses (and itself rejects a value outside a
``Literal``), and a pydantic model beside them would be a second schema of the same keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, List, Literal, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rmt.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Numeric bounds of a key, used as ``Annotated[int, Range(gt=0)]``: ``gt``/``ge`` the lower
    bound (exclusive/inclusive), ``lt``/``le`` the upper one; None leaves that side open."""

    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    le: Optional[float] = None

    def admits(self, value) -> bool:
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def describe(self) -> str:
        """``> 0``, ``>= 1``, ``in [0, 1)``, ..."""
        low = f"({_number(self.gt)}" if self.gt is not None else f"[{_number(self.ge)}" if self.ge is not None else None
        high = (
            f"{_number(self.lt)})" if self.lt is not None else f"{_number(self.le)}]" if self.le is not None else None
        )
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>' if self.gt is not None else '>='} {low[1:]}"
        return f"{'<' if self.lt is not None else '<='} {high[:-1]}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass
class ModelConfig:
    """Architecture and shape. ``arch`` picks a builder registered in :mod:`rmt.models.build`."""

    arch: Literal["transformer", "rmt", "recurrent", "mixer"] = "transformer"
    """Architecture: ``transformer`` (megatron-core GPT baseline), ``rmt`` (Residual Matrix
    Transformer), ``recurrent`` (recurrent transformer) or ``mixer`` (masked / repeat mixers)."""

    num_layers: Annotated[int, Range(gt=0)] = 2
    """Number of layers; must be divisible by the number of pipeline stages (pipeline x virtual
    pipeline size)."""

    hidden_size: Annotated[int, Range(gt=0)] = 64
    """Hidden (residual) width. For ``arch: rmt`` it is derived as ``dk * dv``."""

    num_attention_heads: Annotated[int, Range(gt=0)] = 4
    """Attention heads (token-mixing heads for ``arch: mixer``); must be divisible by the tensor
    parallel size. For ``arch: rmt`` the heads are ``rank``."""

    ffn_hidden_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Feed-forward inner width; ``null`` = 4 x ``hidden_size`` (4·R·Dv for ``arch: rmt``). Must be
    divisible by the tensor parallel size."""

    num_query_groups: Optional[Annotated[int, Range(gt=0)]] = None
    """Grouped-query attention (Ainslie et al., 2023; megatron-core's ``num_query_groups``): the
    query heads share this many key and value heads, each group ``num_attention_heads /
    num_query_groups`` query heads; ``null`` = one per query head (multi-head attention).
    ``arch: transformer`` only; must divide ``num_attention_heads`` and be divisible by the tensor
    parallel size."""

    gated_linear_unit: bool = False
    """A gated feed-forward layer (Shazeer, "GLU Variants Improve Transformer", 2020, Eq. 5-6;
    megatron-core's ``gated_linear_unit``): the first linear makes two ``ffn_hidden_size`` halves
    and the layer computes ``activation(x W) * (x V)`` before the second; with ``activation: silu``
    it is SwiGLU (Llama's FFN). ``arch: transformer`` only, not with MoE experts."""

    add_bias_linear: bool = True
    """Biases on the transformer layers' linears (megatron-core's ``add_bias_linear``); ``false``:
    bias-free, as Llama's. ``arch: transformer`` only, not with MoE experts."""

    seq_length: Annotated[int, Range(gt=0)] = 128
    """Tokens per sample. For synthetic tasks it must be at least 2·``data.task_tokens`` +
    ``data.curriculum_target``."""

    vocab_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Vocabulary size; ``null`` = taken from the data (tokenizer or dataset metadata)."""

    make_vocab_size_divisible_by: Annotated[int, Range(gt=0)] = 128
    """Pad the vocabulary to a multiple of this; the padding is independent of TP, so every
    layout has the same table."""

    position: Literal["learned", "rope", "alibi", "block"] = "learned"
    """Positions: ``learned`` or ``rope`` for the transformer; ``alibi`` or ``learned`` for the
    RMT (the shipped ``rmt_*.yaml`` set ``alibi``); ``learned`` (absolute) or ``block`` (learned,
    indexed by the position within its block, the same at any sequence length) for the recurrent
    transformer."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``. Ignored by the RMT (whole-matrix RMSNorm)."""

    activation: Optional[Literal["gelu", "gelu_tanh", "silu", "relu"]] = None
    """Feed-forward activation of every architecture (and of megatron's MoE experts): ``gelu`` (exact, erf), ``gelu_tanh`` (the tanh approximation: the RMT
    authors' ``hax.nn.gelu``, GPT-2's), ``silu`` or ``relu``; ``null`` = the architecture's own,
    ``gelu`` (transformer, rmt, recurrent) or ``silu`` (mixer, as its author's code)."""

    layernorm_epsilon: Annotated[float, Range(gt=0)] = 1e-5
    """Epsilon of the normalization layers."""

    init_std: Annotated[float, Range(gt=0)] = 0.02
    """Standard deviation of the weight init. The RMT uses N(0, ``init_std``/sqrt(fan_in)), layer
    writes further divided by sqrt(2L), embedding tables ``init_std``."""

    embedding_init_std: Optional[Annotated[float, Range(gt=0)]] = None
    """Standard deviation of the token and position embedding tables' init (every architecture);
    ``null`` = ``init_std``. torch's own ``nn.Embedding`` default is 1."""

    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Dropout probability, in [0, 1); must be 0 for the RMT."""

    attention_kernel: Literal["sdpa", "megatron", "megatron_fused"] = "sdpa"
    """Core attention of the architectures built on megatron-core layers (``transformer``,
    ``recurrent``): ``sdpa`` (torch's fused ``scaled_dot_product_attention``), ``megatron``
    (megatron-core's unfused ``DotProductAttention``, the reference) or ``megatron_fused`` (the
    same with megatron's fused scale-mask-softmax CUDA kernel under bf16, where Megatron-LM's or
    Apex's ``scaled_upper_triang_masked_softmax_cuda`` extension is installed; in fp32 megatron
    runs its unfused softmax). The same function: fp32 outputs agree to rounding. The RMT always
    uses torch's; the mixer has no attention."""

    block_width: Annotated[int, Range(gt=0)] = 32
    """Recurrent transformer (``arch: recurrent``): block width k; one layer slides over blocks
    of k tokens on windows of 2k tokens. At most ``seq_length``."""

    recurrent_alpha: Annotated[float, Range(ge=0, le=1)] = 0.5
    """Recurrent transformer: initial (or frozen) accumulation scalar α (Eq. 6–8 of "Efficient
    LLM Architectures"), in [0, 1]; α is clamped to [``recurrent_alpha_min``, 1]."""

    recurrent_alpha_learned: bool = True
    """Recurrent transformer: learn α (false: keep ``recurrent_alpha`` fixed)."""

    recurrent_alpha_min: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Recurrent transformer: the floor of the learned α, which is clamped to
    [``recurrent_alpha_min``, 1]; at most ``recurrent_alpha``."""

    mixer_kind: Literal["masked", "row", "column", "mixed"] = "mixed"
    """Masked / repeat mixer (``arch: mixer``) token mixing: ``masked`` (full upper-triangular
    mixing matrix), ``row``, ``column``, ``mixed`` (half column-, half row-repeat heads; needs
    ``num_attention_heads`` >= 2)."""

    mixer_decay: bool = False
    """Mixer: multiply the mixing weights by clip(d, 0.9, 1)^((j-i)/c), c = ``mixer_decay_scale``."""

    mixer_decay_scale: Annotated[float, Range(gt=0)] = 1.0
    """Mixer: the scale c of the decay exponent (with ``mixer_decay``)."""

    dk: Annotated[int, Range(gt=0)] = 16
    """Residual Matrix Transformer (``arch: rmt``): rows Dk of the Dk x Dv residual matrix per
    token (key size)."""

    dv: Annotated[int, Range(gt=0)] = 16
    """RMT: columns Dv of the residual matrix (= head size)."""

    rank: Annotated[int, Range(gt=0)] = 4
    """RMT: rank R = attention heads = feed-forward reads/writes = embedding/unembedding keys; must
    be divisible by the tensor parallel size."""

    def position_rows(self) -> int:
        """Rows of the recurrent transformer's learned position table: ``block_width`` with
        ``position: block`` (indexed by position mod ``block_width``), else ``seq_length``. The
        model and the planner's parameter count both read it here."""
        return self.block_width if self.position == "block" else self.seq_length


@dataclass
class ParallelConfig:
    """Megatron-core 3D parallelism: tensor x pipeline x data = world size."""

    tensor_model_parallel_size: Annotated[int, Range(gt=0)] = 1
    """Tensor parallel size (megatron-core groups)."""

    pipeline_model_parallel_size: Annotated[int, Range(gt=0)] = 1
    """Pipeline parallel size; must divide ``model.num_layers``."""

    virtual_pipeline_model_parallel_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Model chunks per pipeline rank for the interleaved schedule; ``null`` = not interleaved.
    Needs ``pipeline_model_parallel_size`` >= 2 and a number of microbatches that is a multiple of
    it."""

    data_parallel_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Data parallel size; ``null`` = derived, world size / (tp x pp); if set it must match."""

    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``TransformerConfig.sequence_parallel``, Korthikanti et al.
    2022): the norms, dropouts and residuals between the tensor-parallel linears hold
    ``seq_length / tensor_model_parallel_size`` tokens per rank, with an all-gather before each
    column-parallel linear and a reduce-scatter after each row-parallel one in place of the
    all-reduce. Needs ``tensor_model_parallel_size`` >= 2, ``model.arch: transformer`` and a
    ``model.seq_length`` divisible by it. Memory layers gather the sequence first and keep
    their own tokens' output (docs/memory.md)."""

    expert_model_parallel_size: Annotated[int, Range(gt=0)] = 1
    """MoE expert parallelism (megatron-core's expert groups): the experts are split over this
    many ranks of the data x tensor parallel grid, ``num_experts / EP`` each; needs ``memory.type:
    moe``. Expert tensor x expert model x pipeline size must divide the world size."""

    expert_tensor_parallel_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Ranks splitting each MoE expert's MLP; ``null`` = ``tensor_model_parallel_size``. Must
    divide the expert hidden size."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: ``auto`` (NCCL with CUDA, else gloo), ``gloo`` or ``nccl``."""

    timeout_minutes: Annotated[int, Range(gt=0)] = 10
    """Timeout of the process groups' collectives, in minutes."""

    join_timeout_minutes: Annotated[float, Range(gt=0)] = 10.0
    """How long ranks wait for every rank to join the process group, in minutes; when it expires
    the error names the ranks that did not join and the nodes they belong on."""


@dataclass
class DataConfig:
    """Training data: an indexed dataset prefix (``.bin``/``.idx``) or the default corpus."""

    path: Any = None
    """The training data, split into train/valid/test by ``data.split``: the prefix of a
    megatron-core indexed dataset (``P.bin``/``P.idx`` from ``rmt-preprocess``), or a blend of
    several in megatron's form: weights and prefixes alternating (``"0.3 A 0.7 B"`` or the list
    ``[0.3, A, 0.7, B]``; samples drawn in proportion to the weights), prefixes alone (``"A B"``:
    in proportion to their numbers of tokens), or a ``.blend`` file holding either (relative prefixes are
    relative to it; ``rmt-preprocess --per-input`` writes one). Every dataset of a blend must
    share one tokenizer. ``null`` = the default corpus (the running interpreter's standard
    library), unless ``train_path`` is set."""

    train_path: Any = None
    """A blend per split (megatron-core's ``blend_per_split``; in place of ``path``): the
    training blend, in ``path``'s forms, used whole (``data.split`` does not apply)."""

    valid_path: Any = None
    """With ``train_path``: the validation blend, in ``path``'s forms, used whole; needed when
    ``train.eval_iters`` > 0."""

    tokenizer: Optional[str] = None
    """``null`` = the tokenizer the data was made with (recorded in ``data.path``'s ``.json`` by
    ``rmt-preprocess``; ``byte`` for the default corpus); or ``byte`` (256 bytes +
    end-of-document), ``bpe`` (byte-level BPE trained on the default corpus with HF tokenizers) or
    a path to a HF ``tokenizer.json`` or its directory. A setting that contradicts the data's
    record is an error; the checkpoint's config records the tokenizer actually used."""

    bpe_vocab_size: Annotated[int, Range(gt=0)] = 2048
    """Vocabulary size of the BPE trained with ``tokenizer: bpe``."""

    split: str = "98,2,0"
    """Train/valid/test weights, by document (``train,valid,test``); the train weight must be
    positive, and the valid weight too when ``train.eval_iters`` > 0."""

    cache_dir: str = ".rmt_cache"
    """Cache directory: tokenized default corpus, trained BPE, dataset index caches."""

    max_documents: Optional[Annotated[int, Range(gt=0)]] = None
    """Limit the default corpus to its first N documents; ``null`` = all."""

    task: Literal["none", "copy", "selective_copy"] = "none"
    """Synthetic task (:mod:`rmt.data.tasks`) instead of the corpus: ``none`` (corpus), ``copy``
    or ``selective_copy``."""

    task_tokens: Annotated[int, Range(gt=0)] = 16
    """Synthetic tasks: data tokens n to copy per sample."""

    task_alphabet: Annotated[int, Range(ge=3)] = 16
    """Synthetic tasks: alphabet size; the last two ids are noise and recall."""

    noise_length: Annotated[int, Range(ge=0)] = 128
    """Synthetic tasks: noise tokens between the data and the recall tokens (the curriculum's
    start)."""

    noise_min_fraction: Annotated[float, Range(ge=0, le=1)] = 1.0
    """Synthetic tasks: each training step draws its noise length uniformly from
    ``ceil(noise_min_fraction x N) .. N``, ``N`` the current noise length (the curriculum's), one
    length for all the step's samples (so every parallel layout trains on the same batches);
    validation stays at ``N``. In [0, 1]; 1 = every sample at ``N``. A mix of lengths asks for a
    recall that does not depend on how many blocks the noise spans (docs/recipes.md)."""

    noise_mix_step: Annotated[int, Range(ge=1)] = 1
    """Synthetic tasks, with ``noise_min_fraction < 1``: the mixed lengths are ``N, N - s,
    N - 2s, ..`` down to ``ceil(noise_min_fraction x N)``, ``s`` this step. The recurrent
    transformer's block width keeps every recall token at its place in its block and varies only
    the number of blocks the noise spans; 1 = every length of the range."""

    noise_mix_from: Annotated[int, Range(ge=0)] = 0
    """Synthetic tasks, with ``noise_min_fraction < 1``: mix lengths only once the curriculum's
    noise length ``N`` is at least this (earlier stages train at ``N`` alone); 0 = from the
    start."""

    curriculum_threshold: Optional[Annotated[float, Range(ge=0)]] = None
    """Curriculum: double the noise length after each evaluation whose validation loss is below
    this (``0``: never, the noise length held); set together with ``curriculum_target``
    (``null``: no curriculum). The noise length is saved in checkpoints and restored on resume."""

    curriculum_target: Optional[Annotated[int, Range(ge=0)]] = None
    """Curriculum: the noise length at which doubling stops; set together with
    ``curriculum_threshold``."""

    reset_position_ids: bool = False
    """Documents (megatron-core's GPTDataset key): position ids restart at 0 after every
    end-of-document token, so a document packed mid-sequence gets the positions it has alone.
    Only meaningful with absolute positions (``model.position: learned``); RoPE and ALiBi depend
    on distances only, so without ``reset_attention_mask`` it is rejected for them."""

    reset_attention_mask: bool = False
    """Documents (megatron-core's GPTDataset key): no token attends across an end-of-document
    token, so every document in a packed sequence is computed as if alone (with
    ``reset_position_ids`` for learned positions). Transformer and RMT: a per-sample block-causal
    attention mask; recurrent transformer and mixer: each document runs as its own sequence
    from position 0 (their windows and token mixing are position-indexed); UltraMem's query
    convolution does not reach into the previous document. Every parallel layout."""

    eod_mask_loss: bool = False
    """Documents (megatron-core's GPTDataset key): no loss where the input token is the
    end-of-document token, i.e. on predicting the first token of the next document."""


@dataclass
class TrainConfig:
    """Optimisation, schedule, precision, logging and checkpointing."""

    steps: Annotated[int, Range(gt=0)] = 300
    """Training steps (optimizer steps of one global batch each)."""

    micro_batch_size: Annotated[int, Range(gt=0)] = 8
    """Samples per microbatch per data-parallel rank."""

    global_batch_size: Optional[Annotated[int, Range(gt=0)]] = None
    """Samples per step; ``null`` = micro x dp. More means gradient accumulation over
    microbatches; must be a multiple of micro x dp."""

    lr: Annotated[float, Range(gt=0)] = 3e-3
    """Peak learning rate."""

    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    """Final learning rate as a fraction of ``lr``, in [0, 1]; also the lowest factor that
    ``lr_curriculum_decay`` and ``lr_plateau_decay`` bring the schedule to."""

    warmup_steps: Annotated[int, Range(ge=0)] = 30
    """Linear warmup steps, >= 0; a value not below ``steps`` (e.g. a short smoke run of a config
    made for longer ones) is clamped to ``steps`` - 1, and the run says so."""

    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup: ``cosine``, ``linear`` or ``constant``."""

    lr_curriculum_decay: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Synthetic-task curriculum (``data.curriculum_threshold``): multiply the learning rate by
    this, in (0, 1], each time the curriculum doubles the noise length ("Efficient LLM
    Architectures" §6.2: the learning rate "decays as a function of the sequence length and the
    validation loss"); 1 = never. Like ``lr_plateau_decay`` it scales the whole schedule, never
    below ``min_lr_ratio`` x its value, and is saved in checkpoints."""

    lr_target_decay: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Synthetic-task curriculum: multiply the learning rate by this, in (0, 1], once more (on top
    of ``lr_curriculum_decay``) at the doubling that brings the noise length to
    ``data.curriculum_target``, so that the last stage, which must drive the loss down rather than
    only below ``data.curriculum_threshold``, can start lower than the early stages' rule puts it;
    1 = no extra cut. Floored and saved like ``lr_curriculum_decay``."""

    lr_plateau_decay: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Reduce on plateau: multiply the learning rate by this, in (0, 1], after
    ``lr_plateau_patience`` evaluations in a row without a new lowest validation loss; with a
    curriculum only once the noise length is at ``data.curriculum_target`` (the lowest loss is
    forgotten at each doubling). 1 = never."""

    lr_plateau_patience: Annotated[int, Range(gt=0)] = 10
    """Evaluations without a new lowest validation loss before ``lr_plateau_decay`` applies
    (counted afresh after each reduction); positive."""

    lr_plateau_smoothing: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """The plateau rule judges an exponential moving average of the validation loss,
    ``s = smoothing * s + (1 - smoothing) * val_loss`` (started afresh at each doubling of a
    curriculum), instead of each evaluation alone; in [0, 1), 0 = each evaluation alone. On a
    loss that swings from one evaluation to the next, a lone low value resets the patience
    count and postpones the reduction however long the trend has been level."""

    ema_decay: Optional[Annotated[float, Range(gt=0, lt=1)]] = None
    """Also keep an exponential moving average of the weights, ``ema = ema_decay * ema + (1 -
    ema_decay) * w`` after every step, in (0, 1) (0.99 averages over about 100 steps); ``null`` =
    none (:mod:`rmt.training.weight_average`; memory value tables are not averaged). Each evaluation then also measures the average (``val_loss_ema``); the trained
    weights' loss still drives the curriculum and the learning-rate rules. Checkpoints keep the
    average (one made without it starts it at the loaded weights); a task curriculum restarts it
    at every doubling of the noise length."""

    weight_decay: Annotated[float, Range(ge=0)] = 0.1
    """AdamW weight decay wd; never on norms, biases, embedding and unembedding tables, memory
    values (:mod:`rmt.training.optimizer` lists what each recipe decays)."""

    weight_decay_mode: Literal["lr", "schedule"] = "lr"
    """How the decay scales per step: ``lr`` shrinks weights by ``lr_t * wd`` (torch's and
    megatron's AdamW); ``schedule`` by ``wd * lr_t / lr``, the decay following the LR schedule's
    shape but not its size (Loshchilov & Hutter's decoupled decay; the RMT authors' optax chain,
    whose "decoupled weight decay 1e-4" at lr 1e-2 is 100x the ``lr`` mode's)."""

    decay_rmt_keys: bool = False
    """RMT: also decay the embedding's and unembedding's key matrices (``embedding.word_keys``,
    ``embedding.position_keys``, ``output_layer.read``), as the authors' code does; their
    tables stay undecayed."""

    adam_beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    """Adam β1 (also for the sparse value optimizers)."""

    adam_beta2: Annotated[float, Range(ge=0, lt=1)] = 0.95
    """Adam β2 (also for the sparse value optimizers)."""

    adam_eps: Annotated[float, Range(gt=0)] = 1e-8
    """Adam epsilon (also for the sparse value optimizers)."""

    clip_grad: Annotated[float, Range(ge=0)] = 1.0
    """Clip the global gradient norm (over the model-parallel group) to this; 0 = no clipping."""

    z_loss: Annotated[float, Range(ge=0)] = 0.0
    """z-loss weight z: adds ``z * logZ^2``; ``1e-4`` is the RMT authors' value."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """``fp32``, or ``bf16`` as megatron-core trains it: bf16 dense parameters and activations with
    fp32 main parameters, fp32 gradient accumulation and reduction, and the optimizer stepping the
    fp32 copy (megatron's float16 or distributed optimizer). The memory value tables keep
    ``memory.value_dtype``."""

    distributed_optimizer: bool = False
    """megatron-core's distributed optimizer (ZeRO-1): the dense parameters' main copies and Adam
    moments are sharded over the data-parallel group, gradients reduce-scattered and parameters
    all-gathered in megatron's buckets. Memory value tables keep their own optimizers
    (docs/parallelism.md)."""

    overlap_grad_reduce: bool = False
    """Start each gradient bucket's all-reduce (reduce-scatter with ``distributed_optimizer``)
    as soon as its gradients are complete in the backward (megatron DDP's
    ``overlap_grad_reduce``)."""

    overlap_param_gather: bool = False
    """With ``distributed_optimizer``: all-gather the updated parameters bucket by bucket during
    the next step's forward instead of at the end of the optimizer step (megatron's
    ``overlap_param_gather``); needs ``overlap_grad_reduce``."""

    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation (megatron's ``recompute_granularity``): ``none`` keeps every
    activation; ``selective`` recomputes the core attention (softmax(q k^T) v) of every layer in
    the backward, keeping only its inputs; ``full`` keeps only the inputs of the layer spans that
    ``recompute_method`` picks and recomputes the spans in the backward, with megatron's
    RNG-tracked ``tensor_parallel.checkpoint``. Memory layers are never recomputed: they run
    once and keep their activations (docs/memory.md). The mixer has no core attention, so
    ``selective`` does not apply to it."""

    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With ``recompute_granularity: full`` (required there, ``null`` otherwise): ``uniform``
    splits each model chunk's layers into spans of ``recompute_num_layers`` and recomputes every
    span from its input; ``block`` recomputes the first ``recompute_num_layers`` layers of each
    chunk one by one and keeps the rest (megatron's semantics)."""

    recompute_num_layers: Optional[Annotated[int, Range(gt=0)]] = None
    """With ``recompute_granularity: full`` (required there, ``null`` otherwise): the layers per
    span (``uniform``; must divide the layers per model chunk) or the layers recomputed per chunk
    (``block``; at most the layers per chunk)."""

    seed: int = 1234
    """Random seed. Each weight tensor is drawn from a generator seeded by (seed, its checkpoint
    key), so the init does not depend on the parallel layout."""

    log_interval: Annotated[int, Range(gt=0)] = 10
    """Every N steps: print the step line and log the memory layers' slot usage
    (``memory/layerK/*`` in TensorBoard and the JSONL log)."""

    eval_interval: Annotated[int, Range(gt=0)] = 100
    """Evaluate on the validation split every N steps."""

    eval_iters: Annotated[int, Range(ge=0)] = 4
    """Validation batches per evaluation; 0 disables validation."""

    save: Optional[str] = None
    """Checkpoint directory to save into (megatron-core distributed checkpoints); ``null`` = no
    checkpoints. A run continues from its newest complete checkpoint, so the same command serves
    the first start and every restart."""

    save_interval: Annotated[int, Range(ge=0)] = 0
    """Save every N steps; 0 = only at the end. Needs ``save``."""

    keep_checkpoints: Annotated[int, Range(ge=0)] = 0
    """Complete checkpoints kept under ``save``: the newest N; 0 = all. Older ones are deleted only
    after a new one is complete."""

    exit_interval: Optional[Annotated[int, Range(gt=0)]] = None
    """Stop, after saving, every N steps (for time-limited jobs); ``null`` = run all ``steps``."""

    load: Optional[str] = None
    """Checkpoint to start from while ``save`` holds none (e.g. to fine-tune), or to evaluate with
    ``--eval-only``: a save root (its newest complete checkpoint) or one ``iter_*`` directory; must
    exist unless it equals ``save``."""

    tensorboard_dir: Optional[str] = None
    """TensorBoard log directory (scalars of every step), one subdirectory per run (its start time
    and process id, continued by the run's restarts); ``null`` = no TensorBoard logs."""

    log_file: Optional[str] = None
    """JSONL file that gets one line of metrics per training step (appended; a resumed run first
    drops the lines of steps after its checkpoint); ``null`` = none."""

    progress: bool = True
    """true: a tqdm progress bar; false, as in batch jobs: the step lines every ``log_interval``
    steps and at evaluations are printed plainly."""

    threads: Optional[Annotated[int, Range(gt=0)]] = None
    """torch intra-op threads; ``null`` = torch's default."""

    host_heap_retain_mib: Annotated[int, Range(ge=0)] = 256
    """Host memory (MiB) that freed tensors under 32 MiB leave in the process's heap for the next
    step, so that it is not returned to the OS and faulted in again every step (glibc only;
    :mod:`rmt.training.host_heap`, measured in docs/benchmarks.md); ``0`` = the C library's
    defaults."""

    flush_denormal: bool = True
    """Flush denormal floats to zero in CPU arithmetic (``torch.set_flush_denormal``: x86's FTZ and
    DAZ), as TensorFlow's and XLA's CPU runtimes do by default: the attention probabilities of far
    keys under ALiBi underflow into the denormal range, which Intel cores compute slowly, by
    microcode assist (measured in docs/benchmarks.md). Results change only where a value falls
    below 1.2e-38, which becomes 0. ``false`` = IEEE gradual underflow, torch's default."""

    ignore_memory_plan: bool = False
    """Start a run whose whole-rank memory plan (``rmt-plan memory --config``) exceeds a rank's
    memory (its GPU's, or its share of the machine's RAM and swap) by more than the plan's largest
    measured overstatement, which ``rmt-train`` otherwise refuses before building anything, naming
    the cheapest changes that fit (:mod:`rmt.training.fit`); it then only warns. For a plan
    known to overstate this run. A run whose certain lower bound cannot fit is refused whatever
    this says."""


TABLE_TYPES = ("ultramem", "ultramem_v2", "pkm")
"""The ``memory.type`` values whose layers hold value tables (an MoE's experts are dense)."""


@dataclass
class MemoryConfig:
    """Sparse memory layers added to the dense model (``type: none`` adds none): UltraMem
    (arXiv 2411.12364), PKM and MoE (:mod:`rmt.memory`), and memory-parallel tables (UltraMem
    Appendix C/D; :mod:`rmt.memory.distribution`)."""

    type: Literal["none", "ultramem", "ultramem_v2", "pkm", "moe"] = "none"
    """``none``, ``ultramem``, ``ultramem_v2`` (UltraMemV2, arXiv 2508.18756: a memory beside the
    FFN of every block, :mod:`rmt.memory.layer_v2`), ``pkm`` or ``moe``."""

    placement: str = ""
    """Skip placements ``i:j/...``: a memory's input is taken after layer i and its output added
    after layer j (1-based global layer numbers, i <= j), e.g. ``"3:5/6:8/9:11"``. Quote a single
    pair (``memory.placement='1:2'``): YAML reads ``3:5`` as a number. With pipeline parallelism
    each placement must lie inside one model chunk. With ``moe_placement: mlp``: the layers whose
    MLP is an MoE, ``i`` or ranges ``i-j`` joined by ``/``. ``ultramem_v2``: the layers with a
    memory beside their FFN, ``i`` or ranges ``i-j`` joined by ``/``; empty = every layer (the
    authors' ``mem_insert_way: full``)."""

    num_heads: Annotated[int, Range(gt=0)] = 2
    """Memory heads."""

    topk: Annotated[int, Range(gt=0)] = 16
    """Top-m values retrieved per head."""

    key_dim: Annotated[int, Range(gt=0)] = 64
    """Key width; divisible by ``tucker_rank`` (Tucker retrieval), even for PKM."""

    num_keys: Annotated[int, Range(gt=0)] = 32
    """Key grid side: slots per layer = ``num_keys²``."""

    retrieval: Literal["tucker", "product"] = "tucker"
    """UltraMem retrieval: ``tucker`` (TDQKR, Eq. 4–10) or ``product`` (product keys)."""

    retrieval_kernel: Literal["auto", "fused", "unfused"] = "auto"
    """How UltraMem, UltraMemV2 and PKM layers select their top-m: ``fused`` streams the keys in
    tiles and never holds the ``[tokens, heads, rank, keys]`` scores (:mod:`rmt.ops.fused_retrieval`;
    refused before training where it has no backend for the device and precision: every precision
    on a CPU, fp32 and bf16 on a CUDA GPU);
    ``unfused`` builds the scores and selects from them (the reference); ``auto`` takes ``fused``
    where it has a backend, else ``unfused``. Both select the same addresses."""

    tucker_rank: Annotated[int, Range(gt=0)] = 2
    """Tucker rank r of TDQKR."""

    num_cores: Annotated[int, Range(gt=0)] = 2
    """Multi-core scoring h (Eq. 16–17); must divide the value dim; > 1 needs ``retrieval:
    tucker``."""

    ive_blocks: Annotated[int, Range(gt=0)] = 4
    """Implicit value expansion E (Eq. 13–15); a perfect square."""

    ive_shuffle: bool = True
    """Implicit value expansion: random shuffle of the expanded values."""

    value_dim: Annotated[int, Range(ge=0)] = 0
    """``ultramem_v2``: width Dv of the values (the authors' ``mem_vdim``), pooled and projected
    to the memory width by one linear map; 0 = half the memory width. (UltraMem's value width is
    set by ``half_value_dim``; the Table 2 switches below do not apply to ``ultramem_v2``.)"""

    pre_value_dim: Annotated[int, Range(ge=0)] = 0
    """``ultramem_v2``: width of the PEER-style pre-values (``mem_pre_vdim``): each retrieved
    slot's score is multiplied by ``act(<P[slot], W_pre x>)``, P a second table of this width;
    0 = none."""

    pre_value_activation: Literal["none", "gelu"] = "none"
    """``ultramem_v2``: ``act`` of the pre-value scores, ``none`` (the authors' default) or
    ``gelu`` (their ``mem_use_glu_act``)."""

    softmax: bool = False
    """Table 2 ablation switch: softmax over the top-m scores (PKM; removed in UltraMem, §3.2
    item 1)."""

    half_value_dim: bool = True
    """Table 2 ablation switch: value dim half the memory width, with an output projection
    (§3.2 item 6)."""

    share_query: bool = True
    """Table 2 ablation switch: one query per head shared by row and column keys (§3.2 item
    5)."""

    query_key_norm: bool = True
    """Table 2 ablation switch: LayerNorm of queries and keys (§3.2 item 2; with
    ``improved_init``, Appendix A's gains). The paper adds it for stability at 151M-6.5B parameters;
    at the tiny configs' width the keys' norm costs validation loss (measured in
    docs/benchmarks.md, memory layers' quality)."""

    query_batchnorm: bool = False
    """BatchNorm of the query projection's output (PKM as published: Lample et al. §3.2, XLM's
    ``mem_query_batchnorm``; the shipped ``pkm_*`` configs set it). Batch statistics over the
    tokens of one microbatch on one data-parallel rank (equal on its tensor-parallel ranks, which
    hold the same tokens), so every layout computes what one process computes with the same
    ``train.micro_batch_size``; running statistics (evaluation, decoding) follow every
    microbatch of the global batch in the single-process order
    (:mod:`rmt.memory.batchnorm`). The memory's input LayerNorm then has no bias (a constant
    shift of the query cancels in the BatchNorm)."""

    query_bias: bool = False
    """A bias in the query projection (PKM as published: XLM's ``mem_query_bias``; the shipped
    ``pkm_*`` configs set it), initialised to zero. With ``query_batchnorm`` it is kept but not
    trained: the BatchNorm subtracts exactly the mean it adds, so its gradient is zero up to
    rounding noise (which Adam would turn into steps of ~0.1 x lr)."""

    query_conv: bool = True
    """Table 2 ablation switch: causal depthwise convolution over the sequence before the
    query (§3.2 item 4)."""

    conv_kernel: Annotated[int, Range(gt=0)] = 3
    """Kernel size of the query convolution (with ``query_conv``)."""

    improved_init: bool = True
    """Table 2 ablation switch: Appendix A init (E[Y] sampled)."""

    value_init_std: Optional[Annotated[float, Range(gt=0)]] = None
    """Init std of the value tables; ``null``: Appendix A's ``sqrt(E / (2 m H L))`` with
    ``improved_init`` (E expansion, m top-m, H heads, L layers: memory output ~ N(0, 1/(2L)) at
    init), else Lample et al.'s ``1 / sqrt(value dim)``. Appendix A's output variance 1/(2L) does
    not shrink with the width, so at small widths it outweighs the MLP's output; the tiny configs
    set 0.02, as the authors' public code (``UltraMemLayerV1``) does at every size (measured in
    docs/benchmarks.md, memory layers' quality)."""

    init_samples: Annotated[int, Range(ge=0)] = 0
    """How the improved init gets E[Y], the expected mean of the top-m of the grid's candidate
    scores (Appendix A): 0 = exactly, by quadrature over the order statistics, in milliseconds
    for any number of slots; k > 0 = the paper's Monte Carlo estimate from k draws of every
    candidate (streamed in bounded chunks, but its time grows with the slots)."""

    aux_loss_weight: Annotated[float, Range(ge=0)] = 0.001
    """TDQKR auxiliary loss weight α (Eq. 11–12)."""

    aux_loss_margin: Annotated[float, Range(ge=0)] = 0.15
    """TDQKR auxiliary loss margin τ (Eq. 11–12)."""

    value_lr_mult: Annotated[float, Range(ge=1)] = 10.0
    """Value learning rate = mult x base LR, decaying linearly to 1x at the last step; >= 1."""

    value_optimizer: Literal["adamw", "sparse_adam", "rowwise_adagrad"] = "adamw"
    """Optimizer of the value tables: ``adamw`` (dense table gradients, in the AdamW step with the
    other parameters), ``sparse_adam`` (torch's SparseAdam, lazy Adam on the touched rows) or
    ``rowwise_adagrad`` (one accumulator per row). The last two take the touched rows' sparse
    gradients, never a table-sized one (:mod:`rmt.ops.sparse_optim`); ``rowwise_adagrad`` needs
    ``partition`` ``local`` or ``number``. MoE has no value tables (leave it ``adamw``)."""

    value_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage dtype of the value tables: ``fp32`` or ``bf16`` (half the bytes of the table and
    of its gradients). Lookups read the stored rows and accumulate in fp32 whatever the dtype;
    the optimizers' state and update rule per dtype are stated in :mod:`rmt.ops.sparse_optim`
    (``sparse_adam`` and ``rowwise_adagrad`` keep fp32 state and round the updated rows once;
    ``adamw`` keeps torch's moments in the table's dtype). ``rmt-plan memory`` counts it."""

    fused_value_optimizer: bool = False
    """Apply ``value_optimizer`` (``sparse_adam`` or ``rowwise_adagrad``) inside the lookups'
    backward, FBGEMM-style: each touched row is stepped once its gradient is summed, and no
    table gradient (``[U, D]`` touched rows) exists. Same optimizer, state, LR schedule and
    checkpoints; micro-batches accumulate and replicas sum their lookups exactly as gradients do
    (the last micro-batch's backward steps). What changes: the value rows step with their
    unclipped gradient (``train.clip_grad`` still counts them in ``grad_norm`` and clips every
    other parameter as before), and a bf16 table's gradient is not rounded to bf16 before the
    step (:mod:`rmt.ops.fused_update`)."""

    num_experts: Annotated[int, Range(gt=0)] = 8
    """MoE (megatron-core's MoELayer, :mod:`rmt.memory.moe`): number of experts; divisible by
    ``parallel.expert_model_parallel_size``."""

    moe_topk: Annotated[int, Range(gt=0)] = 2
    """MoE: experts per token; at most ``num_experts``."""

    expert_hidden_size: Optional[Annotated[int, Range(gt=0)]] = None
    """MoE: inner width of one expert; ``null`` = the dense MLP's ffn / ``moe_topk`` (granularity
    k: the k activated experts together as wide as the dense MLP)."""

    balance_loss_weight: Annotated[float, Range(ge=0)] = 0.01
    """MoE: coefficient of the Switch load-balancing loss (Fedus et al. Eq. 4), megatron's
    ``moe_aux_loss_coeff``."""

    moe_placement: Literal["skip", "mlp"] = "skip"
    """MoE: ``mlp`` (the MoE replaces the MLP of the layers listed in ``placement``, e.g. ``"1-12"``
    or ``"2/4/6"``; megatron's usual form, transformer only) or ``skip`` (LayerNorm + MoE beside
    the dense model at ``i:j`` placements, like UltraMem; transformer and RMT)."""

    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """MoE: megatron's token dispatcher, ``alltoall`` or ``allgather`` (both run on gloo)."""

    moe_expert_capacity_factor: Optional[Annotated[float, Range(gt=0)]] = None
    """MoE: ``null`` = no token dropping; else each expert takes at most ``ceil(factor x tokens x
    moe_topk / num_experts)`` routing slots per microbatch and drops those of smallest weight."""

    partition: Literal["local", "number", "dimension", "auto"] = "local"
    """Memory-parallel table sharding: ``local`` (whole table on every rank), ``number`` (rows
    split), ``dimension`` (columns split) or ``auto`` (``rmt-plan comm``'s forward+backward choice
    for this run's tokens, top-m, IVE and cores). Only UltraMem/PKM tables shard."""

    group_size: Annotated[int, Range(ge=0)] = 0
    """Ranks per memory-parallel group; 0 = all DP x TP ranks of the stage; must divide DP x TP.
    Smaller groups are replicas."""

    owner_reduce: bool = False
    """Number-wise: the row owners pool and send partial sums back (cheaper when top-m > group
    size). Needs ``partition`` ``number`` or ``auto``."""

    async_stream: bool = False
    """Run a memory layer placed ``i:j`` (retrieval, lookup, collectives) from layer i's output
    alongside layers i+1..j, joined at layer j; its backward runs alongside the dense backward of
    layers j..i+1."""

    table_location: Literal["device", "host"] = "device"
    """Where the value tables (UltraMem, UltraMemV2, PKM) live: ``device`` (the compute device) or
    ``host`` (each rank's shard in its host memory; the rows cross through pinned staging
    buffers on a GPU machine). With ``host`` a lookup sends its distinct rows' indices to the host, gathers those rows into a staging buffer
    and copies it to the device (beside layers i+1..j with ``async_stream``); the backward brings
    the row gradients back and ``value_optimizer`` (``sparse_adam`` or ``rowwise_adagrad``, not
    fused) steps the rows on the host on a thread of its own, finished before the next lookup of
    the table (:mod:`rmt.memory.storage`). Keys, queries and the dense model stay on the
    device; checkpoints read and write the host shards directly."""

    host_cache_rows: Annotated[int, Range(ge=0)] = 0
    """With ``table_location: host``: rows of each value table shard kept on the device with their
    optimizer state, a write-back cache of the rows looked up most (0 = none; at most the shard's
    rows). Lookups read cached rows there, only the others cross the host link; the cached rows'
    gradients stay on the device, where ``value_optimizer`` steps them with the same update, so
    the numbers are those of the uncached table. Device memory per table: the rows, their
    optimizer state and 33 bytes of index per row (:mod:`rmt.memory.host_cache`;
    ``rmt-plan memory --table-location host --cache-rows``)."""

    host_cache_refresh: Annotated[int, Range(gt=0)] = 10
    """Steps between the refreshes of the device cache (``host_cache_rows``): at the start of every
    such step, once the host step has finished, the cache takes the rows the lookups since the
    last refresh hit most often, writing evicted rows back to the host and reading admitted ones
    with their optimizer state; a refresh waits for the host step that the next step's start
    would otherwise overlap."""


@dataclass
class RMTConfig:
    """The whole configuration: one section per dataclass above."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture and shape."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron-core 3D parallelism."""

    data: DataConfig = field(default_factory=DataConfig)
    """Training data and synthetic tasks."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, schedule, precision, logging and checkpointing."""

    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Sparse memory layers and memory-parallel tables."""


@dataclass(frozen=True)
class Allowed:
    """What one key allows, as its type declares it: ``choices`` (a ``Literal``), ``bounds`` (a
    :class:`Range`), whether it may be null, and its value type."""

    kind: Any
    choices: Optional[tuple] = None
    bounds: Optional[Range] = None
    nullable: bool = False

    def admits(self, value) -> bool:
        if value is None:
            return self.nullable or not self.constrained()
        if self.choices is not None:
            return value in self.choices
        if self.kind is float and isinstance(value, (int, float)) and not math.isfinite(value):
            return False
        return self.bounds is None or self.bounds.admits(value)

    def describe(self) -> str:
        """What is allowed, as the error sentences and docs/config.md put it ('' for no constraint)."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind is float:
            text = "a finite number" + (f" {self.bounds.describe()}" if self.bounds else "")
        elif self.bounds is not None:
            text = f"an integer {self.bounds.describe()}"
        else:
            return ""
        return text + (" or null" if self.nullable else "")

    def constrained(self) -> bool:
        return bool(self.describe())


def _allowed(hint) -> Allowed:
    """Read a field's type hint: ``Optional[...]``, ``Annotated[T, Range(...)]``, ``Literal[...]``."""
    nullable, bounds = False, None
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Union:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            nullable, hint = True, args[0]
        elif origin is Annotated:
            bounds = next((m for m in hint.__metadata__ if isinstance(m, Range)), bounds)
            hint = typing.get_args(hint)[0]
        elif origin is Literal:
            return Allowed(str, typing.get_args(hint), bounds, nullable)
        else:
            return Allowed(hint, None, bounds, nullable)


@functools.cache
def schema_fields() -> Dict[str, Allowed]:
    """``{"section.key": Allowed}`` for every key of :class:`RMTConfig`, in schema order (read
    once; do not change the dict)."""
    out = {}
    for section in dataclasses.fields(RMTConfig):
        cls = typing.get_type_hints(RMTConfig)[section.name]
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            out[f"{section.name}.{f.name}"] = _allowed(hints[f.name])
    return out


def field_error(key: str, value, allowed: Allowed) -> str:
    """The one sentence for a value its key does not allow."""
    return f"{key} must be {allowed.describe()}, got {value!r}"


def check_fields(config: RMTConfig) -> None:
    """Raise :class:`ConfigError` (:func:`field_error`'s sentence) for the first key whose value
    its declaration does not allow."""
    for key, allowed in schema_fields().items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if not allowed.admits(value):
            raise ConfigError(field_error(key, value, allowed))


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
        if os.path.isdir(path):
            raise ConfigError(f"config file '{path}' is a directory; --config takes a YAML file")
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
            allowed = schema_fields().get(key)
            if allowed is not None and allowed.choices is not None:  # OmegaConf checks a Literal itself
                section, name = key.split(".")
                raise ConfigError(field_error(key, container[section][name], allowed))
            msg = str(err).splitlines()[0]
            raise ConfigError(f"{origin}: bad value for '{key}' ({msg})")
    config = OmegaConf.to_object(merged)
    check_fields(config)
    return config


def to_dict(config: RMTConfig) -> dict:
    """Plain nested dict (for checkpoints, logs and TensorBoard)."""
    return dataclasses.asdict(config)


def from_dict(data: dict) -> RMTConfig:
    """Rebuild a config saved with :func:`to_dict` (unknown keys rejected as in YAML)."""
    _check_known(data, RMTConfig(), "saved config")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RMTConfig), data))
