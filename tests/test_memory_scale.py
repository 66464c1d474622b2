"""A memory table costs its shard (issue #14): layout-independent counter-based init drawn shard
by shard, no whole-table per-slot state (computed IVE shuffle, per-shard hit counts, exact E[Y]
for the improved init), checkpoints streamed by shard under any change of layout."""

import json
import math
import struct

import pytest
import torch

from rmt.memory.ive import AddressShuffle
from rmt.memory.retrieval import expected_topm_mean
from rmt.ops import counter_normal as cn
from rmt.planner.memory import TablePlan, resharding_read

from conftest import run_python, tiny_overrides


def spec_normal(key: int, e: int) -> float:
    """The specification of :mod:`rmt.ops.counter_normal`, evaluated with Python floats (IEEE
    float64, no fused multiply-add), element by element."""
    M = (1 << 64) - 1
    z = (key + (e + 1) * cn.GAMMA) & M
    z = ((z ^ (z >> 30)) * cn.MIX1) & M
    z = ((z ^ (z >> 27)) * cn.MIX2) & M
    z ^= z >> 31
    bits = struct.unpack("<Q", struct.pack("<d", float((z >> 32) + 1)))[0]
    k = (bits >> 52) - 1023
    m = struct.unpack("<d", struct.pack("<Q", (bits & ((1 << 52) - 1)) | (1023 << 52)))[0]
    big = m >= cn.SQRT2
    m = m * 0.5 if big else m
    s = (m - 1.0) / (m + 1.0)

    def horner(t, coeffs):
        p = coeffs[-1]
        for c in reversed(coeffs[:-1]):
            p = p * t + c
        return p

    ln_u1 = float(k + big - 32) * cn.LN2 + s * horner(s * s, cn.LOG_COEFFS)
    q = (z >> 30) & 3
    x = float(z & 0x3FFFFFFF) * 2.0**-30 * cn.PIO2
    trig = x * horner(x * x, cn.SIN_COEFFS) if q & 1 else horner(x * x, cn.COS_COEFFS)
    return math.sqrt(ln_u1 * -2.0) * (-trig if q in (1, 2) else trig)


KEY = cn.stream_key(7, "memory.0.values.weight")


def test_cpu_kernel_is_the_specification_bit_for_bit():
    out = cn.fill_normal_(torch.empty(40, 24, dtype=torch.float64), KEY, row0=1000, col0=8, global_cols=64)
    want = torch.tensor(
        [[spec_normal(KEY, (1000 + r) * 64 + 8 + c) for c in range(24)] for r in range(40)], dtype=torch.float64
    )
    assert torch.equal(out, want)


def test_reference_matches_the_kernel_within_torchs_sqrt():
    """The torch formulation does the same IEEE operations except torch's vectorized float64
    sqrt, which is not correctly rounded (up to 1 ulp): float64 results agree within 1 ulp of
    the largest value, and float32 results (one rounding of those) agree exactly here."""
    kernel = cn.fill_normal_(torch.empty(512, 64, dtype=torch.float64), KEY)
    ref = cn.reference_fill_normal_(torch.empty(512, 64, dtype=torch.float64), KEY, 0, 0, 64, 1.0)
    assert (kernel - ref).abs().max() <= 2 * torch.finfo(torch.float64).eps * 8
    k32 = cn.fill_normal_(torch.empty(512, 64), KEY, std=0.3)
    r32 = cn.reference_fill_normal_(torch.empty(512, 64), KEY, 0, 0, 64, 0.3)
    assert torch.equal(k32, r32)


@pytest.mark.parametrize("fill", [cn.fill_normal_, lambda out, *a: cn.reference_fill_normal_(out, *a)])
def test_blocks_equal_the_whole_table_at_their_positions(fill, monkeypatch):
    """Number-wise rows, dimension-wise columns and reference chunk boundaries inside a block all
    give the global table's values: the draw does not depend on the layout."""
    monkeypatch.setattr(cn, "CHUNK_ELEMENTS", 100)  # the reference path crosses chunk boundaries
    N, D, std = 96, 16, 0.05
    whole = fill(torch.empty(N, D), KEY, 0, 0, D, std)
    for P in (1, 2, 4):
        for r in range(P):
            rows = fill(torch.empty(N // P, D), KEY, r * N // P, 0, D, std)
            cols = fill(torch.empty(N, D // P), KEY, 0, r * D // P, D, std)
            assert torch.equal(rows, whole[r * N // P : (r + 1) * N // P])
            assert torch.equal(cols, whole[:, r * D // P : (r + 1) * D // P])


def test_draws_are_standard_normal_and_narrow_dtypes_round_once():
    x = cn.fill_normal_(torch.empty(1 << 20, dtype=torch.float64).view(-1, 64), KEY).flatten()
    n = x.numel()
    assert abs(float(x.mean())) < 5 / math.sqrt(n)
    assert abs(float(x.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((x > 1.959964).double().mean()) - 0.025) < 5 * math.sqrt(0.025 * 0.975 / n)
    assert float(x.abs().max()) <= math.sqrt(64 * math.log(2))
    half = cn.fill_normal_(torch.empty(256, 64, dtype=torch.bfloat16), KEY, std=0.1)
    wide = cn.fill_normal_(torch.empty(256, 64, dtype=torch.float64), KEY, std=0.1)
    assert torch.equal(half, wide.to(torch.bfloat16))


def test_fill_rejects_blocks_outside_the_global_width():
    with pytest.raises(ValueError, match="does not fit a global width of 16"):
        cn.fill_normal_(torch.empty(4, 8), KEY, col0=12, global_cols=16)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 181])
def test_ive_shuffle_is_a_bijection_with_its_inverse(n):
    shuffle = AddressShuffle(n, seed=3)
    v = torch.arange(n * n)
    p = shuffle(v)
    assert torch.equal(p.sort().values, v)
    assert torch.equal(shuffle.inverse(p), v)
    if n >= 64:  # shuffled: few fixed points, neighbours scattered
        assert int((p == v).sum()) < 8
        assert float((p[1:] - p[:-1]).abs().float().median()) > n


def test_ive_shuffle_depends_on_the_seed_only():
    a, b, c = AddressShuffle(100, 1), AddressShuffle(100, 1), AddressShuffle(100, 2)
    v = torch.arange(10000)
    assert torch.equal(a(v), b(v)) and not torch.equal(a(v), c(v))


@pytest.mark.parametrize(
    "K,m,exact", [(2, 1, 1 / math.sqrt(math.pi)), (3, 1, 1.5 / math.sqrt(math.pi)), (5, 5, 0.0), (1, 1, 0.0)]
)
def test_expected_topm_mean_closed_forms(K, m, exact):
    assert expected_topm_mean(K, m) == pytest.approx(exact, abs=1e-9)


@pytest.mark.parametrize("K,m", [(64, 4), (1000, 16)])
def test_expected_topm_mean_agrees_with_sampling(K, m):
    draws = torch.randn(20000, K, generator=torch.Generator().manual_seed(0)).topk(m, dim=-1).values.mean(-1)
    error = 5 * float(draws.std()) / math.sqrt(draws.numel())
    assert expected_topm_mean(K, m) == pytest.approx(float(draws.mean()), abs=error)
    assert expected_topm_mean(K, m, samples=2000, seed=1) == pytest.approx(float(draws.mean()), abs=0.02)


def test_expected_topm_mean_for_billions_of_candidates_is_cheap():
    """10^10 candidates (too many to sample): the asymptotic expansion of the expected maximum,
    sqrt(2 ln K) - (ln ln K + ln 4 pi - 2 gamma) / (2 sqrt(2 ln K)), is within 0.01 of it."""
    L = math.log(1e10)
    asymptotic = math.sqrt(2 * L) - (math.log(L) + math.log(4 * math.pi) - 2 * 0.5772156649) / (2 * math.sqrt(2 * L))
    assert expected_topm_mean(10**10, 1) == pytest.approx(asymptotic, abs=0.01)
    assert expected_topm_mean(10**10, 16) < expected_topm_mean(10**10, 1)


@pytest.mark.slow
def test_table_checkpoints_reshard_through_chains_of_layouts_within_one_chunk(tmp_path):
    """4 ranks: number(4) -> dimension(2) -> number(4), dimension(4) -> number(2) -> local, with
    per-row state number(4) -> number(2) -> local, and one-column shards dimension(4) -> number(4);
    every init and every load exact, and
    each load allocates at most one chunk beside the new shard (read in place when the saved
    blocks have the shard's columns)."""
    chunk = 16384
    proc = run_python(["tests/dist/table_checkpoint.py", str(tmp_path), str(chunk)], nproc=4)
    loads = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(loads) == 7
    for load in loads:
        assert max(load["load_peak_bytes"]) <= chunk
        same_width = load["from"][0] != "dimension" and load["to"][0] != "dimension"
        assert (max(load["load_peak_bytes"]) == 0) == same_width, load
    # rmt-plan memory's resharding buffer, exactly, for the partition switch at one group size
    switch = [load for load in loads if load["from"] == ["dimension", 4] and load["to"] == ["number", 4]]
    assert len(switch) == 1
    plan = TablePlan(slots=4096, dim=4, group_size=4, partition="number")
    assert (
        max(switch[0]["load_peak_bytes"])
        == min(chunk, resharding_read(plan, switch[0]["shard_bytes"]))
        == switch[0]["shard_bytes"] // 4
    )


MEMORY = ["memory.type=ultramem", "memory.placement='1:2'", "memory.num_keys=512", "memory.topk=4", "memory.key_dim=16"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["memory.partition=number", "memory.value_optimizer=sparse_adam"],
        ["memory.partition=number", "memory.owner_reduce=true", "memory.value_optimizer=rowwise_adagrad"],
        ["memory.partition=dimension", "memory.value_optimizer=adamw"],
    ],
    ids=["number-sparse_adam", "number-owner_reduce-rowwise_adagrad", "dimension-adamw"],
)
def test_no_rank_allocates_the_whole_table(layout, cache_dir, tmp_path):
    """Trainer init, two steps, a save and a load on 4 ranks (262,144 slots of 16): no tensor
    larger than the rank's shard, no integer per-slot array of the whole table."""
    args = tiny_overrides(cache_dir, steps=2) + ["train.global_batch_size=8"] + MEMORY + layout
    proc = run_python(["tests/dist/no_whole_table.py", str(tmp_path / "ckpt")] + args, nproc=4)
    assert "OK" in proc.stdout, proc.stdout[-2000:]


RESUME_SCRIPT = """
import json, sys, torch
from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.memory import table
from rmt.training.trainer import Trainer
out, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
draws = []
fill = table.fill_normal_
table.fill_normal_ = lambda weight, *a, **k: draws.append(weight.shape) or fill(weight, *a, **k)
config = validate(load_config(None, overrides + [f"train.steps={steps}"]), world_size=1)
parallel.initialize(config)
trainer = Trainer(config)
built = {n: p.detach().clone() for n, p in trainer.chunks[0].named_parameters() if "values" in n}
trainer.train()
torch.save({"draws": len(draws), "built": built, "final": {n: p.detach().clone() for n, p in
            trainer.chunks[0].named_parameters() if "values" in n}}, out)
parallel.destroy()
"""


@pytest.mark.slow
def test_a_resumed_run_does_not_draw_the_tables_it_loads(tmp_path, cache_dir):
    """A restart allocates its shards without drawing them (the load overwrites every value): no
    counter-normal fill runs, and the tables start as the checkpoint holds them."""
    overrides = tiny_overrides(cache_dir) + MEMORY + [f"train.save={tmp_path}/ckpt", "train.save_interval=2"]

    def run(steps, name):
        run_python(["-c", RESUME_SCRIPT, str(tmp_path / name), str(steps)] + overrides)
        return torch.load(tmp_path / name)

    first = run(2, "first.pt")
    assert first["draws"] >= 1 and first["built"]
    second = run(3, "second.pt")
    assert second["draws"] == 0
    assert second["built"].keys() == first["final"].keys()
    for name, values in second["built"].items():
        assert torch.equal(values, first["final"][name]), name
