"""memory.value_dtype: a bf16 value table is stored in bf16 and everything computed from it is the
fp32 computation on the stored values (the kernels accumulate in fp32); each value optimizer's
step on a bf16 table is its fp32 step rounded once (its state as rmt.ops.sparse_optim states it:
fp32 for sparse_adam and rowwise_adagrad, torch AdamW's moments in the table's dtype); checkpoints
keep both dtypes and convert between them."""

import pytest
import torch
from test_memory_integration import _cfg, megatron  # noqa: F401  (single-process megatron fixture)

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.ops.sparse_optim import RowWiseAdagrad, SparseAdam


def _model(value_dtype, optimizer):
    from rmt.models.build import build

    (chunk,) = build(
        validate(_cfg(f"memory.value_dtype={value_dtype}", f"memory.value_optimizer={optimizer}"), world_size=1)
    )
    return chunk


@pytest.mark.parametrize("optimizer", ["adamw", "sparse_adam"])
def test_bf16_table_model_is_the_fp32_model_on_the_stored_values(megatron, optimizer):
    """Same init (the bf16 table is the fp32 draw rounded once); forward and backward on the same
    batch: equal losses bit for bit, and each bf16 table gradient is the fp32 one rounded once."""
    wide, narrow = _model("fp32", optimizer), _model("bf16", optimizer)
    tables = [(a.values.weight, b.values.weight) for a, b in zip(wide.memory, narrow.memory)]
    for w, n in tables:
        assert n.dtype == torch.bfloat16 and torch.equal(n, w.detach().to(torch.bfloat16))
        with torch.no_grad():
            w.copy_(n.float())
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None]
    losses = []
    for model in (wide, narrow):
        logits = model(tokens, positions, mask)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for w, n in tables:
        gw, gn = (t.grad.to_dense() if t.grad.is_sparse else t.grad for t in (w, n))
        assert gn.dtype == torch.bfloat16 and gw.abs().sum() > 0
        assert torch.equal(gn, gw.to(torch.bfloat16))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)


@pytest.mark.parametrize(
    "make,state_dtype",
    [
        (_adamw, torch.bfloat16),
        (lambda p: SparseAdam(p, lr=1e-2, betas=(0.9, 0.95), eps=1e-8), torch.float32),
        (lambda p: RowWiseAdagrad(p, lr=1e-2, eps=1e-8), torch.float32),
    ],
    ids=["adamw", "sparse_adam", "rowwise_adagrad"],
)
def test_a_bf16_step_is_the_fp32_step_rounded_once(make, state_dtype):
    """Table and gradient bf16-representable: the first step of the bf16 table lands exactly where
    the fp32 step rounded to bf16 does (the optimizers compute in fp32 and round the new row once),
    with the state in the stated dtype."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    grad = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([0, 3, 7, 8, 21, 39])
    sparse = make is not _adamw
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        table = torch.nn.Parameter(values.to(dtype).clone())
        g = grad.to(dtype)
        table.grad = torch.sparse_coo_tensor(rows[None], g[rows], table.shape).coalesce() if sparse else g.clone()
        opt = make([table])
        opt.step()
        state = [v for v in opt.state[table].values() if torch.is_tensor(v) and v.dim()]
        assert all(v.dtype == (state_dtype if dtype == torch.bfloat16 else torch.float32) for v in state)
        results[dtype] = table.detach()
    assert not torch.equal(results[torch.float32], values.float())  # the step moved the table
    assert torch.equal(results[torch.bfloat16], results[torch.float32].to(torch.bfloat16))


def test_bf16_checkpoint_round_trip_and_dtype_change(megatron, cache_dir, tmp_path):
    """A bf16 table with fp32 SparseAdam moments is saved and loaded exactly; resuming the same
    checkpoint with memory.value_dtype=fp32 widens the stored table exactly."""
    from rmt.training.trainer import Trainer

    from conftest import tiny_overrides

    base = tiny_overrides(cache_dir, steps=2) + [
        "memory.type=ultramem",
        "memory.placement='1:2'",
        "memory.num_keys=8",
        "memory.topk=4",
        "memory.key_dim=8",
        "memory.value_optimizer=sparse_adam",
    ]
    saved = Trainer(
        validate(load_config(None, base + ["memory.value_dtype=bf16", f"train.save={tmp_path}"]), world_size=1)
    )
    saved.train()
    table = saved.chunks[0].module.memory[0].values.weight
    state = saved.optimizer.state[table]
    assert table.dtype == torch.bfloat16 and state["exp_avg"].dtype == torch.float32
    for dtype in ("bf16", "fp32"):
        loaded = Trainer(
            validate(load_config(None, base + [f"memory.value_dtype={dtype}", f"train.load={tmp_path}"]), world_size=1)
        )
        got = loaded.chunks[0].module.memory[0].values.weight
        assert got.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
        assert torch.equal(got.detach().float(), table.detach().float())
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded.optimizer.state[got][name], state[name])
