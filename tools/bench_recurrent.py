"""Benchmark for recurrent transformers and repeat mixers (issue: recurrent transformers and masked
repeat mixers).

(a) Copy and selective copy ("Efficient LLM Architectures" §6.2) trained on CPU with the
    noise-length curriculum (start at ``--noise-start``, default 16, double when validation loss
    < 0.3, up to ``--noise-target``, default 512), then recall accuracy at the noise reached.
    Positions are learned per place in the block (``model.position=block``): with absolute
    positions the recall tokens move to untrained rows at every doubling. Batch 32 (the paper's
    Table 4 has 64, which reaches 512 sooner but then learns slower per CPU second;
    docs/recipes.md). Weights start from N(0, ``--init-std``), 0.06 (megatron's default of 0.02
    passes the curriculum's stages 2-3x slower and ends below 0.99; docs/recipes.md). The
    accumulation scalar α of eq. 7 starts at ``--alpha`` (0.5) and is learned
    (``--no-learn-alpha`` holds it there). The learning rate ``--lr`` falls by ``--lr-curriculum-decay`` (0.8) at every doubling and by
    ``--lr-plateau-decay`` (0.5) after ``--lr-plateau-patience`` (40) evaluations at the target
    without a new lowest validation loss, down to ``--min-lr-ratio`` x ``--lr`` (the paper's
    learning rate "decays as a function of the sequence length and the validation loss", §6.2);
    ``--lr-cooldown F`` (0.25) also brings it linearly down to that floor over the last fraction F
    of the budget, or, with ``--lr-cooldown-from target``, over the whole stage at
    ``--noise-target`` (from the arrival to the end of the budget). The run delivers the
    exponential moving average of the weights, decay ``--ema-decay`` (0.99; ``train.ema_decay``),
    restarted at each doubling: at 512 its validation loss is several times below the trained
    weights', which swing from one evaluation to the next (docs/recipes.md); the trained weights'
    loss still drives the curriculum and the learning rate. A run ends early once the delivered
    model's validation loss at the target falls below ``--stop-loss`` (0.01) and its recall
    accuracy on ``--stop-confirm`` (1,024) held-out samples reaches ``--stop-accuracy`` (0.993):
    the loss is one evaluation's batch (32 samples), and a batch below it can be luck. The paper starts at 128 and
    reports 100% / 99.4% at 4096 noise tokens with ~0.5M parameters; docs/recipes.md ("Recurrent
    transformer on copy tasks") lists what was measured here.
(b) Decoding tokens/s and cache memory against position, up to 2048: the repeat mixer in its
    recurrent form (one state vector per head per layer) and the recurrent transformer (last
    window per layer plus the current block) against the transformer with megatron-core's KV
    cache.

    python tools/bench_recurrent.py [--quick] [--json out.json]
    python tools/bench_recurrent.py --tasks selective_copy --no-decode --cpu-budget 4800 --json out.json
    python tools/bench_recurrent.py --tasks selective_copy --no-decode --cpu-budget 4800 --seeds 1,2,3 --jobs 2

How far a curriculum run gets in its budget varies several-fold with the seed (docs/recipes.md),
so a recipe is judged on several: ``--seeds`` runs the tasks once per seed (``train.seed``), each
seed in a process of its own, ``--jobs`` of them at a time, each pinned to ``--threads`` cores of
its own (their CPU-second budgets then do not compete), and summarizes the accuracies over the
seeds.

Each task's result row also gives ``accuracy_trained_weights`` (the trained weights' accuracy
beside the delivered average's ``accuracy``), ``accuracy_by_block``, the recall accuracy grouped by the block
that held the recalled token, and with ``--eval-noise 256,1024`` ``accuracy_at_noise``, the trained
model's accuracy at other noise lengths; ``--save-model DIR`` keeps the trained models.

Summary keys: ``copy_accuracy``, ``selective_copy_accuracy`` (with ``--seeds``: the mean over the
seeds, and ``<task>_accuracy_per_seed``, ``<task>_accuracy_min`` and ``seeds`` beside it),
``max_noise_tokens`` (largest noise length reached by both tasks, on every seed),
``mixer_decode_mem_growth`` and ``recurrent_decode_mem_growth`` (state bytes at position 2048
over those at 128), plus ``transformer_decode_mem_growth`` for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rmt import setup_process  # noqa: E402

setup_process()  # rmt's process settings (rmt.process), before torch is imported
import torch  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.bench_report import check_report, machine, refuse, write_report  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.data.tasks import noise_token, recall_accuracy  # noqa: E402
from rmt.decoding import decoder_for  # noqa: E402
from rmt.errors import ConfigError  # noqa: E402
from rmt.models.build import build  # noqa: E402
from rmt.training.trainer import Trainer  # noqa: E402

POSITIONS = (128, 256, 512, 1024, 2048)


def task_config(task: str, args):
    """The validated config of one curriculum run (ConfigError on a bad override)."""
    overrides = (
        [
            "model.arch=recurrent",
            f"model.hidden_size={args.hidden}",
            f"model.num_attention_heads={args.heads}",
            "model.num_layers=1",
            f"model.block_width={args.block}",
            f"model.seq_length={32 + args.noise_target}",
            f"model.recurrent_alpha={args.alpha}",
            f"model.recurrent_alpha_learned={str(args.learn_alpha).lower()}",
            f"model.recurrent_alpha_min={args.alpha_min}",
            "model.position=block",
            f"model.init_std={args.init_std}",
            f"data.task={task}",
            "data.task_tokens=16",
            "data.task_alphabet=16",
            f"data.noise_length={args.noise_start}",
            "data.curriculum_threshold=0.3",
            f"data.curriculum_target={args.noise_target}",
            f"train.steps={args.max_steps}",
            f"train.warmup_steps={min(20, args.max_steps - 1)}",
            "train.lr_decay_style=constant",
            f"train.lr={args.lr}",
            f"train.lr_curriculum_decay={args.lr_curriculum_decay}",
            f"train.lr_target_decay={args.lr_target_decay}",
            f"train.min_lr_ratio={args.min_lr_ratio}",
            f"train.lr_plateau_decay={args.lr_plateau_decay}",
            f"train.lr_plateau_patience={args.lr_plateau_patience}",
            f"train.lr_plateau_smoothing={args.lr_plateau_smoothing}",
            f"train.micro_batch_size={args.batch}",
            f"train.eval_interval={args.eval_interval}",
            "train.eval_iters=1",
            "train.weight_decay=0.0",
            "train.progress=false",
            f"train.threads={args.threads}",
        ]
        + ([f"train.ema_decay={args.ema_decay}"] if args.ema_decay else [])
        + args.overrides
    )
    return validate(load_config(None, overrides), 1)


def budget_spent(args, steps: int, wall_s: float, cpu_s: float) -> float:
    """The fraction of the run's budget spent: of steps, wall seconds or CPU seconds, whichever
    is furthest along (the run ends at 1)."""
    return max(steps / args.max_steps, wall_s / args.time_budget, cpu_s / args.cpu_budget)


def cool_down(trainer, args, spent: float, arrived) -> None:
    """Scale the learning rate the validation rules have set (:mod:`rmt.training.lr_control`)
    linearly down to the floor ``--min-lr-ratio`` over the last ``--lr-cooldown`` fraction of the
    budget (``--lr-cooldown-from budget``: a warmup-stable-decay ending), or from ``arrived``, the
    fraction of the budget spent when the curriculum reached ``--noise-target``, to the end
    (``--lr-cooldown-from target``: a decay to the floor over the whole last stage). megatron-core's
    decay styles count steps; a CPU-second budget fixes no step count, so the factor is applied
    here."""
    if args.lr_cooldown_from == "target":
        if arrived is None:
            return
        left = (1.0 - spent) / (1.0 - arrived)
    elif args.lr_cooldown <= 0 or spent <= 1.0 - args.lr_cooldown:
        return
    else:
        left = (1.0 - spent) / args.lr_cooldown
    scale = max(trainer.lr_control.scale * left, args.min_lr_ratio)
    if scale != trainer.scheduler.scale:
        trainer.scheduler.scale = scale
        trainer.scheduler.step(0)


def accuracy_by_block(logits: torch.Tensor, batch: dict, block: int) -> list:
    """Recall accuracy grouped by the block (``position // block``) that held the recalled data
    token: ``[block, accuracy, recall tokens]`` for every block that held one. Where the errors
    sit tells a failing relay across many blocks from errors spread evenly."""
    tokens, n = batch["tokens"], 16
    hits = logits[:, -n:, :16].argmax(-1) == batch["labels"][:, -n:]
    where = (tokens[:, :-n] != noise_token(16)).nonzero()[:, 1].view(-1, n) // block
    return [[b, float(hits[where == b].float().mean()), int((where == b).sum())] for b in where.unique().tolist()]


def validation_logits(model, ds, noise: int, first: int, n: int) -> tuple:
    """(``model``'s logits, the stacked batch) on validation samples ``first .. first + n - 1``
    with ``noise`` noise tokens."""
    ds.noise_length = noise
    batch = [ds[first + i] for i in range(n)]
    stacked = {k: torch.stack([s[k] for s in batch]) for k in batch[0]}
    with torch.no_grad():
        return model(stacked["tokens"], stacked["position_ids"], None), stacked


def recall_eval(model, ds, noise: int, args) -> tuple:
    """Recall accuracy and :func:`accuracy_by_block` of ``model`` on ``--eval-samples`` validation
    samples with ``noise`` noise tokens."""
    logits, stacked = validation_logits(model, ds, noise, 10_000, args.eval_samples)
    return (
        recall_accuracy(logits, stacked["labels"], stacked["loss_mask"], 16),
        accuracy_by_block(logits, stacked, args.block),
    )


def delivered(trainer):
    """Context in which the model holds the weights the run delivers: the weight average
    (``train.ema_decay``) when there is one, else the trained weights."""
    return trainer.average.swapped_in() if trainer.average is not None else contextlib.nullcontext()


def stop_confirmed(trainer, args, task: str, rows: list) -> bool:
    """Whether the recall accuracy on ``--stop-confirm`` held-out validation samples (indices from
    30,000: neither the evaluations' nor the final accuracy's), in batches of 256, is at least
    ``--stop-accuracy``. The stop rule's validation loss is one batch: a run stopped on an
    evaluation at 0.0062 measured 0.987 on 2,048 fresh samples, and one stopped at 0.0031 had a
    loss of 0.041 on 256 held-out samples (docs/recipes.md). The model is evaluated in eval mode
    and put back in training mode; the caller puts in the weights it judges (:func:`delivered`).
    Logs the check as a ``stop_check`` row."""
    if args.stop_confirm == 0:
        return True
    model, ds = trainer.chunks[0].module, trainer.valid_ds
    hits = total = 0.0
    model.eval()
    try:
        for first in range(30_000, 30_000 + args.stop_confirm, 256):
            logits, stacked = validation_logits(
                model, ds, ds.noise_length, first, min(256, 30_000 + args.stop_confirm - first)
            )
            recalls = float(stacked["loss_mask"].sum())
            hits += recall_accuracy(logits, stacked["labels"], stacked["loss_mask"], 16) * recalls
            total += recalls
    finally:
        model.train()
    accuracy = hits / total
    rows.append(
        {
            "part": "stop_check",
            "task": task,
            "seed": trainer.config.train.seed,
            "step": trainer.iteration,
            "heldout_accuracy": accuracy,
            "samples": args.stop_confirm,
            "stop": accuracy >= args.stop_accuracy,
        }
    )
    print(json.dumps(rows[-1]), flush=True)
    return rows[-1]["stop"]


def train_task(task: str, args, rows: list) -> dict:
    """Curriculum training of the recurrent transformer; returns accuracy at the noise reached."""
    config = task_config(task, args)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        params = sum(p.numel() for p in trainer.params)
        start, cpu = time.perf_counter(), time.process_time()
        noise, val, arrived = args.noise_start, float("inf"), None
        while (
            spent := budget_spent(args, trainer.iteration, time.perf_counter() - start, time.process_time() - cpu)
        ) < 1.0:
            if arrived is None and noise == args.noise_target:
                arrived = spent
            cool_down(trainer, args, spent, arrived)
            m = trainer.train_step()
            if trainer.iteration % args.eval_interval == 0:
                m["val_loss"] = val = trainer.evaluate()
                if trainer.average is not None:
                    m["val_loss_ema"] = val = trainer.evaluate_average()
                trainer.after_evaluation(m)  # the trained weights' loss drives the curriculum
                rows.append(
                    {
                        "part": "curriculum",
                        "task": task,
                        "seed": config.train.seed,
                        "step": trainer.iteration,
                        "noise_length": noise,
                        "val_loss": m["val_loss"],
                        "val_loss_ema": m.get("val_loss_ema"),
                        "lr": m["lr"],
                        "alpha": trainer.chunks[0].module.layers[0].alpha.item(),
                        "elapsed_s": time.perf_counter() - start,
                        "cpu_s": time.process_time() - cpu,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                if noise == m["noise_length"] == args.noise_target and val < args.stop_loss:
                    with delivered(trainer):
                        if stop_confirmed(trainer, args, task, rows):
                            break
                noise = m["noise_length"]
        model = trainer.chunks[0].module.eval()
        ds = trainer.valid_ds
        reached = ds.noise_length
        with delivered(trainer):
            acc, by_block = recall_eval(model, ds, reached, args)
            at_noise = {str(n): recall_eval(model, ds, n, args)[0] for n in args.eval_noise}
            if args.save_model:
                os.makedirs(args.save_model, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(args.save_model, f"{task}_seed{config.train.seed}.pt"))
        # without an average the delivered model is the trained one: no second evaluation
        trained_acc = recall_eval(model, ds, reached, args)[0] if trainer.average is not None else acc
        return {
            "accuracy": acc,
            "accuracy_trained_weights": trained_acc,
            "accuracy_by_block": by_block,
            "accuracy_at_noise": at_noise,
            "seed": config.train.seed,
            "noise_length": reached,
            "steps": trainer.iteration,
            "parameters": params,
            "final_val_loss": val,
            "train_s": time.perf_counter() - start,
            "train_cpu_s": time.process_time() - cpu,
        }
    finally:
        parallel.destroy()


def decode_profile(arch: str, args, rows: list) -> dict:
    """Greedy-feed decoding from position 0 to 2048; per-token time and cache bytes at POSITIONS."""
    extra = {
        "mixer": ["model.mixer_kind=mixed", "model.mixer_decay=true"],
        "recurrent": [f"model.block_width={args.block}"],
    }.get(arch, [])
    config = validate(
        load_config(
            None,
            [
                f"model.arch={arch}",
                "model.vocab_size=257",
                "model.hidden_size=64",
                "model.num_attention_heads=4",
                "model.num_layers=2",
                f"model.seq_length={POSITIONS[-1]}",
                f"train.threads={args.threads}",
            ]
            + extra,
        ),
        1,
    )
    parallel.initialize(config)
    try:
        model = build(config)[0].eval()
        decoder = decoder_for(model, POSITIONS[-1], use_cache=True)
        out = {}
        with torch.no_grad():
            decoder.prefill(torch.zeros(1, 1, dtype=torch.long))
            window, tic = 32, time.perf_counter()
            for pos in range(1, POSITIONS[-1]):
                decoder.next(torch.tensor([pos % 257]))
                if pos + 1 in POSITIONS:
                    # bytes of the cache holding positions 0..pos (mixer: the recurrent state)
                    if arch == "mixer":
                        mem = sum(s.numel() * s.element_size() for s in decoder.state)
                    elif arch == "recurrent":
                        held = [h for w in decoder.windows if w is not None for h in w] + [decoder.pending]
                        mem = sum(t.numel() * t.element_size() for t in held)
                    else:
                        kv = decoder.context.key_value_memory_dict
                        per_pos = (
                            sum(t.numel() * t.element_size() for pair in kv.values() for t in pair) / POSITIONS[-1]
                        )
                        mem = int(per_pos * (pos + 1))
                    out[pos + 1] = mem
                if (pos + 1) % window == 0:
                    rate = window / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                    if pos + 1 in POSITIONS:
                        rows.append(
                            {
                                "part": "decode",
                                "arch": arch,
                                "position": pos + 1,
                                "tokens_per_s": rate,
                                "cache_bytes": out[pos + 1],
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
        return out
    finally:
        parallel.destroy()


def without_options(argv: list, names: tuple) -> list:
    """``argv`` without the options ``names`` and their values (``--name value`` or ``--name=value``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in names:
            skip = True
        elif not token.startswith(tuple(f"{n}=" for n in names)):
            out.append(token)
    return out


def run_seeds(argv: list, seeds: list, slots: list) -> tuple:
    """Runs this benchmark once per seed, each in a process of its own (``--seeds S``), one per
    slot at a time, pinned to that slot's cores; returns (rows, results by task and seed)."""
    base = without_options(argv, ("--seeds", "--jobs", "--json"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_recurrent_") as tmp:
        pending, running, free = list(seeds), [], list(slots)
        while pending or running:
            while pending and free:
                seed, cores = pending.pop(0), free.pop(0)
                path = os.path.join(tmp, f"seed{seed}.json")
                proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__)] + base + ["--seeds", str(seed), "--json", path],
                    preexec_fn=lambda c=cores: os.sched_setaffinity(0, c),
                )
                print(f"bench_recurrent: seed {seed} started on cores {cores} (pid {proc.pid})", flush=True)
                running.append((seed, proc, cores, path))
            seed, proc, cores, path = running.pop(0)
            if proc.wait() != 0:
                for other in running:
                    other[1].kill()
                raise RuntimeError(f"the run of seed {seed} failed (exit status {proc.returncode})")
            free.append(cores)
            with open(path) as f:
                rows += [r for r in json.load(f)["rows"] if r["part"] != "decode"]
    results = {}
    for r in rows:
        if r["part"] == "result":
            results.setdefault(r["task"], {})[r["seed"]] = r
    return rows, results


class UsageError(ValueError):
    """A bad command line: one sentence on stderr and exit status 2, before any training."""


def parse_args(argv):
    """The command line -> ``(args, tasks, seeds)``, every default filled in as the run uses it
    (tests rebuild a run's config from it); :class:`UsageError` on bad input."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="small curriculum target, short budget (~3 min)")
    ap.add_argument("--json", metavar="FILE", help="write the benchmark JSON")
    ap.add_argument("--noise-start", type=int, default=None)
    ap.add_argument("--noise-target", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None, help="wall-clock seconds of training per task")
    ap.add_argument(
        "--cpu-budget",
        type=float,
        default=float("inf"),
        help="CPU seconds (all threads of this process) of training per task; on a shared machine "
        "the budget that compares runs",
    )
    ap.add_argument("--tasks", default="copy,selective_copy", help="comma-separated subset of copy,selective_copy")
    ap.add_argument("--no-decode", action="store_true", help="skip part (b), the decoding profile")
    ap.add_argument("--hidden", type=int, help="default 96 (quick 32)")
    ap.add_argument("--heads", type=int, help="default 6 (quick 4)")
    ap.add_argument("--block", type=int, help="block width, default 32 (quick 8)")
    ap.add_argument("--batch", type=int, help="samples per step, default 32 (the paper: 64; quick 16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate at the first noise length")
    ap.add_argument(
        "--init-std",
        type=float,
        default=0.06,
        help="standard deviation of the weight init (model.init_std); megatron's 0.02 passes the "
        "curriculum's stages 2-3x slower (docs/recipes.md)",
    )
    ap.add_argument(
        "--alpha",
        type=float,
        default=0.5,
        help="the accumulation scalar α of eq. 7 at the start (model.recurrent_alpha)",
    )
    ap.add_argument(
        "--learn-alpha",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="learn α from --alpha (--no-learn-alpha: keep it fixed; model.recurrent_alpha_learned)",
    )
    ap.add_argument(
        "--alpha-min", type=float, default=0.0, help="the floor the learned α is clamped to (model.recurrent_alpha_min)"
    )
    ap.add_argument(
        "--lr-curriculum-decay",
        type=float,
        default=0.8,
        help="factor on the learning rate at each doubling of the noise length (train.lr_curriculum_decay)",
    )
    ap.add_argument(
        "--lr-target-decay",
        type=float,
        default=1.0,
        help="a further factor at the doubling that reaches --noise-target (train.lr_target_decay)",
    )
    ap.add_argument(
        "--lr-plateau-decay",
        type=float,
        default=0.5,
        help="factor on the learning rate at the target noise length after --lr-plateau-patience "
        "evaluations without a new lowest validation loss (train.lr_plateau_decay)",
    )
    ap.add_argument(
        "--lr-plateau-patience",
        type=int,
        default=40,
        help="evaluations (of --eval-interval steps) without a new lowest validation loss that "
        "make a plateau (train.lr_plateau_patience)",
    )
    ap.add_argument(
        "--lr-plateau-smoothing",
        type=float,
        default=0.0,
        help="the plateau rule judges a moving average of the validation loss with this weight on "
        "the previous average, in [0, 1) (train.lr_plateau_smoothing)",
    )
    ap.add_argument(
        "--lr-cooldown",
        type=float,
        default=0.25,
        help="over this last fraction of the budget (steps, wall or CPU seconds, whichever runs "
        "out first) the learning rate falls linearly to the floor --min-lr-ratio; 0 = none",
    )
    ap.add_argument(
        "--lr-cooldown-from",
        choices=("budget", "target"),
        default="budget",
        help="budget: the cooldown is the last --lr-cooldown fraction of the budget; target: it "
        "runs from the arrival at --noise-target to the end of the budget",
    )
    ap.add_argument(
        "--ema-decay",
        type=float,
        default=0.99,
        help="the run delivers, and its stop rule judges, an exponential moving average of the weights "
        "with this decay (train.ema_decay), restarted at each doubling; 0 = the trained weights",
    )
    ap.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.02,
        help="the lowest the learning rate falls to, as a fraction of --lr (train.min_lr_ratio)",
    )
    ap.add_argument("--eval-interval", type=int, help="default 25 (quick 10)")
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument(
        "--stop-loss",
        type=float,
        default=0.01,
        help="end a task's run at the first evaluation at --noise-target whose validation loss is "
        'below this (the paper trains "down to the desired minimal level for completion")',
    )
    ap.add_argument(
        "--stop-confirm",
        type=int,
        default=1024,
        help="held-out validation samples on which the recall accuracy must also reach --stop-accuracy "
        "for the run to end (0: the evaluation's validation loss alone decides)",
    )
    ap.add_argument(
        "--stop-accuracy",
        type=float,
        default=0.993,
        help="the held-out recall accuracy that confirms a stop (--stop-confirm)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--eval-noise",
        default="",
        help="comma-separated noise lengths at which the trained model's recall accuracy is also "
        "measured (result: accuracy_at_noise); above --noise-target only with block positions",
    )
    ap.add_argument(
        "--save-model", metavar="DIR", help="keep each task's trained model's state dict as DIR/<task>_seed<seed>.pt"
    )
    ap.add_argument(
        "--seeds",
        help="comma-separated seeds (train.seed): one run per seed, each in a process "
        "of its own, and the accuracies summarized over them",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="with --seeds: seed runs at a time, each pinned to --threads cores of its own",
    )
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for the task runs")
    args = ap.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or any(t not in ("copy", "selective_copy") for t in tasks):
        raise UsageError(f"--tasks must name copy and/or selective_copy, got '{args.tasks}'")
    if args.stop_confirm < 0:
        raise UsageError(f"--stop-confirm must be a non-negative sample count, got {args.stop_confirm}")
    if not 0.0 <= args.stop_accuracy <= 1.0:
        raise UsageError(f"--stop-accuracy must lie in [0, 1], got {args.stop_accuracy}")
    if not 0.0 <= args.ema_decay < 1.0:
        raise UsageError(f"--ema-decay must lie in [0, 1), got {args.ema_decay}")
    if not 0.0 <= args.lr_cooldown < 1.0:
        raise UsageError(f"--lr-cooldown must lie in [0, 1), got {args.lr_cooldown}")
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else []
    except ValueError:
        seeds = None
    if seeds is None or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds must be distinct comma-separated integers, got '{args.seeds}'")
    raw_noise = args.eval_noise
    try:
        args.eval_noise = [int(x) for x in raw_noise.split(",") if x]
    except ValueError:
        args.eval_noise = None
    if args.eval_noise is None or any(n < 0 for n in args.eval_noise):
        raise UsageError(f"--eval-noise must list non-negative noise lengths, got '{raw_noise}'")
    cores = sorted(os.sched_getaffinity(0))
    if args.jobs < 1 or (len(seeds) > 1 and args.jobs * args.threads > len(cores)):
        raise UsageError(
            f"--jobs x --threads must lie in [1, {len(cores)}] (the cores this process may use), "
            f"got {args.jobs} x {args.threads}"
        )
    if len(seeds) == 1:
        args.overrides = args.overrides + [f"train.seed={seeds[0]}"]
    q = args.quick
    args.noise_start = args.noise_start or (8 if q else 16)
    args.noise_target = args.noise_target or (16 if q else 512)
    args.max_steps = args.max_steps or (300 if q else 200_000)
    args.time_budget = args.time_budget or (60.0 if q else 4 * 3600.0)
    for name, full, quick in (
        ("hidden", 96, 32),
        ("heads", 6, 4),
        ("batch", 32, 16),
        ("block", 32, 8),
        ("eval_interval", 25, 10),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    try:
        for task in tasks:
            if (
                task_config(task, args).model.position != "block"
                and max(args.eval_noise, default=0) > args.noise_target
            ):
                raise ConfigError(
                    f"--eval-noise above --noise-target ({args.noise_target}) needs model.position=block "
                    f"(a learned position table has no rows past the longest training sample)"
                )
    except ConfigError as err:
        raise UsageError(str(err)) from None
    return args, tasks, seeds


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, tasks, seeds = parse_args(argv)
    except UsageError as err:
        return refuse("bench_recurrent", str(err))
    check_report(args.json, "bench_recurrent")
    q, cores = args.quick, sorted(os.sched_getaffinity(0))
    rows: list = []
    if len(seeds) > 1:
        slots = [set(cores[i * args.threads : (i + 1) * args.threads]) for i in range(args.jobs)]
        try:
            rows, per_seed = run_seeds(argv, seeds, slots)
        except RuntimeError as err:
            print(f"bench_recurrent: {err}", file=sys.stderr)
            return 1
        summary = {"seeds": seeds}
        for task in tasks:
            accuracies = [per_seed[task][s]["accuracy"] for s in seeds]
            mean, low = statistics.mean(accuracies), min(accuracies)
            summary.update(
                {f"{task}_accuracy": mean, f"{task}_accuracy_min": low, f"{task}_accuracy_per_seed": accuracies}
            )
            print(
                f"{task}: accuracy per seed {', '.join(f'{s}: {a:.3f}' for s, a in zip(seeds, accuracies))}; "
                f"mean {mean:.3f}, min {low:.3f}",
                flush=True,
            )
        summary["max_noise_tokens"] = min(r["noise_length"] for task in tasks for r in per_seed[task].values())
    else:
        results = {task: train_task(task, args, rows) for task in tasks}
        for task, r in results.items():
            rows.append({"part": "result", "task": task, **r})
            print(json.dumps(rows[-1]), flush=True)
        summary = {f"{task}_accuracy": r["accuracy"] for task, r in results.items()}
        summary["max_noise_tokens"] = min(r["noise_length"] for r in results.values())
    if not args.no_decode:
        mem = {arch: decode_profile(arch, args, rows) for arch in ("mixer", "recurrent", "transformer")}
        summary.update({f"{arch}_decode_mem_growth": mem[arch][2048] / mem[arch][128] for arch in mem})
    print(json.dumps(summary, indent=1))
    if args.json:
        where = machine(threads=args.threads, jobs=args.jobs, quick=q)
        write_report(args.json, "bench_recurrent", rows, summary, where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
