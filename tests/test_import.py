"""train.load of a Hugging Face directory: an rmt-export (standard or remote code) or a
standard GPT-2 / GPT-NeoX checkpoint starts a run with exactly its weights; another model is
one sentence."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.errors import UserError  # noqa: E402
from rmt.export.cli import main as export_main  # noqa: E402

from eval_models import causal_logits, tiny_config, train_tiny  # noqa: E402

warnings.filterwarnings("ignore")

V = 257


def run_from(tmp_path, name, load, extra=()):
    """A Trainer of ``name`` started with ``train.load=load``; returns (its model, the trainer)."""
    from rmt.training.trainer import Trainer

    config = tiny_config(
        name,
        [
            "train.steps=1",
            "train.warmup_steps=0",
            "train.micro_batch_size=2",
            "train.eval_iters=0",
            "train.progress=false",
            "data.max_documents=4",
            f"data.cache_dir={tmp_path}/cache",
            f"train.load={load}",
            f"train.save={tmp_path}/run",
        ]
        + list(extra),
    )
    parallel.initialize(config)
    trainer = Trainer(config)
    return trainer.chunks[0].module.eval(), trainer


@pytest.mark.parametrize("name", ["transformer", "transformer_rope", "rmt", "ultramem"])
def test_export_round_trip(tmp_path, name):
    from rmt.generate import load_model

    save = train_tiny(tmp_path, name, ["train.lr=3e-2"])
    assert export_main(["--checkpoint", save, "--out", str(tmp_path / "hf")]) == 0
    tokens = torch.randint(0, V, (2, 40))
    model, _, _ = load_model(save, [])
    with torch.no_grad():
        want = causal_logits(model, tokens)
    parallel.destroy()
    try:
        started, trainer = run_from(tmp_path, name, tmp_path / "hf")
        with torch.no_grad():
            got = causal_logits(started, tokens)
        assert torch.equal(got, want)
        assert trainer.iteration == 0
        trainer.train()  # trains on from them: one step, one checkpoint
        assert trainer.iteration == 1 and (tmp_path / "run" / "iter_0000001").is_dir()
    finally:
        parallel.destroy()


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox"])
def test_standard_hf_checkpoint(tmp_path, kind):
    """A GPT-2 / GPT-NeoX made by transformers itself (not by rmt) runs as rmt's transformer."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=V,
            n_positions=40,
            n_embd=16,
            n_layer=2,
            n_head=2,
            tie_word_embeddings=False,
            activation_function="gelu_new",
        )
        extra = ["model.activation=gelu_tanh"]
    else:
        cfg = GPTNeoXConfig(
            vocab_size=V,
            max_position_embeddings=40,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            use_parallel_residual=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        )
        extra = ["model.position=rope"]
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, V, (2, 40))
    try:
        started, _ = run_from(tmp_path, "transformer", tmp_path / "hf", extra)
        with torch.no_grad():
            got, want = causal_logits(started, tokens), hf(tokens).logits
        assert want.abs().max() > 1
        # the same fp32 model computed by two codes: attention and GEMM orders differ
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    finally:
        parallel.destroy()


def test_other_model_is_one_sentence(tmp_path):
    cfg = GPT2Config(
        vocab_size=V,
        n_positions=40,
        n_embd=16,
        n_layer=2,
        n_head=2,
        tie_word_embeddings=False,
        activation_function="gelu",
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    hf = tmp_path / "hf"
    for extra, message in (
        (["model.hidden_size=32"], f"model.hidden_size is 32 here but 16 in checkpoint '{hf}'"),
        (["model.activation=gelu_tanh"], f"Hugging Face model '{hf}' uses activation 'gelu'"),
        (["model.position=rope"], "model.position is 'rope' here but 'learned'"),
    ):
        try:
            with pytest.raises(UserError) as err:
                run_from(tmp_path, "transformer", hf, extra)
            assert str(err.value).startswith(message), str(err.value)
        finally:
            parallel.destroy()
