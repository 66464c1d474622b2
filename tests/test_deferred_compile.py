"""megatron-core's import-time torch.compile is deferred to the first call (rmt.deferred_compile):
after :func:`rmt.setup_process`, importing rmt's trainer does not import torch's compiler stack,
and a deferred function is compiled once, on its first call, with the arguments it was decorated
with."""

import json

import pytest

from rmt.deferred_compile import deferred

from conftest import run_python


@pytest.mark.slow
def test_importing_the_trainer_leaves_the_compiler_unimported_and_fusions_deferred():
    proc = run_python(
        [
            "-c",
            "import json, sys, rmt\n"
            "rmt.setup_process()\n"
            "import torch, rmt.training.trainer\n"
            "import megatron.core.jit as jit\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "print(json.dumps({'dynamo': 'torch._dynamo' in sys.modules,\n"
            "                  'inductor': 'torch._inductor.compile_fx' in sys.modules,\n"
            "                  'fuser_is_compile': jit.jit_fuser is torch.compile,\n"
            "                  'name': bias_gelu.__name__}))",
        ]
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "dynamo": False,
        "inductor": False,
        "fuser_is_compile": False,
        "name": "bias_gelu",
    }


def test_a_deferred_function_is_compiled_once_on_its_first_call_with_its_arguments():
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((fn, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def twice(x, y=1):
        return 2 * x + y

    plain = deferred(fake_compile)(twice)
    with_kwargs = deferred(fake_compile)(mode="max-autotune", dynamic=False)(twice)
    assert calls == [] and plain.__name__ == "twice"
    assert plain(3) == ("compiled", 7) and plain(4, y=0) == ("compiled", 8)
    assert calls == [(twice, {})]
    assert with_kwargs(1) == ("compiled", 3)
    assert calls == [(twice, {}), (twice, {"mode": "max-autotune", "dynamic": False})]
