"""No rank ever allocates a tensor of the whole memory table, nor whole-table per-slot state.

    python -m torch.distributed.run --nproc_per_node=P tests/dist/no_whole_table.py CKPT_DIR key=value...

Builds the trainer (model init), trains (including a checkpoint save) and builds a second
trainer that loads the checkpoint, all under a TorchDispatchMode that raises on any tensor of
more bytes than this rank's shard of the value table (so a copy of the shard in a wider dtype
fails too) and, for a number-wise table, on any integer or boolean tensor with a dimension as
long as the table (per-slot state of the whole table: a shuffle permutation, hit counters, flags,
slot lists; float tensors that long are the shard's own gradient or states, flattened). Then
checks that the guard does fire on such tensors.
Rank 0 prints ``OK`` with the largest tensor seen.
"""

import sys
import warnings

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402


def main():
    warnings.filterwarnings("ignore")
    ckpt, overrides = sys.argv[1], sys.argv[2:]
    from alloc_guard import AllocationTracker, ForbiddenAllocation
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.memory.layer import MemorySpec
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, overrides + [f"train.save={ckpt}"]))
    parallel.initialize(config)
    spec = MemorySpec.from_config(config)
    N, D, P = spec.num_values, spec.value_dim, torch.distributed.get_world_size()
    partition = config.memory.partition
    shard = N * D // P * 4  # bytes, fp32

    def forbid(t):
        size = t._values().nbytes if t.is_sparse else t.numel() * t.element_size()
        if size > shard:
            return f"{size} bytes, more than this rank's shard of the table ({shard})"
        integral = not (t.is_floating_point() or t.is_complex())
        if partition == "number" and integral and t.dim() and max(t.shape) >= N:
            return f"an integer tensor with a dimension as long as the whole table ({N} slots)"
        return None

    with AllocationTracker(forbid) as tracker:
        Trainer(config).train()
        torch.distributed.barrier()
        loaded = Trainer(validate(load_config(None, overrides + [f"train.load={ckpt}"])))
        assert loaded.iteration == config.train.steps
        controls = [lambda: torch.empty(N, D)] + ([lambda: torch.zeros(N, dtype=torch.uint8)]
                                                   if partition == "number" else [])
        for make in controls:
            try:
                make()
            except ForbiddenAllocation:
                continue
            raise AssertionError("the guard let a whole-table tensor through")
    if torch.distributed.get_rank() == 0:
        print(f"OK {partition}: largest tensor {tracker.largest} bytes, shard {shard} bytes", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
