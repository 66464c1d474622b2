"""``rmt-train``: train (or evaluate) a model from a YAML config plus dotted overrides.

    rmt-train --config configs/tiny.yaml train.steps=50 model.num_layers=4
    torchrun --nproc_per_node=4 -m rmt.training.cli --config X parallel.tensor_model_parallel_size=2
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import List, Optional

from rmt.config import load_config, validate
from rmt.errors import cli_entry


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rmt-train",
        description="Train a model. Settings come from the schema defaults, then --config, then "
                    "section.key=value overrides (see docs/config.md for every key).")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    ap.add_argument("--eval-only", action="store_true",
                    help="load train.load, report the validation loss and exit")
    ap.add_argument("--json", metavar="FILE",
                    help="write the final metrics (and the loss history) as JSON")
    return ap


@cli_entry("rmt-train")
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # megatron-core announces every missing optional accelerator library (apex, TE) on import.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    config = validate(load_config(args.config, args.overrides))
    if args.eval_only and not config.train.load:
        from rmt.errors import ConfigError

        raise ConfigError("--eval-only needs train.load=<checkpoint directory>")
    from rmt import parallel
    from rmt.training.trainer import Trainer

    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        if args.eval_only:
            result = {"val_loss": trainer.evaluate(), "iteration": trainer.iteration}
            print(f"validation loss {result['val_loss']:.6f} at iteration {trainer.iteration}")
        else:
            history = trainer.train()
            result = {"history": history, "final": history[-1] if history else None}
        if args.json and _rank() == 0:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        parallel.destroy()
    return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


if __name__ == "__main__":
    sys.exit(main())
