"""Train a few steps under the current launch (plain python or torchrun) and save, on global
rank 0, the loss history, the full (reassembled) parameters and gradients (``.grad``, which
the trainer points at megatron DDP's ``main_grad`` and which sharded or sparse-gradient memory
tables, outside DDP, fill directly; sparse ones are saved dense, tables stepped in their backward
as zeros) and every rank's running statistics.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist/train_steps.py OUT.pt key=value...
"""

import sys
import warnings

import torch


def main():
    warnings.filterwarnings("ignore")
    out, overrides = sys.argv[1], sys.argv[2:]
    from rmt import parallel
    from rmt.config import load_config, validate
    from rmt.parallel.sharding import gather_full
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, overrides))
    parallel.initialize(config)
    trainer = Trainer(config)
    history = trainer.train()
    # a table stepped in its backward (memory.fused_value_optimizer) has no gradient: zeros
    grads = gather_full(trainer.chunks, lambda p: torch.zeros_like(p) if p.grad is None
                        else p.grad.to_dense() if p.grad.is_sparse else p.grad)
    params = gather_full(trainer.chunks)
    # running statistics (query BatchNorm) of every rank, by global name
    stats = {n: b.clone() for c in trainer.chunks for n, b in c.module.named_buffers() if "running_" in n}
    every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, stats)
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": [m["lm loss"] for m in history], "running_stats": every_rank,
                    "grad_norms": [m["grad_norm"] for m in history],
                    "val": [m.get("val_loss") for m in history],
                    "grads": grads, "params": params}, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
