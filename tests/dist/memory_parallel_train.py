"""Train a few steps with memory layers under the current launch and save, on global rank 0,
the losses and the full (reassembled) parameters and gradients (``.grad``: sharded memory
tables are outside megatron DDP's buffers, so ``main_grad`` does not cover them).

    python -m torch.distributed.run --nproc_per_node=4 tests/dist/memory_parallel_train.py OUT.pt key=value...
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
    grads = gather_full(trainer.chunks, lambda p: p.grad)
    params = gather_full(trainer.chunks)
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": [m["lm loss"] for m in history], "grad_norms": [m["grad_norm"] for m in history],
                    "grads": grads, "params": params}, out)
    parallel.destroy()


if __name__ == "__main__":
    main()
