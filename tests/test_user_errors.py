"""A newcomer's mistakes (issue 19 item 2): each is one sentence on stderr and exit status 2,
before any work starts, never a traceback; under torchrun the sentence is printed once."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, _env, rmt_train, run_python, tiny_overrides

TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")


def _one_sentence(proc, prog, phrase):
    """``proc`` exited 2 with exactly one stderr line, ``prog: error: ...phrase...``."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and phrase in lines[0], proc.stderr[-3000:]
    return lines[0]


def _module(module, args, **kw):
    return run_python(["-m", module] + args, check=False, **kw)


@pytest.fixture(scope="module")
def checkpoint(cache_dir, tmp_path_factory):
    """A 2-step run of the tiny transformer with a checkpoint (and validation data)."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "ckpt"
    rmt_train(tiny_overrides(cache_dir, steps=2) + [f"train.save={ckpt}", "train.eval_iters=1", "data.split=80,20,0"])
    return ckpt


@pytest.mark.slow
def test_allocation_that_can_never_fit_is_refused_before_allocating(cache_dir):
    proc = rmt_train(tiny_overrides(cache_dir) + ["model.seq_length=400000"], check=False)
    line = _one_sentence(proc, "rmt-train", "this run needs at least ")
    assert "GiB per rank (activations of one micro batch of 2 x 400000 tokens " in line
    assert "lower model.seq_length, train.micro_batch_size or the model size" in line


def test_memory_floor_counts_what_training_certainly_allocates():
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.flops import plan_model
    from rmt.training.fit import check_fits, memory_floor

    given = ["model.vocab_size=257", "train.ignore_memory_plan=true"]  # the floor alone decides
    config = validate(load_config(TINY_YAML, given), 1)
    floor = memory_floor(config)
    doc = plan_model(config)
    assert floor == {
        "state": 16 * doc["params"],
        "mask": 128 * 128,
        "activations": doc["activation_bytes_per_token"] * 8 * 128,
    }
    check_fits(config, TINY_YAML, given, available=sum(floor.values()))  # exactly enough: accepted
    with pytest.raises(Exception, match="needs at least"):
        check_fits(config, TINY_YAML, given, available=sum(floor.values()) - 1)
    # bf16 with the distributed optimizer over DP = 4: 6 + 12 / 4 bytes per parameter; no
    # activations counted under recomputation (it keeps less, by an amount the bound does not model)
    scaled = validate(
        load_config(
            TINY_YAML,
            [
                "model.vocab_size=257",
                "train.precision=bf16",
                "train.distributed_optimizer=true",
                "parallel.data_parallel_size=4",
                "train.recompute_granularity=full",
                "train.recompute_method=uniform",
                "train.recompute_num_layers=1",
            ],
        ),
        4,
    )
    assert memory_floor(scaled) == {"state": 9 * doc["params"], "mask": 128 * 128, "activations": 0}


def test_a_run_over_the_whole_rank_plan_is_said_once_and_goes_ahead(capsys, monkeypatch):
    """Between the certain floor and the whole-rank plan (which counts the process and upper
    bounds), the run starts and rank 0 says in one line what the planner counts."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.rank import plan_rank
    from rmt.training.fit import check_fits, memory_floor

    given = ["model.vocab_size=257"]
    config = validate(load_config(TINY_YAML, given), 1)
    floor, peak = sum(memory_floor(config).values()), plan_rank(config, 1, "cpu")["peak"]
    assert floor < peak
    check_fits(config, TINY_YAML, given, available=peak, device="cpu")
    assert capsys.readouterr().err == ""
    check_fits(config, TINY_YAML, given, available=peak - 1, device="cpu")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rmt-train: rmt-plan counts {peak / 2**30:,.1f} GiB per rank for this run")
    monkeypatch.setenv("RANK", "1")
    check_fits(config, TINY_YAML, given, available=peak - 1, device="cpu")
    assert capsys.readouterr().err == ""


def _planned_peak(overrides):
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.rank import plan_rank

    return plan_rank(validate(load_config(TINY_YAML, overrides), 1), 1, "cpu")["peak"]


def test_a_run_beyond_the_plan_and_its_error_is_refused_with_the_changes_that_fit(capsys):
    """Beyond the planner's largest measured overstatement the run stops, naming the cheapest
    layout that fits at this world size (the micro-batch halved, the global batch kept, when no
    layout fits at its own); ``train.ignore_memory_plan`` starts it with the warning."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import ConfigError
    from rmt.planner.rank import human
    from rmt.training.fit import PLAN_ERROR, check_fits

    given = ["model.vocab_size=257", "model.seq_length=1024"]  # activations dominate the rank
    config = validate(load_config(TINY_YAML, given), 1)
    peak = _planned_peak(given)
    full = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
    halved = ["train.micro_batch_size=4", "train.global_batch_size=8"]
    recomputed, smaller = _planned_peak(given + full), _planned_peak(given + halved)
    assert smaller < recomputed < peak * (1 - PLAN_ERROR)
    edge = math.ceil(peak * (1 - PLAN_ERROR))
    check_fits(config, TINY_YAML, given, available=edge, device="cpu", world_size=1)  # within the error: a warning
    assert capsys.readouterr().err.startswith("rmt-train: rmt-plan counts ")
    for available, change, fits in [(recomputed, full, recomputed), (recomputed - 1, halved, smaller)]:
        with pytest.raises(ConfigError) as err:
            check_fits(config, TINY_YAML, given, available=available, device="cpu", world_size=1)
        assert str(err.value) == (
            f"rmt-plan counts {human(peak)} per rank for this run, more than the "
            f"{human(available)} a rank has here even allowing for the plan's largest measured "
            f"overstatement (7.6%), so it would run out of memory; it fits with {' '.join(change)} "
            f"({human(fits)} per rank); `rmt-plan memory --config ... --world-size 1` itemizes it, "
            f"and train.ignore_memory_plan=true starts it anyway"
        )
    anyway = validate(load_config(TINY_YAML, given + ["train.ignore_memory_plan=true"]), 1)
    check_fits(anyway, TINY_YAML, given, available=recomputed - 1, device="cpu", world_size=1)
    assert capsys.readouterr().err.startswith(f"rmt-train: rmt-plan counts {peak / 2**30:,.1f} GiB per rank")


def test_host_tables_over_the_machines_memory_are_said_once(capsys, monkeypatch):
    """A GPU rank's tables in host memory are planned against its share of the machine's memory."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.rank import plan_rank
    from rmt.training import fit

    host = ["memory.table_location=host", "memory.value_optimizer=sparse_adam", "model.vocab_size=257"]
    config = validate(load_config("configs/ultramem_tiny.yaml", host), 1)
    host_peak = plan_rank(config, 1, "gpu")["host_peak"]
    monkeypatch.setattr(fit, "machine_memory", lambda: host_peak)
    fit.check_fits(config, "configs/ultramem_tiny.yaml", host, available=2**40, device="gpu", world_size=1)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(fit, "machine_memory", lambda: host_peak - 1)
    fit.check_fits(config, "configs/ultramem_tiny.yaml", host, available=2**40, device="gpu", world_size=1)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rmt-train: rmt-plan counts {host_peak / 2**30:,.1f} GiB of host memory per rank")


@pytest.mark.slow
def test_a_run_beyond_the_plan_stops_before_building_anything(cache_dir, tmp_path):
    """In real processes, the machine's memory shared by as many local ranks as leave each less
    than the plan minus its error but enough for full recomputation: one sentence naming it, exit
    2, no step logged; with ``train.ignore_memory_plan=true`` the run is accepted after the warning."""
    from rmt.planner.rank import human
    from rmt.training.fit import PLAN_ERROR, rank_memory

    given = ["model.vocab_size=257", "model.seq_length=1024"]
    full = ["train.recompute_granularity=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
    peak, recomputed = _planned_peak(given), _planned_peak(given + full)
    machine = rank_memory()  # this process has no LOCAL_WORLD_SIZE: the whole machine
    ranks = math.ceil(machine / ((recomputed + peak * (1 - PLAN_ERROR)) / 2))
    if not recomputed <= machine // ranks < peak * (1 - PLAN_ERROR):
        pytest.skip(f"no share of {machine} bytes falls between {recomputed} and {peak * (1 - PLAN_ERROR):.0f}")
    overrides = given + [f"data.cache_dir={cache_dir}", f"train.log_file={tmp_path}/log.jsonl", "train.steps=1"]
    env = dict(_env(), LOCAL_WORLD_SIZE=str(ranks))
    cmd = [sys.executable, "-m", "rmt.training.cli", "--config", TINY_YAML] + overrides
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = _one_sentence(refused, "rmt-train", f"; it fits with {' '.join(full)} (")
    assert line.startswith(f"rmt-train: error: rmt-plan counts {human(peak)} per rank for this run, more than the ")
    assert not os.path.exists(tmp_path / "log.jsonl")
    anyway = subprocess.run(
        cmd + ["train.ignore_memory_plan=true", "--check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert anyway.returncode == 0, anyway.stderr[-3000:]
    assert anyway.stderr.startswith(f"rmt-train: rmt-plan counts {peak / 2**30:,.1f} GiB per rank for this run")
    assert anyway.stdout.startswith("rmt-train: config OK")


def test_config_naming_a_directory(tmp_path):
    proc = _module("rmt.training.cli", ["--config", str(tmp_path)])
    assert _one_sentence(proc, "rmt-train", "") == (
        f"rmt-train: error: config file '{tmp_path}' is a directory; --config takes a YAML file"
    )


@pytest.mark.slow
def test_resuming_with_another_model_shape_or_architecture(checkpoint, cache_dir):
    for override, key, ours, theirs in [
        ("model.hidden_size=64", "model.hidden_size", 64, 32),
        ("model.num_attention_heads=8", "model.num_attention_heads", 8, 4),
        ("model.arch=mixer", "model.arch", "'mixer'", "'transformer'"),
    ]:
        proc = rmt_train(tiny_overrides(cache_dir, steps=4) + [f"train.save={checkpoint}", override], check=False)
        assert _one_sentence(proc, "rmt-train", "") == (
            f"rmt-train: error: {key} is {ours} here but {theirs} in checkpoint '{checkpoint}/iter_0000002', "
            f"which holds another model; a checkpoint cannot change its model (train another in a new "
            f"train.save directory)"
        )
    gen = _module("rmt.generate", ["--checkpoint", str(checkpoint), "model.num_attention_heads=8"])
    _one_sentence(gen, "rmt-generate", "model.num_attention_heads is 8 here but 4 in checkpoint")


@pytest.mark.slow
def test_truncated_checkpoint_in_generate_and_training(checkpoint, cache_dir, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint, broken)
    shard = broken / "iter_0000002" / "__0_0.distcp"
    size = os.path.getsize(shard)
    os.truncate(shard, 100)
    expected = (
        f"checkpoint '{broken}/iter_0000002' is incomplete or corrupt: its file '__0_0.distcp' "
        f"has 100 bytes where the manifest records {size}"
    )
    gen = _module("rmt.generate", ["--checkpoint", str(broken / "iter_0000002")])
    assert _one_sentence(gen, "rmt-generate", "") == f"rmt-generate: error: {expected}"
    gen_root = _module("rmt.generate", ["--checkpoint", str(broken)])
    _one_sentence(gen_root, "rmt-generate", f"'{broken}' holds no complete checkpoint")
    train = rmt_train(
        tiny_overrides(cache_dir, steps=4)
        + [f"train.load={broken}/iter_0000002", "--eval-only", "train.eval_iters=1", "data.split=80,20,0"],
        check=False,
    )
    assert _one_sentence(train, "rmt-train", "") == f"rmt-train: error: {expected}"


def test_empty_or_contentless_preprocess_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n \n\n")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    for name, sentence in [
        ("empty.jsonl", f"input file '{tmp_path}/empty.jsonl' is empty"),
        ("empty.txt", f"input file '{tmp_path}/empty.txt' is empty"),
        ("blank.txt", f"input file '{tmp_path}/blank.txt' holds nothing but white space"),
        ("blank.jsonl", "the inputs hold no text: every 'text' is empty"),
    ]:
        proc = _module("rmt.data.preprocess", ["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "o")])
        assert _one_sentence(proc, "rmt-preprocess", "") == f"rmt-preprocess: error: {sentence}"
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o.")]  # nothing written


@pytest.mark.slow
def test_metadata_understating_the_vocabulary(cache_dir, tmp_path):
    from rmt.data.preprocess import main as preprocess_main

    (tmp_path / "in.txt").write_text("hello world\nsecond document\n")
    prefix = str(tmp_path / "ds")
    preprocess_main(["--input", str(tmp_path / "in.txt"), "--output-prefix", prefix])
    with open(prefix + ".json") as f:
        meta = json.load(f)
    meta["vocab_size"] = 100  # the data holds bytes up to 'w' = 119 and EOD 256
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f)
    proc = rmt_train(tiny_overrides(cache_dir) + [f"data.path={prefix}"], check=False)
    assert _one_sentence(proc, "rmt-train", "") == (
        f"rmt-train: error: dataset metadata '{prefix}.json' understates the vocabulary: vocab_size 100 but "
        f"eod 256; re-run rmt-preprocess to rewrite it"
    )


def test_prompt_that_is_not_utf8(checkpoint):
    cmd = [
        sys.executable.encode(),
        b"-m",
        b"rmt.generate",
        b"--checkpoint",
        str(checkpoint).encode(),
        b"--prompt",
        b"caf\xe9",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert _one_sentence(proc, "rmt-generate", "") == (
        "rmt-generate: error: the prompt is not valid UTF-8 (character 3 is an undecodable byte); "
        "pass UTF-8 text or token ids with --prompt-ids"
    )


@pytest.mark.slow
def test_output_piped_into_head_is_cut_off_quietly(checkpoint):
    """The reader leaves after one line: no 'Broken pipe' error, exit status 0, work finished."""
    cmd = (
        f"{sys.executable} -m rmt.planner.cli model --config {TINY_YAML} | head -c 10; "
        f'echo " rc=${{PIPESTATUS[0]}}"; '
        f"{sys.executable} -m rmt.generate --checkpoint {checkpoint} --prompt-ids 1 --max-new-tokens 16 "
        f'--num-samples 8000 --json {checkpoint}/../g.json | head -c 1; echo " rc=${{PIPESTATUS[0]}}"'
    )
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.stdout == "transforme rc=0\n1 rc=0\n" and proc.stderr == "", proc.stderr
    with open(checkpoint / ".." / "g.json") as f:
        assert len(json.load(f)["samples"]) == 8000  # more than a pipe buffer: the reader left first


@pytest.mark.slow
def test_overrides_after_eval_only(checkpoint, cache_dir):
    proc = rmt_train(
        ["--eval-only", f"train.load={checkpoint}"]
        + tiny_overrides(cache_dir)
        + ["train.eval_iters=1", "data.split=80,20,0", "--json", f"{checkpoint}/../e.json"]
    )
    assert "validation loss " in proc.stdout and "at iteration 2" in proc.stdout
    no_batches = rmt_train(tiny_overrides(cache_dir) + ["--eval-only", f"train.load={checkpoint}"], check=False)
    assert _one_sentence(no_batches, "rmt-train", "") == (
        "rmt-train: error: --eval-only needs train.eval_iters > 0 (validation batches to evaluate)"
    )


@pytest.mark.slow
def test_mistake_under_torchrun_is_said_once(cache_dir, tmp_path):
    """Two ranks under the launcher (torchrun) with a checkpoint directory that cannot be
    created: said once, exit status 2, no traceback, no restart."""
    (tmp_path / "file").write_text("")
    proc = subprocess.run(
        ["bash", "launch/torchrun_single_node.sh"] + tiny_overrides(cache_dir) + [f"train.save={tmp_path}/file/ckpt"],
        cwd=ROOT,
        env=dict(_env(), NPROC="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "restarting" not in proc.stderr
    assert [l for l in proc.stderr.splitlines() if "error" in l] == [
        f"rmt-train: error: train.save '{tmp_path}/file/ckpt' cannot be created: '{tmp_path}/file' is a file, "
        f"not a directory"
    ], proc.stderr[-3000:]


def test_unwritable_cache_directory(tmp_path):
    from rmt.config import load_config
    from rmt.data.gpt_data import prepare_default_corpus
    from rmt.errors import UserError

    (tmp_path / "file").write_text("")
    config = load_config(None, [f"data.cache_dir={tmp_path}/file/cache", "data.max_documents=2"])
    with pytest.raises(UserError) as err:
        prepare_default_corpus(config)
    assert str(err.value) == (
        f"cannot write the tokenized default corpus into data.cache_dir '{tmp_path}/file/cache' "
        f"(Not a directory); set data.cache_dir to a writable directory"
    )
