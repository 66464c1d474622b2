"""Bytes one rank of a sharded UltraMem memory table sends per step, and the cheaper partition.

Torch-free: the tables (:mod:`rmt.memory.table`, ``memory.partition: auto``) choose their
partition with it, and the planner (``rmt-plan comm``, :mod:`rmt.planner.time`) counts with it.

The memory table of ``N`` slots x ``v_dim`` columns is sharded over a memory-parallel
group of ``P`` ranks (UltraMem paper, Appendix C). Each rank holds ``T`` tokens per step
(``T`` = batch size x sequence length on this rank, the paper's ``bs``), each token
retrieves ``K`` = top-m slots with scores.

Partitions (Appendix D, Fig. 8):

``number`` (rows split)
    all-to-all of the indices to the row owners, lookup, all-to-all of the looked-up rows
    back, weighted-sum pooling at the requester. With ``owner_reduce`` the scores travel
    with the indices and the owner pools: it sends back one dense partial sum
    ``[T, E, v_dim]`` per requester.
``dimension`` (columns split)
    all-gather of indices and scores, lookup-reduce on the local column slice for all
    ``P * T`` tokens of the group, all-to-all of the pooled slices back to the requesters.

Conventions (binding for the implementation that must send exactly these bytes):

* **Bytes sent by one rank** = bytes this rank puts on the wire to *other* ranks; the
  chunk a collective keeps locally is excluded. For an all-to-all of ``X`` bytes spread
  evenly over ``P`` destinations that is ``X (P-1)/P``; for an all-gather of an ``X``-byte
  contribution it is ``X (P-1)``; for a reduce-scatter of a ``P X``-byte buffer it is
  ``X (P-1)``. This is the convention under which Appendix D's formulas hold.
* **Received == sent.** For all-gathers, reduce-scatters and the dense all-to-alls (pooled
  slices, owner-side partial sums, their gradients) every rank receives exactly what it
  sends. Number-wise index/row/score all-to-alls depend on where the indices fall: the
  formulas are the expectation with owners drawn uniformly, exact (and received ==
  sent) when each rank's requested rows are spread evenly, ``R/P`` per owner.
* **Backward** sends the gradient of every floating-point tensor the forward received,
  in the forward tensor's dtype, back along the reverse route (rows -> row grads,
  pooled slices -> pooled grads, partial sums -> grads of partial sums, gathered scores
  -> reduce-scatter of score grads). Integer tensors (indices, block ids) have no
  gradient; the receiver keeps them from the forward.
* Ragged all-to-alls also exchange split sizes (``P - 1`` integers per rank); like
  Appendix D, that metadata is not counted.
* Non-integral expectations are rounded half up per collective; the totals are sums of
  the rounded collectives.

Tensor parallelism (``tensor_parallel = t > 1``): the ``t`` tensor-parallel ranks of a
memory-parallel group hold the same ``T`` tokens, so each looks up only its ``T / t`` of
them (every formula above with ``T / t``) and the pooled outputs are all-gathered over the
``t`` ranks (``tp_all_gather_pooled`` = ``activation_bytes T/t E v_dim (t-1)``); the backward
all-gathers the score gradients of the chunks (``tp_all_gather_score_grads`` =
``activation_bytes T/t K C (t-1)``). ``T`` must be divisible by ``t`` here (the tables take
ragged chunks; the planner counts the even split). Under megatron's sequence parallelism the
memory layers all-gather the sequence before they run (:mod:`rmt.memory.attach`), so ``T`` is
the whole sequence's tokens and all of the above holds unchanged; that gather (outside the
table, on the TP group) is not counted here.

Options beyond Appendix D:

* **Multi-core scoring** (Eq. 16-17): scores are ``[T, K, C]`` instead of ``[T, K]``;
  ``v_dim`` must be divisible by ``C``.
* **IVE** (Eq. 13-15): pooling is grouped by ``E`` virtual blocks, so every pooled
  tensor is ``[T, E, v_dim]``. The block id of a retrieved slot must reach whoever
  pools. By default (``block_id_bytes=0``) it is *derived*: the rank sends the virtual
  address ``block * N + row`` in place of the row index (one int, same size), and the
  receiver splits it, so IVE adds no index bytes (this needs ``E * N`` to fit the index
  type). ``block_id_bytes > 0`` counts block ids sent as a separate ``[T, K]`` tensor of
  that element size instead. Plain number-wise pools at the requester, where the block
  ids already are, so IVE does not change its volume at all.
* **Index dedup** (plain number-wise only): each rank requests every distinct row once,
  so ``R`` = unique rows per rank replaces ``T K`` for both the index all-to-all and the
  row all-to-all (the requester sums duplicate row gradients before sending them back).
  ``R`` is either ``unique_fraction * T * K`` (a measured fraction) or, given ``slots=N``,
  the expected distinct count when each token draws its ``K`` distinct slots uniformly:
  ``R = N (1 - (1 - K/N)^T)``. Uniform access is the worst case for dedup (skewed
  access only repeats rows more), so this is a conservative estimate; ``R <= T K``
  always. Owner-reduce needs every (token, slot, score) triple at the owner and the
  dimension partition needs every index for its column slice, so dedup does not apply
  to them (their bytes are unchanged).
"""

from __future__ import annotations

import math
from fractions import Fraction

PARTITIONS = ("number", "dimension")
PHASES = ("forward", "forward_backward")

_PHASE_KEY = {"forward": "forward_total", "forward_backward": "forward_backward_total"}


def _round(x: Fraction) -> int:
    """Round a non-negative exact quantity half up to whole bytes."""
    return math.floor(x + Fraction(1, 2))


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def validate(
    tokens,
    topm,
    v_dim,
    P,
    *,
    dedup=False,
    slots=None,
    unique_fraction=None,
    ive=1,
    cores=1,
    index_bytes=4,
    value_bytes=2,
    block_id_bytes=0,
    tensor_parallel=1,
    activation_bytes=None,
) -> None:
    """Raise ``ValueError`` with one sentence if the shape or options are impossible."""
    for name, value in (
        ("tokens", tokens),
        ("topm", topm),
        ("v_dim", v_dim),
        ("group size P", P),
        ("ive", ive),
        ("cores", cores),
        ("index_bytes", index_bytes),
        ("value_bytes", value_bytes),
        ("tensor_parallel", tensor_parallel),
    ):
        _positive_int(name, value)
    if activation_bytes is not None:
        _positive_int("activation_bytes", activation_bytes)
    if tokens % tensor_parallel:
        raise ValueError(
            f"tokens ({tokens}) must be divisible by tensor_parallel ({tensor_parallel}): "
            f"each tensor-parallel rank looks up tokens / tensor_parallel of them."
        )
    if isinstance(block_id_bytes, bool) or not isinstance(block_id_bytes, int) or block_id_bytes < 0:
        raise ValueError(f"block_id_bytes must be a non-negative integer, got {block_id_bytes!r}.")
    if v_dim % cores:
        raise ValueError(f"v_dim ({v_dim}) must be divisible by the number of scoring cores ({cores}).")
    if slots is not None:
        _positive_int("slots", slots)
        if topm > slots:
            raise ValueError(f"top-m ({topm}) cannot exceed the number of slots ({slots}).")
        if ive * slots > 2 ** (8 * index_bytes - 1) - 1:
            raise ValueError(
                f"ive x slots ({ive * slots}) virtual addresses do not fit {index_bytes}-byte "
                f"signed indices; use index_bytes=8."
            )
    if unique_fraction is not None:
        if not dedup:
            raise ValueError("unique_fraction is only meaningful with dedup.")
        if not 0 < unique_fraction <= 1:
            raise ValueError(f"unique_fraction must be in (0, 1], got {unique_fraction!r}.")
    if dedup and (slots is None) == (unique_fraction is None):
        raise ValueError("dedup needs exactly one of slots (uniform-access model) or unique_fraction (measured).")


def expected_unique(tokens: int, topm: int, slots: int) -> float:
    """Expected distinct rows among ``tokens`` draws of ``topm`` distinct uniform slots.

    A slot is missed by one token with probability ``1 - K/N``, so the expected number
    of distinct slots is ``N (1 - (1 - K/N)^T)``, computed stably with log1p/expm1.
    """
    validate(tokens, topm, 1, 1, slots=slots, index_bytes=8)  # the count, not an index dtype
    if topm == slots:
        return float(slots)
    return -slots * math.expm1(tokens * math.log1p(-topm / slots))


def _requested_rows(tokens, topm, slots, unique_fraction) -> Fraction:
    if unique_fraction is not None:
        return Fraction(unique_fraction) * tokens * topm
    return Fraction(expected_unique(tokens, topm, slots))


def comm_volume(
    partition: str,
    tokens: int,
    topm: int,
    v_dim: int,
    P: int,
    *,
    dedup: bool = False,
    slots: int | None = None,
    unique_fraction: float | None = None,
    owner_reduce: bool = False,
    ive: int = 1,
    cores: int = 1,
    index_bytes: int = 4,
    value_bytes: int = 2,
    block_id_bytes: int = 0,
    tensor_parallel: int = 1,
    activation_bytes: int | None = None,
) -> dict:
    """Bytes one rank sends per step, per collective, for one partition (Appendix D).

    ``partition`` is ``"number"`` or ``"dimension"``; ``tokens`` = T tokens on this rank,
    ``topm`` = K, ``v_dim`` = D, ``P`` = memory-parallel group size. ``owner_reduce``
    and ``dedup`` affect only the number partition (dedup only without owner_reduce),
    see the module docstring for every convention (and for ``tensor_parallel``).
    ``value_bytes`` is the table's element size: the looked-up rows and their gradients;
    ``activation_bytes`` (default ``value_bytes``, Appendix D's single dtype) that of the
    scores, the pooled outputs and partial sums and their gradients: the lookup accumulates
    in the scores' dtype, so a bf16 table under fp32 training sends 2-byte rows but 4-byte
    scores and pooled slices.

    Returns ``{"forward": {collective: bytes}, "backward": {collective: bytes},
    "forward_total": int, "backward_total": int, "forward_backward_total": int}``.
    With no option set, ``forward`` holds exactly Appendix D's terms:
    number: ``all_to_all_indices`` = 4 T K (P-1)/P, ``all_to_all_values`` =
    2 T K D (P-1)/P; dimension: ``all_gather_indices`` = 4 T K (P-1),
    ``all_gather_scores`` = 2 T K (P-1), ``all_to_all_pooled`` = 2 T D (P-1)/P.
    """
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}.")
    validate(
        tokens,
        topm,
        v_dim,
        P,
        dedup=dedup,
        slots=slots,
        unique_fraction=unique_fraction,
        ive=ive,
        cores=cores,
        index_bytes=index_bytes,
        value_bytes=value_bytes,
        block_id_bytes=block_id_bytes,
        tensor_parallel=tensor_parallel,
        activation_bytes=activation_bytes,
    )
    tp = tensor_parallel
    ab = value_bytes if activation_bytes is None else activation_bytes
    T, K, D, E, C = tokens // tp, topm, v_dim, ive, cores
    remote = Fraction(P - 1, P)
    send_block_ids = block_id_bytes > 0 and E > 1
    fwd: dict[str, Fraction] = {}
    bwd: dict[str, Fraction] = {}
    if partition == "number" and not owner_reduce:
        rows = _requested_rows(T, K, slots, unique_fraction) if dedup else Fraction(T * K)
        fwd["all_to_all_indices"] = index_bytes * rows * remote
        fwd["all_to_all_values"] = value_bytes * rows * D * remote
        bwd["all_to_all_value_grads"] = value_bytes * rows * D * remote
    elif partition == "number":
        fwd["all_to_all_indices"] = index_bytes * T * K * remote
        fwd["all_to_all_scores"] = ab * T * K * C * remote
        if send_block_ids:
            fwd["all_to_all_block_ids"] = block_id_bytes * T * K * remote
        fwd["all_to_all_partial_sums"] = Fraction(ab * T * E * D * (P - 1))
        bwd["all_to_all_partial_sum_grads"] = Fraction(ab * T * E * D * (P - 1))
        bwd["all_to_all_score_grads"] = ab * T * K * C * remote
    else:
        fwd["all_gather_indices"] = Fraction(index_bytes * T * K * (P - 1))
        fwd["all_gather_scores"] = Fraction(ab * T * K * C * (P - 1))
        if send_block_ids:
            fwd["all_gather_block_ids"] = Fraction(block_id_bytes * T * K * (P - 1))
        fwd["all_to_all_pooled"] = ab * T * E * D * remote
        bwd["all_to_all_pooled_grads"] = ab * T * E * D * remote
        bwd["reduce_scatter_score_grads"] = Fraction(ab * T * K * C * (P - 1))
    if tp > 1:
        fwd["tp_all_gather_pooled"] = Fraction(ab * T * E * D * (tp - 1))
        bwd["tp_all_gather_score_grads"] = Fraction(ab * T * K * C * (tp - 1))
    forward = {name: _round(v) for name, v in fwd.items()}
    backward = {name: _round(v) for name, v in bwd.items()}
    f, b = sum(forward.values()), sum(backward.values())
    return {
        "forward": forward,
        "backward": backward,
        "forward_total": f,
        "backward_total": b,
        "forward_backward_total": f + b,
    }


def plan_comm(tokens: int, topm: int, v_dim: int, P: int, *, phase: str = "forward", **options) -> dict:
    """Both partitions and the choice: the ``rmt-plan comm`` JSON document.

    ``options`` are :func:`comm_volume`'s keyword options. ``number_bytes`` and
    ``dimension_bytes`` are the ``phase`` totals (``"forward"``: Appendix D's volume;
    ``"forward_backward"``: a training step); ``choice`` is the smaller, ``"dimension"``
    on a tie; ``ratio`` = number_bytes / dimension_bytes (``None`` when P = 1);
    ``collectives`` maps each partition to its :func:`comm_volume` result.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}.")
    vols = {p: comm_volume(p, tokens, topm, v_dim, P, **options) for p in PARTITIONS}
    n, d = vols["number"][_PHASE_KEY[phase]], vols["dimension"][_PHASE_KEY[phase]]
    return {
        "number_bytes": n,
        "dimension_bytes": d,
        "choice": "number" if n < d else "dimension",
        "ratio": n / d if d else None,
        "phase": phase,
        "collectives": vols,
    }


def choose_partition(tokens: int, topm: int, v_dim: int, P: int, *, phase: str = "forward", **options) -> str:
    """``"number"`` or ``"dimension"``: the partition sending fewer bytes in ``phase``.

    Ties (including P = 1, where nothing is sent) go to ``"dimension"``.
    """
    return plan_comm(tokens, topm, v_dim, P, phase=phase, **options)["choice"]


def boundary_v_dim(
    topm: int,
    P: int,
    *,
    ive: int = 1,
    cores: int = 1,
    index_bytes: int = 4,
    value_bytes: int = 2,
    activation_bytes: int | None = None,
) -> float:
    """The v_dim where plain number-wise and dimension-wise forward volumes are equal.

    Setting Appendix D's totals equal, ``(ib K + vb K D)(P-1)/P = (P-1)(ib K + ab K C)
    + ab E D (P-1)/P`` (``ab``: ``activation_bytes``, default ``vb``), gives
    ``D* = K (P (ib + ab C) - ib) / (vb K - ab E)``; with int32, bf16, C = E = 1 that is
    ``K (3P - 2) / (K - 1)``. Number-wise is cheaper exactly when ``v_dim < D*``.
    Independent of T. Returns ``math.inf`` when ``vb K <= ab E`` (number-wise is then
    always cheaper).
    """
    ab = value_bytes if activation_bytes is None else activation_bytes
    if value_bytes * topm <= ab * ive:
        return math.inf
    return topm * (P * (index_bytes + ab * cores) - index_bytes) / (value_bytes * topm - ab * ive)
