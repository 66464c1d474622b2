"""The schema's declared constraints (issue 61 item 6): every key's choices and bounds are
declared in rmt/config.py, and a value outside them is one sentence naming the key, the value
and what is allowed, with exit status 2 from ``rmt-train --check``, for every constrained key."""

import json
import math
import subprocess
import sys

import pytest

from rmt.config import RMTConfig, check_fields, schema_fields
from rmt.errors import ConfigError

from conftest import ROOT, _env

FIELDS = {key: allowed for key, allowed in schema_fields().items() if allowed.constrained()}


def bad_values(allowed):
    """Values just outside what ``allowed`` admits: a missing choice, each bound itself or one past
    it, and for floats NaN and infinity."""
    if allowed.choices is not None:
        return ["no_such_choice"]
    b, step = allowed.bounds, (0.5 if allowed.kind is float else 1)
    out = []
    if b is not None:
        out += [b.gt] if b.gt is not None else []
        out += [b.ge - step] if b.ge is not None else []
        out += [b.lt] if b.lt is not None else []
        out += [b.le + step] if b.le is not None else []
    if allowed.kind is float:
        out = [float(v) for v in out] + [math.nan, math.inf]
    else:
        out = [int(v) for v in out]
    return out


CASES = [(key, value) for key, allowed in FIELDS.items() for value in bad_values(allowed)]

PROBE = """
import io, json, sys, contextlib
from rmt.training.cli import main
out = {}
for key, value in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["--check", f"{key}={value}"])
        except SystemExit as exit:
            code = exit.code
    out[f"{key}={value}"] = [code, err.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def check_results():
    """``rmt-train --check KEY=VALUE`` of every case, run in one process (its ``main`` as the
    console script runs it)."""
    cases = [(key, str(v)) for key, v in CASES]
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_choice_and_numeric_key_is_constrained():
    """Every str key with a fixed set of values is a Literal, every int/float key has bounds (the
    free ones are listed here: text, paths, the seed, and a YAML-parsed blend)."""
    free = {
        "data.path",
        "data.train_path",
        "data.valid_path",
        "data.tokenizer",
        "data.split",
        "data.cache_dir",
        "train.seed",
        "train.save",
        "train.load",
        "train.tensorboard_dir",
        "train.log_file",
        "memory.placement",
    }
    for key, allowed in schema_fields().items():
        if allowed.kind is bool:
            continue
        assert allowed.constrained() != (key in free), key


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_bad_value_is_one_sentence_and_exit_2(check_results, key, value):
    code, stderr = check_results[f"{key}={value}"]
    allowed = FIELDS[key]
    assert code == 2
    assert stderr == f"rmt-train: error: {key} must be {allowed.describe()}, got {value!r}\n"


def test_check_fields_on_a_config_built_in_code():
    """Configs made in code (not loaded) meet the same check, before the cross-key checks."""
    config = RMTConfig()
    check_fields(config)
    config.train.lr = float("nan")
    with pytest.raises(ConfigError, match=r"^train.lr must be a finite number > 0, got nan$"):
        check_fields(config)
    config.train.lr = 1e-3
    config.memory.value_dtype = "fp16"
    from rmt.config_checks import validate

    with pytest.raises(ConfigError, match=r"^memory.value_dtype must be one of 'fp32', 'bf16', got 'fp16'$"):
        validate(config, 1)


def test_literals_match_what_the_code_implements():
    """The choices the schema declares are exactly the ones the runtime registries take."""
    from rmt.memory.layer_v2 import PRE_VALUE_ACTIVATIONS
    from rmt.models.activation import ACTIVATIONS
    from rmt.models.attention import KERNELS
    from rmt.models.build import registered_archs
    from rmt.planner.memory import VALUE_OPTIMIZERS

    f = schema_fields()
    assert set(f["model.arch"].choices) == set(registered_archs())
    assert set(f["model.activation"].choices) == set(ACTIVATIONS)
    assert set(f["model.attention_kernel"].choices) == set(KERNELS)
    assert set(f["memory.pre_value_activation"].choices) == set(PRE_VALUE_ACTIVATIONS)
    assert set(f["memory.value_optimizer"].choices) == set(VALUE_OPTIMIZERS)
