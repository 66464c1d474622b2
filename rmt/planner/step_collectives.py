"""The collectives a training step issues besides the data-parallel gradient reduction, the
pipeline's sends and the memory layers' own: each as megatron-core and rmt issue it (kind, buffer
bytes, group), for :mod:`rmt.planner.time` to price.

**Tensor parallelism, per layer and micro-batch** (megatron-core's ``ColumnParallelLinear`` /
``RowParallelLinear`` and their mappings; ``T`` tokens, hidden ``D``, ``b`` bytes an element):

- a transformer layer, forward: each row-parallel output (attention's projection, the second MLP
  linear) all-reduced, ``T D b`` bytes; backward: each column-parallel input's gradient (QKV, the
  first MLP linear) all-reduced asynchronously beside its weight-gradient GEMM;
- under sequence parallelism, forward: an all-gather of the sequence-sharded input before each
  column-parallel linear and a reduce-scatter after each row-parallel one; backward: each
  reduce-scatter's gradient gathered, and each column-parallel linear's input gathered again
  (asynchronously, beside its input-gradient GEMM) and its input's gradient reduce-scattered
  (beside its weight-gradient GEMM);
- an RMT layer (:mod:`rmt.models.rmt`), forward: the attention's write summed over the ranks
  (the residual matrix, ``T Dk Dv b``) and the FFN's second linear (``T R Dv b``); backward: the
  copy-to region's sums of the residual matrix's and the norm gain's (``Dk Dv``) gradients, and
  the FFN's first linear's input gradient beside its weight-gradient GEMM;
- full recomputation runs the recomputed layers' forward collectives again in the backward;
- a memory layer under sequence parallelism gathers its input whole and its output's gradient.

**The edges**: the vocab-parallel embedding's output all-reduced (under sequence parallelism then
split, whose gradient is gathered); the output layer is a column-parallel linear (its input
gathered first under sequence parallelism) and the vocab-parallel cross entropy sums three fp32
values a token (:mod:`rmt.training.loss`).

**Once a step**: the losses every rank reports (:data:`REPORTED_LOSSES` fp64 values over the
world), the gradient norm's sum (fp32, over the model-parallel group; with the distributed
optimizer over the world), the sharded memory tables' norm over their group and, where the model
has tables, their norm over the pipeline stages, and under sequence parallelism the gradients of the parameters every
tensor-parallel rank holds whole (norms, row-parallel biases), summed in one all-reduce by
megatron-core's ``finalize_model_grads``.

``tests/test_planner_time.py`` counts these in traced steps of each layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from rmt.config import TABLE_TYPES
from rmt.memory.byte_sizes import DTYPE_BYTES
from rmt.planner.hardware import Profile, collective_seconds, gemm_seconds
from rmt.planner.rank import chunks_of, norm_params, stage_table_plan
from rmt.planner.step_work import layer_tokens

REPORTED_LOSSES = 2
"""fp64 means every rank reads after a step (``rmt.training.trainer.LOSSES``)."""
LOSS_SUMS = 3
"""fp32 sums a token of the vocab-parallel cross entropy: the max, the sum of exponentials, the
target's logit."""


@dataclass(frozen=True)
class Collective:
    """One collective: ``kind``, its whole buffer's bytes (an all-gather's gathered output, a
    reduce-scatter's input), its group's ``ranks`` ``stride`` apart, and for one issued
    asynchronously the GEMM ``(m, n, k)`` megatron-core runs while it is in flight."""

    kind: str
    nbytes: int
    ranks: int
    stride: int = 1
    beside: Optional[Tuple[int, int, int]] = None


def exposed_seconds(profile: Profile, collectives: List[Collective], dtype: str) -> float:
    """Seconds of ``collectives`` a rank waits for: all of each synchronous one; of an
    asynchronous one on a GPU what outlasts its GEMM (NCCL's kernels run beside it), on a CPU all
    of it (the rank's cores run both)."""
    total = 0.0
    for c in collectives:
        comm = collective_seconds(profile, c.kind, c.nbytes, c.ranks, c.stride)
        if c.beside is not None and profile.device == "gpu":
            comm = max(0.0, comm - gemm_seconds(profile, *c.beside, dtype))
        total += comm
    return total


def _column_parallel_backward(tp: int, sp: bool, nbytes: int, tokens: int, width: int, out: int):
    """The backward collectives of a column-parallel linear ``width -> out`` (``out`` this
    rank's columns) over ``tokens`` tokens whose input is ``nbytes``."""
    if sp:
        return [
            Collective("all_gather", nbytes, tp, beside=(tokens, width, out)),
            Collective("reduce_scatter", nbytes, tp, beside=(out, width, tokens)),
        ]
    return [Collective("all_reduce", nbytes, tp, beside=(out, width, tokens))]


def layer_collectives(config, tp: int, sp: bool, tokens: int) -> Dict[str, List[Collective]]:
    """One dense layer's tensor-parallel collectives for ``tokens`` tokens: ``forward`` and
    ``backward`` (module docstring)."""
    if tp == 1:
        return {"forward": [], "backward": []}
    m = config.model
    b = DTYPE_BYTES[config.train.precision]
    if m.arch == "rmt":
        matrix, hidden = tokens * m.dk * m.dv * b, tokens * m.rank * m.dv * b
        ffn = (m.ffn_hidden_size or 4 * m.rank * m.dv) // tp
        return {
            "forward": [Collective("all_reduce", matrix, tp), Collective("all_reduce", hidden, tp)],
            "backward": [Collective("all_reduce", matrix, tp), Collective("all_reduce", m.dk * m.dv * b, tp)]
            + _column_parallel_backward(tp, False, hidden, tokens, m.rank * m.dv, ffn),
        }
    D = m.hidden_size
    hidden = tokens * D * b
    columns = (3 * D // tp, (m.ffn_hidden_size or 4 * D) // tp)  # QKV, the first MLP linear
    backward = [c for w in columns for c in _column_parallel_backward(tp, sp, hidden, tokens, D, w)]
    if sp:
        forward = 2 * [Collective("all_gather", hidden, tp), Collective("reduce_scatter", hidden, tp)]
        return {"forward": forward, "backward": 2 * [Collective("all_gather", hidden, tp)] + backward}
    return {"forward": 2 * [Collective("all_reduce", hidden, tp)], "backward": backward}


def edge_collectives(config, tp: int, sp: bool, first: bool, last: bool) -> Dict[str, List[Collective]]:
    """The embedding's (``first``) and the output layer's and the loss's (``last``) tensor-parallel
    collectives of one micro-batch (module docstring)."""
    out = {"forward": [], "backward": []}
    if tp == 1:
        return out
    from rmt.models.vocab import padded_vocab_size

    m = config.model
    T = config.train.micro_batch_size * m.seq_length
    width = m.rank * m.dv if m.arch == "rmt" else m.hidden_size
    rows = T * width * DTYPE_BYTES[config.train.precision]
    if first:
        out["forward"].append(Collective("all_reduce", rows, tp))
        if sp:
            out["backward"].append(Collective("all_gather", rows, tp))
    if last:
        if sp:
            out["forward"].append(Collective("all_gather", rows, tp))
        out["forward"] += LOSS_SUMS * [Collective("all_reduce", 4 * T, tp)]
        out["backward"] += _column_parallel_backward(tp, sp, rows, T, width, padded_vocab_size(config) // tp)
    return out


def memory_layer_collectives(config, tp: int, sp: bool) -> Dict[str, List[Collective]]:
    """A memory layer's own tensor-parallel collectives on one micro-batch: under sequence
    parallelism its input gathered whole (every rank's replicated layer reads the whole
    sequence) and, backward, its output's gradient gathered (the output split back to the rank's
    share); none otherwise."""
    if tp == 1 or not sp:
        return {"forward": [], "backward": []}
    rows = layer_tokens(config) * config.model.hidden_size * DTYPE_BYTES[config.train.precision]
    return {"forward": [Collective("all_gather", rows, tp)], "backward": [Collective("all_gather", rows, tp)]}


def step_sums(config, layout, stage: int) -> List[Collective]:
    """The small collectives a rank of pipeline ``stage`` issues once a step (module docstring)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    world = tp * pp * dp
    out = [Collective("all_reduce", 8 * REPORTED_LOSSES, world)]
    if layout.distributed_optimizer:
        out.append(Collective("all_reduce", 4, world))
    else:
        out.append(Collective("all_reduce", 4, tp * pp, dp if pp > 1 else 1))
    plan = stage_table_plan(config, layout, stage)
    if plan is not None and plan.partition != "local" and plan.group_size > 1:
        out.append(Collective("all_reduce", 8, plan.group_size))
    if pp > 1 and config.memory.type in TABLE_TYPES:
        out.append(Collective("all_reduce", 8, pp, tp * dp))
    if layout.sequence_parallel:
        norm = norm_params(config)
        layers = sum(last - first + 1 for first, last in chunks_of(config, layout, stage))
        whole = layers * (2 * norm + 2 * config.model.hidden_size) + (norm if stage == pp - 1 else 0)
        out.append(Collective("all_reduce", 4 * whole, tp))
    return out
