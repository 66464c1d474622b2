"""``launch/deepspeed.sh``: DeepSpeed's launcher starts rmt-train on two ranks of this machine,
from no hostfile and from a hostfile without ssh (the multi-node path, here with one node), and
the run equals the single process; bad input exits 2 with one line."""

import subprocess

import pytest

from conftest import ROOT, _env, free_port, json_history, rmt_train, tiny_overrides

pytestmark = pytest.mark.slow


def _launch(args, timeout=600, **env):
    full = dict(_env(), MASTER_PORT=str(free_port()), **env)
    return subprocess.run(
        ["bash", "launch/deepspeed.sh"] + args, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def _losses(path):
    return [m["lm loss"] for m in json_history(path)]


@pytest.fixture(scope="module")
def single(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_single") / "single.json"
    rmt_train(tiny_overrides(cache_dir, steps=2) + ["--json", str(out)])
    return _losses(out)


@pytest.mark.parametrize("mode", ["one_node", "hostfile_no_ssh"])
def test_two_ranks_equal_single_process(mode, single, cache_dir, tmp_path):
    """``parallel.data_parallel_size=2`` is only valid with a world of two: the launcher gave
    each process its rank; the data-parallel run equals the single process."""
    out = tmp_path / "ds.json"
    env = {"NPROC": "2"}
    if mode == "hostfile_no_ssh":
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("localhost slots=2\n")
        env = {"HOSTFILE": str(hostfile), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    proc = _launch(tiny_overrides(cache_dir, steps=2) + ["parallel.data_parallel_size=2", "--json", str(out)], **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _losses(out) == pytest.approx(single, abs=1e-5)


@pytest.mark.parametrize(
    "env,message",
    [
        ({"HOSTFILE": "/nonexistent/hostfile"}, "HOSTFILE '/nonexistent/hostfile' does not exist"),
        ({"HOSTFILE": __file__, "NODE_RANK": "0"}, "NODE_RANK (no-ssh mode) needs MASTER_ADDR"),
        ({"NODE_RANK": "1"}, "NODE_RANK needs HOSTFILE"),
    ],
)
def test_bad_launcher_input_exits_2(env, message):
    proc = _launch(["--config", "configs/tiny.yaml"], timeout=60, **env)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith(f"launch/deepspeed.sh: {message}")


def test_bad_config_exits_2_without_traceback(cache_dir):
    """A user mistake inside rmt-train: DeepSpeed passes the exit status 2 through; the ranks
    print rmt-train's one sentence, no traceback."""
    proc = _launch(tiny_overrides(cache_dir) + ["model.num_attention_heads=5"], NPROC="2")
    assert proc.returncode == 2
    lines = {line for line in proc.stderr.splitlines() if "num_attention_heads" in line}
    assert lines == {"rmt-train: error: model.hidden_size (32) must be divisible by model.num_attention_heads (5)"}
    assert "Traceback" not in proc.stderr
