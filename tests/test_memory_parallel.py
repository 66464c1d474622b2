"""Sharded memory tables (UltraMem Appendix C/D) under torchrun gloo against the local table."""

import pytest

from conftest import run_python


@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_table_equals_local_and_sends_planned_bytes(nproc):
    out = run_python(["tests/dist/memory_parallel_table.py"], nproc=nproc).stdout
    for name in ("number", "number+owner_reduce", "dimension"):
        assert out.count(f"OK {name} P={nproc} ") == 2, out
