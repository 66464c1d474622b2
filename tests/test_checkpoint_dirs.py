"""Checkpoint directory logic on fake checkpoints (files with manifests): verification, the
choice of the checkpoint a run continues from, rotation and the free-space check."""

import os

import pytest

from rmt.errors import UserError
from rmt.training import checkpoint_dirs as cd


def _checkpoint(root, iteration, complete=True):
    path = cd.iteration_dir(str(root), iteration)
    os.makedirs(path)
    for name, size in (("__0_0.distcp", 700), (".metadata", 50), ("common.pt", 30)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(b"x" * size)
    if complete:
        assert cd.write_manifest(path, iteration) == 780
    return path


def test_verify_names_what_is_wrong(tmp_path):
    path = _checkpoint(tmp_path, 4)
    assert cd.verify(path) is None
    with open(os.path.join(path, "__0_0.distcp"), "ab") as f:
        f.write(b"y")
    assert cd.verify(path) == "its file '__0_0.distcp' has 701 bytes where the manifest records 700"
    os.truncate(os.path.join(path, "__0_0.distcp"), 700)
    os.remove(os.path.join(path, "common.pt"))
    assert cd.verify(path) == "its file 'common.pt' is missing"
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{")
    assert cd.verify(path) == "its manifest.json is unreadable"
    assert cd.verify(_checkpoint(tmp_path, 5, complete=False)) == "it has no manifest.json (its save did not finish)"
    assert cd.verify(str(tmp_path / "iter_0000009")) == "it does not exist"


def test_resume_plan_prefers_the_runs_own_newest_complete_checkpoint(tmp_path):
    save, load = tmp_path / "save", tmp_path / "pretrained"
    _checkpoint(load, 100)
    assert cd.resume_plan(str(save), str(load)) == ([cd.iteration_dir(str(load), 100)], [], False)
    _checkpoint(save, 2)
    _checkpoint(save, 4)
    _checkpoint(save, 6, complete=False)
    candidates, notes, explicit = cd.resume_plan(str(save), str(load))
    assert candidates == [cd.iteration_dir(str(save), 4), cd.iteration_dir(str(save), 2)] and not explicit
    assert notes == [
        f"checkpoint '{cd.iteration_dir(str(save), 6)}' is incomplete or corrupt (it has no "
        f"manifest.json (its save did not finish)), so it is skipped"
    ]
    # train.load equal to train.save is the run's own directory: nothing extra, no error when empty.
    assert cd.resume_plan(str(tmp_path / "new"), str(tmp_path / "new")) == ([], [], False)
    # One iter_* directory named explicitly must be complete.
    assert cd.resume_plan(None, cd.iteration_dir(str(save), 4))[2]
    with pytest.raises(UserError, match="iter_0000006' is incomplete or corrupt: it has no manifest"):
        cd.resume_plan(None, cd.iteration_dir(str(save), 6))


def test_rotation_keeps_the_newest_complete_and_anything_newer(tmp_path):
    for it in (1, 2, 3):
        _checkpoint(tmp_path, it)
    _checkpoint(tmp_path, 4, complete=False)  # e.g. a save still being written by hand
    removed = cd.rotate(str(tmp_path), keep=2)
    assert removed == [cd.iteration_dir(str(tmp_path), 1)]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000004"]
    assert cd.rotate(str(tmp_path), keep=0) == []


def test_publish_renames_and_points_latest(tmp_path):
    tmp = cd.iteration_dir(str(tmp_path), 7) + ".tmp"
    os.makedirs(tmp)
    cd.publish(tmp, cd.iteration_dir(str(tmp_path), 7), str(tmp_path), 7)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000007", "latest"]
    with open(tmp_path / "latest") as f:
        assert f.read() == "7"
    os.makedirs(cd.iteration_dir(str(tmp_path), 9) + ".tmp")
    assert cd.remove_stale_saves(str(tmp_path)) == [cd.iteration_dir(str(tmp_path), 9) + ".tmp"]
