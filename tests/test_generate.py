"""rmt-generate: cached decoding (KV cache, recurrent mixer state) equals recomputation, for
every architecture; the CLI end to end from a saved checkpoint."""

import json
import warnings

import pytest
import torch

from rmt import parallel
from rmt.config import load_config
from rmt.config_checks import validate
from rmt.decoding import RecomputeDecoder, decoder_for, generate
from rmt.generate import main
from rmt.models.build import build

warnings.filterwarnings("ignore")

TINY = [
    "model.vocab_size=16",
    "model.seq_length=24",
    "model.hidden_size=16",
    "model.num_attention_heads=2",
    "model.num_layers=2",
    "model.block_width=4",
]
ARCHS = {
    "transformer": ["model.arch=transformer"],
    "mixer_mixed_decay": ["model.arch=mixer", "model.mixer_kind=mixed", "model.mixer_decay=true"],
    "mixer_masked": ["model.arch=mixer", "model.mixer_kind=masked"],
    "recurrent": ["model.arch=recurrent"],
    "recurrent_block_positions": ["model.arch=recurrent", "model.position=block"],
    "transformer_moe_mlp": [
        "model.arch=transformer",
        "memory.type=moe",
        "memory.moe_placement=mlp",
        "memory.placement=1-2",
        "memory.num_experts=4",
    ],
}


@pytest.fixture
def model_of():
    def make(name):
        config = validate(load_config(None, TINY + ARCHS[name]), 1)
        parallel.initialize(config)
        model = build(config)[0].eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.3 * torch.randn_like(p))  # non-trivial biases, gains and decays
        return model

    yield make
    parallel.destroy()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_cached_equals_uncached(model_of, name):
    model = model_of(name)
    prompt = torch.randint(0, 16, (2, 5))
    with torch.no_grad():
        cached, plain = decoder_for(model, 24, True), RecomputeDecoder(model)
        torch.testing.assert_close(cached.prefill(prompt), plain.prefill(prompt), rtol=0, atol=1e-5)
        for t in range(6):
            token = torch.randint(0, 16, (2,))
            torch.testing.assert_close(cached.next(token), plain.next(token), rtol=0, atol=1e-5)
    for temperature in (0.0, 1.0):
        a = generate(model, prompt, 8, 16, 24, use_cache=True, temperature=temperature, top_k=5, seed=7)
        b = generate(model, prompt, 8, 16, 24, use_cache=False, temperature=temperature, top_k=5, seed=7)
        assert a.shape == (2, 13) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)


def test_decoder_kinds_and_constant_mixer_state(model_of):
    model = model_of("mixer_mixed_decay")
    decoder = decoder_for(model, 24, True)
    assert type(decoder).__name__ == "RecurrentMixerDecoder"
    decoder.prefill(torch.randint(0, 16, (1, 3)))
    sizes = set()
    for t in range(10):
        decoder.next(torch.tensor([t % 16]))
        sizes.add(sum(s.numel() for s in decoder.state))
    assert sizes == {2 * 2 * 8}  # layers x heads x (hidden / heads), whatever the position


def test_recurrent_transformer_state_is_bounded(model_of):
    model = model_of("recurrent")
    decoder = decoder_for(model, 24, True)
    assert type(decoder).__name__ == "BlockRecurrentDecoder"
    decoder.prefill(torch.randint(0, 16, (1, 3)))
    sizes = []
    for t in range(16):
        decoder.next(torch.tensor([t % 16]))
        windows = sum(h.numel() for w in decoder.windows if w is not None for h in w)
        sizes.append((windows, decoder.pending.shape[0]))
    # from the second block on: per layer two halves of k=4 positions x hidden 16; at most k pending
    assert {w for w, _ in sizes[5:]} == {2 * 2 * 4 * 16}
    assert max(p for _, p in sizes) == 4 and min(p for _, p in sizes) == 1


def test_cli_from_checkpoint(tmp_path, capsys):
    from rmt.training.trainer import Trainer

    config = validate(
        load_config(
            None,
            TINY
            + ARCHS["mixer_mixed_decay"]
            + [
                "data.task=copy",
                "data.task_tokens=4",
                "data.task_alphabet=16",
                "data.noise_length=8",
                "train.steps=2",
                "train.warmup_steps=0",
                "train.micro_batch_size=2",
                "train.eval_iters=1",
                "train.progress=false",
                f"train.save={tmp_path}/ckpt",
            ],
        ),
        1,
    )
    parallel.initialize(config)
    try:
        Trainer(config).train()
    finally:
        parallel.destroy()
    outs = []
    for extra in ([], ["--no-cache"]):
        assert (
            main(
                [
                    "--checkpoint",
                    str(tmp_path / "ckpt"),
                    "--prompt-ids",
                    "1,2,3",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0.7",
                    "--json",
                    str(tmp_path / "g.json"),
                ]
                + extra
            )
            == 0
        )
        outs.append(json.loads((tmp_path / "g.json").read_text())["samples"][0]["ids"])
    assert len(outs[0]) == 9 and outs[0][:3] == [1, 2, 3] and outs[0] == outs[1]
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "1", "--max-new-tokens", "40"])
    assert err.value.code == 2 and "exceeds the model's seq_length 24" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", str(tmp_path / "nothing")])
    assert err.value.code == 2
