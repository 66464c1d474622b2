"""Write the table-checkpoint fixture of ``tests/test_table_checkpoint_format.py`` on 2 ranks.

    python -m torch.distributed.run --nproc_per_node=2 tests/dist/table_fixture.py OUT_DIR

Two ``16 x 4`` tables with known values (counter-stream normals, :data:`KEYS`): ``memory.0``
number-wise over the 2 ranks with Adam's two moments, ``memory.1`` dimension-wise over them with
row-wise Adagrad's per-row sums; :func:`rmt.training.table_checkpoint.save_tables` writes them.
"""

import sys

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from rmt.memory.table import MemoryTable  # noqa: E402
from rmt.ops.counter_normal import fill_normal_  # noqa: E402
from rmt.parallel import compat  # noqa: E402
from rmt.training.table_checkpoint import save_tables  # noqa: E402

N, D = 16, 4
KEYS = {"weight": 21, "exp_avg": 22, "exp_avg_sq": 23, "sum": 24}
TABLES = {0: ("number", ("exp_avg", "exp_avg_sq")), 1: ("dimension", ("sum",))}


def expected(name: str) -> torch.Tensor:
    """The global values of tensor ``name`` (a per-row state as one column)."""
    return fill_normal_(torch.empty(N, 1 if name == "sum" else D), KEYS[name], std=0.5)


class Holder(torch.nn.Module):
    """The tables under the keys ``memory.<k>.values.weight``."""

    def __init__(self, tables):
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = {}
        for k, table in enumerate(self.tables):
            out.update(table.sharded_state_dict(f"memory.{k}.values."))
        return out


class States:
    """A stand-in optimizer: ``state[weight]`` holds the table-sized states, at their values."""

    def __init__(self, tables):
        self.state = {}
        for table, (_, names) in zip(tables, TABLES.values()):
            rows, cols = table.shard_index
            self.state[table.weight] = {
                name: expected(name)[rows].view(-1).clone() if name == "sum" else expected(name)[rows, cols].clone()
                for name in names
            }


def main():
    compat.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    tables = [
        MemoryTable(N, D, 0.5, partition, dist.group.WORLD, init_key=KEYS["weight"]) for partition, _ in TABLES.values()
    ]
    save_tables(sys.argv[1], [Holder(tables)], States(tables))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
