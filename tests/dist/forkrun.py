"""Run a test script on N local gloo ranks forked from one process that imported torch,
megatron-core and rmt's trainer once.

    python tests/dist/forkrun.py NPROC SCRIPT [ARG ...]

What torchrun's ``--standalone`` launch gives a script, for the tests' own multi-process
scripts (``tests/dist/*.py``): ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0 serves the rendezvous store there, as rmt does
outside torchrun's agent store), the script run as ``__main__`` with its arguments, and the
launch failing with the first failed rank's exit status after the others are stopped. A rank
process costs a fraction of a second instead of the 4-5 CPU seconds of importing torch and
megatron-core again, which is most of what such a test spends. The commands users run
(``rmt-train``, the tools, the launchers) are still tested under torchrun itself; torchrun's
agent (restarts, health checks) has no part in what these scripts check.
"""

import os
import runpy
import signal
import sys

import rmt

rmt.setup_process()  # as the scripts do, before torch is imported
import megatron.core.parallel_state  # noqa: E402,F401
import torch  # noqa: E402,F401

import rmt.training.trainer  # noqa: E402,F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import free_port  # noqa: E402


def _rank(rank: int, world: int, port: int, script: str, args: list) -> int:
    """The body of one forked rank: the script as ``__main__``; returns its exit status."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def main(argv: list) -> int:
    world, script, args = int(argv[0]), argv[1], argv[2:]
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = _rank(rank, world, port, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    status = 0
    while children:
        pid, wait = os.wait()
        children.pop(pid)
        code = os.waitstatus_to_exitcode(wait)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
