"""Lazy JIT build of the csrc extensions with torch's cpp_extension (ninja)."""

import hashlib
import os
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"

_cache = {}


def _cpu_flags():
    """The host CPU's feature flags (Linux), '' where /proc/cpuinfo is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_dir(name, flags=()):
    """Build directory $TORCH_EXTENSIONS_DIR (or ~/.cache/rmt/torch_extensions) / <name>-<tag>.

    The tag hashes the csrc path, so clones sharing a home directory do not rebuild over each
    other's objects, and for ``-march=native`` builds also the host CPU's flags, so machines
    sharing a home directory never load each other's instruction sets.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "rmt", "torch_extensions")
    key = str(CSRC) + (_cpu_flags() if "-march=native" in flags else "")
    tag = hashlib.sha1(key.encode()).hexdigest()[:10]
    path = Path(root) / f"{name}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def load_extension(name, sources, **kwargs):
    """Build (once per process, cached on disk) and import an extension; None if the build fails.

    A failed build emits one warning and is not retried in the same process.
    """
    if name not in _cache:
        from torch.utils import cpp_extension

        try:
            _cache[name] = cpp_extension.load(
                name=name, sources=[str(CSRC / s) for s in sources],
                build_directory=build_dir(name, kwargs.get("extra_cflags", ())), verbose=False,
                **kwargs)
        except Exception as exc:  # compiler missing, headers missing, link errors...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"rmt.ops: building extension {name} failed ({first}); falling back",
                          RuntimeWarning, stacklevel=3)
            _cache[name] = None
    return _cache[name]
