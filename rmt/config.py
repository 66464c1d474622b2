"""The one configuration schema of rmt.

Dataclasses hold every default; a YAML file sets some keys and dotted ``section.key=value``
overrides set others (OmegaConf does the merging and type checking). :func:`validate` rejects
every impossible combination with one clear sentence before any process group exists.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rmt.errors import ConfigError

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")


@dataclass
class ModelConfig:
    """Architecture and shape. ``arch`` picks a builder registered in :mod:`rmt.models.build`."""

    arch: str = "transformer"
    """Architecture: ``transformer`` (megatron-core GPT baseline), ``rmt`` (Residual Matrix
    Transformer), ``recurrent`` (recurrent transformer) or ``mixer`` (masked / repeat mixers)."""

    num_layers: int = 2
    """Number of layers; must be divisible by the number of pipeline stages (pipeline x virtual
    pipeline size)."""

    hidden_size: int = 64
    """Hidden (residual) width. For ``arch: rmt`` it is derived as ``dk * dv``."""

    num_attention_heads: int = 4
    """Attention heads (token-mixing heads for ``arch: mixer``); must be divisible by the tensor
    parallel size. For ``arch: rmt`` the heads are ``rank``."""

    ffn_hidden_size: Optional[int] = None
    """Feed-forward inner width; ``null`` = 4 x ``hidden_size`` (4·R·Dv for ``arch: rmt``). Must be
    divisible by the tensor parallel size."""

    seq_length: int = 128
    """Tokens per sample. For synthetic tasks it must be at least 2·``data.task_tokens`` +
    ``data.curriculum_target``."""

    vocab_size: Optional[int] = None
    """Vocabulary size; ``null`` = taken from the data (tokenizer or dataset metadata)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this; the padding is independent of TP, so every
    layout has the same table."""

    position: str = "learned"
    """Positions: ``learned`` or ``rope`` for the transformer; ``alibi`` or ``learned`` for the
    RMT (the shipped ``rmt_*.yaml`` set ``alibi``); ``learned`` (absolute) or ``block`` (learned,
    indexed by the position within its block, the same at any sequence length) for the recurrent
    transformer."""

    normalization: str = "LayerNorm"
    """``LayerNorm`` or ``RMSNorm``. Ignored by the RMT (whole-matrix RMSNorm)."""

    activation: Optional[str] = None
    """Feed-forward activation of every architecture (and of megatron's MoE experts): ``gelu`` (exact, erf), ``gelu_tanh`` (the tanh approximation: the RMT
    authors' ``hax.nn.gelu``, GPT-2's), ``silu`` or ``relu``; ``null`` = the architecture's own,
    ``gelu`` (transformer, rmt, recurrent) or ``silu`` (mixer, as its author's code)."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""

    init_std: float = 0.02
    """Standard deviation of the weight init. The RMT uses N(0, ``init_std``/sqrt(fan_in)), layer
    writes further divided by sqrt(2L), embedding tables ``init_std``."""

    embedding_init_std: Optional[float] = None
    """Standard deviation of the token and position embedding tables' init (every architecture);
    ``null`` = ``init_std``. torch's own ``nn.Embedding`` default is 1."""

    dropout: float = 0.0
    """Dropout probability, in [0, 1); must be 0 for the RMT."""

    attention_kernel: str = "sdpa"
    """Core attention of the architectures built on megatron-core layers (``transformer``,
    ``recurrent``): ``sdpa`` (torch's fused ``scaled_dot_product_attention``) or ``megatron``
    (megatron-core's unfused ``DotProductAttention``, the reference). The same function: fp32
    outputs agree to rounding. The RMT always uses torch's; the mixer has no attention."""

    block_width: int = 32
    """Recurrent transformer (``arch: recurrent``): block width k; one layer slides over blocks
    of k tokens on windows of 2k tokens. At most ``seq_length``."""

    recurrent_alpha: float = 0.5
    """Recurrent transformer: initial (or frozen) accumulation scalar α (Eq. 6–8 of "Efficient
    LLM Architectures"), in [0, 1]; α is clamped to [``recurrent_alpha_min``, 1]."""

    recurrent_alpha_learned: bool = True
    """Recurrent transformer: learn α (false: keep ``recurrent_alpha`` fixed)."""

    recurrent_alpha_min: float = 0.0
    """Recurrent transformer: the floor of the learned α, which is clamped to
    [``recurrent_alpha_min``, 1]; at most ``recurrent_alpha``."""

    mixer_kind: str = "mixed"
    """Masked / repeat mixer (``arch: mixer``) token mixing: ``masked`` (full upper-triangular
    mixing matrix), ``row``, ``column``, ``mixed`` (half column-, half row-repeat heads; needs
    ``num_attention_heads`` >= 2)."""

    mixer_decay: bool = False
    """Mixer: multiply the mixing weights by clip(d, 0.9, 1)^((j-i)/c), c = ``mixer_decay_scale``."""

    mixer_decay_scale: float = 1.0
    """Mixer: the scale c of the decay exponent (with ``mixer_decay``)."""

    dk: int = 16
    """Residual Matrix Transformer (``arch: rmt``): rows Dk of the Dk x Dv residual matrix per
    token (key size)."""

    dv: int = 16
    """RMT: columns Dv of the residual matrix (= head size)."""

    rank: int = 4
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

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (megatron-core groups)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size; must divide ``model.num_layers``."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; ``null`` = not interleaved.
    Needs ``pipeline_model_parallel_size`` >= 2 and a number of microbatches that is a multiple of
    it."""

    data_parallel_size: Optional[int] = None
    """Data parallel size; ``null`` = derived, world size / (tp x pp); if set it must match."""

    sequence_parallel: bool = False
    """Megatron's sequence parallelism (``TransformerConfig.sequence_parallel``, Korthikanti et al.
    2022): the norms, dropouts and residuals between the tensor-parallel linears hold
    ``seq_length / tensor_model_parallel_size`` tokens per rank, with an all-gather before each
    column-parallel linear and a reduce-scatter after each row-parallel one in place of the
    all-reduce. Needs ``tensor_model_parallel_size`` >= 2, ``model.arch: transformer`` and a
    ``model.seq_length`` divisible by it. Memory layers gather the sequence first and keep
    their own tokens' output (docs/memory.md)."""

    expert_model_parallel_size: int = 1
    """MoE expert parallelism (megatron-core's expert groups): the experts are split over this
    many ranks of the data x tensor parallel grid, ``num_experts / EP`` each; needs ``memory.type:
    moe``. Expert tensor x expert model x pipeline size must divide the world size."""

    expert_tensor_parallel_size: Optional[int] = None
    """Ranks splitting each MoE expert's MLP; ``null`` = ``tensor_model_parallel_size``. Must
    divide the expert hidden size."""

    backend: str = "auto"
    """torch.distributed backend: ``auto`` (NCCL with CUDA, else gloo), ``gloo`` or ``nccl``."""

    timeout_minutes: int = 10
    """Timeout of the process groups' collectives, in minutes."""

    join_timeout_minutes: float = 10.0
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

    bpe_vocab_size: int = 2048
    """Vocabulary size of the BPE trained with ``tokenizer: bpe``."""

    split: str = "98,2,0"
    """Train/valid/test weights, by document (``train,valid,test``); the train weight must be
    positive, and the valid weight too when ``train.eval_iters`` > 0."""

    cache_dir: str = ".rmt_cache"
    """Cache directory: tokenized default corpus, trained BPE, dataset index caches."""

    max_documents: Optional[int] = None
    """Limit the default corpus to its first N documents; ``null`` = all."""

    task: str = "none"
    """Synthetic task (:mod:`rmt.data.tasks`) instead of the corpus: ``none`` (corpus), ``copy``
    or ``selective_copy``."""

    task_tokens: int = 16
    """Synthetic tasks: data tokens n to copy per sample."""

    task_alphabet: int = 16
    """Synthetic tasks: alphabet size; the last two ids are noise and recall."""

    noise_length: int = 128
    """Synthetic tasks: noise tokens between the data and the recall tokens (the curriculum's
    start)."""

    noise_min_fraction: float = 1.0
    """Synthetic tasks: each training step draws its noise length uniformly from
    ``ceil(noise_min_fraction x N) .. N``, ``N`` the current noise length (the curriculum's), one
    length for all the step's samples (so every parallel layout trains on the same batches);
    validation stays at ``N``. In [0, 1]; 1 = every sample at ``N``. A mix of lengths asks for a
    recall that does not depend on how many blocks the noise spans (docs/recipes.md)."""

    noise_mix_step: int = 1
    """Synthetic tasks, with ``noise_min_fraction < 1``: the mixed lengths are ``N, N - s,
    N - 2s, ..`` down to ``ceil(noise_min_fraction x N)``, ``s`` this step. The recurrent
    transformer's block width keeps every recall token at its place in its block and varies only
    the number of blocks the noise spans; 1 = every length of the range."""

    noise_mix_from: int = 0
    """Synthetic tasks, with ``noise_min_fraction < 1``: mix lengths only once the curriculum's
    noise length ``N`` is at least this (earlier stages train at ``N`` alone); 0 = from the
    start."""

    curriculum_threshold: Optional[float] = None
    """Curriculum: double the noise length after each evaluation whose validation loss is below
    this; set together with ``curriculum_target`` (``null``: no curriculum). The noise length is
    saved in checkpoints and restored on resume."""

    curriculum_target: Optional[int] = None
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

    steps: int = 300
    """Training steps (optimizer steps of one global batch each)."""

    micro_batch_size: int = 8
    """Samples per microbatch per data-parallel rank."""

    global_batch_size: Optional[int] = None
    """Samples per step; ``null`` = micro x dp. More means gradient accumulation over
    microbatches; must be a multiple of micro x dp."""

    lr: float = 3e-3
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``, in [0, 1]; also the lowest factor that
    ``lr_curriculum_decay`` and ``lr_plateau_decay`` bring the schedule to."""

    warmup_steps: int = 30
    """Linear warmup steps, >= 0; a value not below ``steps`` (e.g. a short smoke run of a config
    made for longer ones) is clamped to ``steps`` - 1, and the run says so."""

    lr_decay_style: str = "cosine"
    """Decay after warmup: ``cosine``, ``linear`` or ``constant``."""

    lr_curriculum_decay: float = 1.0
    """Synthetic-task curriculum (``data.curriculum_threshold``): multiply the learning rate by
    this, in (0, 1], each time the curriculum doubles the noise length ("Efficient LLM
    Architectures" §6.2: the learning rate "decays as a function of the sequence length and the
    validation loss"); 1 = never. Like ``lr_plateau_decay`` it scales the whole schedule, never
    below ``min_lr_ratio`` x its value, and is saved in checkpoints."""

    lr_target_decay: float = 1.0
    """Synthetic-task curriculum: multiply the learning rate by this, in (0, 1], once more (on top
    of ``lr_curriculum_decay``) at the doubling that brings the noise length to
    ``data.curriculum_target``, so that the last stage, which must drive the loss down rather than
    only below ``data.curriculum_threshold``, can start lower than the early stages' rule puts it;
    1 = no extra cut. Floored and saved like ``lr_curriculum_decay``."""

    lr_plateau_decay: float = 1.0
    """Reduce on plateau: multiply the learning rate by this, in (0, 1], after
    ``lr_plateau_patience`` evaluations in a row without a new lowest validation loss; with a
    curriculum only once the noise length is at ``data.curriculum_target`` (the lowest loss is
    forgotten at each doubling). 1 = never."""

    lr_plateau_patience: int = 10
    """Evaluations without a new lowest validation loss before ``lr_plateau_decay`` applies
    (counted afresh after each reduction); positive."""

    lr_plateau_smoothing: float = 0.0
    """The plateau rule judges an exponential moving average of the validation loss,
    ``s = smoothing * s + (1 - smoothing) * val_loss`` (started afresh at each doubling of a
    curriculum), instead of each evaluation alone; in [0, 1), 0 = each evaluation alone. On a
    loss that swings from one evaluation to the next, a lone low value resets the patience
    count and postpones the reduction however long the trend has been level."""

    ema_decay: Optional[float] = None
    """Also keep an exponential moving average of the weights, ``ema = ema_decay * ema + (1 -
    ema_decay) * w`` after every step, in (0, 1) (0.99 averages over about 100 steps); ``null`` =
    none (:mod:`rmt.training.weight_average`; memory value tables are not averaged). Each evaluation then also measures the average (``val_loss_ema``); the trained
    weights' loss still drives the curriculum and the learning-rate rules. Checkpoints keep the
    average (one made without it starts it at the loaded weights); a task curriculum restarts it
    at every doubling of the noise length."""

    weight_decay: float = 0.1
    """AdamW weight decay wd; never on norms, biases, embedding and unembedding tables, memory
    values (:mod:`rmt.training.optimizer` lists what each recipe decays)."""

    weight_decay_mode: str = "lr"
    """How the decay scales per step: ``lr`` shrinks weights by ``lr_t * wd`` (torch's and
    megatron's AdamW); ``schedule`` by ``wd * lr_t / lr``, the decay following the LR schedule's
    shape but not its size (Loshchilov & Hutter's decoupled decay; the RMT authors' optax chain,
    whose "decoupled weight decay 1e-4" at lr 1e-2 is 100x the ``lr`` mode's)."""

    decay_rmt_keys: bool = False
    """RMT: also decay the embedding's and unembedding's key matrices (``embedding.word_keys``,
    ``embedding.position_keys``, ``output_layer.read``), as the authors' code does; their
    tables stay undecayed."""

    adam_beta1: float = 0.9
    """Adam β1 (also for the sparse value optimizers)."""

    adam_beta2: float = 0.95
    """Adam β2 (also for the sparse value optimizers)."""

    adam_eps: float = 1e-8
    """Adam epsilon (also for the sparse value optimizers)."""

    clip_grad: float = 1.0
    """Clip the global gradient norm (over the model-parallel group) to this; 0 = no clipping."""

    z_loss: float = 0.0
    """z-loss weight z: adds ``z * logZ^2``; ``1e-4`` is the RMT authors' value."""

    precision: str = "fp32"
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

    recompute_granularity: str = "none"
    """Activation recomputation (megatron's ``recompute_granularity``): ``none`` keeps every
    activation; ``selective`` recomputes the core attention (softmax(q k^T) v) of every layer in
    the backward, keeping only its inputs; ``full`` keeps only the inputs of the layer spans that
    ``recompute_method`` picks and recomputes the spans in the backward, with megatron's
    RNG-tracked ``tensor_parallel.checkpoint``. Memory layers are never recomputed: they run
    once and keep their activations (docs/memory.md). The mixer has no core attention, so
    ``selective`` does not apply to it."""

    recompute_method: Optional[str] = None
    """With ``recompute_granularity: full`` (required there, ``null`` otherwise): ``uniform``
    splits each model chunk's layers into spans of ``recompute_num_layers`` and recomputes every
    span from its input; ``block`` recomputes the first ``recompute_num_layers`` layers of each
    chunk one by one and keeps the rest (megatron's semantics)."""

    recompute_num_layers: Optional[int] = None
    """With ``recompute_granularity: full`` (required there, ``null`` otherwise): the layers per
    span (``uniform``; must divide the layers per model chunk) or the layers recomputed per chunk
    (``block``; at most the layers per chunk)."""

    seed: int = 1234
    """Random seed. Each weight tensor is drawn from a generator seeded by (seed, its checkpoint
    key), so the init does not depend on the parallel layout."""

    log_interval: int = 10
    """Every N steps: print the step line and log the memory layers' slot usage
    (``memory/layerK/*`` in TensorBoard and the JSONL log)."""

    eval_interval: int = 100
    """Evaluate on the validation split every N steps."""

    eval_iters: int = 4
    """Validation batches per evaluation; 0 disables validation."""

    save: Optional[str] = None
    """Checkpoint directory to save into (megatron-core distributed checkpoints); ``null`` = no
    checkpoints. A run continues from its newest complete checkpoint, so the same command serves
    the first start and every restart."""

    save_interval: int = 0
    """Save every N steps; 0 = only at the end. Needs ``save``."""

    keep_checkpoints: int = 0
    """Complete checkpoints kept under ``save``: the newest N; 0 = all. Older ones are deleted only
    after a new one is complete."""

    exit_interval: Optional[int] = None
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

    threads: Optional[int] = None
    """torch intra-op threads; ``null`` = torch's default."""

    host_heap_retain_mib: int = 256
    """Host memory (MiB) that freed tensors under 32 MiB leave in the process's heap for the next
    step, instead of returning it to the OS and faulting it in again (glibc only; 20% of the tiny
    RMT's CPU step time, :mod:`rmt.training.host_heap`); ``0`` = the C library's defaults."""

    flush_denormal: bool = True
    """Flush denormal floats to zero in CPU arithmetic (``torch.set_flush_denormal``: x86's FTZ and
    DAZ), as TensorFlow's and XLA's CPU runtimes do by default. The attention probabilities of
    far keys under ALiBi underflow into the denormal range, which Intel cores compute by microcode
    assist: the RMT's attention backward took 1.4x as long at 256 tokens (docs/benchmarks.md).
    Results change only where a value falls below 1.2e-38, which becomes 0. ``false`` = IEEE
    gradual underflow, torch's default."""


@dataclass
class MemoryConfig:
    """Sparse memory layers added to the dense model (``type: none`` adds none): UltraMem
    (arXiv 2411.12364), PKM and MoE (:mod:`rmt.memory`), and memory-parallel tables (UltraMem
    Appendix C/D; :mod:`rmt.memory.sharded_table`)."""

    type: str = "none"
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

    num_heads: int = 2
    """Memory heads."""

    topk: int = 16
    """Top-m values retrieved per head."""

    key_dim: int = 64
    """Key width; divisible by ``tucker_rank`` (Tucker retrieval), even for PKM."""

    num_keys: int = 32
    """Key grid side: slots per layer = ``num_keys²``."""

    retrieval: str = "tucker"
    """UltraMem retrieval: ``tucker`` (TDQKR, Eq. 4–10) or ``product`` (product keys)."""

    tucker_rank: int = 2
    """Tucker rank r of TDQKR."""

    num_cores: int = 2
    """Multi-core scoring h (Eq. 16–17); must divide the value dim; > 1 needs ``retrieval:
    tucker``."""

    ive_blocks: int = 4
    """Implicit value expansion E (Eq. 13–15); a perfect square."""

    ive_shuffle: bool = True
    """Implicit value expansion: random shuffle of the expanded values."""

    value_dim: int = 0
    """``ultramem_v2``: width Dv of the values (the authors' ``mem_vdim``), pooled and projected
    to the memory width by one linear map; 0 = half the memory width. (UltraMem's value width is
    set by ``half_value_dim``; the Table 2 switches below do not apply to ``ultramem_v2``.)"""

    pre_value_dim: int = 0
    """``ultramem_v2``: width of the PEER-style pre-values (``mem_pre_vdim``): each retrieved
    slot's score is multiplied by ``act(<P[slot], W_pre x>)``, P a second table of this width;
    0 = none."""

    pre_value_activation: str = "none"
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
    ``improved_init``, Appendix A's gains). The paper adds it for stability at 151M-6.5B; on
    ``configs/ultramem_tiny.yaml`` (hidden 128, 2 layers) it costs 0.075 of validation loss at
    2000 steps, on each of three seeds; neither unit gains nor a 6x smaller query gain recover
    it, and the cost is the keys' norm alone (docs/benchmarks.md, "Memory layers, quality")."""

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

    conv_kernel: int = 3
    """Kernel size of the query convolution (with ``query_conv``)."""

    improved_init: bool = True
    """Table 2 ablation switch: Appendix A init (E[Y] sampled)."""

    value_init_std: Optional[float] = None
    """Init std of the value tables; ``null``: Appendix A's ``sqrt(E / (2 m H L))`` with
    ``improved_init`` (E expansion, m top-m, H heads, L layers: memory output ~ N(0, 1/(2L)) at
    init), else Lample et al.'s ``1 / sqrt(value dim)``. The authors' public code
    (``UltraMemLayerV1``) draws the values at 0.02 whatever the model's size. Appendix A's output
    variance 1/(2L) does not shrink with the width: it is about the MLP's at init for hidden
    1024-2048 (the paper's models) but 18x the MLP's output (12x the residual stream) at hidden
    128 with 2 layers, which costs ``configs/ultramem_tiny.yaml`` 0.22 of validation loss at 1000
    steps (docs/benchmarks.md, "Memory layers, quality"); it sets 0.02."""

    init_samples: int = 0
    """How the improved init gets E[Y], the expected mean of the top-m of the grid's candidate
    scores (Appendix A): 0 = exactly, by quadrature over the order statistics, in milliseconds
    for any number of slots; k > 0 = the paper's Monte Carlo estimate from k draws of every
    candidate (streamed in bounded chunks, but its time grows with the slots)."""

    aux_loss_weight: float = 0.001
    """TDQKR auxiliary loss weight α (Eq. 11–12)."""

    aux_loss_margin: float = 0.15
    """TDQKR auxiliary loss margin τ (Eq. 11–12)."""

    value_lr_mult: float = 10.0
    """Value learning rate = mult x base LR, decaying linearly to 1x at the last step; >= 1."""

    value_optimizer: str = "adamw"
    """Optimizer of the value tables: ``adamw`` (dense table gradients, in the AdamW step with the
    other parameters), ``sparse_adam`` (torch's SparseAdam, lazy Adam on the touched rows) or
    ``rowwise_adagrad`` (one accumulator per row). The last two take the touched rows' sparse
    gradients, never a table-sized one (:mod:`rmt.ops.sparse_optim`); ``rowwise_adagrad`` needs
    ``partition`` ``local`` or ``number``. MoE has no value tables (leave it ``adamw``)."""

    value_dtype: str = "fp32"
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

    num_experts: int = 8
    """MoE (megatron-core's MoELayer, :mod:`rmt.memory.moe`): number of experts; divisible by
    ``parallel.expert_model_parallel_size``."""

    moe_topk: int = 2
    """MoE: experts per token; at most ``num_experts``."""

    expert_hidden_size: Optional[int] = None
    """MoE: inner width of one expert; ``null`` = the dense MLP's ffn / ``moe_topk`` (granularity
    k: the k activated experts together as wide as the dense MLP)."""

    balance_loss_weight: float = 0.01
    """MoE: coefficient of the Switch load-balancing loss (Fedus et al. Eq. 4), megatron's
    ``moe_aux_loss_coeff``."""

    moe_placement: str = "skip"
    """MoE: ``mlp`` (the MoE replaces the MLP of the layers listed in ``placement``, e.g. ``"1-12"``
    or ``"2/4/6"``; megatron's usual form, transformer only) or ``skip`` (LayerNorm + MoE beside
    the dense model at ``i:j`` placements, like UltraMem; transformer and RMT)."""

    moe_token_dispatcher_type: str = "alltoall"
    """MoE: megatron's token dispatcher, ``alltoall`` or ``allgather`` (both run on gloo)."""

    moe_expert_capacity_factor: Optional[float] = None
    """MoE: ``null`` = no token dropping; else each expert takes at most ``ceil(factor x tokens x
    moe_topk / num_experts)`` routing slots per microbatch and drops those of smallest weight."""

    partition: str = "local"
    """Memory-parallel table sharding: ``local`` (whole table on every rank), ``number`` (rows
    split), ``dimension`` (columns split) or ``auto`` (``rmt-plan comm``'s forward+backward choice
    for this run's tokens, top-m, IVE and cores). Only UltraMem/PKM tables shard."""

    group_size: int = 0
    """Ranks per memory-parallel group; 0 = all DP x TP ranks of the stage; must divide DP x TP.
    Smaller groups are replicas."""

    owner_reduce: bool = False
    """Number-wise: the row owners pool and send partial sums back (cheaper when top-m > group
    size). Needs ``partition`` ``number`` or ``auto``."""

    async_stream: bool = False
    """Run a memory layer placed ``i:j`` (retrieval, lookup, collectives) from layer i's output
    alongside layers i+1..j, joined at layer j; its backward runs alongside the dense backward of
    layers j..i+1."""


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
            what = "the mixer has no position ids" if m.arch == "mixer" else (
                f"model.position '{m.position}' depends on token distances only")
            raise ConfigError(f"data.reset_position_ids has no effect here ({what}); set "
                              f"data.reset_attention_mask to compute every document as if alone")


def validate_recompute(config: RMTConfig, stages: int) -> None:
    """``train.recompute_*``: megatron's rules (``TransformerConfig.__post_init__``), checked
    before any process group exists, plus the span sizes its uniform method needs."""
    t, m = config.train, config.model
    if t.recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(f"train.recompute_granularity must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, "
                          f"got '{t.recompute_granularity}'")
    if t.recompute_granularity != "full":
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(t, key) is not None:
                raise ConfigError(f"train.{key} applies to train.recompute_granularity 'full' only "
                                  f"(got '{t.recompute_granularity}'); set it to null")
        if t.recompute_granularity == "selective" and m.arch == "mixer":
            raise ConfigError("train.recompute_granularity 'selective' recomputes core attention, which the mixer "
                              "does not have; use 'full'")
        return
    if t.recompute_method not in ("uniform", "block"):
        raise ConfigError(f"train.recompute_granularity 'full' needs train.recompute_method 'uniform' or 'block', "
                          f"got {t.recompute_method!r}")
    per_chunk = m.num_layers // stages
    n = t.recompute_num_layers
    if n is None or not 1 <= n <= per_chunk:
        raise ConfigError(f"train.recompute_num_layers must lie in [1, {per_chunk}] (the layers per model chunk) "
                          f"with train.recompute_granularity 'full', got {n}")
    if t.recompute_method == "uniform" and per_chunk % n:
        raise ConfigError(f"train.recompute_num_layers ({n}) must divide the layers per model chunk ({per_chunk}) "
                          f"with train.recompute_method 'uniform'")
    if config.memory.type == "ultramem_v2":
        raise ConfigError("train.recompute_granularity 'full' does not take memory.type 'ultramem_v2' yet: its "
                          "memory layer reads the FFN's input inside the recomputed layer, which the "
                          "recomputation does not relink (use 'selective', or UltraMem v1)")


def validate_sequence_parallel(config: RMTConfig) -> None:
    """``parallel.sequence_parallel``: megatron's GPTModel shards the sequence between its TP
    linears; the other architectures' layers have no sequence-parallel mappings."""
    p, m = config.parallel, config.model
    if not p.sequence_parallel:
        return
    if p.tensor_model_parallel_size < 2:
        raise ConfigError("parallel.sequence_parallel shards the sequence over the tensor-parallel ranks and needs "
                          "parallel.tensor_model_parallel_size >= 2")
    if m.arch != "transformer":
        raise ConfigError(f"parallel.sequence_parallel needs model.arch 'transformer' (megatron's GPTModel): the "
                          f"{m.arch}'s layers have no sequence-parallel all-gather / reduce-scatter mappings")
    if m.seq_length % p.tensor_model_parallel_size:
        raise ConfigError(f"model.seq_length ({m.seq_length}) must be divisible by "
                          f"parallel.tensor_model_parallel_size ({p.tensor_model_parallel_size}) with "
                          f"parallel.sequence_parallel")
    if config.memory.type == "ultramem_v2":
        raise ConfigError("parallel.sequence_parallel does not take memory.type 'ultramem_v2' yet: its memory "
                          "layer reads the FFN's sequence-sharded input, a path not tested against the "
                          "single process")


def validate(config: RMTConfig, world_size: Optional[int] = None) -> RMTConfig:
    """Reject impossible settings with one sentence (:class:`ConfigError`). Returns ``config``.
    The model code (torch, megatron-core) is imported only for the architecture's own checks,
    after the generic ones, so most mistakes are reported at once."""
    world_size = world_size_from_env() if world_size is None else world_size
    m, p, d, t = config.model, config.parallel, config.data, config.train
    _positive(config, [
        "model.num_layers", "model.hidden_size", "model.num_attention_heads",
        "model.ffn_hidden_size", "model.seq_length", "model.vocab_size",
        "model.make_vocab_size_divisible_by", "model.init_std", "model.embedding_init_std", "model.layernorm_epsilon",
        "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
        "parallel.virtual_pipeline_model_parallel_size", "parallel.data_parallel_size",
        "parallel.timeout_minutes", "parallel.join_timeout_minutes",
        "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size",
        "data.bpe_vocab_size", "train.steps",
        "train.micro_batch_size", "train.global_batch_size", "train.lr", "train.log_interval",
        "train.eval_interval", "train.threads", "train.exit_interval",
    ])
    if t.host_heap_retain_mib < 0:
        raise ConfigError(f"train.host_heap_retain_mib must be >= 0, got {t.host_heap_retain_mib}")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"model.normalization must be 'LayerNorm' or 'RMSNorm', got '{m.normalization}'")
    from rmt.models.activation import ACTIVATIONS

    if m.activation is not None and m.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation must be one of {', '.join(ACTIVATIONS)} (or null for the "
                          f"architecture's own), got '{m.activation}'")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must lie in [0, 1), got {m.dropout}")
    from rmt.models.attention import KERNELS

    if m.attention_kernel not in KERNELS:
        raise ConfigError(f"model.attention_kernel must be one of {', '.join(KERNELS)}, got '{m.attention_kernel}'")
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
    if t.overlap_param_gather and not (t.distributed_optimizer and t.overlap_grad_reduce):
        raise ConfigError("train.overlap_param_gather needs train.distributed_optimizer and "
                          "train.overlap_grad_reduce (megatron-core gathers the parameters only "
                          "for its distributed optimizer, behind the gradient reduction)")
    if t.overlap_param_gather and t.ema_decay is not None:
        raise ConfigError("train.overlap_param_gather leaves the updated weights to be gathered during the "
                          "next step's forward, but train.ema_decay averages them right after each step: "
                          "set one of them only")
    validate_recompute(config, stages)
    validate_sequence_parallel(config)
    if t.weight_decay_mode not in ("lr", "schedule"):
        raise ConfigError(f"train.weight_decay_mode must be 'lr' or 'schedule', got '{t.weight_decay_mode}'")
    if t.decay_rmt_keys and m.arch != "rmt":
        raise ConfigError(f"train.decay_rmt_keys applies to model.arch 'rmt' (its key matrices), not '{m.arch}'")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"train.lr_decay_style must be 'cosine', 'linear' or 'constant', got '{t.lr_decay_style}'")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must not be negative, got {t.warmup_steps}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}")
    for key in ("lr_curriculum_decay", "lr_target_decay", "lr_plateau_decay"):
        if not 0.0 < getattr(t, key) <= 1.0:
            raise ConfigError(f"train.{key} must lie in (0, 1], got {getattr(t, key)}")
    if t.lr_plateau_patience <= 0:
        raise ConfigError(f"train.lr_plateau_patience must be positive, got {t.lr_plateau_patience}")
    if t.ema_decay is not None and not 0.0 < t.ema_decay < 1.0:
        raise ConfigError(f"train.ema_decay must lie in (0, 1) or be null, got {t.ema_decay}")
    if not 0.0 <= t.lr_plateau_smoothing < 1.0:
        raise ConfigError(f"train.lr_plateau_smoothing must lie in [0, 1), got {t.lr_plateau_smoothing}")
    for key in ("lr_curriculum_decay", "lr_target_decay"):
        if getattr(t, key) < 1.0 and (d.task == "none" or d.curriculum_threshold is None):
            raise ConfigError(f"train.{key} needs a curriculum (data.task with data.curriculum_threshold)")
    if t.z_loss < 0 or t.weight_decay < 0 or t.clip_grad < 0:
        raise ConfigError("train.z_loss, train.weight_decay and train.clip_grad must not be negative")
    if t.eval_iters < 0:
        raise ConfigError(f"train.eval_iters must not be negative, got {t.eval_iters} (0 disables validation)")
    if t.save_interval < 0:
        raise ConfigError(f"train.save_interval must not be negative, got {t.save_interval}")
    if t.save_interval and not t.save:
        raise ConfigError("train.save_interval is set but train.save (the checkpoint directory) is not")
    if t.keep_checkpoints < 0:
        raise ConfigError(f"train.keep_checkpoints must not be negative, got {t.keep_checkpoints} (0 keeps all)")
    # train.load equal to train.save is the resume directory itself, which a first start lacks.
    same = t.save is not None and t.load is not None and os.path.realpath(t.load) == os.path.realpath(t.save)
    if t.load is not None and not same and not os.path.isdir(t.load):
        raise ConfigError(f"train.load directory '{t.load}' does not exist")
    from rmt.data.blend import blend_prefixes, data_blends

    blends = data_blends(d)
    if blends is not None:
        for prefix in blend_prefixes(blends):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"data.path '{prefix}' has no '{prefix}{ext}' (run rmt-preprocess first)")
        from rmt.data.metadata import adopt_dataset_tokenizer

        adopt_dataset_tokenizer(config, blend_prefixes(blends))
    if d.tokenizer not in (None, "byte", "bpe") and not os.path.exists(d.tokenizer):
        raise ConfigError(
            f"data.tokenizer must be 'byte', 'bpe' or a path to a HF tokenizer; '{d.tokenizer}' does not exist")
    try:
        split = [float(x) for x in d.split.split(",")]
    except ValueError:
        split = []
    if len(split) != 3 or any(x < 0 for x in split) or split[0] <= 0:
        raise ConfigError(f"data.split must be three non-negative weights 'train,valid,test', got '{d.split}'")
    if t.eval_iters and blends is not None and "train" in blends:
        if "valid" not in blends:
            raise ConfigError("train.eval_iters > 0 with data.train_path needs data.valid_path "
                              "(or train.eval_iters=0)")
    elif t.eval_iters and split[1] <= 0:
        raise ConfigError("data.split gives no validation data but train.eval_iters > 0")
    from rmt.models.build import registered_archs, validate_arch

    archs = registered_archs()
    if m.arch not in archs:
        raise ConfigError(f"model.arch '{m.arch}' is not a known architecture; choose one of: {', '.join(archs)}")
    validate_arch(config)
    validate_documents(config)
    if d.task != "none":
        from rmt.data.tasks import validate_task

        validate_task(config)
    from rmt.memory.validate import validate_memory

    validate_memory(config, world_size)
    return config
