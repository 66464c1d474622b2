"""bf16 (megatron's: bf16 parameters and activations, fp32 main copies) trains on CPU and tracks
fp32 closely, for the transformer, the RMT, the recurrent transformer, the mixer and megatron's MoE
(router in fp32), and the UltraMem, UltraMemV2 and PKM memory layers (bf16 queries and scores meeting a float32
value table); its weights are bf16, the memory value tables keep ``memory.value_dtype``."""

import pytest

from conftest import tiny_overrides, train_steps

pytestmark = pytest.mark.slow

# The RMT's logits start uniform and move slowly at the tiny default rate (3 steps: fp32 and bf16
# losses equal to 6 digits); at its configs' rate 1e-2 and 8 steps its loss falls by 0.2
ARCHS = {
    "transformer": [],
    "rmt": [
        "model.arch=rmt",
        "model.position=alibi",
        "model.dk=8",
        "model.dv=8",
        "model.rank=4",
        "train.lr=0.01",
        "train.steps=8",
    ],
    "moe_mlp": ["memory.type=moe", "memory.moe_placement=mlp", "memory.placement=1-2", "memory.num_experts=4"],
    "recurrent": ["model.arch=recurrent", "model.block_width=4", "model.seq_length=16"],
    "mixer": ["model.arch=mixer", "model.seq_length=16"],
    **{
        kind: [
            f"memory.type={kind}",
            "memory.placement='1:2'",
            "memory.key_dim=8",
            "memory.num_keys=8",
            "memory.topk=4",
        ]
        for kind in ("ultramem", "pkm")
    },
    "ultramem_v2": [
        "memory.type=ultramem_v2",
        "memory.num_heads=1",
        "memory.key_dim=8",
        "memory.num_keys=8",
        "memory.topk=4",
        "memory.pre_value_dim=8",
    ],
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_tracks_fp32(arch, cache_dir, tmp_path):
    losses = {
        precision: train_steps(
            tmp_path / f"{precision}.pt", tiny_overrides(cache_dir) + ARCHS[arch] + [f"train.precision={precision}"]
        )["losses"]
        for precision in ("fp32", "bf16")
    }
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], abs=0.05)
    if arch == "rmt":
        assert losses["fp32"][-1] < losses["fp32"][0] - 0.1


def test_bf16_keeps_bf16_weights_and_tables_in_their_own_dtype(cache_dir):
    """After the cast every dense parameter is bf16 with an fp32 main copy in megatron's float16
    optimizer; the memory value tables keep ``memory.value_dtype`` (fp32 here) and stay out of it."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params

    from rmt import parallel
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.memory.descriptor import is_table
    from rmt.training.dense_state import dense_states
    from rmt.training.trainer import Trainer

    config = validate(load_config(None, tiny_overrides(cache_dir) + ARCHS["ultramem"] + ["train.precision=bf16"]), 1)
    parallel.initialize(config)
    try:
        trainer = Trainer(config)
        (dense,) = trainer.optimizer.dense_optimizers
        assert isinstance(dense, Float16OptimizerWithFloat16Params)
        states = dense_states([dense])
        for name, p in trainer.chunks[0].module.named_parameters():
            if is_table(p):
                assert p.dtype.is_floating_point and str(p.dtype) == "torch.float32" and p not in states, name
            else:
                assert str(p.dtype) == "torch.bfloat16", name
        trainer.train_step()
        for p, state in states.items():
            assert str(state.main.dtype) == "torch.float32" and state.main.shape == p.shape
            assert state.main.bfloat16().equal(p.detach())  # the weights are the main copy rounded
    finally:
        parallel.destroy()
