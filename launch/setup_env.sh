#!/usr/bin/env bash
# Create .venv (Python 3.11) in the repository root and install rmt with its pinned
# dependencies. Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || {
  echo "setup_env.sh: Python 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.rmt-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: a looser requirement elsewhere would otherwise pull a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  # bench: FBGEMM, the peer of tools/bench_lookup_reduce.py (its smoke test runs it where installed);
  # eval: lm-eval, which rmt-eval and its tests need
  .venv/bin/python -m pip install -q -e ".[dev,bench,eval]"
  touch "$stamp"
fi
# The C++ extensions of csrc/, built here once per environment where a compiler exists (else on
# first use, or never: every kernel has a plain-torch fallback). Rerun when csrc/ changes.
# RMT_BUILD_EXTENSIONS=0 (the quickstart: its tiny transformer calls none) leaves them to their
# first use, which builds each with a message.
built=.venv/.rmt-extensions
if [ "${RMT_BUILD_EXTENSIONS:-1}" != 0 ] && command -v "${CXX:-c++}" >/dev/null \
        && { [ ! -f "$built" ] || [ -n "$(find csrc -newer "$built")" ]; }; then
  .venv/bin/python -m rmt.ops.extensions && touch "$built"
fi
