"""Checkpoint directories on disk: names, manifests, verification, publishing, rotation and the
choice of the checkpoint a run continues from (whether a directory can take one:
:mod:`rmt.outputs`).

Layout under a save root::

    ROOT/iter_0000400/        a complete checkpoint (megatron-core torch_dist files + manifest.json)
    ROOT/iter_0000600.tmp/    a save in progress (or one a killed job left behind)
    ROOT/latest               the newest published iteration, for people and scripts

``manifest.json`` lists every file of the checkpoint (paths relative to it, the memory tables'
``tables/`` included) with its size in bytes; it is written last, inside the ``.tmp`` directory,
just before the rename that publishes the checkpoint. A checkpoint is *complete* when its
manifest exists and every listed file has the listed size (torch's ``.metadata`` and
megatron-core's ``metadata.json`` among them). Checkpoints written before manifests existed
count as complete when megatron-core recognises them.

Everything here is plain file-system work on one process; ``rmt.training.checkpoint`` decides
which rank runs it and shares the outcome.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

from rmt.errors import UserError

MANIFEST = "manifest.json"
LATEST = "latest"
_ITER = re.compile(r"^iter_(\d+)$")
_MANIFEST_FORMAT = 1


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iterations(root: str) -> List[Tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_*`` directory under ``root``, newest first
    (``.tmp`` directories are not checkpoints)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _ITER.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: str, iteration: int) -> int:
    """Record every file under ``path`` (subdirectories included, such as the memory tables')
    with its size, after flushing each to disk, in ``path/manifest.json``; returns the
    checkpoint's total size in bytes."""
    files = {}
    for folder, _, names in sorted(os.walk(path)):
        for name in sorted(names):
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, path)
            if rel != MANIFEST:
                _fsync(full)
                files[rel] = os.path.getsize(full)
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "iteration": iteration, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))
    return sum(files.values())


def read_manifest(path: str) -> Optional[dict]:
    """The manifest of checkpoint ``path``, or None when it has none or it is unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        return manifest if isinstance(manifest.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


def verify(path: str) -> Optional[str]:
    """None when ``path`` is a complete checkpoint, else why not (a clause for a sentence)."""
    if not os.path.isdir(path):
        return "it does not exist"
    if not os.path.exists(os.path.join(path, MANIFEST)):
        from megatron.core import dist_checkpointing

        if dist_checkpointing.check_is_distributed_checkpoint(path) and os.path.isfile(os.path.join(path, ".metadata")):
            return None  # written before manifests existed
        return "it has no manifest.json (its save did not finish)"
    manifest = read_manifest(path)
    if manifest is None:
        return "its manifest.json is unreadable"
    for name, size in manifest["files"].items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"its file '{name}' is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"its file '{name}' has {actual} bytes where the manifest records {size}"
    return None


def complete_checkpoints(root: str) -> Tuple[List[str], List[str]]:
    """``(complete, skipped)``: the complete checkpoints under ``root``, newest first, and one
    sentence for each incomplete one newer than the newest complete one."""
    complete, skipped = [], []
    for _, path in iterations(root):
        reason = verify(path)
        if reason is None:
            complete.append(path)
        elif not complete:
            skipped.append(f"checkpoint '{path}' is incomplete or corrupt ({reason}), so it is skipped")
    return complete, skipped


def resolve(path: str) -> str:
    """The checkpoint an explicitly named ``path`` means: an ``iter_*`` directory itself (which
    must be complete), or the newest complete checkpoint under a save root."""
    if _ITER.match(os.path.basename(os.path.normpath(path))):
        reason = verify(path)
        if reason is not None:
            raise UserError(f"checkpoint '{path}' is incomplete or corrupt: {reason}")
        return path
    complete, skipped = complete_checkpoints(path)
    if complete:
        return complete[0]
    if skipped:
        raise UserError(f"'{path}' holds no complete checkpoint: {skipped[0]}")
    if not os.path.isdir(path):
        raise UserError(f"checkpoint directory '{path}' does not exist")
    raise UserError(f"'{path}' is not a checkpoint directory (no complete iter_* checkpoint in it)")


def remove_stale_saves(root: str) -> List[str]:
    """Delete the ``iter_*.tmp`` directories saves of killed jobs left behind; returns them."""
    if not os.path.isdir(root):
        return []
    stale = [os.path.join(root, n) for n in sorted(os.listdir(root)) if n.endswith(".tmp") and _ITER.match(n[:-4])]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def publish(tmp: str, final: str, root: str, iteration: int) -> None:
    """Make the finished save ``tmp`` the checkpoint ``final`` (one rename) and point ``latest``
    at it; a crash at any point leaves either the old or the new state, never a mix."""
    if os.path.isdir(final):  # an older save of the same iteration (e.g. an interrupted run's)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    latest_tmp = os.path.join(root, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST))


def rotate(root: str, keep: int) -> List[str]:
    """Keep the newest ``keep`` complete checkpoints under ``root`` (0 keeps all): delete every
    ``iter_*`` directory older than the ``keep``-th newest complete one. Returns what went."""
    if keep <= 0:
        return []
    found = iterations(root)
    complete = [it for it, path in found if verify(path) is None]
    if len(complete) <= keep:
        return []
    removed = [path for it, path in found if it < complete[keep - 1]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def resume_plan(save: Optional[str], load: Optional[str]) -> Tuple[List[str], List[str], bool]:
    """Where a run continues from: ``(candidates, notes, explicit)``.

    The newest complete checkpoint under ``save`` comes first (a restarted job continues its own
    run); without one, ``load`` (a checkpoint to start from, e.g. for fine-tuning); without
    either, nothing (step 0). ``candidates`` are complete checkpoints in the order to try them,
    ``notes`` sentences about incomplete ones that were passed over, ``explicit`` whether
    ``load`` named a single ``iter_*`` checkpoint (a failure to load it is then an error, not a
    reason to fall back)."""
    complete, notes = complete_checkpoints(save) if save else ([], [])
    if complete or not load or (save and os.path.realpath(load) == os.path.realpath(save)):
        return complete, notes, False
    if _ITER.match(os.path.basename(os.path.normpath(load))):
        return [resolve(load)], notes, True
    resolve(load)  # raises when the root holds no complete checkpoint
    loadable, skipped = complete_checkpoints(load)
    return loadable, notes + skipped, False
