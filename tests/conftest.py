"""Shared fixtures: a tiny model on a small slice of the default corpus, and launchers for
``rmt-train`` and multi-process runs (torchrun over gloo)."""

import os
import signal
import socket
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")


def tiny_overrides(cache_dir, steps=3):
    """A 2-layer transformer small enough for three steps in a second or two."""
    return [f"data.cache_dir={cache_dir}", "data.max_documents=20", "model.num_layers=2",
            "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=32",
            f"train.steps={steps}", "train.warmup_steps=1", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.eval_iters=0", "train.progress=false",
            "train.z_loss=1e-3"]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_python(args, nproc=1, timeout=600, check=True):
    """``python ARGS`` (nproc == 1) or ``torchrun --nproc_per_node=nproc ARGS``."""
    if nproc == 1:
        cmd = [sys.executable] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}"] + args
    # A session of its own, so a timeout kills torchrun's workers too (not only the launcher).
    with subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            raise
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def rmt_train(args, nproc=1, check=True):
    return run_python(["-m", "rmt.training.cli"] + args, nproc=nproc, check=check)


def train_steps(out, overrides, nproc):
    """``tests/dist/train_steps.py``'s record (losses, full gradients and weights) of a run."""
    run_python(["tests/dist/train_steps.py", str(out)] + overrides, nproc=nproc)
    import torch

    return torch.load(out)


def json_history(path):
    """The per-step metrics of ``rmt-train --json PATH``."""
    import json

    with open(path) as f:
        return json.load(f)["history"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenized default-corpus slice for the whole session."""
    return str(tmp_path_factory.mktemp("rmt_cache"))
