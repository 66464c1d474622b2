"""Tiny dense / PKM / MoE / UltraMem transformers trained for the same tokens on the default
corpus; prints their validation losses as a table (UltraMem arXiv 2411.12364, Table 1 in
miniature). Each model is ``configs/tiny.yaml`` plus the memory of ``configs/<kind>_tiny.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import time

import torch

from rmt.config import load_config, validate

VARIANTS = {"dense": None, "pkm": "configs/pkm_tiny.yaml", "moe": "configs/moe_tiny.yaml",
            "ultramem": "configs/ultramem_tiny.yaml"}


def _config(kind, steps, overrides):
    base = ["train.tensorboard_dir=null", "train.progress=false", f"train.steps={steps}",
            f"train.warmup_steps={max(1, steps // 10)}", f"train.eval_interval={steps}", "train.eval_iters=4"]
    return validate(load_config(VARIANTS[kind] or "configs/tiny.yaml", base + overrides), world_size=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="60 steps per model (~3 min on 2 cores)")
    ap.add_argument("--steps", type=int, help="training steps per model (default 300, quick 60)")
    ap.add_argument("--json", help="write {benchmark, machine, rows, summary} here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every model")
    args = ap.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)
    from rmt.parallel import destroy, initialize
    from rmt.training.trainer import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    rows = []
    initialize(_config("dense", steps, args.overrides))
    try:
        for kind in VARIANTS:
            cfg = _config(kind, steps, args.overrides)
            torch.manual_seed(cfg.train.seed)
            start = time.perf_counter()
            trainer = Trainer(cfg)
            history = trainer.train()
            params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
            rows.append({"model": kind, "params": params, "tokens": steps * trainer.global_batch * cfg.model.seq_length,
                         "train_loss": history[-1]["lm loss"], "val_loss": history[-1]["val_loss"],
                         "seconds": time.perf_counter() - start})
            print(f"{kind}: val_loss {rows[-1]['val_loss']:.4f}", flush=True)
    finally:
        destroy()
    print(f"\n{'model':<10} {'params':>10} {'tokens':>10} {'train loss':>11} {'val loss':>9} {'s':>7}")
    for r in rows:
        print(f"{r['model']:<10} {r['params']:>10} {r['tokens']:>10} {r['train_loss']:>11.4f} {r['val_loss']:>9.4f} "
              f"{r['seconds']:>7.1f}")
    by = {r["model"]: r["val_loss"] for r in rows}
    summary = {f"{k}_val_loss": v for k, v in by.items()}
    summary["ultramem_minus_dense_val_loss"] = by["ultramem"] - by["dense"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_memory_train",
                       "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                   "threads": torch.get_num_threads()},
                       "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
