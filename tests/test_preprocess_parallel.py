"""rmt-preprocess on several workers: output byte-identical to a plain single-process build with
megatron-core's IndexedDatasetBuilder whatever the workers and chunks, every input format
(jsonl, txt, parquet, saved HF datasets, globs), one dataset per input with its blend, resume
after an interruption, memory that does not grow with the input, clear errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rmt.data.blend import Blend, parse_blend
from rmt.data.preprocess import main as preprocess_main
from rmt.data.shards import merge_indexed, write_indexed
from rmt.data.tokenizers import ByteTokenizer, HFTokenizer, train_bpe

from conftest import ROOT, _env

WORDS = "memory layers recall sparse slots ünïcode ✓ tokens attention blend".split()


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two jsonl files (a glob), a txt file with blank and CRLF lines, a parquet file of several
    row groups and a saved HF dataset; with the texts each holds, in order."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("inputs")
    texts = {}
    for i in range(2):
        texts[f"part{i}.jsonl"] = _texts(150, i)
        with open(d / f"part{i}.jsonl", "w") as f:
            for t in texts[f"part{i}.jsonl"]:
                f.write(json.dumps({"id": 1, "text": t}) + "\n")
            f.write("\n" + json.dumps({"text": ""}) + "\n")  # a blank line and an empty text: no documents
    lines = _texts(120, 7)
    with open(d / "lines.txt", "w", newline="") as f:
        f.write("\r\n".join(lines[:60]) + "\r\n\n" + "\n".join(lines[60:]))  # no final line end
    texts["lines.txt"] = lines
    texts["table.parquet"] = _texts(90, 8)
    pq.write_table(pa.table({"text": texts["table.parquet"]}), d / "table.parquet", row_group_size=20)
    texts["saved"] = _texts(110, 9)
    datasets.Dataset.from_dict({"text": texts["saved"]}).save_to_disk(str(d / "saved"))
    patterns = [str(d / "part*.jsonl"), str(d / "lines.txt"), str(d / "table.parquet"), str(d / "saved")]
    return d, patterns, texts


def _reference(prefix, documents, tokenizer):
    """The plain path: megatron-core's IndexedDatasetBuilder, one document after another."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for text in documents:
        builder.add_item(torch.tensor(tokenizer.tokenize(text) + [tokenizer.eod]))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _files(prefix, exts=(".bin", ".idx", ".json")):
    out = {}
    for ext in exts:
        with open(prefix + ext, "rb") as f:
            out[ext] = f.read()
    return out


def _run(argv):
    assert preprocess_main(argv + ["--no-progress"]) == 0


@pytest.mark.slow
def test_output_identical_whatever_workers_and_chunks(inputs, tmp_path):
    d, patterns, texts = inputs
    tok = HFTokenizer(train_bpe(sum(texts.values(), []), 300, str(tmp_path / "bpe.json")))
    runs = {}
    for workers, chunk in ((1, None), (2, 0.004), (3, 0.001)):
        prefix = str(tmp_path / f"w{workers}" / "ds")
        argv = (
            ["--input"]
            + patterns
            + ["--output-prefix", prefix, "--workers", str(workers), "--tokenizer", str(tmp_path / "bpe.json")]
        )
        _run(argv + (["--chunk-mib", str(chunk)] if chunk else []))
        runs[workers] = _files(prefix)
        assert not os.path.exists(prefix + ".partial")
    assert runs[1] == runs[2] == runs[3]
    order = ["part0.jsonl", "part1.jsonl", "lines.txt", "table.parquet", "saved"]
    _reference(str(tmp_path / "ref"), sum((texts[n] for n in order), []), tok)
    ref = _files(str(tmp_path / "ref"), (".bin", ".idx"))
    assert runs[1][".bin"] == ref[".bin"] and runs[1][".idx"] == ref[".idx"]
    meta = json.loads(runs[1][".json"])
    assert meta["num_documents"] == sum(len(texts[n]) for n in order)
    assert meta["tokenizer"] == str(tmp_path / "bpe.json")


def test_merge_equals_megatron_add_index(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = ByteTokenizer()
    parts = []
    for i, n in enumerate((5, 0, 17)):  # an empty shard too
        parts.append(str(tmp_path / f"part{i}"))
        write_indexed(parts[-1], tok.tokenize_batch(_texts(n, i)), tok)
    merge_indexed(str(tmp_path / "merged"), parts)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for part in parts:
        builder.add_index(part)
    builder.finalize(str(tmp_path / "ref.idx"))
    merged, ref = _files(str(tmp_path / "merged")), _files(str(tmp_path / "ref"), (".bin", ".idx"))
    assert merged[".bin"] == ref[".bin"] and merged[".idx"] == ref[".idx"]
    assert json.loads(merged[".json"])["num_documents"] == 22


def test_one_dataset_per_input_with_its_blend(inputs, tmp_path):
    from rmt.data.indexed import open_indexed

    d, patterns, texts = inputs
    prefix = str(tmp_path / "out" / "mix")
    _run(
        [
            "--input",
            str(d / "part*.jsonl"),
            str(d / "saved"),
            "--output-prefix",
            prefix,
            "--per-input",
            "--workers",
            "2",
        ]
    )
    names = ["part0", "part1", "saved"]
    tokens = []
    for name, key in zip(names, ["part0.jsonl", "part1.jsonl", "saved"]):
        ds = open_indexed(f"{prefix}_{name}")
        assert [ds[i].tolist()[:-1] for i in range(len(ds))] == [list(t.encode()) for t in texts[key]]
        tokens.append(float(sum(len(t.encode()) + 1 for t in texts[key])))
    assert parse_blend(prefix + ".blend") == Blend(tuple(f"{prefix}_{n}" for n in names), tuple(tokens))
    assert open(prefix + ".blend").read().splitlines()[0] == f"{int(tokens[0])} mix_part0"


def _big_jsonl(path, megabytes):
    line = json.dumps({"text": " ".join(WORDS * 40)}) + "\n"
    with open(path, "w") as f:
        f.write(line * int(megabytes * (1 << 20) / len(line)))
    return str(path)


def test_interrupted_run_resumes(tmp_path):
    """Ctrl-C part way: the finished chunks are kept and named; the same command then does
    only the rest, and the output is that of an uninterrupted run. 384 chunks of 1/8 MiB: the
    byte tokenizer does one in a few ms, so the run lasts long enough (about a second on an idle
    core) for the signal to arrive before the end even when this process is descheduled."""
    src = _big_jsonl(tmp_path / "big.jsonl", 48)
    prefix = str(tmp_path / "ds")
    argv = [
        sys.executable,
        "-m",
        "rmt.data.preprocess",
        "--input",
        src,
        "--output-prefix",
        prefix,
        "--workers",
        "1",
        "--chunk-mib",
        "0.125",
        "--no-progress",
    ]
    # Ctrl-C as a terminal delivers it: to a process that does not ignore SIGINT (a test run started
    # in the background by a non-interactive shell inherits SIGINT ignored, and Python then keeps
    # ignoring it)
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120

    def finished():  # a shard's .json is renamed into place last: present = complete
        work = prefix + ".partial"
        return [n for n in os.listdir(work) if re.fullmatch(r"\d{6}\.json", n)] if os.path.isdir(work) else []

    while len(finished()) < 3:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    line = err.strip().splitlines()[-1]
    done = int(line.split("interrupted: ")[1].split(" of ")[0])
    total = -(-os.path.getsize(src) // (1 << 17))  # 1/8 MiB chunks
    assert line == (
        f"rmt-preprocess: interrupted: {done} of {total} chunks are done and kept in "
        f"'{prefix}.partial'; the same command resumes with the other {total - done}"
    )
    assert 3 <= done < total and not os.path.exists(prefix + ".bin")
    again = subprocess.run(argv, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"resuming the run in '{prefix}.partial': " in again.stderr
    resumed = int(again.stderr.split("resuming the run in")[1].split(": ")[1].split(" of ")[0])
    assert resumed >= done
    _run(["--input", src, "--output-prefix", str(tmp_path / "whole"), "--workers", "2"])
    assert _files(prefix) == _files(str(tmp_path / "whole"))


def _worker_peak_rss_mib(src, out):
    code = (
        "import resource, sys; from rmt.data.preprocess import main; "
        f"main(['--input', {src!r}, '--output-prefix', {out!r}, '--workers', '1', '--chunk-mib', '1', "
        "'--no-progress']); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) / 1024


def test_worker_memory_does_not_grow_with_the_input(tmp_path):
    """A worker holds one batch and its chunk's index: the same peak for 4 and 16 MiB of input
    (1 MiB chunks); the margin is a batch of 1024 documents (~0.5 MiB here) and allocator slack."""
    small = _worker_peak_rss_mib(_big_jsonl(tmp_path / "s.jsonl", 4), str(tmp_path / "s"))
    large = _worker_peak_rss_mib(_big_jsonl(tmp_path / "l.jsonl", 16), str(tmp_path / "l"))
    assert large <= small + 8, (small, large)


def _error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        preprocess_main(argv)
    return exc.value.code, capsys.readouterr().err.strip()


def test_input_errors_are_one_sentence(inputs, tmp_path, capsys):
    import datasets

    d, patterns, texts = inputs
    out = ["--output-prefix", str(tmp_path / "o")]
    assert _error(["--input", str(tmp_path / "none*.jsonl")] + out, capsys) == (
        2,
        f"rmt-preprocess: error: input pattern '{tmp_path}/none*.jsonl' matches no file",
    )
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    capsys.readouterr()  # the test's own save_to_disk may draw HF's progress bar
    assert _error(["--input", str(tmp_path / "dd")] + out, capsys) == (
        2,
        f"rmt-preprocess: error: input '{tmp_path}/dd' is a HF DatasetDict (splits: train); give the "
        f"directory of one split, e.g. '{tmp_path}/dd/train'",
    )
    assert _error(["--input", str(d / "part0.jsonl"), str(d / "part*.jsonl")] + out, capsys) == (
        2,
        f"rmt-preprocess: error: input '{d}/part0.jsonl' is given twice",
    )
    assert _error(["--input", str(d / "part0.jsonl"), "--workers", "0"] + out, capsys) == (
        2,
        "rmt-preprocess: error: --workers must be at least 1, got 0",
    )
    assert _error(["--input", str(d / "table.parquet"), "--text-key", "body"] + out, capsys) == (
        2,
        f"rmt-preprocess: error: input '{d}/table.parquet' has no 'body' field; its fields are: text",
    )
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"text": "fine"}) + "\n"
    bad.write_text(good * 3000 + "{not json\n" + good)
    code, err = _error(["--input", str(bad), "--chunk-mib", "0.01", "--workers", "2"] + out, capsys)
    assert code == 2 and err.startswith(
        f"rmt-preprocess: error: input '{bad}' is not JSON lines: the line at byte {len(good) * 3000} does not parse"
    )
