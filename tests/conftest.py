"""Shared fixtures: a tiny model on a small slice of the default corpus, and launchers for
``rmt-train`` and multi-process runs (torchrun over gloo)."""

import os
import random
import signal
import socket
import subprocess
import sys

import command_server
import pytest

import rmt

rmt.setup_process()  # as rmt's commands do (rmt.process), before torch is imported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Llama's layer on a transformer of 4 heads: RoPE, RMSNorm, grouped-query attention (two key/value
# heads), SwiGLU (its first linear checkpointed as one piece of its halves' stack,
# rmt.models.gated_mlp), bias-free linears
LLAMA = [
    "model.position=rope",
    "model.normalization=RMSNorm",
    "model.num_query_groups=2",
    "model.gated_linear_unit=true",
    "model.activation=silu",
    "model.add_bias_linear=false",
]


def tiny_overrides(cache_dir, steps=3):
    """A 2-layer transformer small enough for three steps in a second or two."""
    return [
        f"data.cache_dir={cache_dir}",
        "data.max_documents=20",
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.seq_length=32",
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_iters=0",
        "train.progress=false",
        "train.z_loss=1e-3",
    ]


# A 2-layer transformer with one tiny UltraMem layer (IVE and multi-core scoring on), for the
# memory tests' tiny_overrides runs.
TINY_ULTRAMEM = [
    "model.seq_length=16",
    "memory.type=ultramem",
    "memory.placement='1:2'",
    "memory.num_keys=8",
    "memory.topk=4",
    "memory.key_dim=16",
    "memory.ive_blocks=4",
    "memory.num_cores=2",
]

# One tiny UltraMemV2 layer beside the FFN of every block (IVE, multi-core scoring and
# pre-values on), for the memory tests' tiny_overrides runs.
TINY_ULTRAMEM_V2 = [
    "model.seq_length=16",
    "memory.type=ultramem_v2",
    "memory.num_heads=1",
    "memory.num_keys=4",
    "memory.topk=4",
    "memory.key_dim=8",
    "memory.ive_blocks=4",
    "memory.num_cores=2",
    "memory.value_dim=8",
    "memory.pre_value_dim=4",
]

# A tiny Residual Matrix Transformer (8 x 8 residual matrices, rank-4 keys) for tiny_overrides.
TINY_RMT = [
    "model.arch=rmt",
    "model.position=alibi",
    "model.dk=8",
    "model.dv=8",
    "model.rank=4",
    "model.ffn_hidden_size=64",
]


def memory_spec(index=0, **keys):
    """The ``MemorySpec`` of memory layer ``index`` of a validated one-process config, as the
    trainer builds it: a 2-layer model, ``memory.type`` ultramem at placement ``1:2`` unless
    ``keys`` say otherwise, ``train.seed`` 0. ``keys`` are config keys by name: ``model.*``'s,
    ``seed`` (``train.seed``), and any other ``memory.*``'s (``type="pkm"``, ``key_dim=8``,
    ``query_conv=False``, ...)."""
    import dataclasses

    from rmt.config import ModelConfig, load_config
    from rmt.config_checks import validate
    from rmt.memory.layer import MemorySpec

    keys = {"type": "ultramem", "seed": 0, **keys}
    if keys["type"] != "ultramem_v2":
        keys.setdefault("placement", "1:2")
    model = {f.name for f in dataclasses.fields(ModelConfig)}
    overrides = []
    for key, value in keys.items():
        section = "train" if key == "seed" else "model" if key in model else "memory"
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, str):
            value = f"'{value}'"  # quoted: YAML reads an unquoted 1:2 as a number
        overrides.append(f"{section}.{key}={'null' if value is None else value}")
    return MemorySpec.from_config(validate(load_config(None, overrides), world_size=1), index)


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A free TCP port for launchers that must be told one (multi-node emulations, launch
    scripts): drawn outside the kernel's ephemeral range, so no process binding port 0 or
    opening a connection can take it before the launcher binds it (a port the kernel handed out
    and took back, as before, was often reused under load: EADDRINUSE). torchrun runs within one
    node use ``--standalone`` instead (:func:`run_python`)."""
    low, high = _ephemeral_ports()
    pool = [p for p in range(10000, 65536) if not low <= p <= high]
    rng = random.Random()
    while True:
        port = rng.choice(pool)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


# Rendezvous variables that an in-process test's parallel.initialize leaves in os.environ: a
# subprocess starts from a user's shell, not from them (launchers' input checks read them).
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


# the environment of every launch in a session whose tests leave os.environ as they found it: the
# one the command server (tests/command_server.py) runs commands in
_STANDARD_ENV = _env()


def run_python(args, nproc=1, timeout=600, check=True):
    """``python ARGS`` (nproc == 1) or ``torchrun --nproc_per_node=nproc ARGS``; the tests' own
    scripts (``tests/dist/``) on ranks forked from one process instead (``tests/dist/forkrun.py``),
    and single-process commands as forks of the command server (``tests/command_server.py``)."""
    if nproc == 1:
        cmd = [sys.executable] + args
    elif args[0].startswith("tests/dist/"):
        cmd = [sys.executable, "tests/dist/forkrun.py", str(nproc)] + args
    else:
        # --standalone: torchrun's store binds a free port itself and the workers join that store
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args
    env = _env()
    if nproc == 1 and command_server.served(args, env, _STANDARD_ENV):
        proc = command_server.run(args, env, ROOT, timeout)
    else:
        # A session of its own, so a timeout kills torchrun's workers too (not only the launcher).
        with subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as popen:
            try:
                stdout, stderr = popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                raise
        proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def fast_cases(values, fast):
    """``values`` as a parametrization in which only the cases in ``fast`` run in the fast tier
    (``pytest -m "not slow"``), the others being marked slow: a test of every architecture keeps
    its representative cases there and runs all of them in the full suite."""
    unknown = set(fast) - set(values)
    assert not unknown, f"fast cases {sorted(unknown)} are not among {values}"
    return [value if value in fast else pytest.param(value, marks=pytest.mark.slow) for value in values]


def load_script(path):
    """The script at ``path`` (relative to the repository) as a module, for tests that call its
    functions; its ``__main__`` block does not run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rmt_train(args, nproc=1, check=True):
    return run_python(["-m", "rmt.training.cli"] + args, nproc=nproc, check=check)


def train_runs(runs, nproc=1):
    """``tests/dist/train_steps.py``'s records (losses, full gradients and weights) of the runs
    ``{path: overrides}``, in one launch of ``nproc`` processes, each also saved to its path. One
    process runs in this one: torch and megatron-core are imported here already, where a
    subprocess would spend seconds importing them again; it runs on one thread, as each rank of a
    launch does (``OMP_NUM_THREADS=1``)."""
    import torch

    if nproc > 1:
        args = []
        for path, overrides in runs.items():
            args += ["--", str(path)] + list(overrides)
        run_python(["tests/dist/train_steps.py"] + args[1:], nproc=nproc)
        return {path: torch.load(path) for path in runs}
    import warnings

    import torch.distributed as dist

    from rmt import parallel

    script = load_script("tests/dist/train_steps.py")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    owned = not dist.is_initialized()  # else a module fixture's process group: left to it
    records = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for path, overrides in runs.items():
                records[path] = script.record(list(overrides))
                torch.save(records[path], path)
    finally:
        if owned:
            parallel.destroy()
        torch.set_num_threads(threads)
    return records


def train_steps(out, overrides, nproc=1):
    """:func:`train_runs` of one run."""
    return train_runs({out: overrides}, nproc)[out]


def train_cases(tmp_path_factory, name, cases):
    """The records of ``{case: (overrides, nproc)}``: one launch for all the cases of a process
    count (each launch spends seconds per process importing torch and megatron-core before its
    first run), and once per test session: the first pytest-xdist worker to need them runs them
    under a file lock, the others wait for it and load them (xdist's recipe for a session-wide
    fixture; its ``xdist_group`` mark, which would send such tests to one worker, has no effect
    with pytest 9.2's node ids)."""
    import torch
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # shared by the workers of this session
    directory = root / name
    paths = {case: directory / f"{case}.pt" for case in cases}
    with FileLock(str(directory) + ".lock"):
        done = directory / "done"
        if done.exists():
            return {case: torch.load(path) for case, path in paths.items()}
        directory.mkdir(exist_ok=True)
        records = {}
        for nproc in sorted({n for _, n in cases.values()}):
            records.update(
                train_runs({paths[case]: overrides for case, (overrides, n) in cases.items() if n == nproc}, nproc)
            )
        done.touch()
    return {case: records[path] for case, path in paths.items()}


def json_history(path):
    """The per-step metrics of ``rmt-train --json PATH``."""
    import json

    with open(path) as f:
        return json.load(f)["history"]


@pytest.fixture(autouse=True)
def ieee_underflow():
    """Every test starts and ends with the CPU's IEEE gradual underflow, torch's default: a
    trainer built in this process turns on flushing denormals to zero (``train.flush_denormal``),
    which would otherwise carry into the tests after it."""
    import torch

    torch.set_flush_denormal(False)
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenized default-corpus slice for the whole session."""
    return str(tmp_path_factory.mktemp("rmt_cache"))
