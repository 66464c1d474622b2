"""torchrun for long jobs: ``python -m rmt.parallel.launcher [torchrun options] -m rmt.training.cli ARGS``.

It runs torch's own launcher (``torch.distributed.run``: every torchrun option, its elastic
agent and rendezvous) and adds what an unattended job needs; ``launch/torchrun_*.sh`` call it.

* **Checks before workers start.** rmt-train's arguments are validated for the world size this
  launch will have, and the checkpoint it would continue from is verified; a mistake is one
  sentence and exit status 2, with no worker started and no launcher traceback.
* **Restarts that recover.** Failed workers are restarted (``--max-restarts``) and resume from
  the newest complete checkpoint. Every attempt gets a fresh rendezvous store served by its
  rank 0 (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): torch's shared store keeps the addresses of
  dead workers, and restarted gloo groups failed connecting to them. Workers that exit with
  status 2 (a user error, printed once by rank 0) are not restarted: the job exits 2.
* **Preemption.** SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) are passed to the workers, which save at
  the next step boundary and exit 0 (torch's agent would instead stop them and raise); the job
  then exits 0. A second Ctrl-C is passed on too: the workers quit at once and the job exits 130.
* **Several nodes.** Before torch's rendezvous, every node reports its ``--node-rank`` to a store
  node 0 serves at the rendezvous endpoint (torch's rendezvous then uses the same store); when
  ``--join-timeout`` expires the message names the node ranks that are missing.
* **One line per event.** A restart, a final failure or a missing node is one line naming the
  rank and what happened to it, not torchrun's traceback. A rank killed by SIGKILL, SIGSEGV or
  SIGBUS is named with its host, the signal, the likely cause (for SIGKILL the kernel's
  out-of-memory record of its process where the kernel log is readable, else "probably out of
  memory") and the run's planned peak per rank (:mod:`rmt.parallel.deaths`).

Workers die with the launcher even when it is killed (``rmt.parallel.lifetime``).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
from typing import List, Optional

import psutil
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher import api as launcher_api

from rmt.errors import USER_ERROR_EXIT, JobError, UserError
from rmt.parallel import deaths
from rmt.parallel.rendezvous import roll_call
from rmt.process import setup_process

PROG = "rmt-launch"
_TRAINER = "rmt.training.cli"
_FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_stopping = False
_quit_now = False  # a second SIGINT: the workers exit 130 at once
_run: tuple = ()  # (rmt-train's arguments, world size): the run whose plan a killed rank's line states


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class _NoRestart(Exception):
    """Workers failed in a way a restart cannot mend (a user error, or a requested stop)."""

    def __init__(self, rank: int, failure):
        super().__init__(rank)
        self.rank, self.failure = rank, failure


def _describe(rank: int, failure) -> str:
    """``rank N exited with status S``, or for a rank killed by a signal the line of
    :func:`rmt.parallel.deaths.death_line`: its host, the signal, the likely cause (the kernel's
    out-of-memory record of its process, where readable) and the run's planned peak per rank."""
    code = failure.exitcode
    if code >= 0:
        return f"rank {rank} exited with status {code}"
    if -code not in deaths.KILL_SIGNALS:
        return f"rank {rank} was killed by {deaths.signal_name(-code)}"
    peak = deaths.planned_peak(*_run) if _run else None
    return deaths.death_line(str(rank), socket.gethostname(), -code, deaths.likely_cause(-code, failure.pid), peak)


def _root_failure(failures: dict):
    """``(global rank, failure)`` of the worker that failed first. torch's agent stops the
    others with SIGTERM once one fails (timestamps are whole seconds), so those are passed over;
    a user error (exit status 2) comes first, as the one that says what to fix. Next comes a
    worker killed by a signal (SIGKILL from the OOM killer or an operator, SIGSEGV): its peers
    then fail in their next collective and exit with status 1, sometimes before the agent has
    seen the killed one, and a failure's timestamp is when the agent saw it unless the worker
    wrote an error file, so the order of the timestamps cannot tell cause from consequence."""
    own = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    return min(
        own.items(), key=lambda kv: (kv[1].exitcode != USER_ERROR_EXIT, kv[1].exitcode >= 0, kv[1].timestamp, kv[0])
    )


class _Agent(LocalElasticAgent):
    """torch's agent, told which failures not to restart and saying what it restarts."""

    restarts = 0

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and result.failures:
            rank, failure = _root_failure(result.failures)
            if failure.exitcode == USER_ERROR_EXIT or _stopping:
                raise _NoRestart(rank, failure)
            limit = worker_group.spec.max_restarts
            if self.restarts < limit:
                self.restarts += 1
                say(
                    f"{_describe(rank, failure)}; restarting the workers (restart "
                    f"{self.restarts} of {limit}); they continue from the newest complete checkpoint"
                )
        return result


def _forward(signum, _frame) -> None:
    """Pass a stop signal to the workers (they save at the next step boundary and exit 0)."""
    global _stopping, _quit_now
    again = _stopping
    _stopping = True
    if signum == signal.SIGINT and again:
        _quit_now = True
        say("received SIGINT again: the workers quit now, without a checkpoint")
    else:
        say(f"received {signal.Signals(signum).name}: asking the workers to save and stop")
    for child in psutil.Process().children():
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


def _world_size(args) -> int:
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    return max_nodes * torchrun.determine_local_world_size(args.nproc_per_node)


def _preflight(args) -> None:
    """Check rmt-train's arguments for this launch's world size (raises UserError)."""
    if not (args.module and args.training_script == _TRAINER):
        return
    from rmt.training import cli

    # the memory check's share of this machine per rank (torch's agent sets it again for each worker)
    os.environ["LOCAL_WORLD_SIZE"] = str(torchrun.determine_local_world_size(args.nproc_per_node))
    cli.preflight(cli.build_parser().parse_args(args.training_script_args), _world_size(args))
    global _run
    _run = (args.training_script_args, _world_size(args))


def _join_nodes(args):
    """Set torch's rendezvous options; for several nodes (c10d), hold the roll call first and let
    torch's rendezvous use its store (returned: node 0 serves it while it is referenced)."""
    conf = f"join_timeout={int(args.join_timeout)}"
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    store = None
    if max_nodes > 1 and not args.standalone and args.rdzv_backend == "c10d":
        store = roll_call(args.rdzv_endpoint, max_nodes, args.node_rank, datetime.timedelta(seconds=args.join_timeout))
        conf += ",is_host=0"
        args.node_rank = 0  # only the roll call uses it; torch warns that c10d ignores it
    args.rdzv_conf = ",".join(c for c in (args.rdzv_conf, conf) if c)
    return store


def build_parser():
    ap = torchrun.get_args_parser()
    ap.prog = "python -m rmt.parallel.launcher"
    ap.add_argument(
        "--join-timeout",
        type=float,
        default=600.0,
        help="seconds every node (and every restarted worker group) may take to join "
        "before the launch fails naming the missing node ranks (default 600)",
    )
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    setup_process()
    args = build_parser().parse_args(argv)
    try:
        _preflight(args)
    except UserError as err:
        print(f"rmt-train: error: {err}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    # torch logs each stop and failure of a worker; the lines of this launcher say it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGTERM, SIGUSR1, SIGINT: _forward
    for sig in _FORWARDED:
        signal.signal(sig, _forward)
    try:
        store = _join_nodes(args)  # node 0 serves the multi-node rendezvous from it, for the whole job
    except JobError as err:
        say(str(err))
        return 1
    # torch's launch_agent builds its agent from this module name; _Agent only overrides
    # _monitor_workers, the extension point torch documents for agents.
    launcher_api.LocalElasticAgent = _Agent
    try:
        torchrun.run(args)
    except _NoRestart as stop:
        if stop.failure.exitcode == USER_ERROR_EXIT:
            return USER_ERROR_EXIT  # rank 0 has said what is wrong
        if _quit_now:
            return 128 + signal.SIGINT  # said when the second SIGINT came
        say(f"{_describe(stop.rank, stop.failure)} while stopping")
        return 1
    except ChildFailedError as err:
        rank, failure = _root_failure(err.failures)
        say(
            f"{_describe(rank, failure)}; no restart is left (--max-restarts {args.max_restarts}); see its output above"
        )
        return 1
    except SignalException as err:  # SIGHUP, SIGQUIT: torch's agent stopped the workers
        say(f"stopped by {signal.Signals(err.sigval).name}; the workers were stopped")
        return 128 + err.sigval
    except RendezvousError as err:
        say(
            f"the rendezvous failed ({type(err).__name__}: {err or 'no detail'}); "
            f"--join-timeout is {args.join_timeout:g} s"
        )
        return 1
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
        del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
