"""Reject, before anything is allocated, a run whose per-rank memory can never fit.

A *lower bound* of the bytes one rank must hold at once is compared with the memory the rank
could ever get (its GPU's total memory, or on CPU the machine's RAM plus swap shared by the
ranks on the node). Only what training certainly allocates counts, so the check never rejects
a run that might fit:

* the dense parameters with their fp32 gradient buffer, main copies and Adam's two moments
  (:func:`rmt.planner.dense.dense_bytes_per_param` for ``train.precision`` and
  ``train.distributed_optimizer``: 16 bytes per parameter in fp32, 6 + 12 / DP in bf16 with the
  distributed optimizer), split evenly over tensor x pipeline ranks (memory tables, which may be
  sharded further, are left out);
* the activations one micro batch keeps for its backward pass
  (``rmt-plan model``'s ``activation_bytes_per_token``, :mod:`rmt.planner.flops`), split evenly
  over tensor x pipeline ranks; for architectures without that figure, the fp32 logits; none
  under ``train.recompute_granularity`` (which keeps less, by an amount this bound does not
  model);
* the ``seq_length x seq_length`` causal mask every rank builds.

A model that fits this bound may still run out of memory later; one that exceeds it cannot run
at all, and without this check it would fail inside an allocation with a traceback (or after
the machine swapped for minutes).

Beyond the bound, the whole-rank plan (``rmt-plan memory --config``, :mod:`rmt.planner.rank`)
decides. Where even :data:`PLAN_ERROR` below the plan exceeds what a rank has, the run could not
fit, so it stops before anything is built, naming the planned and available bytes and the
cheapest changes that fit (:func:`changes_that_fit`, from the layout search of ``rmt-plan
layouts``); ``train.ignore_memory_plan`` runs it anyway. Where only the plan itself exceeds it
(within the planner's error), one line says so and the run goes ahead.
"""

from __future__ import annotations

import copy
import os
import sys
from operator import attrgetter
from typing import Optional, Sequence

from rmt.config import RMTConfig
from rmt.errors import ConfigError, UserError
from rmt.machine_memory import machine_memory
from rmt.parallel.launch_env import world_size_from_env

_GIB = 2**30
PLAN_ERROR = 0.076
"""The most the whole-rank plan has overstated a measured peak: ``tools/bench_rank_memory.py``
measures every phase of every rank of its layouts against the plan (docs/planner.md, "Measured"),
and its lowest ``measured / planned - 1`` is -7.6% (``largest_overestimate`` in its summary).
A run planned at ``P`` bytes is therefore refused only when ``P (1 - PLAN_ERROR)`` exceeds the
rank's memory; errors the other way (the plan short of the measurement) never refuse a run that
would fit. The shipped bf16 configs measured at their own settings (``--only transformer_49m
transformer_49m_distopt rmt_46m``) come above their plans in every step, the phase a fit is
decided on; the one phase below, rank 0's save of ``rmt_46m`` (-23%), is a fifth of the step."""
MAX_RANKS = 1024
"""The largest rank count :func:`changes_that_fit` searches for a layout that fits."""


def _ranks_per_node() -> int:
    """The ranks that share this machine, as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``,
    SLURM's ``SLURM_NTASKS_PER_NODE``); 1 for a plain process."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0]  # SLURM writes e.g. "4(x2)"
        if value.isdigit():
            return max(1, int(value))
    return 1


def rank_memory() -> int:
    """The most memory one rank could ever use: its GPU's, or the machine's share per local rank."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory
    return machine_memory() // _ranks_per_node()


def memory_floor(config: RMTConfig) -> dict:
    """Bytes a rank of ``config`` certainly holds at once: ``{"state", "activations", "mask"}``."""
    from rmt.data.metadata import known_vocab_size
    from rmt.memory.byte_sizes import DTYPE_BYTES
    from rmt.models.vocab import padded_vocab_size
    from rmt.planner.dense import dense_bytes_per_param
    from rmt.planner.flops import plan_model

    config = copy.deepcopy(config)
    m, t, p = config.model, config.train, config.parallel
    if m.vocab_size is None:  # a vocabulary known only once data is built: its lower end
        m.vocab_size = (known_vocab_size(config) if config.data.task == "none" else None) or 1
    doc = plan_model(config)
    model_ranks = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    memory_params = doc.get("memory", {}).get("params", 0)
    dp = p.data_parallel_size or max(1, world_size_from_env() // model_ranks)
    per_param = sum(dense_bytes_per_param(t.precision, t.distributed_optimizer, dp).values())
    state = int(per_param * (doc["params"] - memory_params)) // model_ranks
    tokens = t.micro_batch_size * m.seq_length
    if t.recompute_granularity != "none":
        activations = 0
    elif "activation_bytes_per_token" in doc:
        activations = doc["activation_bytes_per_token"] * tokens // model_ranks
    else:
        Vp = padded_vocab_size(config)
        activations = max(4, DTYPE_BYTES[t.precision]) * Vp * tokens // p.tensor_model_parallel_size
    return {"state": state, "activations": activations, "mask": m.seq_length**2}


def planned(config: RMTConfig, device: str, world_size: int) -> Optional[dict]:
    """The whole-rank plan (:mod:`rmt.planner.rank`, every phase) for this run on ``world_size``
    ranks: its ``peak`` per rank, and with tables in host memory its ``host_peak``; None where it
    cannot be made without the data (an unknown vocabulary)."""
    from rmt.planner.rank import plan_rank, with_vocabulary

    try:
        return plan_rank(with_vocabulary(copy.deepcopy(config)), world_size, device)
    except ValueError:  # the vocabulary, or the layout at this world size, is not known yet
        return None


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"rmt-train: {message}", file=sys.stderr, flush=True)


def changes_that_fit(
    path: Optional[str], overrides: Sequence[str], world_size: int, available: int, device: str
) -> str:
    """The cheapest change with which the run of config ``path`` + ``overrides`` fits
    ``available`` bytes per rank, as a phrase for a sentence, from the layout search of ``rmt-plan
    layouts`` (:func:`rmt.planner.layouts.search`, ranked by its cost per step): its cheapest
    layout on these ``world_size`` ranks, at the largest micro-batch (a divisor of
    ``train.micro_batch_size``, the global batch kept, so the optimisation does not change) that
    has one; else the smallest number of such ranks with a layout that fits (up to
    :data:`MAX_RANKS`); else that none does."""
    from rmt.config import load_config
    from rmt.planner.layouts import overrides_text, search, smallest
    from rmt.planner.rank import human, layout_of, with_vocabulary

    gib = available / _GIB
    given = with_vocabulary(load_config(path, list(overrides)))

    def changed(best: dict) -> str:  # the layout's settings that differ from the run's
        keys = [o.split("=", 1)[0] for o in best["overrides"]]
        current = overrides_text({k: attrgetter(k)(given) for k in keys})
        return " ".join(o for o in best["overrides"] if o not in current)

    layout = layout_of(given, world_size, device)
    micro = given.train.micro_batch_size
    global_batch = micro * layout.dp * layout.microbatches
    for smaller in [d for d in range(micro, 0, -1) if micro % d == 0]:
        batch = (
            [] if smaller == micro else [f"train.micro_batch_size={smaller}", f"train.global_batch_size={global_batch}"]
        )
        fitting = search(path, list(overrides) + batch, world_size, gib, device)["fitting"]
        if fitting:
            best = fitting[0]
            what = " ".join(c for c in (changed(best), " ".join(batch)) if c)
            return f"it fits with {what} ({human(best['peak'])} per rank)"
    more = smallest(path, list(overrides), gib, device, limit=MAX_RANKS)
    if more is None:
        return (
            f"no layout of up to {MAX_RANKS} ranks of {human(available)} fits it: lower model.seq_length, "
            f"train.micro_batch_size or the model size"
        )
    best = more["fitting"][0]
    what = changed(best)
    return (
        f"it fits on {more['gpus']} ranks of {human(available)}{' with ' + what if what else ''} "
        f"({human(best['peak'])} per rank)"
    )


def check_fits(
    config: RMTConfig,
    path: Optional[str],
    overrides: Sequence[str],
    available: Optional[int] = None,
    device: Optional[str] = None,
    world_size: Optional[int] = None,
) -> None:
    """Raise :class:`ConfigError` when :func:`memory_floor` exceeds what a rank could ever get,
    or when the whole-rank plan does by more than :data:`PLAN_ERROR` (naming the changes that fit
    the run of config file ``path`` + ``overrides``, which ``config`` was made from), unless
    ``train.ignore_memory_plan``; say (once, on rank 0) when the plan exceeds it by less, which
    an upper-bound term of the plan may overstate, so the run goes ahead; likewise when a GPU
    rank's host tables (``memory.table_location: host``) exceed its share of the machine's
    memory."""
    import torch

    available = rank_memory() if available is None else available
    device = device or ("gpu" if torch.cuda.is_available() else "cpu")
    floor = memory_floor(config)
    need = sum(floor.values())
    if need <= available:
        world_size = world_size or world_size_from_env()
        plan = planned(config, device, world_size) or {}
        itemized = (
            f"`rmt-plan memory --config ... --world-size {world_size}` itemizes it and "
            f"`rmt-plan layouts --config ...` lists the layouts that fit"
        )
        peak = plan.get("peak", 0)
        if peak * (1 - PLAN_ERROR) > available and not config.train.ignore_memory_plan:
            from rmt.planner.rank import human

            raise ConfigError(
                f"rmt-plan counts {human(peak)} per rank for this run, more than the "
                f"{human(available)} a rank has here even allowing for the plan's largest measured "
                f"overstatement ({PLAN_ERROR:.1%}), so it would run out of memory; "
                f"{changes_that_fit(path, overrides, world_size, available, device)}; "
                f"`rmt-plan memory --config ... --world-size {world_size}` itemizes it, and "
                f"train.ignore_memory_plan=true starts it anyway"
            )
        if peak > available:
            _say(
                f"rmt-plan counts {peak / _GIB:,.1f} GiB per rank for this run, more than the "
                f"{available / _GIB:,.1f} GiB a rank has here, so it may run out of memory; {itemized}"
            )
        host = machine_memory() // _ranks_per_node()
        if device == "gpu" and plan.get("host_peak", 0) > host:
            _say(
                f"rmt-plan counts {plan['host_peak'] / _GIB:,.1f} GiB of host memory per rank for the "
                f"tables in host memory, more than the {host / _GIB:,.1f} GiB a rank's share of this "
                f"machine is; {itemized}"
            )
        return
    m, t = config.model, config.train
    raise ConfigError(
        f"this run needs at least {need / _GIB:,.1f} GiB per rank (activations of one micro batch of "
        f"{t.micro_batch_size} x {m.seq_length} tokens {floor['activations'] / _GIB:,.1f} GiB, parameters with "
        f"gradients and Adam state {floor['state'] / _GIB:,.1f} GiB, causal mask {floor['mask'] / _GIB:,.1f} GiB), "
        f"more than the {available / _GIB:,.1f} GiB a rank can have here; lower model.seq_length, "
        f"train.micro_batch_size or the model size, or split the model over more tensor/pipeline ranks"
    )


def step_prediction(config: RMTConfig, world_size: int, device: str) -> dict:
    """What the step-time model (``rmt-plan time``, :mod:`rmt.planner.time`) says of this run,
    for the trainer's log: ``flops_per_token`` (the model FLOPs of a training step per token,
    three times ``rmt-plan model``'s forward: recomputation not counted) and, where a hardware
    profile for this device is known, its ``profile`` name, ``peak_flops`` (of
    ``train.precision``) and ``predicted_step_s``. The profile: on a GPU the shipped one of its
    kind (H100, A100), else the calibrated profile at ``rmt-plan calibrate``'s default path
    (``$RMT_HARDWARE_PROFILE``), which is also a CPU's; without one these three are None."""
    from rmt.planner.flops import plan_model
    from rmt.planner.profiles import PROFILES

    out = {"flops_per_token": None, "profile": None, "peak_flops": None, "predicted_step_s": None}
    try:
        config = copy.deepcopy(config)
        out["flops_per_token"] = 3.0 * plan_model(config)["flops_per_token"]
    except ValueError:  # the vocabulary is known only once the data is built
        return out
    import torch

    from rmt.planner.hardware import default_profile_path, load_profile
    from rmt.planner.rank import with_vocabulary
    from rmt.planner.time import plan_time

    name = None
    if device == "gpu" and torch.cuda.is_available():
        card = torch.cuda.get_device_name().upper()
        name = next((key for key in PROFILES if key.upper() in card), None)
    if name is None and os.path.isfile(default_profile_path()):
        name = default_profile_path()
    if name is None:
        return out
    try:
        profile = load_profile(name)
        doc = plan_time(with_vocabulary(config), world_size, profile)
    except (ValueError, UserError) as err:  # a profile that does not load, a layout it cannot time
        _say(f"no step-time prediction ({err})")
        return out
    out.update(profile=profile.name, peak_flops=doc["peak_tflops"] * 1e12, predicted_step_s=doc["step_s"])
    return out
