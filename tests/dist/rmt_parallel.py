"""Run the tiny RMT under several parallel layouts in one torchrun launch and compare each with
the single-process reference (losses of two train steps, gradients and weights after them).

    torchrun --nproc_per_node=2 tests/dist/rmt_parallel.py REFERENCE.pt LAYOUT [LAYOUT ...]

LAYOUT is ``tp``, ``pp`` or ``dp`` (two ranks each). The reference comes from
``tests/test_rmt_parallel.py`` (:func:`run_steps` in one process). Exit status 0 iff every
layout matches within 1e-5. The ``tp`` run also saves a checkpoint to the reference's
``save_dir`` (the test loads it with TP=1).
"""

import sys

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.config import load_config  # noqa: E402
from rmt.config_checks import validate  # noqa: E402
from rmt.parallel.sharding import gather_full  # noqa: E402
from rmt.training.trainer import Trainer  # noqa: E402

LAYOUTS = {"tp": ["parallel.tensor_model_parallel_size=2"],
           "pp": ["parallel.pipeline_model_parallel_size=2"],
           "dp": []}
TOL = 1e-5


def tiny_overrides(cache_dir: str):
    return ["model.arch=rmt", "model.position=alibi", "model.num_layers=2", "model.dk=8",
            "model.dv=8", "model.rank=4", "model.ffn_hidden_size=64", "model.seq_length=32",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2",
            "train.warmup_steps=0", "train.lr=1e-2", "train.z_loss=1e-4", "train.eval_iters=1",
            "train.progress=false", "data.max_documents=20", "data.split=80,20,0", f"data.cache_dir={cache_dir}"]


def run_steps(overrides, world_size: int) -> dict:
    """Two train steps (then a checkpoint if ``train.save`` is set); losses, then full
    gradients and weights (every rank gets them)."""
    config = validate(load_config(None, overrides), world_size)
    parallel.initialize(config)
    trainer = Trainer(config)
    losses = [trainer.train_step()["lm loss"] for _ in range(2)]
    if config.train.save:
        trainer.save()
    grads = gather_full(trainer.chunks, lambda p: p.main_grad)
    weights = gather_full(trainer.chunks)
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "grads": grads, "weights": weights}


def compare(name: str, ref: dict, got: dict) -> list:
    errors = []
    for a, b in zip(ref["losses"], got["losses"]):
        if abs(a - b) > TOL:
            errors.append(f"{name}: loss {b} != reference {a}")
    for kind in ("grads", "weights"):
        if sorted(ref[kind]) != sorted(got[kind]):
            errors.append(f"{name}: {kind} keys differ")
            continue
        for key, value in ref[kind].items():
            diff = (value - got[kind][key]).abs().max().item()
            if diff > TOL:
                errors.append(f"{name}: {kind} {key} differs by {diff}")
    return errors


def main() -> int:
    ref = torch.load(sys.argv[1])
    errors = []
    for layout in sys.argv[2:]:
        save = [f"train.save={ref['save_dir']}"] if layout == "tp" else []
        got = run_steps(tiny_overrides(ref["cache_dir"]) + LAYOUTS[layout] + save, 2)
        errors += compare(layout, ref, got)
    if torch.distributed.get_rank() == 0:
        print("\n".join(errors) or "all layouts equal the single-process run")
    parallel.destroy()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
