"""The megatron-core and torch symbols rmt replaces (``rmt.parallel.compat.PATCHES``) exist in the
installed releases with the parameters their replacements expect: one named test per symbol, so an
upgrade that renames or reshapes one fails by its name, not somewhere at run time."""

import pytest
import torch

from rmt.parallel import compat


@pytest.mark.parametrize("patch", compat.PATCHES, ids=lambda p: p.target)
def test_symbol_holds_its_contract(patch):
    assert compat.contract_problem(patch) is None


def test_apply_replaces_exactly_the_listed_symbols():
    compat.apply()
    listed = {p.target for p in compat.PATCHES if not p.where.startswith("rmt.")}
    if torch.cuda.is_available():
        listed = {p.target for p in compat.PATCHES if not p.where.startswith("rmt.") and not p.cpu_only}
    assert compat.replaced() == listed
    for patch in compat.PATCHES:  # still judged by the release's own definition once replaced
        assert compat.contract_problem(patch) is None


def test_a_broken_contract_is_named():
    renamed = compat.Patch("megatron.core.tensor_parallel.mappings:_gather_along_first_dim_v2", None, "x")
    assert compat.contract_problem(renamed).startswith(
        "megatron.core.tensor_parallel.mappings:_gather_along_first_dim_v2 is gone"
    )
    reshaped = compat.Patch("megatron.core.tensor_parallel.mappings:_gather_along_first_dim", ("tensor", "group"), "x")
    assert compat.contract_problem(reshaped) == (
        "megatron.core.tensor_parallel.mappings:_gather_along_first_dim takes ('input_', 'group', "
        "'output_split_sizes', 'use_global_buffer'), the replacement expects ('tensor', 'group') first"
    )
    assert compat.contract_problem(compat.Patch("megatron.core.nonexistent_module:torch", None, "x")).startswith(
        "megatron.core.nonexistent_module:torch is gone (ModuleNotFoundError"
    )
