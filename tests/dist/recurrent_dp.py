"""Train the recurrent transformer and the mixer a few steps on the copy task under the current
launch (plain python or torchrun) and save, on global rank 0, losses and full gradients.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist/recurrent_dp.py OUT.pt
"""

import sys
import warnings

import torch

COMMON = ["model.num_layers=1", "model.hidden_size=16", "model.num_attention_heads=2", "model.seq_length=24",
          "model.block_width=4", "data.task=copy", "data.task_tokens=4", "data.task_alphabet=8",
          "data.noise_length=8", "train.steps=2", "train.warmup_steps=0", "train.micro_batch_size=2",
          "train.global_batch_size=4", "train.eval_iters=1", "train.progress=false"]


def main():
    warnings.filterwarnings("ignore")
    from rmt import parallel
    from rmt.config import load_config, validate
    from rmt.parallel.sharding import gather_full
    from rmt.training.trainer import Trainer

    result = {}
    for arch in ("recurrent", "mixer"):
        config = validate(load_config(None, COMMON + [f"model.arch={arch}"]))
        parallel.initialize(config)  # same layout for both: process groups are created once
        trainer = Trainer(config)
        history = trainer.train()
        grads = gather_full(trainer.chunks, lambda p: p.main_grad)
        result[arch] = {"losses": [m["lm loss"] for m in history], "grads": grads}
    if torch.distributed.get_rank() == 0:
        torch.save(result, sys.argv[1])
    parallel.destroy()


if __name__ == "__main__":
    main()
