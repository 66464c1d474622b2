"""The command server (tests/command_server.py) gives a forked command what a new interpreter
gives it: arguments, exit status, standard streams, environment, working directory, its own
session; a timeout kills it; a changed environment gets a new interpreter."""

import os
import subprocess
import sys

import command_server
import pytest

from conftest import ROOT, _env, run_python

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
print("out", sys.argv[1:], os.getcwd(), os.environ.get("RMT_PROBE"), os.getsid(0) == os.getpid())
print("err", __name__, sys.path[0], file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise ValueError("probe failed")
if what == "kill":
    os.kill(os.getpid(), 9)
if what == "sleep":
    import time
    time.sleep(600)
sys.exit(int(what))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def _served(script, *args, timeout=120):
    return command_server.run([script, *args], _env(), ROOT, timeout)


def test_status_streams_and_session_as_a_new_interpreter(script):
    proc = _served(script, "3")
    assert proc.returncode == 3
    assert proc.stdout == f"out ['3'] {ROOT} None True\n"
    assert proc.stderr == f"err __main__ {os.path.dirname(script)}\n"
    fresh = subprocess.run(
        [sys.executable, script, "3"], cwd=ROOT, env=_env(), capture_output=True, text=True, start_new_session=True
    )
    assert (fresh.returncode, fresh.stdout, fresh.stderr) == (proc.returncode, proc.stdout, proc.stderr)


def test_an_uncaught_exception_and_a_signal(script):
    raised = _served(script, "raise")
    assert raised.returncode == 1
    assert raised.stderr.rstrip().endswith("ValueError: probe failed") and "Traceback" in raised.stderr
    assert _served(script, "kill").returncode == -9


def test_a_timeout_kills_the_command(script):
    with pytest.raises(subprocess.TimeoutExpired):
        _served(script, "sleep", timeout=2)
    assert _served(script, "0").returncode == 0  # the server serves the next command


def test_only_the_servers_environment_is_served(script, monkeypatch):
    standard = _env()
    assert command_server.served(["-m", "rmt.training.cli"], standard, standard)
    assert command_server.served([script], dict(standard, NVTE_FLASH_ATTN="0"), standard)
    assert command_server.served([script], dict(standard, PYTEST_CURRENT_TEST="another test (call)"), standard)
    assert not command_server.served(["-c", "pass"], standard, standard)
    assert not command_server.served(["-m", "torch.distributed.run"], standard, standard)
    monkeypatch.setenv("RMT_PROBE", "set")
    assert not command_server.served([script], _env(), standard)
    proc = run_python([script, "0"])  # a new interpreter, which sees the variable
    assert proc.stdout.split()[-2:] == ["set", "True"]
