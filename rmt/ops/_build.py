"""Lazy JIT build of the csrc extensions with torch's cpp_extension (ninja)."""

import os
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"

_cache = {}


def build_dir(name):
    """Build directory: $TORCH_EXTENSIONS_DIR/<name> or ~/.cache/rmt/torch_extensions/<name>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "rmt", "torch_extensions")
    path = Path(root) / name
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
                build_directory=build_dir(name), verbose=False, **kwargs)
        except Exception as exc:  # compiler missing, headers missing, link errors...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"rmt.ops: building extension {name} failed ({first}); falling back",
                          RuntimeWarning, stacklevel=3)
            _cache[name] = None
    return _cache[name]
