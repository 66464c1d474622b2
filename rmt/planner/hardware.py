"""Hardware profiles of the step-time model (:mod:`rmt.planner.time`): what one device computes,
moves and sends per second, and how that falls with the size of the work.

A profile is a JSON object (``rmt-plan calibrate --out FILE`` writes one, ``--hardware FILE``
reads it) or the name of a shipped one (:mod:`rmt.planner.profiles`). Its fields:

``name``, ``device``
    a label; ``gpu`` or ``cpu`` (how kernels are issued, below).
``peak_flops``
    dense matrix FLOP/s per device for ``fp32`` and ``bf16`` (the training precisions).
``gemm_efficiency``
    per dtype, ``[[m, n, k, efficiency], ...]``: the achieved fraction of the peak of measured
    GEMMs ``[m, k] @ [k, n]`` (size classes); a GEMM takes the efficiency of the measured shape
    nearest to it in ``(log m, log n, log k)``. On a GPU a GEMM also pays its wave quantization
    (``ceil(tiles / units)`` waves of ``gemm_tile`` output tiles over ``units`` streaming
    multiprocessors) and never runs faster than its bytes allow (``(mk + kn + mn) b /
    bandwidth``): the GEMM's efficiency falls with its size through both. A GEMM of fewer tiles
    than processors splits its reduction over the idle ones (split-K, slices of at least
    :data:`SPLIT_K_DEPTH`).
``gemm_tile``, ``units``
    ``[rows, cols]`` of one output tile and the processors that run tiles side by side (a CPU
    rank: ``[1, 1]`` and 1, no quantization).
``attention_efficiency``
    per dtype, ``{"forward": e, "backward": e}``: the fraction of the peak the fused attention
    kernel reaches (its FLOPs: ``4 s_q s_k d`` per head forward, 2.5x that backward).
``memory_bandwidth``
    ``[[bytes, bytes/s], ...]``: the rate of a memory-bound operation that touches ``bytes``
    (norms, activations, softmax, residual additions, the optimizer step), interpolated like
    the GEMMs' (a CPU's caches make small operations faster than DRAM).
``elementwise_rate``
    per dtype, ``{kind: {"forward": elements/s, "backward": elements/s}}`` for the kinds
    :data:`ELEMENTWISE` (the GELU, a norm, a softmax, a dropout): the rate their arithmetic allows
    per element. Such an operation takes the longer of its bytes at ``memory_bandwidth`` and its
    elements at this rate: a GPU's is far above its bytes' (they are memory-bound), a CPU thread's
    far below (``erf``, ``exp``, the norms' reductions and the dropout's random draws are computed,
    not streamed).
``op_overhead_s``
    seconds the host spends issuing one operation (Python, dispatch, a kernel launch).
``async_launch``
    ``true`` on a GPU: the host issues kernels ahead of the device, so a run of kernels takes
    the longer of their device time and their issue time; ``false`` on a CPU, where the same
    thread does both, so the two add up.
``lookup_bandwidth``
    ``{"forward": B/s, "backward": B/s}``: bytes of gathered value rows per second of the
    lookup-reduce kernel (forward: the rows pooled; backward: the row gradients scattered).
``topk_rate``
    elements per second of the retrieval's top-k selections.
``collectives``
    ``{"intra": {...}, "inter": {...}}``, each ``{kind: {"alpha_s": s, "busbw": B/s}}`` for the
    kinds ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``p2p``: a
    collective over a group inside one node (``intra``) or across nodes takes
    ``alpha_s + factor x bytes / busbw`` with nccl-tests' bus-bandwidth factor of its kind
    (:func:`collective_seconds`).
``gpus_per_node``
    devices joined by the ``intra`` links.
``host_link``
    bytes/s per direction between a device and its host (tables in host memory).
``host_memory_bandwidth``
    bytes/s of the host's memory-bound work (the host tables' optimizer step).
``sources``
    per field, where its value comes from (a specification, a paper, a measurement).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

DTYPES = ("fp32", "bf16")
ELEMENTWISE = ("gelu", "norm", "softmax", "dropout")
"""The kinds of elementwise operation priced by their elements as well as their bytes."""
PHASES = ("forward", "backward")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
SPANS = ("intra", "inter")
FIELDS = (
    "name",
    "device",
    "peak_flops",
    "gemm_efficiency",
    "gemm_tile",
    "units",
    "attention_efficiency",
    "memory_bandwidth",
    "elementwise_rate",
    "op_overhead_s",
    "async_launch",
    "lookup_bandwidth",
    "topk_rate",
    "collectives",
    "gpus_per_node",
    "host_link",
    "host_memory_bandwidth",
    "sources",
)


@dataclass(frozen=True)
class Profile:
    """A validated hardware profile (module docstring)."""

    name: str
    device: str
    peak_flops: Dict[str, float]
    gemm_efficiency: Dict[str, List[List[float]]]
    gemm_tile: List[int]
    units: int
    attention_efficiency: Dict[str, Dict[str, float]]
    memory_bandwidth: List[List[float]]
    elementwise_rate: Dict[str, Dict[str, Dict[str, float]]]
    op_overhead_s: float
    async_launch: bool
    lookup_bandwidth: Dict[str, float]
    topk_rate: float
    collectives: Dict[str, Dict[str, Dict[str, float]]]
    gpus_per_node: int
    host_link: float
    host_memory_bandwidth: float
    sources: Dict[str, str]

    def to_dict(self) -> Dict:
        return {f: getattr(self, f) for f in FIELDS}


def _interpolate(table: Sequence[Sequence[float]], x: float) -> float:
    """``table``'s value at ``x``, linear in ``log x`` between its points, flat beyond them."""
    points = sorted(table)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return points[-1][1]


def bandwidth(profile: Profile, nbytes: float) -> float:
    """Bytes/s of a memory-bound operation touching ``nbytes``."""
    return _interpolate(profile.memory_bandwidth, max(nbytes, 1.0))


def memory_seconds(profile: Profile, nbytes: float) -> float:
    """Device seconds of a memory-bound operation that reads and writes ``nbytes`` in all."""
    return nbytes / bandwidth(profile, nbytes) if nbytes > 0 else 0.0


def elementwise_seconds(profile: Profile, kind: str, elements: float, nbytes: float, dtype: str, phase: str) -> float:
    """Device seconds of an elementwise operation of ``kind`` (:data:`ELEMENTWISE`) over
    ``elements`` elements that reads and writes ``nbytes``: the longer of its bytes at the
    memory bandwidth and its elements at the kind's rate."""
    return max(memory_seconds(profile, nbytes), elements / profile.elementwise_rate[dtype][kind][phase])


SPLIT_K_DEPTH = 512
"""The shallowest reduction slice cuBLAS gives one processor when it splits a GEMM's K over the
processors its few output tiles leave idle."""


def nearest_efficiency(table: Sequence[Sequence[float]], m: int, n: int, k: int) -> float:
    """The efficiency of the measured shape of ``table`` nearest to ``(m, n, k)`` in log space."""
    point = (math.log(m), math.log(n), math.log(k))

    def distance(row):
        return sum((math.log(a) - b) ** 2 for a, b in zip(row[:3], point))

    return min(table, key=distance)[3]


def gemm_seconds(profile: Profile, m: int, n: int, k: int, dtype: str) -> float:
    """Device seconds of one ``[m, k] @ [k, n]`` GEMM in ``dtype`` (module docstring)."""
    if min(m, n, k) <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    rate = profile.peak_flops[dtype] * nearest_efficiency(profile.gemm_efficiency[dtype], m, n, k)
    tm, tn = profile.gemm_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    if tiles < profile.units:  # split-K: a deep reduction spread over the idle processors
        tiles *= max(1, min(profile.units // tiles, k // SPLIT_K_DEPTH))
    waves = math.ceil(tiles / profile.units)
    quantized = flops * waves * profile.units / tiles
    b = 2 if dtype == "bf16" else 4
    return max(quantized / rate, memory_seconds(profile, (m * k + k * n + m * n) * b))


def attention_seconds(profile: Profile, flops: float, dtype: str, phase: str) -> float:
    """Device seconds of ``flops`` of fused attention in ``phase`` (``forward``/``backward``)."""
    return flops / (profile.peak_flops[dtype] * profile.attention_efficiency[dtype][phase])


#: nccl-tests' bus-bandwidth factor of each collective over ``p`` ranks: the bytes a rank's
#: busiest link carries per byte of the collective's buffer (all-reduce: the ring's reduce-scatter
#: and all-gather, 2 (p - 1) / p; all-gather and reduce-scatter: (p - 1) / p of the whole
#: buffer; all-to-all: the (p - 1) / p a rank sends away; a point-to-point send: 1).
def bus_factor(kind: str, p: int) -> float:
    if kind == "p2p":
        return 1.0
    if kind == "all_reduce":
        return 2.0 * (p - 1) / p
    return (p - 1) / p


def link(profile: Profile, kind: str, ranks: int, stride: int = 1) -> Dict[str, float]:
    """``{"alpha_s", "busbw"}`` of a collective of ``kind`` over ``ranks`` ranks ``stride`` apart
    (megatron-core orders its groups tensor-parallel innermost, then data-parallel, pipeline
    outermost): inside a node when they span at most ``gpus_per_node`` ranks; across nodes each
    node's ranks of the group send through their own NICs (one per GPU), so the group's
    ``min(ranks, gpus_per_node / stride)`` ranks a node multiply the one NIC's bus bandwidth, up
    to the node's own links."""
    intra = profile.collectives["intra"][kind]
    if ranks * stride <= profile.gpus_per_node:
        return intra
    inter = profile.collectives["inter"][kind]
    per_node = max(1, min(ranks, profile.gpus_per_node // stride))
    return {"alpha_s": inter["alpha_s"], "busbw": min(intra["busbw"], per_node * inter["busbw"])}


def collective_seconds(profile: Profile, kind: str, nbytes: float, ranks: int, stride: int = 1) -> float:
    """Seconds of one collective of ``kind`` over ``ranks`` ranks ``stride`` apart whose buffer
    is ``nbytes`` (an all-gather's and a reduce-scatter's whole, gathered buffer; an all-to-all's
    send buffer): ``alpha + bus_factor x nbytes / busbw``."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    lk = link(profile, kind, ranks, stride)
    return lk["alpha_s"] + bus_factor(kind, ranks) * nbytes / lk["busbw"]


def sent_seconds(profile: Profile, kind: str, sent: float, ranks: int, stride: int = 1) -> float:
    """Seconds of one collective in which each rank sends ``sent`` bytes to the others (the
    convention of :mod:`rmt.memory.comm_volume`, which is the bus bytes of nccl-tests' convention):
    ``alpha + sent / busbw``."""
    if ranks <= 1 or sent <= 0:
        return 0.0
    lk = link(profile, kind, ranks, stride)
    return lk["alpha_s"] + sent / lk["busbw"]


# -- loading and validation -------------------------------------------------------------------------
def default_profile_path() -> str:
    """Where ``rmt-plan calibrate`` writes by default and ``rmt-train`` looks for a profile of
    its machine: ``$RMT_HARDWARE_PROFILE``, else ``~/.cache/rmt/hardware-profile.json``."""
    return os.environ.get("RMT_HARDWARE_PROFILE") or os.path.join(
        os.path.expanduser("~"), ".cache", "rmt", "hardware-profile.json"
    )


def _positive(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"hardware profile field {where} must be a positive number, got {value!r}.")
    return float(value)


def _table(where: str, value, width: int = 2) -> List[List[float]]:
    what = "[size, value] pairs" if width == 2 else "[m, n, k, efficiency] rows"
    if not isinstance(value, list) or not value:
        raise ValueError(f"hardware profile field {where} must be a non-empty list of {what}.")
    out = []
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != width:
            raise ValueError(f"hardware profile field {where}[{i}] must be one of its {what}, got {row!r}.")
        out.append([_positive(f"{where}[{i}][{j}]", x) for j, x in enumerate(row)])
    return out


def _mapping(where: str, value, keys: Sequence[str]) -> Dict:
    if not isinstance(value, dict):
        raise ValueError(f"hardware profile field {where} must be an object with keys {', '.join(keys)}.")
    for key in keys:
        if key not in value:
            raise ValueError(f"hardware profile field {where} lacks '{key}' (it needs {', '.join(keys)}).")
    return value


def _rates(where: str, value, keys: Sequence[str]) -> Dict[str, float]:
    """``{key: positive number}`` for each of ``keys`` of the object ``value``."""
    entries = _mapping(where, value, keys)
    return {key: _positive(f"{where}.{key}", entries[key]) for key in keys}


def profile_from_dict(doc: Dict) -> Profile:
    """A :class:`Profile` of ``doc``; one sentence (``ValueError``) for a missing field or a
    non-positive rate."""
    if not isinstance(doc, dict):
        raise ValueError("a hardware profile must be a JSON object.")
    for field in FIELDS:
        if field not in doc:
            raise ValueError(f"the hardware profile lacks the field '{field}' (a profile needs {', '.join(FIELDS)}).")
    if doc["device"] not in ("gpu", "cpu"):
        raise ValueError(f"hardware profile field device must be gpu or cpu, got {doc['device']!r}.")
    gemm = _mapping("gemm_efficiency", doc["gemm_efficiency"], DTYPES)
    attention = _mapping("attention_efficiency", doc["attention_efficiency"], DTYPES)
    elementwise = _mapping("elementwise_rate", doc["elementwise_rate"], DTYPES)
    kinds = {d: _mapping(f"elementwise_rate.{d}", elementwise[d], ELEMENTWISE) for d in DTYPES}
    links = _mapping("collectives", doc["collectives"], SPANS)
    tile = doc["gemm_tile"]
    if not isinstance(tile, list) or len(tile) != 2:
        raise ValueError("hardware profile field gemm_tile must be [rows, cols].")
    collectives = {}
    for span in SPANS:
        groups = _mapping(f"collectives.{span}", links[span], COLLECTIVES)
        collectives[span] = {
            kind: {
                "alpha_s": _non_negative(
                    f"collectives.{span}.{kind}.alpha_s", _get(groups[kind], span, kind, "alpha_s")
                ),
                "busbw": _positive(f"collectives.{span}.{kind}.busbw", _get(groups[kind], span, kind, "busbw")),
            }
            for kind in COLLECTIVES
        }
    return Profile(
        name=str(doc["name"]),
        device=doc["device"],
        peak_flops=_rates("peak_flops", doc["peak_flops"], DTYPES),
        gemm_efficiency={d: _table(f"gemm_efficiency.{d}", gemm[d], 4) for d in DTYPES},
        gemm_tile=[int(_positive("gemm_tile[0]", tile[0])), int(_positive("gemm_tile[1]", tile[1]))],
        units=int(_positive("units", doc["units"])),
        attention_efficiency={d: _rates(f"attention_efficiency.{d}", attention[d], PHASES) for d in DTYPES},
        memory_bandwidth=_table("memory_bandwidth", doc["memory_bandwidth"]),
        elementwise_rate={
            d: {kind: _rates(f"elementwise_rate.{d}.{kind}", kinds[d][kind], PHASES) for kind in ELEMENTWISE}
            for d in DTYPES
        },
        op_overhead_s=_non_negative("op_overhead_s", doc["op_overhead_s"]),
        async_launch=bool(doc["async_launch"]),
        lookup_bandwidth=_rates("lookup_bandwidth", doc["lookup_bandwidth"], PHASES),
        topk_rate=_positive("topk_rate", doc["topk_rate"]),
        collectives=collectives,
        gpus_per_node=int(_positive("gpus_per_node", doc["gpus_per_node"])),
        host_link=_positive("host_link", doc["host_link"]),
        host_memory_bandwidth=_positive("host_memory_bandwidth", doc["host_memory_bandwidth"]),
        sources=dict(doc["sources"]) if isinstance(doc["sources"], dict) else {},
    )


def _get(entry, span: str, kind: str, key: str):
    if not isinstance(entry, dict) or key not in entry:
        raise ValueError(
            f"hardware profile field collectives.{span}.{kind} lacks '{key}' (it needs alpha_s and busbw)."
        )
    return entry[key]


def _non_negative(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
        raise ValueError(f"hardware profile field {where} must be a non-negative number, got {value!r}.")
    return float(value)


def load_profile(name_or_path: str) -> Profile:
    """The shipped profile called ``name_or_path`` (:data:`rmt.planner.profiles.PROFILES`), or the
    JSON file at that path; one sentence for anything else."""
    from rmt.planner.profiles import PROFILES

    if name_or_path in PROFILES:
        return profile_from_dict(PROFILES[name_or_path])
    if not os.path.isfile(name_or_path):
        raise ValueError(
            f"unknown hardware '{name_or_path}': give a profile file (rmt-plan calibrate --out FILE) or one of "
            f"{', '.join(sorted(PROFILES))}."
        )
    try:
        with open(name_or_path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"the hardware profile '{name_or_path}' is not JSON ({err.msg}, line {err.lineno}).") from None
    return profile_from_dict(doc)
