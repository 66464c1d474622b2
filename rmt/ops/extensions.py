"""The C++/CUDA extensions of csrc/: what each is built from, where its binary is cached, and
loading it (building it first where the cache has none).

Built once per environment: ``launch/setup_env.sh`` runs ``python -m rmt.ops.extensions`` after
installing, and a process that finds no binary builds it on first use (torch's
``cpp_extension`` with ninja), saying so on stderr with the time it took. A build that fails
warns once and the caller falls back to the next backend.

The cache folder of an extension is ``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/rmt/
torch_extensions``) ``/<name>-<key>``, the key a hash of everything the binary depends on:
its sources and every header in csrc/, its compiler flags, the interpreter's environment
(``sys.prefix``) and version, torch's version, CUDA version and location, the compiler named
by ``$CXX``, and, for ``-march=native`` builds, the host CPU's feature flags. So two
environments, or two machines sharing a home directory, never load each other's binaries, and
one environment finds its own binary every time: a present binary is imported directly,
without asking ninja whether it is stale (ninja compares build commands, which differ between
interpreters and launch environments, and rebuilt whenever two of them alternated).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, Optional

CSRC = Path(__file__).resolve().parents[2] / "csrc"

_NATIVE_CPU = ["-O3", "-march=native", "-fopenmp"]

#: name -> cpp_extension.load arguments (sources relative to csrc/).
EXTENSIONS: Dict[str, dict] = {
    # -ffp-contract=off: the fused optimizer step (csrc/row_optim.h) rounds every product and sum
    # on its own, as the separate step does; the kernels' own multiply-adds are explicit (madd).
    # -fno-math-errno (both optimizers): std::sqrt stays correctly rounded but sets no errno, so
    # the Adam row update vectorizes; with errno GCC kept it scalar (a branch and a libm call per
    # element), and SparseAdam's step took 2x (unfused) to 4x (fused) as long
    "rmt_lookup_reduce_cpu": dict(
        sources=[
            "lookup_reduce_cpu.cpp",
            "lookup_reduce_sort_cpu.cpp",
            "lookup_reduce_forward_cpu.cpp",
            "lookup_reduce_backward_cpu.cpp",
            "lookup_reduce_update_cpu.cpp",
        ],
        extra_cflags=_NATIVE_CPU + ["-ffp-contract=off", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
    ),
    # -ffp-contract=off: every product and sum rounded on its own, as in torch's formulation (a
    # fused multiply-add in the moment updates would differ from it by an ulp of a moment)
    "rmt_sparse_optim_cpu": dict(
        sources=["sparse_optim_cpu.cpp"],
        extra_cflags=_NATIVE_CPU + ["-ffp-contract=off", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
    ),
    "rmt_counter_normal_cpu": dict(
        sources=["counter_normal_cpu.cpp"],
        extra_cflags=_NATIVE_CPU + ["-ffp-contract=off", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
    ),
    # -ffp-contract=off: the selection's objectives and grids rounded operation by operation, as
    # the torch reference computes them (rmt.ops.topm), so both select the same addresses
    "rmt_retrieval_select_cpu": dict(
        sources=["retrieval_select_cpu.cpp"],
        extra_cflags=_NATIVE_CPU + ["-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
    ),
    "rmt_matrix_rmsnorm_cpu": dict(
        sources=["matrix_rmsnorm_cpu.cpp"], extra_cflags=_NATIVE_CPU, extra_ldflags=["-fopenmp"]
    ),
    "rmt_matrix_write_cpu": dict(
        sources=["matrix_write_cpu.cpp"], extra_cflags=_NATIVE_CPU, extra_ldflags=["-fopenmp"]
    ),
    "rmt_lookup_reduce_cuda": dict(
        sources=["lookup_reduce_cuda.cpp", "lookup_reduce_cuda_kernels.cu"],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
    ),
    # --fmad=false: the selection's objectives and grids rounded operation by operation, as the
    # torch reference computes them (rmt.ops.topm), so both select the same addresses
    "rmt_retrieval_select_cuda": dict(
        sources=["retrieval_select_cuda.cpp", "retrieval_select_cuda_kernels.cu"],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--fmad=false"],
    ),
}

_cache: Dict[str, object] = {}


def is_cuda(spec: dict) -> bool:
    return any(s.endswith(".cu") for s in spec["sources"])


def _cpu_flags() -> str:
    """The host CPU's feature flags (Linux), '' where /proc/cpuinfo is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cache_key(name: str, spec: dict) -> str:
    """16 hex digits naming the binary ``spec`` builds in this environment (see the module
    docstring for what goes in)."""
    import torch
    from torch.utils import cpp_extension

    sources = [CSRC / s for s in spec["sources"]]
    headers = sorted(p for p in CSRC.glob("*") if p.suffix in (".h", ".cuh", ".hpp"))
    digest = hashlib.sha256()
    for path in sources + headers:
        digest.update(str(path.name).encode() + b"\0" + path.read_bytes() + b"\0")
    flags = {k: v for k, v in spec.items() if k != "sources"}
    cuda = is_cuda(spec)
    env = [
        name,
        json.dumps(flags, sort_keys=True),
        sys.prefix,
        sys.version,
        torch.__version__,
        os.path.dirname(torch.__file__),
        str(torch.version.cuda),
        str(cpp_extension.CUDA_HOME) if cuda else "",
        os.environ.get("CXX", "c++"),
        _cpu_flags() if "-march=native" in spec.get("extra_cflags", ()) else "",
    ]
    digest.update("\0".join(env).encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    return Path(
        os.environ.get("TORCH_EXTENSIONS_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "rmt", "torch_extensions")
    )


def build_dir(name: str, spec: Optional[dict] = None) -> Path:
    """The cache folder of extension ``name`` in this environment."""
    spec = EXTENSIONS[name] if spec is None else spec
    return cache_root() / f"{name}-{cache_key(name, spec)}"


def _binary(folder: Path, name: str) -> Path:
    from torch.utils.cpp_extension import LIB_EXT

    return folder / f"{name}{LIB_EXT}"


def _built(folder: Path) -> bool:
    """Whether a build into ``folder`` completed (the binary exists while it is being linked)."""
    return (folder / "complete").exists()


def _import(name: str, path: Path):
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _say(message: str) -> None:
    print(f"rmt: {message}", file=sys.stderr, flush=True)


def _build(name: str, spec: dict, folder: Path):
    """Build into ``folder`` under an exclusive lock (one builder among concurrent processes:
    ranks of a job, pytest workers), or import what the lock's previous holder built."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    binary = _binary(folder, name)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            from rmt.errors import global_rank

            if global_rank() == 0:
                _say(f"waiting for another process building C++ extension {name} in {folder}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(folder):
            return _import(name, binary)
        _say(f"building C++ extension {name} (once per environment; cached in {folder}) ...")
        # torch's own build lock (a file it deletes when its build ends) is left behind by a build
        # that was killed, and torch then waits for it for ever; under this lock it is stale
        (folder / "lock").unlink(missing_ok=True)
        start = time.perf_counter()
        # a copy of the flags: torch's load() appends its own link flags to the extra_ldflags list
        # it is given, which changed the spec, and so its cache key, for the rest of the process
        options = copy.deepcopy({k: v for k, v in spec.items() if k != "sources"})
        module = cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in spec["sources"]],
            build_directory=str(folder),
            verbose=False,
            **options,
        )
        (folder / "complete").touch()
        _say(f"built {name} in {time.perf_counter() - start:.0f} s")
        return module


def load_extension(name: str, spec: Optional[dict] = None):
    """Extension ``name`` (of :data:`EXTENSIONS`, or built from ``spec``), imported from this
    environment's cache, built first where there is none; None if the build fails (one warning,
    not retried in the same process)."""
    if name not in _cache:
        spec = EXTENSIONS[name] if spec is None else spec
        try:
            folder = build_dir(name, spec)
            _cache[name] = _import(name, _binary(folder, name)) if _built(folder) else _build(name, spec, folder)
        except Exception as exc:  # compiler missing, headers missing, link errors...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(
                f"rmt.ops: building extension {name} failed ({first}); falling back", RuntimeWarning, stacklevel=3
            )
            _cache[name] = None
    return _cache[name]


@contextlib.contextmanager
def deepspeed_build_guard(op_name: str):
    """Hold around the first use of DeepSpeed op ``op_name`` (e.g. ``cpu_adam``), which builds it
    on first use: DeepSpeed builds through torch's ``cpp_extension``, whose lock is a plain file
    (``FileBaton``) in the op's build folder; a builder killed mid-build leaves it behind, and every
    later build then waits for it forever without a word. rmt's builders hold an ``flock`` (released
    by the kernel when its holder dies) for the whole build, so a lock file found under it was left
    by a builder that died: it is removed, saying so. Builds started outside rmt are not covered."""
    from torch.utils.cpp_extension import _get_build_directory

    stale = Path(_get_build_directory(op_name, verbose=False)) / "lock"
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f"deepspeed-{op_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stale.exists():
            _say(f"removing the lock file '{stale}' that a killed build of DeepSpeed's {op_name} left behind")
            stale.unlink(missing_ok=True)
        yield


#: DeepSpeed ops the benchmarks compare with (``cpu_adam``: tools/bench_optimizer.py) -> their
#: builder in ``deepspeed.ops.op_builder``. DeepSpeed builds an op on its first use (minutes on
#: two cores); :func:`main` builds them beside rmt's own where DeepSpeed is installed.
DEEPSPEED_OPS = {"cpu_adam": "CPUAdamBuilder"}


def load_deepspeed_op(op_name: str, accelerator: str):
    """DeepSpeed's op ``op_name`` (of :data:`DEEPSPEED_OPS`), built first where DeepSpeed's cache
    has none, under :func:`deepspeed_build_guard`; ``accelerator`` (``cpu``, ``cuda``) is passed
    to DeepSpeed, which otherwise guesses it on import and warns. None where DeepSpeed is not
    installed."""
    os.environ.setdefault("DS_ACCELERATOR", accelerator)
    try:
        from deepspeed.ops import op_builder
    except ImportError:
        return None
    with deepspeed_build_guard(op_name):
        return getattr(op_builder, DEEPSPEED_OPS[op_name])().load()


def main(argv=None) -> int:
    """``python -m rmt.ops.extensions [NAME ...]``: build the named extensions, by default every
    one this machine can (the CUDA one where torch has CUDA and nvcc is present), each once per
    environment and side by side, one process per core; a failure is reported and left to the
    fallbacks."""
    import subprocess

    import torch
    from torch.utils import cpp_extension

    argv = sys.argv[1:] if argv is None else argv
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if argv:
        loaded = [
            load_deepspeed_op(n.split(":", 1)[1], accelerator) if n.startswith("deepspeed:") else load_extension(n)
            for n in argv
        ]
        return 0 if all(module is not None for module in loaded) else 1
    cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    names = [n for n, s in EXTENSIONS.items() if cuda or not is_cuda(s)]
    missing = [n for n in names if not _built(build_dir(n))]
    if importlib.util.find_spec("deepspeed") is not None:
        # DeepSpeed's own build (torch's ninja) decides whether its binary is current: a binary
        # another environment built, with other include paths, is rebuilt
        missing += [f"deepspeed:{op}" for op in DEEPSPEED_OPS]
    if not missing:
        _say(f"C++ extensions up to date in {cache_root()}")
        return 0
    failed, running = [], []
    for name in missing:
        if len(running) >= (os.cpu_count() or 1):
            done = running.pop(0)
            if done[1].wait():
                failed.append(done[0])
        running.append((name, subprocess.Popen([sys.executable, "-m", "rmt.ops.extensions", name])))
    failed += [name for name, proc in running if proc.wait()]
    if failed:
        _say(f"could not build {', '.join(failed)}: rmt's kernels fall back to plain torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
