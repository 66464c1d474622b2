"""Count the collectives one training step issues under the current launch: every call of
torch.distributed's all-reduce, all-gather and reduce-scatter (and megatron-core's own aliases of
the last two) during the third step, by kind, buffer bytes (an all-gather's gathered output, a
reduce-scatter's input), group size and whether it was issued asynchronously.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist/step_collectives.py OUT.json key=value... [-- key=value...]

Runs separated by ``--`` train one after the other in the same processes, each with its own
megatron-core groups; rank 0 writes ``OUT.json``: a list, per run, of
``[kind, bytes, group size, asynchronous, calls]``.
"""

import collections
import json
import sys

import rmt

rmt.setup_process()
import torch.distributed as dist  # noqa: E402
from megatron.core.tensor_parallel import layers, mappings  # noqa: E402

CALLS = collections.Counter()
COUNTING = [False]


def counted(kind, fn, buffer_arg):
    def call(*args, **kwargs):
        if COUNTING[0]:
            buffer = args[buffer_arg]
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            ranks = dist.get_world_size(group) if group is not None else dist.get_world_size()
            key = (kind, buffer.numel() * buffer.element_size(), ranks, bool(kwargs.get("async_op")))
            CALLS[key] += 1
        return fn(*args, **kwargs)

    return call


def count_collectives():
    gather = counted("all_gather", dist.all_gather_into_tensor, 0)
    scatter = counted("reduce_scatter", dist.reduce_scatter_tensor, 1)
    dist.all_reduce = counted("all_reduce", dist.all_reduce, 0)
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gather, scatter
    for module in (layers, mappings):
        module.dist_all_gather_func, module.dist_reduce_scatter_func = gather, scatter


def record(overrides):
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, overrides))
    parallel.initialize(config)
    trainer = Trainer(config)
    for _ in range(2):
        trainer.train_step()
    CALLS.clear()
    COUNTING[0] = True
    trainer.train_step()
    COUNTING[0] = False
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return [list(key) + [n] for key, n in sorted(CALLS.items())]


def main(argv):
    out, rest = argv[0], argv[1:]
    runs, run = [], []
    for arg in rest + ["--"]:
        if arg == "--":
            runs.append(run)
            run = []
        else:
            run.append(arg)
    count_collectives()
    records = [record(r) for r in runs]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(records, f)
    from rmt import parallel

    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
