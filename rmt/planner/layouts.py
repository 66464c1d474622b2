"""The layout search of ``rmt-plan layouts``: every layout of a config over a number of GPUs that
rmt can run and whose every rank fits, ranked by what the layout costs per step.

Candidates: tensor parallel 1, 2, 4, 8; pipeline parallel over the divisors of the layers up to
16, with and without two virtual stages; the data-parallel rest; the distributed optimizer off
and on; recomputation none, selective and full (uniform, one layer per span); sequence
parallelism with TP > 1 (transformer); for memory tables both partitions over the
data x tensor parallel group, half or a quarter of it (:func:`group_sizes`), or replicated
(``local``). A candidate rmt cannot run is dropped by the same validation
``rmt-train`` runs (:func:`rmt.config_checks.validate`), one that does not fit by :mod:`rmt.planner.rank`.

Cost (seconds per step on a rank, a stated model, not a measurement): the bytes the rank sends
per step (data-parallel gradient all-reduce, or reduce-scatter plus parameter all-gather with the
distributed optimizer; pipeline sends, forward and backward; the memory tables' collectives,
``rmt-plan comm``'s forward + backward volume; the tensor-parallel all-reduces, four per layer and
micro-batch of the hidden state, ring ``2 (t - 1) / t``), each at ``nvlink_gbps`` when its group
spans at most ``gpus_per_node`` GPUs (tensor parallel innermost, then data parallel, pipeline
outermost, as megatron-core orders its groups) and at ``link_gbps`` otherwise, plus the
recomputed forward FLOPs at ``tflops`` (the dense layers': memory layers are never recomputed), plus, for tables in host memory, the host-link transfer
time their overlap windows do not hide at ``host_link_gbps`` (:func:`rmt.planner.host.exposed_seconds`).
"""

from __future__ import annotations

import copy
import itertools
from typing import Dict, Iterator, List, Optional

from rmt.planner import comm, host
from rmt.planner.memory import DTYPE_BYTES
from rmt.planner.rank import Layout, layout_of, padded_vocab, plan_rank, stage_params, with_vocabulary

TP_CHOICES = (1, 2, 4, 8)
MAX_PP = 16
RECOMPUTE = ("none", "selective", "full")


def candidates(config, gpus: int) -> Iterator[Dict[str, object]]:
    """``{"section.key": value}`` of every candidate layout of ``config`` on ``gpus`` ranks
    (unvalidated)."""
    m, mem = config.model, config.memory
    pps = [p for p in range(1, min(MAX_PP, m.num_layers) + 1) if m.num_layers % p == 0]
    tables = mem.type in ("ultramem", "ultramem_v2", "pkm")
    partitions = ("local", "number", "dimension") if tables else (None,)
    for tp, pp in itertools.product(TP_CHOICES, pps):
        if gpus % (tp * pp):
            continue
        for vpp, distopt, recompute, part in itertools.product(
            (None, 2) if pp > 1 else (None,), (False, True), RECOMPUTE, partitions
        ):
            for sp in (False, True) if tp > 1 and m.arch == "transformer" else (False,):
                o = {
                    "parallel.tensor_model_parallel_size": tp,
                    "parallel.pipeline_model_parallel_size": pp,
                    "parallel.virtual_pipeline_model_parallel_size": vpp,
                    "parallel.sequence_parallel": sp,
                    "parallel.data_parallel_size": None,
                    "train.distributed_optimizer": distopt,
                    "train.recompute_granularity": recompute,
                }
                if not distopt:  # megatron-core gathers parameters behind the reduction only for it
                    o["train.overlap_param_gather"] = False
                if recompute == "full":
                    o.update({"train.recompute_method": "uniform", "train.recompute_num_layers": 1})
                if part is None:
                    yield o
                    continue
                for group in (0,) if part == "local" else group_sizes(gpus // pp):
                    yield dict(o, **{"memory.partition": part, "memory.group_size": group})


def group_sizes(ranks: int) -> List[int]:
    """Memory-parallel groups tried over ``ranks`` data x tensor parallel ranks: all of them
    (``0``), half and a quarter (the tables then replicated over 2 or 4 groups: less traffic per
    lookup, more memory)."""
    return [0] + [ranks // k for k in (2, 4) if ranks % k == 0 and ranks // k >= 2]


def apply(config, layout: Dict[str, object]):
    """A copy of ``config`` with a candidate's settings (typed values, so no re-parse)."""
    out = copy.deepcopy(config)
    for key, value in layout.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def overrides_text(layout: Dict[str, object]) -> List[str]:
    """The ``section.key=value`` overrides that give a candidate's layout to ``rmt-train``."""

    def text(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [f"{k}={text(v)}" for k, v in layout.items()]


def step_cost(
    config,
    layout: Layout,
    link_gbps: float,
    nvlink_gbps: float,
    tflops: float,
    gpus_per_node: int = 8,
    host_link_gbps: float = host.HOST_LINK_GBPS,
) -> Dict[str, float]:
    """The stated cost of one step on the busiest rank (module docstring)."""
    m, t, mem = config.model, config.train, config.memory
    b = DTYPE_BYTES[t.precision]
    T = t.micro_batch_size * m.seq_length
    mb = layout.microbatches
    width = m.dk * m.dv if m.arch == "rmt" else m.hidden_size
    params = max(stage_params(config, layout, s) for s in range(layout.pp))
    ring = (layout.dp - 1) / layout.dp
    dp_bytes = params * (4 + b) * ring if layout.distributed_optimizer else params * 4 * 2 * ring
    layers = m.num_layers // layout.pp
    tp_bytes = 4 * layers * mb * T * width * b * 2 * (layout.tp - 1) / layout.tp
    pp_bytes = 2 * mb * layout.vpp * T * width * b if layout.pp > 1 else 0
    mem_bytes = 0
    if mem.type in ("ultramem", "ultramem_v2", "pkm") and mem.partition != "local":
        from rmt.memory.shapes import memory_placement, value_dim

        group = mem.group_size or layout.dp * layout.tp
        if group > 1:
            doc = comm.plan_comm(
                T,
                mem.num_heads * mem.topk,
                value_dim(config),
                group,
                phase="forward_backward",
                value_bytes=DTYPE_BYTES[mem.value_dtype],
                activation_bytes=b,
                tensor_parallel=layout.tp,
            )
            per = doc["collectives"][mem.partition]["forward_backward_total"]
            mem_bytes = per * mb * -(-len(memory_placement(config)) // layout.pp)
    flops = 0.0
    if layout.recompute != "none":
        from rmt.planner.flops import plan_model

        doc = plan_model(copy.deepcopy(config))
        # memory layers are never recomputed (rmt.memory.attach relinks them); MoE MLPs are
        # part of their layer and are
        memory = doc.get("memory")
        kept = memory["flops_per_token"] if memory and memory["placement"] != "mlp" else 0
        per_token_layer = (doc["flops_per_token"] - kept - 2 * width * padded_vocab(config)) / m.num_layers
        if layout.recompute == "full":
            flops = per_token_layer * layers * T * mb / layout.tp
        else:  # the core attention: scores and weighted values over all N x N pairs
            flops = layers * T * mb * (4 * width * m.seq_length) / layout.tp

    def link(group_span: int) -> float:  # bytes/s of a collective over ranks spanning group_span GPUs
        return (nvlink_gbps if group_span <= gpus_per_node else link_gbps) * 1e9

    host_exposed = host.exposed_seconds(config, layout, host_link_gbps, tflops)
    seconds = (
        host_exposed
        + dp_bytes / link(layout.tp * layout.dp)
        + pp_bytes / link(layout.world_size)
        + mem_bytes / link(layout.tp * layout.dp)
        + tp_bytes / link(layout.tp)
        + flops / (tflops * 1e12)
    )
    return {
        "data_parallel_bytes": dp_bytes,
        "tensor_parallel_bytes": tp_bytes,
        "pipeline_bytes": pp_bytes,
        "memory_table_bytes": mem_bytes,
        "recomputed_flops": flops,
        "host_link_exposed_seconds": host_exposed,
        "seconds": seconds,
    }


def search(
    path: Optional[str],
    overrides: List[str],
    gpus: int,
    gib: float,
    device: str = "gpu",
    link_gbps: float = 50.0,
    nvlink_gbps: float = 300.0,
    tflops: float = 400.0,
    gpus_per_node: int = 8,
    host_gib: Optional[float] = None,
    host_link_gbps: float = host.HOST_LINK_GBPS,
) -> Dict:
    """Every runnable layout of the config ``path`` + ``overrides`` on ``gpus`` ranks: the fitting
    ones ranked by cost, and how many candidates rmt cannot run or do not fit (``host_gib``: tables
    in host memory must also fit that much host memory per rank)."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import UserError

    fitting, rejected, too_big = [], {}, 0
    config = with_vocabulary(load_config(path, overrides))
    if host_gib is not None and config.memory.table_location != "host":
        raise ValueError("--host-gib is the host memory of tables in host memory: it needs memory.table_location=host.")
    for o in candidates(config, gpus):
        try:
            c = validate(apply(config, o), world_size=gpus)
        except UserError as err:
            rejected[str(err)] = rejected.get(str(err), 0) + 1
            continue
        doc = plan_rank(c, gpus, device, gib, host_gib)
        if not doc["fits"]:
            too_big += 1
            continue
        cost = step_cost(c, layout_of(c, gpus, device), link_gbps, nvlink_gbps, tflops, gpus_per_node, host_link_gbps)
        fitting.append(
            {
                "overrides": overrides_text(o),
                "layout": doc["layout"],
                "peak": doc["peak"],
                "host_peak": doc.get("host_peak"),
                "checkpoint_bytes": doc["checkpoint_bytes"],
                "cost": cost,
            }
        )
    fitting.sort(key=lambda r: (r["cost"]["seconds"], r["peak"]))
    return {
        "gpus": gpus,
        "gib": gib,
        "device": device,
        "fitting": fitting,
        "rejected": sum(rejected.values()),
        "rejected_reasons": rejected,
        "too_big": too_big,
        "cost_model": {
            "link_gbps": link_gbps,
            "nvlink_gbps": nvlink_gbps,
            "tflops": tflops,
            "gpus_per_node": gpus_per_node,
            "host_link_gbps": host_link_gbps,
        },
        "host_gib": host_gib,
    }


def gpu_counts(limit: int = 1 << 16) -> List[int]:
    """Counts tried for the smallest that fits: 1, 2, 4, then multiples of 8 (whole 8-GPU nodes)
    up to 64, then powers of two."""
    small = [1, 2, 4] + list(range(8, 65, 8))
    return small + [1 << k for k in range(7, limit.bit_length()) if (1 << k) <= limit]


def smallest(
    path: Optional[str], overrides: List[str], gib: float, device: str = "gpu", limit: int = 1 << 16, **cost
) -> Optional[Dict]:
    """The search at the smallest GPU count with a fitting layout (None if none up to ``limit``)."""
    for n in gpu_counts(limit):
        doc = search(path, overrides, n, gib, device, **cost)
        if doc["fitting"]:
            return doc
    return None
