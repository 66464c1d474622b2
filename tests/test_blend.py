"""Dataset blends (``data.path`` with weights, per-split blends): the forms megatron users
write, the samples drawn following the weights, an order that depends only on the samples
consumed (resume, another data-parallel size), one tokenizer per blend, clear errors."""

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rmt.config import load_config
from rmt.config_checks import validate
from rmt.data.blend import Blend, parse_blend
from rmt.data.shards import write_indexed
from rmt.data.tokenizers import ByteTokenizer, HFTokenizer, train_bpe
from rmt.errors import ConfigError, UserError

from conftest import free_port, rmt_train, tiny_overrides

# each corpus writes only its own letters, so a sample's tokens tell which corpus it came from
LETTERS = {"web": "abcdefgh", "code": "ijklmnop", "books": "qrstuvwx"}


def _corpus(directory, name, num_docs, tokenizer=None):
    rng = np.random.default_rng(len(name))
    letters = LETTERS[name]
    docs = ["".join(rng.choice(list(letters), size=int(rng.integers(40, 200)))) for _ in range(num_docs)]
    tokenizer = tokenizer or ByteTokenizer()
    prefix = os.path.join(str(directory), name)
    write_indexed(prefix, [tokenizer.tokenize(d) for d in docs], tokenizer)
    return prefix


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    return {name: _corpus(d, name, n) for name, n in (("web", 300), ("code", 200), ("books", 100))}


@pytest.fixture(scope="module")
def process_group():
    """megatron-core's BlendedDataset asks torch.distributed for the rank: one gloo process."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _datasets(overrides, num_train, num_valid=0):
    from rmt.data.gpt_data import build_datasets, resolve_data

    config = validate(
        load_config(
            None, ["model.seq_length=32", "data.split=90,10,0", f"train.eval_iters={int(bool(num_valid))}"] + overrides
        ),
        1,
    )
    return build_datasets(config, resolve_data(config), num_train, num_valid)


def _source(tokens):
    """The corpus whose letters a sample's tokens are (the end-of-document token aside)."""
    text = set(bytes(t for t in tokens.tolist() if t < 256).decode())
    names = [n for n, letters in LETTERS.items() if text <= set(letters)]
    assert len(names) == 1, text
    return list(LETTERS).index(names[0])


def test_blend_forms(tmp_path):
    assert parse_blend("data/a") == Blend(("data/a",))
    assert parse_blend("0.3 A 0.7 B") == Blend(("A", "B"), (0.3, 0.7))
    assert parse_blend([3, "A", 7, "B"]) == Blend(("A", "B"), (3.0, 7.0))
    assert parse_blend(["A", "B"]) == Blend(("A", "B"))
    assert parse_blend("2 A") == Blend(("A",))
    blend = tmp_path / "mix.blend"
    blend.write_text("20 web\n10 /abs/code\n")
    assert parse_blend(str(blend)) == Blend((str(tmp_path / "web"), "/abs/code"), (20.0, 10.0))


@pytest.mark.parametrize(
    "value,message",
    [
        ("0.3 A 0.7", "data.path '0.3 A 0.7' has 3 items: weights and prefixes must alternate ('W1 P1 W2 P2 ...')"),
        (
            "A 0.7 B",
            "data.path 'A 0.7 B' mixes prefixes with the number 0.7: give a weight before every prefix "
            "('W1 P1 W2 P2 ...') or none at all",
        ),
        (
            "0.3 A B 0.7",
            "data.path '0.3 A B 0.7': 'B' stands where a weight belongs; weights and prefixes must "
            "alternate ('W1 P1 W2 P2 ...')",
        ),
        ("0.3 A 0 B", "data.path '0.3 A 0 B': the weight of 'B' must be a positive number, got 0"),
        ("1 A 2 A", "data.path '1 A 2 A' names 'A' twice; give each dataset once with its total weight"),
        ("missing.blend", "data.path blend file 'missing.blend' does not exist"),
    ],
)
def test_bad_blends_are_one_sentence(value, message):
    with pytest.raises(ConfigError) as err:
        parse_blend(value)
    assert str(err.value) == message


def test_samples_follow_the_weights(corpora, process_group):
    """Counts per corpus over 4000 samples lie within three binomial standard deviations of the
    weights, and every sample's tokens come from the corpus its ``dataset_id`` names."""
    from rmt.data.gpt_data import microbatches

    weights = {"web": 0.5, "code": 0.3, "books": 0.2}
    path = " ".join(f"{w} {corpora[n]}" for n, w in weights.items())
    train, _ = _datasets([f"data.path={path}"], 4000)
    batch = microbatches(train, 0, 4000, 1, 0, 1)[0]
    ids = batch["dataset_id"].tolist()
    assert [_source(t) for t in batch["tokens"][:400]] == ids[:400]
    n = len(ids)
    for k, w in enumerate(weights.values()):
        count = ids.count(k)
        assert abs(count - w * n) <= 3 * math.sqrt(n * w * (1 - w)), (k, count)


def test_prefixes_without_weights_blend_by_tokens(corpora, process_group):
    train, _ = _datasets([f"data.path=[{corpora['web']},{corpora['books']}]"], 3000)
    tokens = [os.path.getsize(corpora[n] + ".bin") for n in ("web", "books")]  # uint16 each
    share = tokens[0] / sum(tokens)
    ids = train.dataset_index[:3000]
    assert abs((ids == 0).mean() - share) <= 3 * math.sqrt(share * (1 - share) / 3000)


def test_order_depends_only_on_samples_consumed(corpora, process_group):
    """DP=2 (micro-batch 2) sees exactly DP=1's (micro-batch 4) samples, and a dataset built
    again (a resumed run) continues at the exact sample."""
    from rmt.data.gpt_data import microbatches

    path = f"data.path=0.6 {corpora['web']} 0.4 {corpora['code']}"
    first, _ = _datasets([path], 400)
    again, _ = _datasets([path], 400)
    for start in (0, 8, 200):
        whole = microbatches(first, start, 4, 2, 0, 1)
        ranks = [microbatches(again, start, 2, 2, r, 2) for r in (0, 1)]
        for j in range(2):  # microbatch j of DP=1 holds microbatch j of rank 0, then of rank 1
            for key in ("tokens", "labels", "dataset_id"):
                assert torch.equal(whole[j][key], torch.cat([ranks[0][j][key], ranks[1][j][key]]))


def test_blend_per_split(corpora, process_group):
    train, valid = _datasets(
        [f"data.train_path=0.5 {corpora['web']} 0.5 {corpora['code']}", f"data.valid_path={corpora['books']}"], 200, 32
    )
    assert {int(i) for i in train.dataset_index} == {0, 1}
    assert {_source(valid[i]["tokens"]) for i in range(32)} == {2}


def test_blend_config_errors(corpora, tmp_path):
    def error(overrides):
        with pytest.raises(UserError) as err:
            validate(load_config(None, overrides), 1)
        return str(err.value)

    assert error([f"data.path={corpora['web']}", f"data.train_path={corpora['code']}"]).startswith(
        "data.path and data.train_path / data.valid_path exclude each other"
    )
    assert error([f"data.train_path={corpora['web']}", "train.eval_iters=1"]) == (
        "train.eval_iters > 0 with data.train_path needs data.valid_path (or train.eval_iters=0)"
    )
    assert error([f"data.path=1 {corpora['web']} 1 {tmp_path}/none"]) == (
        f"data.path '{tmp_path}/none' has no '{tmp_path}/none.bin' (run rmt-preprocess first)"
    )


def test_blend_must_share_one_tokenizer(corpora, tmp_path):
    tok = HFTokenizer(train_bpe(["abcdefgh ijkl"] * 50, 280, str(tmp_path / "bpe.json")))
    other = _corpus(tmp_path, "code", 20, tok)
    with pytest.raises(UserError) as err:
        validate(load_config(None, [f"data.path=0.5 {corpora['web']} 0.5 {other}"]), 1)
    assert str(err.value) == (
        f"the datasets of the blend were made with different tokenizers: '{corpora['web']}' with 'byte' and "
        f"'{other}' with '{tmp_path}/bpe.json'; every dataset of a blend must share one tokenizer "
        f"(re-run rmt-preprocess with one of them)"
    )


@pytest.mark.slow
def test_blended_training_resumes_under_another_data_parallel_size(corpora, cache_dir, tmp_path):
    """Six steps on a blend at DP=1, against three at DP=1 and three more resumed at DP=2."""
    common = tiny_overrides(cache_dir, steps=6) + [f"data.path=0.7 {corpora['web']} 0.3 {corpora['code']}"]

    def losses(path):
        with open(path) as f:
            return [m["lm loss"] for m in json.load(f)["history"]]

    whole, second, ckpt = tmp_path / "whole.json", tmp_path / "second.json", tmp_path / "ckpt"
    rmt_train(common + ["--json", str(whole)])
    rmt_train(common + [f"train.save={ckpt}", "train.exit_interval=3"])
    rmt_train(common + [f"train.load={ckpt}", "--json", str(second)], nproc=2)
    assert losses(second) == pytest.approx(losses(whole)[3:], abs=1e-5)
