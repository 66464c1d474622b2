"""rmt-export: the exported Hugging Face model's logits equal rmt's (fp32) and transformers'
greedy ``generate`` equals ``rmt-generate``; the standard architectures load without custom
code; the tokenizer keeps rmt's ids; configs no standard architecture matches are refused."""

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rmt import parallel  # noqa: E402
from rmt.data.tokenizers import ByteTokenizer  # noqa: E402
from rmt.export.cli import main  # noqa: E402
from rmt.generate import load_model  # noqa: E402
from rmt.generate import main as generate_main

from conftest import fast_cases  # noqa: E402
from eval_models import MODELS, causal_logits, train_tiny  # noqa: E402

warnings.filterwarnings("ignore")

V = 257


@pytest.mark.parametrize(
    "name,extra,model_type",
    [
        ("transformer", [], "gpt2"),
        ("transformer", ["model.activation=gelu_tanh"], "gpt2"),
        ("transformer_rope", [], "gpt_neox"),
    ],
)
def test_standard_export_equals_rmt(tmp_path, capsys, name, extra, model_type):
    save = train_tiny(tmp_path, name, extra + ["train.lr=3e-2"])
    out = tmp_path / "hf"
    assert main(["--checkpoint", save, "--out", str(out)]) == 0
    assert f"wrote {model_type} model" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(out).eval()  # no custom code
    assert hf.config.model_type == model_type and hf.dtype == torch.float32
    model, config, _ = load_model(save, [])
    try:
        tokens = torch.randint(0, V, (3, config.model.seq_length))
        with torch.no_grad():
            want, got = causal_logits(model, tokens), hf(tokens).logits
        assert got.shape == want.shape and want.abs().max() > 0.5  # trained: logits far from zero
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        parallel.destroy()
    # the tokenizer: rmt's byte ids, end-of-document 256 as eos
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # é\u4e2d"
    assert tok(text)["input_ids"] == ByteTokenizer().tokenize(text) and tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == 256 and hf.config.eos_token_id == 256
    # greedy generation: transformers' generate equals rmt-generate's tokens
    assert (
        generate_main(
            ["--checkpoint", save, "--prompt", "def ", "--max-new-tokens", "20", "--json", str(tmp_path / "g.json")]
        )
        == 0
    )
    want_ids = json.loads((tmp_path / "g.json").read_text())["samples"][0]["ids"]
    prompt = torch.tensor([tok("def ")["input_ids"]])
    got_ids = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=256)[0].tolist()
    assert got_ids == want_ids and len(got_ids) == 24


REMOTE = sorted(set(MODELS) - {"transformer", "transformer_rope"}) + ["transformer_rmsnorm"]


@pytest.mark.parametrize("name", fast_cases(REMOTE, {"rmt_ultramem", "mixer_mixed_decay"}))
def test_remote_code_export_equals_rmt(tmp_path, capsys, name):
    extra = ["model.normalization=RMSNorm"] if name == "transformer_rmsnorm" else []
    save = train_tiny(tmp_path, "transformer" if extra else name, extra + ["train.lr=3e-2"])
    out = tmp_path / "hf"
    assert main(["--checkpoint", save, "--out", str(out)]) == 0
    assert "wrote rmt model" in capsys.readouterr().out
    assert {"modeling_rmt.py", "configuration_rmt.py", "model.safetensors", "tokenizer.json"} <= set(
        p.name for p in out.iterdir()
    )
    # the exported model recomputes the sequence at every step, as rmt-generate --no-cache
    assert (
        generate_main(
            [
                "--checkpoint",
                save,
                "--prompt",
                "def ",
                "--max-new-tokens",
                "12",
                "--no-cache",
                "--json",
                str(tmp_path / "g.json"),
            ]
        )
        == 0
    )
    want_ids = json.loads((tmp_path / "g.json").read_text())["samples"][0]["ids"]
    # the exported model runs rmt's megatron modules, which need the process groups it sets up
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    try:
        assert type(hf).__name__ == "RMTForCausalLM"
        model, config, _ = load_model(save, [])
        tokens = torch.randint(0, V, (2, config.model.seq_length))
        with torch.no_grad():
            want, got = causal_logits(model, tokens), hf(tokens).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        prompt = torch.tensor([list(b"def ")])
        got_ids = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=256)[
            0
        ].tolist()
        assert got_ids == want_ids and len(got_ids) == 16
    finally:
        parallel.destroy()


def test_tables_stream_in_small_chunks(tmp_path):
    """A memory table goes into the weights file in chunks of a few rows: the same values."""
    from safetensors.torch import load_file

    from rmt.export.cli import export
    from rmt.training.table_checkpoint import table_shards

    save = train_tiny(tmp_path, "ultramem", ["train.lr=3e-2"])
    export(save, str(tmp_path / "hf"), chunk_bytes=64)  # 64 bytes: a row or two per chunk
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    model, _, _ = load_model(save, [])
    try:
        tables = table_shards([model])
        assert tables and all(s.global_shape[0] * s.global_shape[1] * 4 > 10 * 64 for s in tables)
        for s in tables:
            assert torch.equal(weights[f"model.{s.name}"], s.param.detach())
        assert set(weights) == {f"model.{k}" for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    finally:
        parallel.destroy()


def test_refusals(tmp_path, capsys):
    save = train_tiny(tmp_path, "transformer", ["model.normalization=RMSNorm"], steps=1)
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", save, "--out", str(tmp_path / "hf"), "--format", "standard"])
    assert err.value.code == 2
    assert capsys.readouterr().err == (
        "rmt-export: error: no standard Hugging Face architecture matches model.normalization 'RMSNorm' with a "
        "biased GELU MLP (GPT-2 and GPT-NeoX use LayerNorm); export it with --format remote\n"
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit) as err:
        main(["--checkpoint", save, "--out", str(tmp_path / "full")])
    assert err.value.code == 2 and "is not an empty directory" in capsys.readouterr().err
