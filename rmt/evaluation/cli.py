"""``rmt-eval``: lm-evaluation-harness on an rmt checkpoint of any architecture.

    rmt-eval --checkpoint ckpt/ --tasks rmt_local
    rmt-eval --checkpoint ckpt/ --tasks hellaswag,arc_easy,lambada_openai,piqa --batch-size 16

The model is rebuilt from the checkpoint's saved config on one process (any saved TP/PP
layout is resharded on load, as in ``rmt-generate``), with the dataset's own tokenizer, and
evaluated through the ``rmt`` model class (:mod:`rmt.evaluation.harness`). The shipped local
tasks (``rmt_local`` and its four subtasks, ``rmt/evaluation/tasks/``) are always available;
standard tasks download their data from the Hugging Face hub.

This module imports torch, lm-eval and the model code only once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from rmt.errors import UserError, cli_entry
from rmt.outputs import check_output, write_json
from rmt.process import setup_process

#: The shipped local task configs (no hub needed).
LOCAL_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rmt-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="a save root (its newest complete checkpoint is used) or one iter_* directory",
    )
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names (globs allowed)")
    ap.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="another folder of task YAMLs (repeatable); the shipped local tasks are always included",
    )
    ap.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    ap.add_argument(
        "--limit",
        type=float,
        default=None,
        help="evaluate only this many documents per task (a fraction when < 1); for checks, not scores",
    )
    ap.add_argument("--max-gen-toks", type=int, default=256, help="default cap on generated tokens (default 256)")
    ap.add_argument("--device", default=None, help="torch device to evaluate on (default: where the model is built)")
    ap.add_argument(
        "--average",
        action="store_true",
        help="evaluate the checkpoint's weight average (train.ema_decay) instead of the trained weights",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of few-shot sampling and of sampled generation")
    ap.add_argument(
        "--bootstrap-iters", type=int, default=1000, help="bootstrap resamples for standard errors (0: none)"
    )
    ap.add_argument("--log-samples", action="store_true", help="keep every request's answers in the --json output")
    ap.add_argument("--json", metavar="FILE", help="write lm-eval's results (and samples) as JSON")
    ap.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides of the saved config (e.g. train.precision=fp32)",
    )
    return ap


def _check_args(args) -> None:
    if args.batch_size < 1 or args.max_gen_toks < 1:
        raise UserError("--batch-size and --max-gen-toks must be positive")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError("--num-fewshot must be non-negative")
    if args.limit is not None and args.limit <= 0:
        raise UserError("--limit must be positive")
    for path in args.include_path:
        if not os.path.isdir(path):
            raise UserError(f"--include-path '{path}' is not a directory")
    if args.json:
        check_output(args.json, "--json")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise UserError(
            "rmt-eval runs on one process (the checkpoint is resharded onto one device); launch it without torchrun"
        )


def task_manager(include_paths: List[str], defaults: bool = True):
    """lm-eval's task index over the shipped local tasks, ``include_paths`` and, with
    ``defaults``, lm-eval's own tasks (indexing those takes seconds)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("rmt-eval needs lm-eval, the optional extra 'eval': pip install -e '.[eval]'") from None
    return TaskManager(include_path=[LOCAL_TASKS] + list(include_paths), include_defaults=defaults)


def resolve_tasks(spec: str, include_paths: List[str]):
    """``(task manager, task names)`` of ``--tasks``; lm-eval's own tasks are indexed only
    when a name is not among the local ones."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks names no task")
    manager = task_manager(include_paths, defaults=False)
    if not all(manager.match_tasks([n]) for n in names):
        manager = task_manager(include_paths)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        raise UserError(
            f"unknown lm-eval task {', '.join(repr(n) for n in unknown)} (the local ones are "
            f"rmt_local, rmt_local_mc, rmt_local_cloze, rmt_local_gen and rmt_local_rolling)"
        )
    return manager, manager.match_tasks(names)


@cli_entry("rmt-eval")
def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow the options
    _check_args(args)
    manager, tasks = resolve_tasks(args.tasks, args.include_path)

    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table

    from rmt import parallel
    from rmt.evaluation.harness import RMTLM

    try:
        lm = RMTLM(
            checkpoint=args.checkpoint,
            batch_size=args.batch_size,
            max_gen_toks=args.max_gen_toks,
            overrides=args.overrides,
            average=args.average,
            device=args.device,
        )
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            task_manager=manager,
            log_samples=args.log_samples,
            bootstrap_iters=args.bootstrap_iters,
            random_seed=args.seed,
            numpy_random_seed=args.seed,
            torch_random_seed=args.seed,
            fewshot_random_seed=args.seed,
        )
    finally:
        parallel.destroy()
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if args.json:
        results["rmt"] = {
            "checkpoint": os.path.abspath(args.checkpoint),
            "overrides": args.overrides,
            "average": args.average,
        }
        write_json(args.json, results, default=handle_non_serializable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
