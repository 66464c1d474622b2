"""Memory tables stream through checkpoints shard by shard, under any change of layout.

    python -m torch.distributed.run --nproc_per_node=4 tests/dist/table_checkpoint.py OUT_DIR CHUNK_BYTES

A ``N x D`` table with Adam's two moments (or row-wise Adagrad's per-row sums), each filled with
known global values, goes round a chain of layouts on 4 ranks: number-wise over 4 -> dimension-
wise over 2 (two replica groups) -> number-wise over 4, dimension-wise over 4 -> number-wise over
2 -> local, with per-row sums (number-wise only) number-wise over 4 -> over 2 -> local, and a
4-column table dimension-wise over 4 (one column per shard) -> number-wise over 4.
Every freshly built shard must equal the global table (drawn whole here) at its position (the
init does not depend on the layout); after every load each rank's weight and state shards must
equal the global tensors at the shard's position, and the bytes the load allocated (peak of live tensors, counted by a
TorchDispatchMode) must stay within one ``CHUNK_BYTES`` chunk: the new shard is read in place.
Rank 0 prints one JSON line per load with the measured peaks.
"""

import json
import sys

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from alloc_guard import AllocationTracker  # noqa: E402
from rmt.memory.table import MemoryTable  # noqa: E402
from rmt.ops.counter_normal import fill_normal_  # noqa: E402
from rmt.parallel import compat  # noqa: E402
from rmt.training.table_checkpoint import load_tables, save_tables  # noqa: E402

N, D = 4096, 32
STD = 0.5
KEYS = {"weight": 11, "exp_avg": 12, "exp_avg_sq": 13, "sum": 14}


def expected(name, dim=D):
    full = torch.empty(N, 1 if name == "sum" else dim)
    return fill_normal_(full, KEYS[name], std=STD)


class Holder(torch.nn.Module):
    """A module holding one table under the key ``memory.0.values.weight``."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.table.sharded_state_dict("memory.0.values.")


class States:
    """A stand-in optimizer: ``state[weight]`` holds the table-sized states."""

    def __init__(self, weight, names):
        self.state = {weight: {name: torch.zeros(weight.shape[0]) if name == "sum" else torch.zeros_like(weight)
                               for name in names}}


def build(partition, P, names, dim=D):
    """The ``N x dim`` table sharded over groups of ``P`` consecutive ranks (``partition`` local: whole)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g, g + P))) for g in range(0, world, P)]
    replicas = [dist.new_group(list(range(i, world, P))) for i in range(P)]
    if partition == "local":
        table = MemoryTable(N, dim, STD, init_key=KEYS["weight"])
    else:
        table = MemoryTable(N, dim, STD, partition, groups[rank // P], replica_index=rank // P,
                            replica_group=replicas[rank % P], init_key=KEYS["weight"])
    return Holder(table), States(table.weight, names)


def check(holder, states, label):
    table = holder.table
    rows, cols = table.shard_index
    torch.testing.assert_close(table.weight.data, expected("weight", table.dim)[rows, cols], rtol=0, atol=0,
                               msg=f"{label}: weight")
    for name, value in states.state[table.weight].items():
        want = expected(name)[rows].view(-1) if name == "sum" else expected(name, table.dim)[rows, cols]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"{label}: {name}")


def main():
    out, chunk = sys.argv[1], int(sys.argv[2])
    compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()  # a local table's replicas are megatron's data-parallel ones
    rank = dist.get_rank()
    adam, adagrad = ("exp_avg", "exp_avg_sq"), ("sum",)
    chains = [(adam, D, [("number", 4), ("dimension", 2), ("number", 4)]),
              (adam, D, [("dimension", 4), ("number", 2), ("local", 1)]),
              (adagrad, D, [("number", 4), ("number", 2), ("local", 1)]),
              (adam, 4, [("dimension", 4), ("number", 4)])]  # one column per dimension-wise shard
    for c, (names, dim, chain) in enumerate(chains):
        holder, states = build(*chain[0], names, dim)
        for name, value in states.state[holder.table.weight].items():  # known values to carry along
            rows, cols = holder.table.shard_index
            value.copy_(expected(name)[rows].view(-1) if name == "sum" else expected(name, dim)[rows, cols])
        check(holder, states, f"chain {c} start")
        for step, layout in enumerate(chain[1:]):
            path = f"{out}/chain{c}_{step}"
            save_tables(path, [holder], states, chunk)
            dist.barrier()
            holder, states = build(*layout, names, dim)
            rows, cols = holder.table.shard_index  # every layout draws its shard of the same global table
            assert torch.equal(holder.table.weight.data, expected("weight", dim)[rows, cols]), layout
            for value in states.state[holder.table.weight].values():
                value.zero_()
            holder.table.weight.data.zero_()
            with AllocationTracker() as tracker:
                load_tables(path, [holder], states, chunk)
            check(holder, states, f"{chain[step]} -> {layout}")
            peaks = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, tracker.peak)
            shard = holder.table.weight.numel() * 4
            if rank == 0:
                print(json.dumps({"from": chain[step], "to": layout, "shard_bytes": shard,
                                  "load_peak_bytes": peaks, "chunk_bytes": chunk}), flush=True)
            assert max(peaks) <= chunk, (layout, peaks, chunk)
            dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
