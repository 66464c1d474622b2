"""The memory tables' checkpoint format (:mod:`rmt.training.table_checkpoint`, format 1) is pinned
by a fixture that its writer made before the tables were reorganised (``tests/data/
table_checkpoint_format1``, written by ``tests/dist/table_fixture.py`` on 2 ranks: a number-wise
table with Adam's moments and a dimension-wise one with row-wise Adagrad's per-row sums): it loads
into the tables of today bit for bit, and today's writer makes the same files byte for byte."""

import json
import os

import pytest
import torch

from conftest import ROOT, load_script, run_python

FIXTURE = os.path.join(ROOT, "tests", "data", "table_checkpoint_format1")


@pytest.fixture(scope="module")
def fixture_script():
    return load_script("tests/dist/table_fixture.py")


@pytest.fixture
def single_process():
    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate

    parallel.initialize(validate(load_config(None, []), world_size=1))
    yield
    parallel.destroy()


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_fixture_names_every_block_with_its_descriptor():
    """One raw file and one JSON descriptor per saved block: the number-wise table's two row
    ranges of each tensor, the dimension-wise table's two column slices of its weight and its
    per-row sums once."""
    blocks = {
        "memory.0.values.weight": [f"{n}.r{r}.c0" for n in ("exp_avg", "exp_avg_sq", "weight") for r in (0, 8)],
        "memory.1.values.weight": ["sum.r0.c0", "weight.r0.c0", "weight.r0.c2"],
    }
    assert _files(FIXTURE) == sorted(
        os.path.join("tables", key, stem + ext)
        for key, stems in blocks.items()
        for stem in stems
        for ext in (".bin", ".json")
    )
    with open(os.path.join(FIXTURE, "tables", "memory.1.values.weight", "weight.r0.c2.json")) as f:
        assert json.load(f) == {
            "format": 1,
            "global_shape": [16, 4],
            "row0": 0,
            "col0": 2,
            "rows": 16,
            "cols": 2,
            "dtype": "float32",
        }


def test_fixture_loads_into_local_tables_bit_for_bit(single_process, fixture_script):
    """The saved shards, read into whole (local) tables and their states: the global values."""
    from rmt.memory.table import MemoryTable
    from rmt.training.table_checkpoint import load_tables

    script = fixture_script
    tables = [MemoryTable(script.N, script.D, 0.5, init_key=99) for _ in script.TABLES]
    holder, states = script.Holder(tables), script.States(tables)
    for table in tables:
        table.weight.data.zero_()
        for value in states.state[table.weight].values():
            value.zero_()
    load_tables(FIXTURE, [holder], states)
    for table, (_, names) in zip(tables, script.TABLES.values()):
        assert torch.equal(table.weight.data, script.expected("weight"))
        for name in names:
            want = script.expected(name)
            assert torch.equal(states.state[table.weight][name], want.view(-1) if name == "sum" else want), name


@pytest.mark.slow
def test_writer_makes_the_fixture_byte_for_byte(tmp_path):
    run_python(["tests/dist/table_fixture.py", str(tmp_path)], nproc=2)
    assert _files(tmp_path) == _files(FIXTURE)
    for name in _files(FIXTURE):
        with open(os.path.join(FIXTURE, name), "rb") as a, open(os.path.join(tmp_path, name), "rb") as b:
            assert a.read() == b.read(), name
