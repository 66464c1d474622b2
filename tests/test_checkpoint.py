"""Checkpoints: exact resume (by default, from the newest complete checkpoint, with logs that
hold every step once), resume under a different data-parallel size, resharding TP=2 -> TP=1
(weights and weight average, also of a gated feed-forward layer), a gated model's exact resume
under TP=2,
manifests, fallback past corrupt checkpoints, rotation, saves that cannot complete, and clear
errors for missing or corrupt checkpoints."""

import json
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest

from conftest import LLAMA, ROOT, _env, rmt_train, tiny_overrides

pytestmark = pytest.mark.slow


def _losses(path):
    with open(path) as f:
        return [m["lm loss"] for m in json.load(f)["history"]]


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _truncate(path, nbytes):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - nbytes)
    return size


@pytest.fixture(scope="module")
def six_steps(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("six") / "six.json"
    rmt_train(tiny_overrides(cache_dir, steps=6) + ["--json", str(out)])
    return _losses(out)


def test_resume_gives_identical_loss_sequence(six_steps, cache_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    rmt_train(
        tiny_overrides(cache_dir, steps=6) + [f"train.save={ckpt}", "train.exit_interval=3", "--json", str(first)]
    )
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "latest"]
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.load={ckpt}", "--json", str(second)])
    assert _losses(first) + _losses(second) == six_steps


def test_resume_under_different_data_parallel_size(six_steps, cache_dir, tmp_path):
    """Samples are ordered globally, so DP=1 -> DP=2 with the same global batch continues on
    exactly the same data; only reduction order differs."""
    ckpt = tmp_path / "ckpt"
    second = tmp_path / "b.json"
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.save={ckpt}", "train.exit_interval=3"])
    rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.load={ckpt}", "--json", str(second)], nproc=2)
    assert _losses(second) == pytest.approx(six_steps[3:], abs=1e-5)


def test_a_gated_model_resumes_exactly_under_tensor_parallelism(cache_dir, tmp_path):
    """The optimizer's moments of the stacked first linear come back where they were saved."""
    ckpt = tmp_path / "ckpt"
    whole, first, second = tmp_path / "w.json", tmp_path / "a.json", tmp_path / "b.json"
    common = tiny_overrides(cache_dir, steps=4) + LLAMA + ["parallel.tensor_model_parallel_size=2"]
    rmt_train(common + ["--json", str(whole)], nproc=2)
    rmt_train(common + [f"train.save={ckpt}", "train.exit_interval=2", "--json", str(first)], nproc=2)
    rmt_train(common + [f"train.load={ckpt}", "--json", str(second)], nproc=2)
    assert _losses(first) + _losses(second) == _losses(whole)


@pytest.mark.parametrize("model", [[], LLAMA], ids=["gelu", "gqa_swiglu"])
def test_save_tp2_load_tp1_same_validation_loss(cache_dir, tmp_path, model):
    ckpt = tmp_path / "ckpt"
    trained, evaluated = tmp_path / "a.json", tmp_path / "b.json"
    common = (
        tiny_overrides(cache_dir, steps=2)
        + model
        + ["train.eval_iters=2", "train.eval_interval=2", "data.split=80,20,0"]
    )
    rmt_train(
        common
        + [
            "parallel.tensor_model_parallel_size=2",
            f"train.save={ckpt}",
            "train.ema_decay=0.5",
            "--json",
            str(trained),
        ],
        nproc=2,
    )
    # --eval-only reports the checkpoint's weight average without being told train.ema_decay
    rmt_train(common + [f"train.load={ckpt}", "--eval-only", "--json", str(evaluated)])
    with open(trained) as f:
        at_save = json.load(f)["history"][-1]
    with open(evaluated) as f:
        reloaded = json.load(f)
    assert reloaded["iteration"] == 2
    assert reloaded["val_loss"] == pytest.approx(at_save["val_loss"], abs=1e-5)
    # the weight average (train.ema_decay) is resharded as the weights are
    assert reloaded["val_loss_ema"] == pytest.approx(at_save["val_loss_ema"], abs=1e-5)
    assert at_save["val_loss_ema"] != pytest.approx(at_save["val_loss"], abs=1e-3)


def test_missing_and_corrupt_checkpoints_exit_2(cache_dir, tmp_path):
    missing = rmt_train(tiny_overrides(cache_dir) + [f"train.load={tmp_path}/nope"], check=False)
    assert missing.returncode == 2
    assert "train.load directory" in missing.stderr and "does not exist" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = rmt_train(tiny_overrides(cache_dir) + [f"train.load={empty}"], check=False)
    assert bad.returncode == 2
    assert "is not a checkpoint directory" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_same_command_resumes_and_logs_every_step_once(six_steps, cache_dir, tmp_path):
    """One command line for the first start and every restart: a run whose last checkpoint was
    lost (a crash after step 6, before its save) continues from step 3; the JSONL log and the
    TensorBoard scalars (in the run's own subdirectory, which the restart continues) hold steps
    1..6 once, with the uninterrupted run's losses. Each run says where its outputs went."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ckpt, log, tb = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "tb"
    cmd = tiny_overrides(cache_dir, steps=6) + [
        f"train.save={ckpt}",
        "train.save_interval=3",
        f"train.log_file={log}",
        f"train.tensorboard_dir={tb}",
    ]
    first = rmt_train(cmd)
    assert f"starting from step 0: no checkpoint in '{ckpt}' yet" in first.stdout
    (run,) = os.listdir(tb)
    assert f"TensorBoard logs: '{tb / run}' (tensorboard --logdir {tb})\n" in first.stdout
    for step in (3, 6):
        assert f"checkpoint saved to '{ckpt / f'iter_000000{step}'}'\n" in first.stdout
    summary = first.stdout[
        first.stdout.index(f"finished: step 6 of 6; checkpoint '{ckpt / 'iter_0000006'}'\n") :
    ].splitlines()
    assert re.fullmatch(r"  this run: 6 steps, 768 tokens in [0-9.]+ s \([0-9,]+ tokens/s\)", summary[1])
    assert re.fullmatch(
        r"  step time: median [0-9.,]+ ms(, predicted [0-9.,]+ ms by rmt-plan time on .+"
        r"| \(no hardware profile for a prediction: rmt-plan calibrate\))",
        summary[2],
    )
    assert summary[3:] == [
        "  no validation loss (train.eval_iters is 0)",
        f"  TensorBoard: '{tb / run}'",
        f"  metrics log: '{log}'",
    ]
    shutil.rmtree(ckpt / "iter_0000006")
    again = rmt_train(cmd + ["--json", str(tmp_path / "b.json")])
    assert f"resumed from iteration 3 of 6: '{ckpt / 'iter_0000003'}'\n" in again.stdout
    assert os.listdir(tb) == [run] and f"TensorBoard logs: '{tb / run}'" in again.stdout
    assert re.search(r"\n  this run: 3 steps, 384 tokens in ", again.stdout)
    assert f"metrics written to '{tmp_path / 'b.json'}'" in again.stdout
    assert f"'{log}': dropped 3 entries after step 3" in again.stdout
    assert _losses(tmp_path / "b.json") == six_steps[3:]
    entries = _jsonl(log)
    assert [m["step"] for m in entries] == [1, 2, 3, 4, 5, 6]
    assert [m["lm loss"] for m in entries] == six_steps
    events = EventAccumulator(str(tb / run))
    events.Reload()
    assert [e.step for e in events.Scalars("train/lm_loss")] == [1, 2, 3, 4, 5, 6]


def test_checkpoints_carry_a_manifest_and_rotate(cache_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    rmt_train(
        tiny_overrides(cache_dir, steps=5) + [f"train.save={ckpt}", "train.save_interval=1", "train.keep_checkpoints=2"]
    )
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000005", "latest"]
    for name in ("iter_0000004", "iter_0000005"):
        with open(ckpt / name / "manifest.json") as f:
            manifest = json.load(f)
        on_disk = {n: os.path.getsize(ckpt / name / n) for n in os.listdir(ckpt / name) if n != "manifest.json"}
        assert manifest["files"] == on_disk and ".metadata" in on_disk and "common.pt" in on_disk


def test_broken_checkpoints_are_passed_over_and_named_explicitly_exit_2(six_steps, cache_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = tiny_overrides(cache_dir, steps=6) + [f"train.save={ckpt}", "train.save_interval=1"]
    rmt_train(cmd + ["train.exit_interval=4"])
    # iter_4: a truncated shard, caught by the manifest.
    size = _truncate(ckpt / "iter_0000004" / "__0_0.distcp", 100)
    bad = rmt_train(tiny_overrides(cache_dir, steps=6) + [f"train.load={ckpt / 'iter_0000004'}"], check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"rmt-train: error: checkpoint '{ckpt / 'iter_0000004'}' is incomplete or corrupt: its file "
        f"'__0_0.distcp' has {size - 100} bytes where the manifest records {size}"
    ]
    # iter_3: truncated and without a manifest (as written before manifests existed), so only
    # loading finds it: torch's CheckpointException (a BaseException) is caught and said. The
    # same command as before passes over both, saying so, and continues from step 2 exactly as
    # the uninterrupted run did.
    _truncate(ckpt / "iter_0000003" / "__0_0.distcp", 100)
    os.remove(ckpt / "iter_0000003" / "manifest.json")
    resumed = rmt_train(cmd + ["--json", str(tmp_path / "r.json")])
    assert (
        f"checkpoint '{ckpt / 'iter_0000004'}' is incomplete or corrupt (its file '__0_0.distcp' has "
        f"{size - 100} bytes where the manifest records {size}), so it is skipped"
    ) in resumed.stdout
    assert f"checkpoint '{ckpt / 'iter_0000003'}' is corrupt or unreadable (" in resumed.stdout
    assert "falling back to the previous checkpoint" in resumed.stdout
    assert f"resumed from iteration 2 of 6: '{ckpt / 'iter_0000002'}'" in resumed.stdout
    assert _losses(tmp_path / "r.json") == six_steps[2:]


def test_failed_save_leaves_no_tmp_and_says_why(six_steps, cache_dir, tmp_path):
    """A write that fails mid-save (here: files limited to 200 kB, smaller than a shard, as a
    full disk would) stops the run with one sentence and removes the half-written directory.
    (``six_steps`` made the data caches of these steps before the limit applies.)"""
    ckpt = tmp_path / "ckpt"
    args = tiny_overrides(cache_dir, steps=6) + ["train.save_interval=2"]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = subprocess.run(
        [sys.executable, "-m", "rmt.training.cli"] + args + [f"train.save={ckpt}"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"rmt-train: error: saving checkpoint '{ckpt / 'iter_0000002'}' failed ("
    )
    assert "a write was cut short: the disk is full or a quota or file-size limit was hit" in lines[0]
    assert lines[0].endswith("its incomplete directory was removed")
    assert os.listdir(ckpt) == []


def test_free_space_is_checked_before_training(cache_dir, tmp_path):
    """On a file system too small for a checkpoint nothing is trained or written: one sentence,
    exit 2."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("needs permission to mount a 2 MiB tmpfs")
    try:
        bad = rmt_train(tiny_overrides(cache_dir, steps=2) + [f"train.save={mnt}/ckpt"], check=False)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and "step" not in bad.stdout
        assert bad.stderr.startswith(
            f"rmt-train: error: not enough free space for train.save '{mnt}/ckpt': it needs about "
        )
        assert os.listdir(mnt) == []  # not even the directory
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
