"""The layout search of ``rmt-plan layouts``: every layout of a config over a number of GPUs that
rmt can run and whose every rank fits, ranked by the predicted step time.

Candidates: tensor parallel 1, 2, 4, 8; pipeline parallel over the divisors of the layers up to
16, with and without two virtual stages; the data-parallel rest; the distributed optimizer off
and on; recomputation none, selective and full (uniform, one layer per span); sequence
parallelism with TP > 1 (transformer); for memory tables both partitions over the
data x tensor parallel group, half or a quarter of it (:func:`group_sizes`), or replicated
(``local``). A candidate rmt cannot run is dropped by the same validation
``rmt-train`` runs (:func:`rmt.config_checks.validate`), one that does not fit by :mod:`rmt.planner.rank`.

The ranking is the predicted step time of each layout (:func:`rmt.planner.time.plan_time` on a
hardware profile, :mod:`rmt.planner.hardware`): compute, recomputation, every collective with
its overlaps, the pipeline bubble, the optimizer step, the memory layers and their tables'
traffic; each listed with its tokens per second and MFU.
"""

from __future__ import annotations

import copy
import itertools
from typing import Dict, Iterator, List, Optional

from rmt.config import TABLE_TYPES
from rmt.planner.hardware import Profile, load_profile
from rmt.planner.rank import plan_rank, with_vocabulary
from rmt.planner.time import plan_time

TP_CHOICES = (1, 2, 4, 8)
MAX_PP = 16
RECOMPUTE = ("none", "selective", "full")


def candidates(config, gpus: int) -> Iterator[Dict[str, object]]:
    """``{"section.key": value}`` of every candidate layout of ``config`` on ``gpus`` ranks
    (unvalidated)."""
    m, mem = config.model, config.memory
    pps = [p for p in range(1, min(MAX_PP, m.num_layers) + 1) if m.num_layers % p == 0]
    tables = mem.type in TABLE_TYPES
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


def search(
    path: Optional[str],
    overrides: List[str],
    gpus: int,
    gib: float,
    device: str = "gpu",
    profile: Optional[Profile] = None,
    host_gib: Optional[float] = None,
) -> Dict:
    """Every runnable layout of the config ``path`` + ``overrides`` on ``gpus`` ranks: the fitting
    ones ranked by their predicted step time on ``profile`` (default: the shipped H100's,
    :mod:`rmt.planner.time`), and how many candidates rmt cannot run or do not fit (``host_gib``:
    tables in host memory must also fit that much host memory per rank)."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import UserError

    profile = profile or load_profile("h100")
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
        fitting.append(
            {
                "overrides": overrides_text(o),
                "layout": doc["layout"],
                "peak": doc["peak"],
                "host_peak": doc.get("host_peak"),
                "checkpoint_bytes": doc["checkpoint_bytes"],
                "time": summary(plan_time(c, gpus, profile)),
            }
        )
    fitting.sort(key=lambda r: (r["time"]["step_s"], r["peak"]))
    return {
        "gpus": gpus,
        "gib": gib,
        "device": device,
        "hardware": profile.name,
        "fitting": fitting,
        "rejected": sum(rejected.values()),
        "rejected_reasons": rejected,
        "too_big": too_big,
        "host_gib": host_gib,
    }


def summary(doc: Dict) -> Dict:
    """The figures of a :func:`rmt.planner.time.plan_time` document a layout is ranked and listed
    by: step seconds, tokens per second, TFLOP/s per GPU, MFU and the parts of the step."""
    keys = ("step_s", "tokens_per_s", "tflops_per_gpu", "mfu", "pipeline_s", "bubble_s", "after_backward_s")
    out = {k: doc[k] for k in keys}
    stage = doc["stages"].get(str(doc["slowest_stage"])) or next(iter(doc["stages"].values()))
    out["recompute_s"] = stage["recompute_s"]
    out["memory_exposed_s"] = sum(r["exposed_s"] for r in stage["memory"])
    return out


def gpu_counts(limit: int = 1 << 16) -> List[int]:
    """Counts tried for the smallest that fits: 1, 2, 4, then multiples of 8 (whole 8-GPU nodes)
    up to 64, then powers of two."""
    small = [1, 2, 4] + list(range(8, 65, 8))
    return small + [1 << k for k in range(7, limit.bit_length()) if (1 << k) <= limit]


def smallest(
    path: Optional[str], overrides: List[str], gib: float, device: str = "gpu", limit: int = 1 << 16, **options
) -> Optional[Dict]:
    """The search at the smallest GPU count with a fitting layout (None if none up to ``limit``;
    ``options``: :func:`search`'s ``profile`` and ``host_gib``)."""
    for n in gpu_counts(limit):
        doc = search(path, overrides, n, gib, device, **options)
        if doc["fitting"]:
            return doc
    return None
