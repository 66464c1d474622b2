"""Train a few steps under the current launch (plain python or torchrun) and save, on global
rank 0, the loss history and the full (reassembled) parameters and gradients (``.grad``, which
the trainer points at megatron DDP's ``main_grad`` and which sharded or sparse-gradient memory
tables, outside DDP, fill directly; sparse ones are saved dense, tables stepped in their backward
as zeros).

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
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": [m["lm loss"] for m in history],
                    "grad_norms": [m["grad_norm"] for m in history],
                    "val": [m.get("val_loss") for m in history],
                    "grads": grads, "params": params}, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
