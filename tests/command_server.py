"""The tests' single-process commands (``python -m rmt....``, ``python tools/x.py``) run as forks
of one server process that imported torch, megatron-core and rmt's commands once, instead of new
interpreters that import them again: 4-5 CPU seconds a command, most of what a short one spends.

    python tests/command_server.py SOCKET PARENT_PID

The server listens on the Unix socket SOCKET and dies with the test process PARENT_PID. For each
command :func:`run` sends (its arguments, working directory, and the files its standard output
and error go to, as descriptors) it forks a child that does what ``python ARGS`` does: the module
or script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` set as the interpreter sets
them, in a session of its own (as the tests' launches are, so that a timeout kills it with its
children), standard input from /dev/null, and the interpreter's own exit: the status of
``SystemExit``, a traceback and status 1 for an uncaught exception, atexit handlers and
non-daemon threads waited for. The server answers with the child's pid, then its exit status
(negative for a signal, as ``subprocess`` reports it). One command at a time: a test process runs
one test at a time.

A child runs in the environment it was sent, but what the preloaded modules read from the
environment when they were imported, they read in the server's. :func:`served` therefore takes
only commands launched with the environment the server started with (``conftest._env()``), but
for variables libraries set while they run and never read on import (:data:`SET_WHEN_RUN`); the
others, ``python -c``, multi-process launches and the tests of start-up itself (which launch their
own processes) run in new interpreters.
"""

import atexit
import contextlib
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile

#: what the server imports before it forks: every command's heavy imports
PRELOAD = ("torch", "megatron.core.parallel_state", "rmt.training.trainer", "rmt.training.cli", "rmt.planner.cli")


def serve(path: str, parent: int) -> list:
    """Listen on ``path`` until killed; returns only in a forked child, with the command's
    arguments, its standard streams and working directory already set up."""
    import importlib

    import rmt

    rmt.setup_process()  # as every command does before torch is imported
    for module in PRELOAD:
        importlib.import_module(module)
    from rmt.parallel.lifetime import die_with_parent

    die_with_parent(parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            for target, fd in enumerate((null, *fds)):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            return request["args"]
        for fd in fds:
            os.close(fd)
        _answer(conn, pid)
        _, status = os.waitpid(pid, 0)
        _answer(conn, os.waitstatus_to_exitcode(status))
        conn.close()


def _answer(conn, number: int) -> None:
    with contextlib.suppress(OSError):  # the test gave up on the command (a timeout) and closed its end
        conn.send(str(number).encode())


def execute(args: list) -> None:
    """``python ARGS`` in this process: ``-m MODULE ...`` or ``SCRIPT ...``."""
    if args[0] == "-m":
        sys.path[0] = os.getcwd()
        sys.argv = args[1:]  # run_module sets argv[0] to the module's file
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")


class Server:
    """A running server for this test process, started on the first command it serves."""

    def __init__(self, env: dict, cwd: str):
        self.env, self.cwd = env, cwd
        self.folder = tempfile.mkdtemp(prefix="rmt-commands-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "server.log"), "w+")
        self.popen = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.path, str(os.getpid())],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        if self.popen.stdout.readline().strip() != "ready":
            self.popen.wait()
            self.log.seek(0)
            raise RuntimeError(f"the command server did not start ({self.popen.returncode}):\n{self.log.read()}")
        atexit.register(self.stop)

    def stop(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def run(self, args: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """``python ARGS`` forked from the server: its exit status, standard output and error."""
        cmd = [sys.executable, *args]
        with (
            tempfile.TemporaryFile("w+") as out,
            tempfile.TemporaryFile("w+") as err,
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn,
        ):
            conn.connect(self.path)
            request = json.dumps({"args": list(args), "cwd": self.cwd, "env": env}).encode()
            socket.send_fds(conn, [request], [out.fileno(), err.fileno()])
            conn.settimeout(timeout)
            pid = int(conn.recv(64))
            try:
                code = int(conn.recv(64))
            except TimeoutError:
                os.killpg(pid, 9)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


_server = None


#: variables set in ``os.environ`` while tests run, none read on import: pytest's name of the
#: running test, and what libraries set when a test runs them in its own process: megatron-core's
#: attention-backend switches for TransformerEngine (set where it builds attention) and inductor's
#: cache folder (set on first use)
SET_WHEN_RUN = (
    "PYTEST_CURRENT_TEST",
    "NVTE_FLASH_ATTN",
    "NVTE_FUSED_ATTN",
    "NVTE_UNFUSED_ATTN",
    "TORCHINDUCTOR_CACHE_DIR",
)


def _imported_with(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in SET_WHEN_RUN}


def served(args: list, env: dict, standard_env: dict) -> bool:
    """Whether ``python ARGS`` under ``env`` is one the server runs as a fork: ``-m rmt.*`` or a
    script, under the environment the server was started with but for :data:`SET_WHEN_RUN`."""
    module = len(args) > 1 and args[0] == "-m" and args[1].startswith("rmt.")
    return _imported_with(env) == _imported_with(standard_env) and (module or args[0].endswith(".py"))


def run(args: list, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGS`` as a fork of this test process's server (started on first use)."""
    global _server
    if _server is None or _server.popen.poll() is not None:
        _server = Server(_imported_with(env), cwd)
    return _server.run(args, env, timeout)


if __name__ == "__main__":
    execute(serve(sys.argv[1], int(sys.argv[2])))
