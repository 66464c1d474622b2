"""``rmt-train``: train (or evaluate) a model from a YAML config plus dotted overrides.

    rmt-train --config configs/tiny.yaml train.steps=50 model.num_layers=4
    torchrun --nproc_per_node=4 -m rmt.training.cli --config X parallel.tensor_model_parallel_size=2

The same command line serves the first start and every restart: a run continues from the
newest complete checkpoint under ``train.save``. SIGTERM or SIGUSR1 make it save at the next
step boundary and exit with status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import List, Optional

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.data.resolution import resolve_from_data
from rmt.errors import ConfigError, JobError, cli_entry, global_rank
from rmt.models.fused_softmax import check_fused_softmax
from rmt.outputs import check_output, write_json
from rmt.process import require_tested_megatron_core, setup_process
from rmt.training import checkpoint_dirs, preemption
from rmt.training.fit import check_fits


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rmt-train",
        description="Train a model. Settings come from the schema defaults, then --config, then "
        "section.key=value overrides (see docs/config.md for every key).",
    )
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    ap.add_argument("--eval-only", action="store_true", help="load train.load, report the validation loss and exit")
    ap.add_argument("--json", metavar="FILE", help="write the final metrics (and the loss history) as JSON")
    ap.add_argument(
        "--check",
        action="store_true",
        help="check the config for the launcher's world size (WORLD_SIZE or SLURM_NTASKS) "
        "and the checkpoint the run would continue from, say where it would start, "
        "and exit (status 2 on a problem); the launch scripts run this before "
        "starting workers",
    )
    return ap


def checked_config(args: argparse.Namespace, world_size: Optional[int] = None):
    """The validated config of ``args`` for ``world_size`` (default: the launcher's), with the
    settings its data decides filled in (:func:`rmt.data.resolution.resolve_from_data`)."""
    config, _ = resolve_from_data(validate(load_config(args.config, args.overrides), world_size))
    check_fused_softmax(config)  # this machine's kernels: validate() also serves the planner's other machines
    if args.eval_only:
        if not config.train.load:
            raise ConfigError("--eval-only needs train.load=<checkpoint directory>")
        if not config.train.eval_iters:
            raise ConfigError("--eval-only needs train.eval_iters > 0 (validation batches to evaluate)")
        config.train = dataclasses.replace(config.train, save=None)  # evaluate train.load, save nothing
    check_outputs(config, args.json, args.eval_only)
    check_fits(config, args.config, args.overrides, world_size=world_size)
    return config


def check_outputs(config, json_path: Optional[str], eval_only: bool) -> None:
    """Every place the run writes can be written (:mod:`rmt.outputs`; the checkpoint's room is
    checked once the model exists, :func:`rmt.training.checkpoint.check_space`): the checkpoint
    directory on every rank, which all write into it; the logs and ``--json`` on global rank 0,
    the one that writes them."""
    t = config.train
    if t.save:
        check_output(t.save, "train.save", directory=True)
    if global_rank() != 0:
        return
    if t.log_file and not eval_only:
        check_output(t.log_file, "train.log_file")
    if t.tensorboard_dir and not eval_only:
        check_output(t.tensorboard_dir, "train.tensorboard_dir", directory=True)
    if json_path:
        check_output(json_path, "--json")


def preflight(args: argparse.Namespace, world_size: Optional[int] = None) -> str:
    """Everything that can be checked before any worker starts: the megatron-core release, the
    config for ``world_size`` and the checkpoint the run would continue from. Returns where the run would start; raises
    ``UserError`` (one sentence) on a problem."""
    from rmt.export.importer import is_hf_directory

    require_tested_megatron_core()
    t = checked_config(args, world_size).train
    if is_hf_directory(t.load) and not (t.save and checkpoint_dirs.complete_checkpoints(t.save)[0]):
        return f"the run would start from the weights of the Hugging Face model '{t.load}'"
    candidates, notes, _ = checkpoint_dirs.resume_plan(t.save, t.load)
    start = f"the run would continue from '{candidates[0]}'" if candidates else "the run would start from step 0"
    return "; ".join(notes + [start])


@cli_entry("rmt-train")
def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow --eval-only etc.
    preemption.install()  # before the slow imports, so an early SIGTERM is not lost
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its own session, so tie it to torchrun
        from rmt.parallel.lifetime import die_with_parent

        die_with_parent(os.getppid())
    if args.check:
        print(f"rmt-train: config OK; {preflight(args)}")
        return 0
    config = checked_config(args)
    from rmt import parallel
    from rmt.training.trainer import Trainer

    if args.eval_only:
        config = with_saved_average(config)

    parallel.initialize(config)
    try:
        _train_or_evaluate(args, config, Trainer)
    except RuntimeError as err:  # the others' collectives fail when a rank dies: one line, not a traceback
        reason = parallel.lost_peer(err)
        if reason is None:
            raise
        raise JobError(
            f"a collective with the other ranks failed ({reason}): another rank stopped (its launcher names a "
            f"rank killed by a signal) or the network between them failed"
        ) from None
    finally:
        parallel.destroy()
    return 0


def _train_or_evaluate(args: argparse.Namespace, config, trainer_class) -> None:
    """Train (or with ``--eval-only`` evaluate) and write ``--json``."""
    trainer = trainer_class(config)
    if args.eval_only:
        result = {"val_loss": trainer.evaluate(), "iteration": trainer.iteration}
        line = f"validation loss {result['val_loss']:.6f} at iteration {trainer.iteration}"
        if trainer.average is not None:  # train.ema_decay: the checkpoint's weight average too
            result["val_loss_ema"] = trainer.evaluate_average()
            line += f"; its weight average {result['val_loss_ema']:.6f}"
        print(line)
    else:
        history = trainer.train()
        result = {"history": history, "final": history[-1] if history else None}
    if args.json and _rank() == 0:
        write_json(args.json, result)
        print(f"metrics written to '{args.json}'")


def with_saved_average(config):
    """``config`` with the ``train.ema_decay`` of the checkpoint it evaluates, when the command line
    leaves it out and the checkpoint holds a weight average, so ``--eval-only`` reports both."""
    from rmt.training.checkpoint import load_common

    if config.train.ema_decay is not None:
        return config
    saved = load_common(config.train.load)
    if not saved.get("ema"):
        return config
    config.train = dataclasses.replace(config.train, ema_decay=saved["config"]["train"]["ema_decay"])
    return config


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


if __name__ == "__main__":
    sys.exit(main())
