"""The trainer meets the memory layers and the data through one object each
(:class:`rmt.memory.hooks.MemoryHooks`, :class:`rmt.data.training_data.TrainingData`)."""

import ast
from pathlib import Path

import torch

from rmt.config import load_config
from rmt.config_checks import validate

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path):
    """``(module, name)`` of every import in ``path`` (name None for ``import module``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
    return out


def test_trainer_imports_one_memory_and_one_data_interface():
    imports = _imports(ROOT / "rmt/training/trainer.py")
    memory = [
        i
        for i in imports
        if i[0] == "rmt.memory" or i[0].startswith("rmt.memory.") or (i[0] == "rmt" and i[1] == "memory")
    ]
    data = [
        i for i in imports if i[0] == "rmt.data" or i[0].startswith("rmt.data.") or (i[0] == "rmt" and i[1] == "data")
    ]
    assert memory == [("rmt.memory.hooks", "MemoryHooks")]
    assert data == [("rmt.data.training_data", "TrainingData")]


def test_ddp_wrapping_reaches_memory_only_through_the_hooks():
    imports = _imports(ROOT / "rmt/training/ddp.py")
    assert [i for i in imports if i[0].startswith("rmt.memory")] == [("rmt.memory.hooks", "MemoryHooks")]


class _Update:
    final = None


def test_fused_updates_step_on_the_last_microbatch_of_each_chunk():
    """``before_forward`` counts each chunk's micro-batches of the step: only the last one's
    backward steps the fused tables (``final``), again from the next :meth:`start_step`."""
    from rmt.memory.descriptor import TableDescriptor, describe
    from rmt.memory.hooks import MemoryHooks
    from rmt.memory.storage import DeviceStorage

    config = validate(load_config(None, ["model.vocab_size=300"]))
    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    updates = [_Update(), _Update()]
    for chunk, update in zip(chunks, updates):
        describe(chunk.weight, TableDescriptor(2, 2, DeviceStorage("cpu"), fused_update=update))
    hooks = MemoryHooks(config)
    hooks.bind(chunks, num_microbatches=3)
    for step in range(2):
        hooks.start_step()
        seen = []
        for mb in range(3):
            for c in (0, 1):
                hooks.before_forward(c)
                seen.append((updates[0].final, updates[1].final))
        assert seen[-1] == (True, True)
        assert seen[:4] == [(False, None if step == 0 else True), (False, False), (False, False), (False, False)]
        assert seen[4] == (True, False)
