"""What killed a rank: the one line a launcher prints when a rank process dies by a signal.

A rank killed by SIGKILL, SIGSEGV or SIGBUS cannot say anything itself; its launcher names it:
the rank and its host, the signal, the likely cause and the run's planned peak per rank
(``rmt-plan memory --config``), so that an out-of-memory kill is told from a crash. For SIGKILL
the kernel log (``/dev/kmsg``, readable by root or where ``kernel.dmesg_restrict`` is 0) is
searched for the out-of-memory killer's record of that process; SLURM's step daemon reports
the same kills of a job's cgroup on the job's stderr. ``rmt-launch`` (:mod:`rmt.parallel.launcher`)
calls :func:`death_line` for its workers; ``launch/slurm.sbatch`` runs this module on what
``srun`` printed::

    python -m rmt.parallel.deaths --srun-log FILE [rmt-train arguments]

which prints the line for the first task ``srun`` reports killed by a signal (``srun: error:
HOST: task N: Killed``) and exits 0 (nothing when none was).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys
from typing import Iterable, List, Optional

KILL_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS)
_OOM = re.compile(r"(?:Memory cgroup out of memory|Out of memory): Killed process (\d+) \(")
_CAUSES = {
    signal.SIGSEGV: "a crash in native code (an invalid memory access)",
    signal.SIGBUS: "a bus error: usually a memory-mapped file cut short underneath it (a dataset or "
    "checkpoint rewritten while read) or /dev/shm full",
}
# srun's report of a task that died by a signal: "srun: error: node7: task 3: Killed",
# "srun: error: node7: tasks 0-3: Segmentation fault (core dumped)"
_SRUN = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (Killed|Segmentation fault|Bus error)")
_SRUN_SIGNALS = {"Killed": signal.SIGKILL, "Segmentation fault": signal.SIGSEGV, "Bus error": signal.SIGBUS}


def kernel_records() -> List[str]:
    """The kernel log's messages (``/dev/kmsg``), oldest first; none where it cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    records = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)
            except OSError as err:
                if err.errno == errno.EPIPE:  # records overwritten while read: skip on
                    continue
                break  # EAGAIN: the end; EINVAL or EPERM: unreadable
            records.append(raw.decode("utf-8", "replace").split(";", 1)[-1].strip())
    finally:
        os.close(fd)
    return records


def oom_record(pid: Optional[int], records: Iterable[str]) -> Optional[str]:
    """The out-of-memory killer's record of process ``pid`` in ``records``, the newest."""
    found = None
    for record in records:
        m = _OOM.search(record)
        if m and pid is not None and int(m.group(1)) == pid:
            found = record[m.start() :]
    return found


def likely_cause(signum: int, pid: Optional[int] = None, records: Optional[Iterable[str]] = None) -> str:
    """Why a process dies by ``signum``: for SIGKILL the kernel's out-of-memory record of ``pid``
    where the log has one (read from ``records``, default the kernel's), else out of memory as the
    likely cause."""
    if signum != signal.SIGKILL:
        return _CAUSES.get(signum, "a signal")
    record = oom_record(pid, kernel_records() if records is None else records)
    if record is not None:
        return f"out of memory, the kernel's record: '{record}'"
    return "probably out of memory"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def death_line(ranks: str, host: str, signum: int, cause: str, planned_peak: Optional[int]) -> str:
    """One line: rank(s) ``ranks`` (``"3"``, ``"0-3"``) on ``host`` were killed by ``signum``, the
    likely ``cause``, the planned peak per rank (bytes; None where it could not be planned)."""
    plan = (
        f"rmt-plan counts {planned_peak / 2**30:,.2f} GiB per rank for this run"
        if planned_peak
        else "the run's peak per rank could not be planned"
    )
    who = f"rank {ranks} on {host} was" if str(ranks).isdigit() else f"ranks {ranks} on {host} were"
    return f"{who} killed by {signal_name(signum)}: {cause}; {plan}"


def planned_peak(argv: List[str], world_size: int) -> Optional[int]:
    """The whole-rank plan's peak per rank (:func:`rmt.training.fit.planned`) of ``rmt-train
    argv`` on ``world_size`` ranks; None where the arguments cannot be planned."""
    import torch

    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.errors import UserError
    from rmt.training import cli
    from rmt.training.fit import planned

    try:
        args = cli.build_parser().parse_intermixed_args(argv)
        config = validate(load_config(args.config, args.overrides), world_size)
    except (UserError, SystemExit):
        return None
    plan = planned(config, "gpu" if torch.cuda.is_available() else "cpu", world_size)
    return plan["peak"] if plan else None


def srun_deaths(lines: Iterable[str]) -> List[tuple]:
    """``(host, tasks, signum)`` of every report of tasks killed by a signal in ``srun``'s output."""
    found = []
    for line in lines:
        m = _SRUN.match(line.strip())
        if m:
            found.append((m.group(1), m.group(2), _SRUN_SIGNALS[m.group(3)]))
    return found


def _slurm_oom(lines: List[str]) -> Optional[str]:
    """slurmstepd's report of out-of-memory kills in the job's cgroup, where it made one."""
    return next((line.strip() for line in lines if "oom_kill event" in line or "oom-kill event" in line), None)


def main(argv: Optional[List[str]] = None) -> int:
    from rmt.process import setup_process

    setup_process()
    ap = argparse.ArgumentParser(prog="python -m rmt.parallel.deaths", description=__doc__.split("\n\n")[0])
    ap.add_argument("--srun-log", required=True, help="what srun printed on stderr")
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("SLURM_NTASKS", 1)))
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="rmt-train's arguments")
    args = ap.parse_args(argv)
    try:
        with open(args.srun_log, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return 0
    deaths = srun_deaths(lines)
    if not deaths:
        return 0
    host, tasks, signum = deaths[0]  # the first: srun reports the tasks it ended after it too
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    peak = planned_peak(train_args, args.world_size)
    stepd = _slurm_oom(lines)
    if signum == signal.SIGKILL and stepd:
        cause = f"out of memory, SLURM's record: '{stepd}'"
    else:
        cause = likely_cause(signum, None, [])  # the task's pid, on its node, is not known here
    print(f"slurm.sbatch: {death_line(tasks, host, signum, cause, peak)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
