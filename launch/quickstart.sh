#!/usr/bin/env bash
# Quickstart main job: set up .venv (once) and train the default tiny transformer on the
# default corpus (Python's standard library, byte tokens) on CPU. Extra arguments are config
# overrides, e.g.  bash launch/quickstart.sh train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
RMT_BUILD_EXTENSIONS=0 bash launch/setup_env.sh  # the tiny transformer calls no C++ extension
exec .venv/bin/rmt-train --config configs/tiny.yaml "$@"
