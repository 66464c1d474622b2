"""What one rank computes in a training step, kernel by kernel: the work the step-time model
(:mod:`rmt.planner.time`) prices with a hardware profile (:mod:`rmt.planner.hardware`).

A :class:`Kernels` collects, for one phase (a forward or a backward of one micro-batch of a
model chunk, a memory layer, the optimizer step), the GEMMs ``[m, k] @ [k, n]``, the fused
attention FLOPs, the memory-bound operations by their bytes read and written (norms,
activations, softmaxes, residual additions, layouts for the attention kernel, the cross
entropy, the optimizer's passes), the lookup-reduce kernels by the bytes of value rows they
gather or scatter, the top-k selections by their elements, and the operations the host issues.

Per layer on a tensor-parallel rank of ``t`` (``T`` tokens of the micro-batch, ``T'`` = ``T/t``
under sequence parallelism, ``b`` bytes of ``train.precision``):

* transformer (megatron's local spec): GEMMs ``[T, D] @ [D, 3A/t]``, ``[T, A/t] @ [A/t, D]``,
  ``[T, D] @ [D, F/t]``, ``[T, F/t] @ [F/t, D]``; attention ``4 T s A/t`` FLOPs (every ``s x s``
  pair: rmt passes an explicit causal mask, so the kernel skips none), or with
  ``model.attention_kernel: megatron`` the same as batched GEMMs and the passes of an unfused
  softmax, under ``megatron_fused`` one fused softmax pass (:func:`core_attention`); memory-bound: two norms
  ``2 T' D b`` each, two bias-adds with the residual ``3 T' D b`` each (and with ``model.dropout``
  their dropouts, priced by their elements too: the output and the mask or noise written), the GELU ``2 T F/t b``, the attention's layout copies
  (q, k, v into the kernel's ``[b, h, s, d]`` and the context back, ``8 T A/t b``), RoPE on q and
  k ``4 T A/t b``; with ``G`` key-value heads of width ``Dh`` (grouped-query attention) the first
  GEMM is ``(H + 2G) Dh/t`` wide, RoPE rotates ``2 T (A + G Dh)/t b``, and the core attention
  repeats the keys and values to their query heads (``T (G Dh + A)/t b`` each); a gated feed-forward layer's first
  GEMM is ``2F/t`` wide, and it adds the linear half's offset ``2 T F/t b`` and the product
  ``3 T F/t b``;
* RMT (:mod:`rmt.models.rmt`): the reads ``[T Dv, Dk] @ [Dk, 3R/t]`` and ``[T Dv, Dk] @ [Dk, R]``
  (their norm fused: one read of the residual matrix, ``T Dk Dv b`` each), the writes
  ``[T Dv, R] @ [R, Dk]`` (reading and writing the residual matrix, ``2 T Dk Dv b`` each), the
  FFN ``[T, R Dv] @ [R Dv, F/t]`` and back, the GELU, and attention over ``R/t`` heads of ``Dv``
  in fp32;
* the backward of every GEMM is its two GEMMs of the same FLOPs (the input's gradient and the
  weight's), of the attention 2.5x its forward FLOPs (FlashAttention's count), of a memory-bound
  operation twice its bytes; each layer's weight gradient is added into megatron's fp32 gradient
  buffer (``12`` bytes an element: two reads, a write) once per micro-batch;
* the first stage gathers the embedding (and scatters its gradient into an fp32 buffer of the
  rank's vocabulary shard); the last stage runs the final norm, the logits GEMM
  ``[T, D] @ [D, Vp/t]`` and the vocab-parallel cross entropy in fp32 (six passes over the logits
  forward, four backward; the logits' cast under bf16).

Memory layers (UltraMem, UltraMemV2, PKM; :class:`rmt.memory.layer.MemorySpec`): the norm and
causal convolution, the query GEMM, the key scores of every head and side ``[T, Kd] @ [Kd, n]``,
the TDQKR top-k selections (``c = min(2m, n)`` of the ``n`` keys per side and rank, then ``m`` of
the ``c^2`` candidates), the lookup-reduce of ``T H m`` value rows (its bytes at the profile's
lookup rate), the projection; backward the same GEMMs twice, the scatter of the row gradients,
and the value tables' optimizer: AdamW on the dense gradient (``4`` bytes an element to
materialize it, ``16`` more where megatron's DDP buffers it, a norm ``4``, the clip ``8``, the
fused AdamW ``28``), the unfused row-wise optimizers on the touched rows (the sparse gradient's
rows, their coalescing, and ``U`` rows stepped: ``3 b + 16`` bytes an element for SparseAdam,
``3 b`` and 8 bytes a row for row-wise Adagrad), or the fused step inside the backward
(``U`` rows at the lookup's backward rate). ``U`` is the expected distinct rows of uniform
access (:func:`rmt.memory.comm_volume.expected_unique`, an upper bound: skewed access repeats rows).
MoE: the router GEMM and ``k`` experts' two GEMMs per routed token.

The dense optimizer step per element the rank steps (``1/DP`` of them with the distributed
optimizer): the gradient norm (4 bytes), the clip (8), AdamW: megatron-core without apex or
Transformer Engine steps with torch's foreach AdamW on a GPU, eight passes (80 bytes an element),
and with torch's fused form on a CPU (:func:`rmt.training.optimizer._fused_on_cpu`: 28 bytes);
bf16 adds the fp32 main copy's cast back (6 bytes). Every element of the rank's gradient buffer is
zeroed once a step (4 bytes) and, with data parallelism, scaled before its reduction (8 bytes).

Host operations per layer (counted by tracing a tiny model's step under a ``TorchDispatchMode``:
every aten operation dispatched, views included; ``tests/test_planner_time.py`` counts them
again): :data:`LAYER_OPS` and the kernels' and recomputation's more (:func:`layer_ops`),
:data:`MEMORY_LAYER_OPS`, :data:`MICROBATCH_OPS`, :data:`STEP_OPS`; a third of a layer's and a
micro-batch's in its forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Tuple

from rmt.memory.byte_sizes import DTYPE_BYTES
from rmt.planner.flops import fc1_width, qkv_width
from rmt.planner.hardware import Profile, attention_seconds, elementwise_seconds, gemm_seconds, memory_seconds
from rmt.planner.kernel_paths import attention_path, dropout_mask_bytes, drops_embedding, materializes_scores

LAYER_OPS = {"transformer": 129, "rmt": 156, "recurrent": 129, "mixer": 176}
"""Operations the host issues per layer and micro-batch, forward and backward, with torch's fused
attention (the recurrent transformer's per application of its layer, :func:`layer_ops`)."""
ATTENTION_OPS = {"rmt": 0, "none": 0, "sdpa": 0, "math": 39, "megatron": 35, "megatron_fused": 35}
"""More per layer by the core attention's path (:mod:`rmt.planner.kernel_paths`): torch's
unfused math path under dropout with its attention dropout, megatron-core's attention (counted
the same for ``megatron_fused``, whose fused softmax was not traced)."""
SELECTIVE_OPS = {"rmt": 8, "none": 0, "sdpa": 21, "math": 42, "megatron": 30, "megatron_fused": 30}
"""More per layer under selective recomputation (the core attention run again), by path."""
GROUPED_QUERY_OPS = {"sdpa": 15, "math": 16, "megatron": 16, "megatron_fused": 16}
"""More per layer under grouped-query attention, by the core attention's path: the keys and
values repeated to the query heads and their gradients summed back (traced)."""
GROUPED_QUERY_RECOMPUTE_OPS = {"sdpa": 9, "math": 9, "megatron": 8, "megatron_fused": 8}
"""More per layer when selective recomputation repeats them again (traced; ``math``, the same
module as ``sdpa``, taken as its)."""
LINEAR_BIAS_OPS = 23
"""Fewer per layer without the linears' biases (``model.add_bias_linear: false``): their adds,
and their gradients' sums (traced)."""
GATED_FFN_OPS = 6
"""More per layer in a gated feed-forward layer: the halves split, the offset added, their
product, and those operations' gradients (traced)."""
DROPOUT_OPS = 5
"""Per dropout, forward and backward, on a CPU (torch's noise drawn, scaled and applied); counted
the same on a GPU. A layer has two (and megatron's attention one more, run again under selective
recomputation: :data:`DROPOUT_RECOMPUTE_OPS`); the transformer's and recurrent transformer's
embedding one a micro-batch."""
DROPOUT_RECOMPUTE_OPS = 4
"""More per layer when selective recomputation runs megatron's attention dropout again."""
RECURRENT_FEWER_OPS = 6
"""Fewer per recurrent layer than its applications of the layer issue (its parameters' gradient
hooks run once a layer, its windows' masks and mixing once a window)."""
MEMORY_LAYER_OPS = 370
"""Per UltraMem / PKM / UltraMemV2 / MoE layer and micro-batch, forward, backward and its step."""
MICROBATCH_OPS = {"transformer": 134, "rmt": 177, "recurrent": 129, "mixer": 119}
"""Per micro-batch besides the layers: the batch to the device, the embedding, the loss, the
schedule's calls."""
STEP_OPS = {"transformer": 26, "rmt": 25, "recurrent": 26, "mixer": 26}
"""Per step besides the micro-batches: the gradient norm, the clip, the optimizer."""
FORWARD_SHARE = 1 / 3
"""The forward's share of a layer's operations."""

ATTENTION_BACKWARD = 2.5
"""Attention backward FLOPs over its forward's (FlashAttention: five GEMMs of the forward's two,
the score recomputation among them)."""
ADAMW_BYTES = {"gpu": 80, "cpu": 28}
"""Bytes an element of the dense optimizer's AdamW step (module docstring)."""
FUSED_ADAMW_BYTES = 28  # read parameter, gradient, two moments; write parameter, two moments
GRAD_ACCUMULATE_BYTES = 12  # main_grad += grad: two reads and a write of fp32


class Pass(NamedTuple):
    """``count`` memory-bound operations each reading and writing ``nbytes``: plain streams
    (``kind`` ``stream``) or elementwise operations of a kind of
    :data:`rmt.planner.hardware.ELEMENTWISE` over ``elements`` elements in ``dtype`` (``""``: the
    phase's)."""

    nbytes: float
    count: int
    kind: str = "stream"
    elements: float = 0.0
    dtype: str = ""


@dataclass
class Kernels:
    """The work of one phase (module docstring); every size in elements or bytes."""

    dtype: str
    gemms: List[Tuple[int, int, int, int]] = field(default_factory=list)
    attention_flops: float = 0.0
    attention_dtype: str = ""
    memory: List[Pass] = field(default_factory=list)
    lookup_bytes: float = 0.0
    topk_elements: float = 0.0
    ops: float = 0.0
    phase: str = "forward"

    def gemm(self, m: int, n: int, k: int, count: int = 1) -> None:
        if count and min(m, n, k) > 0:
            self.gemms.append((int(m), int(n), int(k), int(count)))

    def mem(self, nbytes: float, count: int = 1) -> None:
        """A memory-bound operation reading and writing ``nbytes``."""
        if count and nbytes > 0:
            self.memory.append(Pass(float(nbytes), int(count)))

    def elementwise(self, kind: str, elements: float, nbytes: float, count: int = 1, dtype: str = "") -> None:
        """An elementwise operation of ``kind`` (:data:`rmt.planner.hardware.ELEMENTWISE`) over
        ``elements`` elements, reading and writing ``nbytes``, computed in ``dtype`` (default the
        phase's)."""
        if count and nbytes > 0:
            self.memory.append(Pass(float(nbytes), int(count), kind, float(elements), dtype))

    def flops(self) -> float:
        """Matrix FLOPs of the phase: its GEMMs and attention."""
        return sum(2.0 * m * n * k * c for m, n, k, c in self.gemms) + self.attention_flops

    def backward(self) -> Kernels:
        """The backward of this forward phase: each GEMM's two gradient GEMMs, 2.5x the
        attention's FLOPs, twice each memory-bound operation's bytes over the same elements (ops
        counted by the caller)."""
        out = Kernels(self.dtype, attention_dtype=self.attention_dtype, phase="backward")
        for m, n, k, c in self.gemms:
            out.gemm(m, k, n, c)  # grad of the input: [m, n] @ [n, k]
            out.gemm(k, n, m, c)  # grad of the weight: [k, m] @ [m, n]
        out.attention_flops = ATTENTION_BACKWARD * self.attention_flops
        out.memory = [p._replace(nbytes=2 * p.nbytes) for p in self.memory]
        return out

    def add(self, other: Kernels) -> None:
        """Append ``other``'s work (same phase kinds) to this one."""
        self.gemms += other.gemms
        self.attention_flops += other.attention_flops
        self.attention_dtype = self.attention_dtype or other.attention_dtype
        self.memory += other.memory
        self.lookup_bytes += other.lookup_bytes
        self.topk_elements += other.topk_elements
        self.ops += other.ops

    def scaled(self, factor: int) -> Kernels:
        """This work ``factor`` times (``factor`` layers alike)."""
        out = Kernels(self.dtype, attention_dtype=self.attention_dtype, phase=self.phase)
        out.gemms = [(m, n, k, c * factor) for m, n, k, c in self.gemms]
        out.attention_flops = self.attention_flops * factor
        out.memory = [p._replace(count=p.count * factor) for p in self.memory]
        out.lookup_bytes = self.lookup_bytes * factor
        out.topk_elements = self.topk_elements * factor
        out.ops = self.ops * factor
        return out

    def _pass_seconds(self, profile: Profile, p: Pass) -> float:
        if p.kind == "stream":
            return memory_seconds(profile, p.nbytes)
        return elementwise_seconds(profile, p.kind, p.elements, p.nbytes, p.dtype or self.dtype, self.phase)

    def seconds(self, profile: Profile) -> Dict[str, float]:
        """The phase's time by component on ``profile``: device seconds of each kind, the host's
        issue seconds, and ``total`` (their larger where the host issues ahead of the device,
        their sum where one thread does both)."""
        parts = {
            "gemm": sum(c * gemm_seconds(profile, m, n, k, self.dtype) for m, n, k, c in self.gemms),
            "attention": attention_seconds(
                profile, self.attention_flops, self.attention_dtype or self.dtype, self.phase
            )
            if self.attention_flops
            else 0.0,
            "memory": sum(p.count * self._pass_seconds(profile, p) for p in self.memory),
            "lookup": self.lookup_bytes / profile.lookup_bandwidth[self.phase],
            "topk": self.topk_elements / profile.topk_rate,
        }
        device = sum(parts.values())
        issue = self.ops * profile.op_overhead_s
        parts["issue"] = issue
        parts["total"] = max(device, issue) if profile.async_launch else device + issue
        return parts


# -- dense layers -----------------------------------------------------------------------------------
def _bytes(config) -> int:
    return DTYPE_BYTES[config.train.precision]


def layer_tokens(config) -> int:
    """Token positions one dense layer processes per micro-batch: the recurrent transformer's
    windows of two blocks over every block are ``2 x`` the padded sequence, the others' the
    sequence."""
    m = config.model
    if m.arch == "recurrent":
        return 2 * config.train.micro_batch_size * m.block_width * -(-m.seq_length // m.block_width)
    return config.train.micro_batch_size * m.seq_length


def core_attention(config, tp: int, device: str) -> Kernels:
    """One layer's core attention on ``device``, forward, one micro-batch on a tensor-parallel
    rank (what selective recomputation runs again), by its path
    (:func:`rmt.planner.kernel_paths.attention_path`): a fused kernel's FLOPs (torch's
    ``scaled_dot_product_attention``; the RMT's in fp32), or under ``model.attention_kernel:
    megatron`` (and torch's math path, priced alike) megatron-core's ``DotProductAttention`` as
    rmt configures it (no fused softmax):
    per head and window the scores ``[w, d] @ [d, w]`` (``baddbmm``) and the context
    ``[w, w] @ [w, d]`` (``bmm``) as batched GEMMs, and over the ``E`` scores the causal mask
    filled in place and the softmax, both in fp32 (``attention_softmax_in_fp32``: under bf16 the
    scores cast up and the probabilities back), the dropout with ``model.dropout``; under
    ``megatron_fused`` one pass that reads the 16-bit scores and writes the probabilities where
    the fused kernel runs (:func:`fused_softmax_runs`), else the unfused passes. Under
    grouped-query attention either kernel first copies each key and value head to its query
    heads."""
    m = config.model
    b = _bytes(config)
    k = Kernels(config.train.precision)
    if m.arch == "rmt":
        k.attention_dtype = "fp32"
        k.attention_flops = 4.0 * config.train.micro_batch_size * m.seq_length**2 * m.dv * m.rank / tp
        return k
    if m.arch == "mixer":
        return k
    T, heads, d = layer_tokens(config), m.num_attention_heads // tp, m.hidden_size // m.num_attention_heads
    w = 2 * m.block_width if m.arch == "recurrent" else m.seq_length
    groups = (m.num_query_groups or m.num_attention_heads) // tp
    if groups < heads:  # each key and value head copied to its group's query heads, by either kernel
        k.mem(T * (groups + heads) * d * b, 2)
    if not materializes_scores(attention_path(config, device)):
        k.attention_flops = 4.0 * T * w * heads * d
        return k
    batches = heads * T // w
    k.gemm(w, w, d, batches)
    k.gemm(w, d, w, batches)
    E = heads * T * w
    if m.attention_kernel == "megatron_fused" and fused_softmax_runs(b, w, batches):
        k.elementwise("softmax", E, 2 * b * E, dtype="fp32")  # read the scores, write the probabilities
    else:
        if b != 4:
            k.mem(E * (b + 4), 2)
        k.mem(E * 9)  # read and write the fp32 scores, read the bool mask
        k.elementwise("softmax", E, 8 * E, dtype="fp32")
    if m.dropout > 0:  # read the probabilities, write them dropped and the mask or noise
        k.elementwise("dropout", E, E * (2 * b + dropout_mask_bytes(config, device)))
    return k


def fused_softmax_runs(b: int, w: int, batches: int) -> bool:
    """Whether megatron-core takes its fused scale-mask-softmax kernel (``model.attention_kernel:
    megatron_fused``; ``FusedScaleMaskSoftmax.is_kernel_available``) for ``batches`` score
    matrices of ``w x w`` in ``b``-byte elements: 16-bit scores, ``16 < w <= 4096``, ``w`` and
    ``batches`` multiples of 4."""
    return b == 2 and 16 < w <= 4096 and w % 4 == 0 and batches % 4 == 0


def layer_forward(config, tp: int, sp: bool, device: str) -> Kernels:
    """One dense layer's forward on a tensor-parallel rank of ``device``, one micro-batch (module
    docstring)."""
    m = config.model
    b = _bytes(config)
    s = m.seq_length
    T = config.train.micro_batch_size * s
    k = Kernels(config.train.precision)
    if m.arch == "rmt":
        Dk, Dv, R = m.dk, m.dv, m.rank
        F = m.ffn_hidden_size or 4 * R * Dv
        k.add(core_attention(config, tp, device))  # in fp32 (rmt.models.rmt)
        k.gemm(T * Dv, 3 * R // tp, Dk)  # attention read, norm fused
        k.gemm(T * Dv, Dk, R // tp)  # attention write
        k.gemm(T * Dv, R, Dk)  # FFN read
        k.gemm(T, F // tp, R * Dv)
        k.gemm(T, R * Dv, F // tp)
        k.gemm(T * Dv, Dk, R)  # FFN write
        k.mem(T * Dk * Dv * b, 2)  # the two norm-fused reads of the residual matrix
        k.mem(2 * T * Dk * Dv * b, 2)  # the two writes, residual added in place
        k.elementwise("gelu", T * F // tp, 2 * T * F // tp * b)
        k.mem(2 * 3 * T * Dv * R // tp * 4)  # q, k, v to fp32 for the attention, its context back
        return k
    D = m.hidden_size
    F = m.ffn_hidden_size or 4 * D
    A = D  # megatron's local spec: heads x head dim = hidden size
    H, G = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    KV = G * (D // H)  # the key (and the value) heads' width
    Ts = T // tp if sp else T
    if m.arch == "recurrent":
        T = Ts = layer_tokens(config)
    if m.arch == "mixer":  # token mixing: an N x N product per head, a GEMM over the heads
        k.gemm(T, D, D, 2)
        k.gemm(s, D, s, config.train.micro_batch_size)
    else:
        k.gemm(T, qkv_width(H, G, D // H) // tp, D)
        k.gemm(T, D, A // tp)
        k.add(core_attention(config, tp, device))
        k.mem(8 * T * A // tp * b)  # q, k, v into the kernel's layout, the context back
        if m.position == "rope":
            k.mem(2 * T * (A + KV) // tp * b)  # the queries and keys rotated
    k.gemm(T, fc1_width(F, m.gated_linear_unit) // tp, D)
    k.gemm(T, D, F // tp)
    k.elementwise("norm", Ts * D, 2 * Ts * D * b, 2)  # two norms
    k.mem(3 * Ts * D * b, 2)  # bias-adds with the residual
    if m.dropout > 0:  # their dropouts: the output and the mask or noise written
        k.elementwise("dropout", Ts * D, Ts * D * (b + dropout_mask_bytes(config, device)), 2)
    k.elementwise("gelu", T * F // tp, 2 * T * F // tp * b)
    if m.gated_linear_unit:  # the linear half plus megatron's offset, and the product
        k.mem(2 * T * F // tp * b)
        k.mem(3 * T * F // tp * b)
    return k


def layer_ops(config, device: str) -> float:
    """Host operations of one layer and micro-batch on ``device``, forward and backward: the
    architecture's, its attention path's more, its dropouts', selective recomputation's more by
    path; a recurrent layer issues them once per application of its layer (``blocks + 1``, eqs.
    6-8 of :mod:`rmt.models.recurrent`), less :data:`RECURRENT_FEWER_OPS`."""
    m = config.model
    path = attention_path(config, device)
    megatron = path in ("megatron", "megatron_fused")
    ops = LAYER_OPS[m.arch] + ATTENTION_OPS[path]
    grouped = m.num_query_groups is not None and m.num_query_groups < m.num_attention_heads
    if grouped:
        ops += GROUPED_QUERY_OPS[path]
    if m.gated_linear_unit:
        ops += GATED_FFN_OPS
    if not m.add_bias_linear:
        ops -= LINEAR_BIAS_OPS
    if m.dropout > 0:
        ops += DROPOUT_OPS * (3 if megatron else 2)
    if config.train.recompute_granularity == "selective":
        ops += SELECTIVE_OPS[path] + (DROPOUT_RECOMPUTE_OPS if megatron and m.dropout > 0 else 0)
        ops += GROUPED_QUERY_RECOMPUTE_OPS[path] if grouped else 0
    if m.arch == "recurrent":
        return ops * (-(-m.seq_length // m.block_width) + 1) - RECURRENT_FEWER_OPS
    return ops


def microbatch_ops(config) -> float:
    """Host operations per micro-batch besides the layers: :data:`MICROBATCH_OPS` and the
    embedding's dropout."""
    return MICROBATCH_OPS[config.model.arch] + (DROPOUT_OPS if drops_embedding(config) else 0)


def layer_param_elements(config, tp: int) -> int:
    """Weight elements of one dense layer on a tensor-parallel rank (the gradient buffer's)."""
    from rmt.planner.rank import Layout, _layer_params

    return _layer_params(config, Layout(tp=tp))


def embedding_work(config, tp: int, sp: bool, first: bool, last: bool, device: str) -> Tuple[Kernels, Kernels]:
    """The embedding (first stage, with its dropout) and the output layer with the loss (last
    stage) on ``device``: (forward, backward) of one micro-batch."""
    from rmt.models.vocab import padded_vocab_size

    m = config.model
    b = _bytes(config)
    T = config.train.micro_batch_size * m.seq_length
    width = m.dk * m.dv if m.arch == "rmt" else m.hidden_size
    Vt = padded_vocab_size(config) // tp
    fwd = Kernels(config.train.precision)
    bwd = Kernels(config.train.precision, phase="backward")
    rows = m.rank * m.dv if m.arch == "rmt" else m.hidden_size
    if first:
        fwd.mem(2 * T * rows * b)  # gather of the token rows (and the RMT's write into its matrix)
        if m.arch == "rmt":
            fwd.gemm(T * m.dv, m.dk, m.rank)
            bwd.gemm(T * m.dv, m.rank, m.dk, 2)
        bwd.mem(2 * T * rows * 4 + GRAD_ACCUMULATE_BYTES * Vt * rows)  # scatter, into the buffer
        if drops_embedding(config):
            Ts = T // tp if sp else T
            dropped = Ts * rows * (2 * b + dropout_mask_bytes(config, device))
            fwd.elementwise("dropout", Ts * rows, dropped)
            bwd.elementwise("dropout", Ts * rows, 2 * dropped)
    if last:
        Ts = T // tp if sp else T
        fwd.elementwise("norm", Ts * width, 2 * Ts * width * b)  # final norm
        bwd.elementwise("norm", Ts * width, 4 * Ts * width * b)
        if m.arch == "rmt":
            fwd.gemm(T * m.dv, m.rank, m.dk)
            bwd.gemm(T * m.dv, m.dk, m.rank, 2)
        fwd.gemm(T, Vt, rows)
        bwd.gemm(T, rows, Vt)
        bwd.gemm(rows, Vt, T)
        cast = T * Vt * (b + 4) if b != 4 else 0
        fwd.elementwise("softmax", T * Vt, 2 * T * Vt * 4, dtype="fp32")  # the cross entropy's exp
        fwd.mem(4 * T * Vt * 4 + cast)  # its other passes
        bwd.mem(4 * T * Vt * 4 + cast)
        bwd.mem(GRAD_ACCUMULATE_BYTES * Vt * rows)
    return fwd, bwd


# -- memory layers --------------------------------------------------------------------------------
def memory_layer_work(config, index: int, tokens: int) -> Tuple[Kernels, Kernels]:
    """(forward, backward) of memory layer ``index`` over ``tokens`` tokens on a rank (its
    lookups; module docstring), the value tables' optimizer not included."""
    mem = config.memory
    b = _bytes(config)
    fwd = Kernels(config.train.precision)
    T = tokens
    if mem.type == "moe":
        from rmt.memory.shapes import expert_hidden_size, memory_width

        W, F = memory_width(config), expert_hidden_size(config)
        fwd.gemm(T, mem.num_experts, W)
        fwd.gemm(T * mem.moe_topk, F, W)
        fwd.gemm(T * mem.moe_topk, W, F)
        fwd.mem(2 * T * mem.moe_topk * W * b, 2)  # the routed copies out and back
        fwd.elementwise("gelu", T * mem.moe_topk * F, 2 * T * mem.moe_topk * F * b)
        fwd.topk_elements = T * mem.num_experts
        bwd = fwd.backward()
        bwd.topk_elements = 0
        fwd.ops = FORWARD_SHARE * MEMORY_LAYER_OPS
        bwd.ops = (1 - FORWARD_SHARE) * MEMORY_LAYER_OPS
        return fwd, bwd
    from rmt.memory.byte_sizes import DTYPE_BYTES as VB
    from rmt.memory.layer import MemorySpec

    s = MemorySpec.from_config(config, index)
    W, H, Kd, r, E, C = s.hidden_size, s.num_heads, s.side_dim, s.tucker_rank, s.ive_blocks, s.num_cores
    n, m, Dv = s.grid, s.topk, s.value_dim
    vb = VB[mem.value_dtype]
    tucker = s.retrieval == "tucker"
    ranks = r if tucker else 1
    fwd.elementwise("norm", T * W, 2 * T * W * b)
    if s.version != 2:
        fwd.mem((s.conv_kernel + 1) * T * W * b)  # causal convolution
    sides = 2 if (s.version == 2 or not s.share_query) else 1
    fwd.gemm(T, H * sides * Kd, W)
    fwd.gemm(T, n * ranks, Kd // ranks if s.version != 2 else Kd, 2 * H)  # row and column key scores
    scores = T * H * 2 * ranks * n
    fwd.mem(2 * scores * 4)
    c = min(2 * m, n)
    fwd.topk_elements = scores + T * H * c * c
    rows = T * H * m
    fwd.lookup_bytes = rows * Dv * vb
    if s.version == 2 and s.pre_value_dim:
        fwd.lookup_bytes += rows * s.pre_value_dim * vb
        fwd.gemm(T, s.pre_value_dim, W)
    out = E * Dv if s.version != 2 else Dv
    if s.version == 2 or E > 1 or Dv != W:
        fwd.gemm(T, W, out)
    fwd.mem(2 * T * W * b)  # the output added to the residual
    bwd = fwd.backward()
    bwd.topk_elements = 0
    bwd.lookup_bytes = fwd.lookup_bytes + rows * 4 * C  # row gradients and the score gradients
    fwd.ops = FORWARD_SHARE * MEMORY_LAYER_OPS
    bwd.ops = (1 - FORWARD_SHARE) * MEMORY_LAYER_OPS
    return fwd, bwd


def table_optimizer_work(config, plan, microbatches: int, device: str) -> Tuple[Kernels, Kernels]:
    """The value tables' optimizer of one memory layer on a rank (``plan``: its
    :class:`rmt.planner.memory.TablePlan`): (inside the backward, per micro-batch; in the step)."""
    from rmt.memory.comm_volume import expected_unique

    mem = config.memory
    inside, step = Kernels("fp32", phase="backward"), Kernels("fp32")
    rows, cols = plan.shard_shape
    vb = DTYPE_BYTES[mem.value_dtype]
    lookups = plan.tokens // max(1, plan.tensor_parallel) * plan.topm * max(1, plan.group_size)
    if plan.partition == "number":
        lookups //= max(1, plan.group_size)  # a number-wise owner serves 1/P of the group's lookups
    unique = expected_unique(max(1, lookups // plan.topk), plan.topk, rows) if lookups else 0
    if mem.value_optimizer == "adamw":
        per = 4 + (16 if plan.ddp_buffered else 0) + 4 + 8 + FUSED_ADAMW_BYTES
        step.mem(per * rows * cols)
        return inside, step
    state = 3 * vb + 16 if mem.value_optimizer == "sparse_adam" else 3 * vb
    row_state = 0 if mem.value_optimizer == "sparse_adam" else 8
    touched = min(rows, unique * microbatches)
    if mem.fused_value_optimizer:
        inside.lookup_bytes = unique * (cols * state + row_state)
        return inside, step
    inside.mem(2 * lookups * cols * 4)  # the sparse gradient's rows, written and coalesced
    step.mem(touched * (cols * state + row_state))
    return inside, step


# -- optimizer ------------------------------------------------------------------------------------
def dense_optimizer_work(config, elements: int, stepped: int, dp: int, device: str) -> Kernels:
    """The dense optimizer's step on a rank holding ``elements`` gradient-buffer elements and
    stepping ``stepped`` of them (module docstring)."""
    k = Kernels("fp32")
    k.mem(4 * elements)  # the gradient buffer zeroed
    if dp > 1:
        k.mem(8 * elements)  # scaled before its reduction
    per = 4 + 8 + ADAMW_BYTES[device] + (6 if config.train.precision == "bf16" else 0)
    k.mem(per * stepped)
    return k
