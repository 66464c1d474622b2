"""Data: preprocessing round trips, tokenizers, and clear errors for bad datasets."""

import json
import os

import numpy as np
import pytest

from rmt.data.indexed import open_indexed, read_metadata
from rmt.data.preprocess import main as preprocess_main
from rmt.data.tokenizers import ByteTokenizer, HFTokenizer, train_bpe
from rmt.errors import UserError

from conftest import rmt_train, tiny_overrides

TEXTS = ["hello world", "memory layers\nwith sparse slots", "ünïcode ✓"]


def _jsonl(path):
    with open(path, "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    return str(path)


def test_jsonl_round_trip_exact_token_ids(tmp_path):
    prefix = str(tmp_path / "out" / "ds")
    assert (
        preprocess_main(
            ["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", prefix, "--cache-dir", str(tmp_path / "c")]
        )
        == 0
    )
    ds = open_indexed(prefix)
    tok = ByteTokenizer()
    assert len(ds) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        assert ds[i].tolist() == list(text.encode("utf-8")) + [256]
    meta = read_metadata(prefix)
    assert meta["vocab_size"] == 257 and meta["eod"] == 256
    assert meta["num_tokens"] == sum(len(t.encode()) + 1 for t in TEXTS)
    assert tok.detokenize(ds[2].tolist()) == TEXTS[2]


def test_txt_and_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    txt = tmp_path / "in.txt"
    lines = ["hello world", "one document per line"]
    txt.write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"body": TEXTS}), tmp_path / "in.parquet")
    preprocess_main(["--input", str(txt), "--output-prefix", str(tmp_path / "t"), "--cache-dir", str(tmp_path)])
    preprocess_main(
        [
            "--input",
            str(tmp_path / "in.parquet"),
            "--output-prefix",
            str(tmp_path / "p"),
            "--text-key",
            "body",
            "--cache-dir",
            str(tmp_path),
        ]
    )
    assert [d.tolist()[:-1] for d in open_indexed(str(tmp_path / "t"))] == [list(t.encode()) for t in lines]
    assert len(open_indexed(str(tmp_path / "p"))) == 3


def test_bpe_tokenizer_round_trip_and_hf_path(tmp_path):
    path = train_bpe(TEXTS * 20, 300, str(tmp_path / "tok" / "tokenizer.json"))
    tok = HFTokenizer(str(tmp_path / "tok"))
    assert tok.eod == tok.tokenize("<|endoftext|>")[0]
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert max(ids) < tok.vocab_size and tok.detokenize(ids) == text
    prefix = str(tmp_path / "bpe")
    preprocess_main(
        [
            "--input",
            _jsonl(tmp_path / "in.jsonl"),
            "--output-prefix",
            prefix,
            "--tokenizer",
            path,
            "--cache-dir",
            str(tmp_path / "c"),
        ]
    )
    ds = open_indexed(prefix)  # keep the dataset alive: items are views into its mmap
    assert ds[0].tolist() == tok.tokenize(TEXTS[0]) + [tok.eod]


def test_truncated_idx_and_bin_rejected(tmp_path):
    prefix = str(tmp_path / "ds")
    preprocess_main(["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", prefix])
    with open(prefix + ".idx", "rb") as f:
        head = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(head[:20])
    with pytest.raises(UserError, match="is corrupt or truncated"):
        open_indexed(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(head)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(5)
    with pytest.raises(UserError, match="truncated or do not belong together"):
        open_indexed(prefix)


@pytest.mark.slow
def test_training_rejects_bad_data_with_exit_2(cache_dir, tmp_path):
    missing = rmt_train(tiny_overrides(cache_dir) + [f"data.path={tmp_path}/none"], check=False)
    assert missing.returncode == 2 and "has no" in missing.stderr and "rmt-preprocess" in missing.stderr
    prefix = str(tmp_path / "ds")
    preprocess_main(["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", prefix])
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(30)
    corrupt = rmt_train(tiny_overrides(cache_dir) + [f"data.path={prefix}"], check=False)
    assert corrupt.returncode == 2 and "corrupt or truncated" in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


@pytest.mark.slow
def test_out_of_range_token_ids_rejected(cache_dir, tmp_path):
    prefix = str(tmp_path / "ds")
    preprocess_main(["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", prefix])
    proc = rmt_train(tiny_overrides(cache_dir) + [f"data.path={prefix}", "model.vocab_size=200"], check=False)
    assert proc.returncode == 2
    assert "out of range for model.vocab_size 200" in proc.stderr


def _exit_code_and_stderr(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        preprocess_main(argv)
    return exc.value.code, capsys.readouterr().err


def test_preprocess_cli_errors_exit_2(tmp_path, capsys):
    code, err = _exit_code_and_stderr(
        ["--input", str(tmp_path / "x.jsonl"), "--output-prefix", str(tmp_path / "o")], capsys
    )
    assert code == 2 and err == f"rmt-preprocess: error: input file '{tmp_path}/x.jsonl' does not exist\n"
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    code, err = _exit_code_and_stderr(["--input", str(csv), "--output-prefix", str(tmp_path / "o")], capsys)
    assert code == 2 and "is not .jsonl, .json, .txt or .parquet" in err
    code, err = _exit_code_and_stderr(
        ["--input", _jsonl(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), "--text-key", "body"], capsys
    )
    assert code == 2 and "no 'body' field" in err
    assert not os.path.exists(tmp_path / "o.bin")


def test_default_corpus_is_real_text():
    from rmt.data.corpus import corpus_documents, corpus_files

    files = corpus_files()
    assert len(files) > 100 and files == sorted(files)
    text = next(corpus_documents(1))
    assert len(text) > 1000 and np.mean([c.isalpha() or c.isspace() for c in text]) > 0.6
    assert os.path.basename(files[0]).endswith(".py")


@pytest.mark.slow
def test_split_without_validation_documents_rejected(cache_dir):
    proc = rmt_train(tiny_overrides(cache_dir) + ["train.eval_iters=1"], check=False)
    assert proc.returncode == 2
    assert "data.split '98,2,0' leaves no validation documents out of the 20" in proc.stderr
