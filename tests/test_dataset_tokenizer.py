"""The dataset's own metadata decides the tokenizer (issue 19 item 1): training with only
``data.path=`` on BPE data records the BPE in the checkpoint, rmt-generate encodes and decodes
with it, and a setting that contradicts the data is one sentence and exit 2."""

import json
import os

import pytest

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.data.preprocess import main as preprocess_main
from rmt.data.resolution import resolve_from_data
from rmt.data.tokenizers import HFTokenizer, train_bpe
from rmt.errors import ConfigError

from conftest import rmt_train, run_python, tiny_overrides

TEXTS = [f"def function_{i}(value):\n    return value * {i} + {i % 7}\n" for i in range(200)]


def _jsonl(path):
    with open(path, "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


@pytest.mark.slow
def test_bpe_data_trains_and_generates_with_its_own_tokenizer(cache_dir, tmp_path):
    prefix = str(tmp_path / "bpe")
    preprocess_main(
        [
            "--input",
            _jsonl(tmp_path / "in.jsonl"),
            "--output-prefix",
            prefix,
            "--tokenizer",
            "bpe",
            "--bpe-vocab-size",
            "300",
            "--cache-dir",
            cache_dir,
        ]
    )
    with open(prefix + ".json") as f:
        recorded = json.load(f)["tokenizer"]
    assert recorded == os.path.abspath(os.path.join(cache_dir, "bpe_300_all.json"))
    ckpt = tmp_path / "ckpt"
    # only data.path, as the README shows (tiny_overrides sets no tokenizer)
    rmt_train(tiny_overrides(cache_dir, steps=2) + [f"data.path={prefix}", f"train.save={ckpt}"])
    from rmt.training.checkpoint import load_common

    assert load_common(str(ckpt))["config"]["data"]["tokenizer"] == recorded
    prompt = "def function_1"
    run_python(
        [
            "-m",
            "rmt.generate",
            "--checkpoint",
            str(ckpt),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "6",
            "--json",
            str(tmp_path / "g.json"),
        ]
    )
    with open(tmp_path / "g.json") as f:
        result = json.load(f)
    tok = HFTokenizer(recorded)
    sample = result["samples"][0]
    assert result["prompt_ids"] == tok.tokenize(prompt) and len(sample["ids"]) == len(result["prompt_ids"]) + 6
    assert sample["text"] == tok.detokenize(sample["ids"]) and sample["text"].startswith(prompt)
    # The checkpoint carries the tokenizer: generating needs neither the data nor its cache.
    os.rename(recorded, recorded + ".moved")
    try:
        run_python(
            [
                "-m",
                "rmt.generate",
                "--checkpoint",
                str(ckpt),
                "--prompt",
                prompt,
                "--max-new-tokens",
                "6",
                "--json",
                str(tmp_path / "g2.json"),
            ]
        )
    finally:
        os.rename(recorded + ".moved", recorded)
    with open(tmp_path / "g2.json") as f:
        assert json.load(f) == result

    contradiction = rmt_train(
        tiny_overrides(cache_dir, steps=2) + [f"data.path={prefix}", "data.tokenizer=byte"], check=False
    )
    assert contradiction.returncode == 2 and "Traceback" not in contradiction.stderr
    assert contradiction.stderr.strip() == (
        f"rmt-train: error: data.tokenizer 'byte' contradicts the tokenizer '{recorded}' that '{prefix}.json' "
        f"records for the data; leave data.tokenizer unset to use the data's own"
    )


def test_settings_that_agree_with_the_data_are_accepted(tmp_path):
    """'bpe' agrees with any of rmt's trained BPEs, a path with the same file (or a copy); a
    dataset without metadata keeps the setting (byte when unset)."""
    tok_file = train_bpe(TEXTS, 280, str(tmp_path / "bpe_280_all.json"))
    prefix = str(tmp_path / "ds")
    preprocess_main(["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--tokenizer", tok_file])
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "tokenizer.json").write_bytes(open(tok_file, "rb").read())
    for setting in (None, "bpe", tok_file, str(copy)):
        config = validate(
            load_config(None, [f"data.path={prefix}"] + ([f"data.tokenizer={setting}"] if setting else [])), 1
        )
        assert config.data.tokenizer == setting  # the checks never change the config
        resolved, notes = resolve_from_data(config)
        assert resolved.data.tokenizer == tok_file and config.data.tokenizer == setting
        assert notes == (
            []
            if setting == tok_file
            else [f"data.tokenizer = {tok_file!r} (what the data records, or the default for data without a record)"]
        )
    with pytest.raises(ConfigError, match="contradicts the tokenizer"):
        validate(load_config(None, [f"data.path={prefix}", "data.tokenizer=byte"]), 1)
    os.remove(prefix + ".json")
    resolved, _ = resolve_from_data(load_config(None, [f"data.path={prefix}"]))
    assert resolved.data.tokenizer == "byte"
