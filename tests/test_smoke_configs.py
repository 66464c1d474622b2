"""A smoke run of a few steps works with every shipped tiny config (issue 19 item 3): their
warmup (20 steps) is clamped below train.steps, and the run says so."""

import glob
import os

import pytest

from rmt.config import load_config

from conftest import ROOT, run_python

pytestmark = pytest.mark.slow

# one process each: the tiny twin of the 7B example needs TP = 2 x DP = 2 (tests/test_scale_config.py)
TINY_CONFIGS = sorted(
    c
    for c in glob.glob(os.path.join(ROOT, "configs", "*tiny.yaml"))
    if load_config(c).parallel.tensor_model_parallel_size == 1
)

# Every config in one process (the imports cost more than three steps of a tiny model).
SCRIPT = """
import sys
from rmt.training.cli import main
overrides = sys.argv[1].split()
for config in sys.argv[2:]:
    print(f"=== {config}", flush=True)
    main(["--config", config] + overrides)
"""


def test_three_steps_of_every_tiny_config(cache_dir, tmp_path):
    assert len(TINY_CONFIGS) >= 9
    overrides = (
        f"train.steps=3 train.micro_batch_size=2 train.global_batch_size=null train.eval_iters=1 "
        f"data.split=80,20,0 data.max_documents=20 data.cache_dir={cache_dir} train.progress=false "
        f"train.tensorboard_dir=null train.threads=1"
    )
    out = run_python(["-c", SCRIPT, overrides] + TINY_CONFIGS).stdout
    runs = out.split("=== ")[1:]
    assert [r.splitlines()[0] for r in runs] == TINY_CONFIGS
    for config, run in zip(TINY_CONFIGS, runs):
        assert "train.warmup_steps 20 is not below train.steps 3: warming up over 2 steps instead\n" in run, config
        assert "finished: step 3 of 3; no checkpoint saved\n" in run and "  final validation loss " in run, config
