"""What killed a rank (rmt.parallel.deaths): the kernel's out-of-memory record of a process, the
likely cause per signal, the one line a launcher prints, srun's reports of killed tasks, and the
collective failures a killed rank's peers meet. The launchers themselves are tested with real
SIGKILLs in tests/test_resilience.py."""

import signal

import pytest

from rmt.parallel import deaths

KMSG = [
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4242,uid=0",
    "Out of memory: Killed process 4242 (python) total-vm:9000000kB, anon-rss:5600000kB, file-rss:0kB",
    "Memory cgroup out of memory: Killed process 77 (python) total-vm:100kB, anon-rss:90kB, file-rss:0kB",
    "Out of memory: Killed process 4242 (python) total-vm:9100000kB, anon-rss:5700000kB, file-rss:0kB",
]


def test_the_kernels_out_of_memory_record_of_a_process():
    assert deaths.oom_record(4242, KMSG) == KMSG[3][KMSG[3].index("Out of memory") :]  # the newest
    assert deaths.oom_record(77, KMSG).startswith("Memory cgroup out of memory: Killed process 77 (python)")
    assert deaths.oom_record(5, KMSG) is None and deaths.oom_record(None, KMSG) is None
    assert isinstance(deaths.kernel_records(), list)  # readable or not, never an error


def test_likely_cause_per_signal():
    assert deaths.likely_cause(signal.SIGKILL, 4242, KMSG) == f"out of memory, the kernel's record: '{KMSG[3]}'"
    assert deaths.likely_cause(signal.SIGKILL, 5, KMSG) == "probably out of memory"
    assert deaths.likely_cause(signal.SIGSEGV, 5, KMSG) == "a crash in native code (an invalid memory access)"
    assert deaths.likely_cause(signal.SIGBUS).startswith("a bus error: usually a memory-mapped file cut short")


def test_death_line():
    assert deaths.death_line("3", "node7", signal.SIGKILL, "probably out of memory", 5 * 2**30) == (
        "rank 3 on node7 was killed by SIGKILL: probably out of memory; rmt-plan counts 5.00 GiB per rank for this run"
    )
    assert deaths.death_line("0-3", "n1", signal.SIGSEGV, "x", None) == (
        "ranks 0-3 on n1 were killed by SIGSEGV: x; the run's peak per rank could not be planned"
    )


def test_srun_reports_of_killed_tasks():
    log = [
        "step 3 loss 5.1\n",
        "srun: error: n2: task 1: Killed\n",
        "srun: error: n1: tasks 0,2-3: Segmentation fault (core dumped)\n",
        "srun: error: n1: task 0: Exited with exit code 1\n",
    ]
    assert deaths.srun_deaths(log) == [("n2", "1", signal.SIGKILL), ("n1", "0,2-3", signal.SIGSEGV)]


def test_the_sbatch_line_from_what_srun_printed(tmp_path, capsys):
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.rank import plan_rank

    args = ["--config", "configs/tiny.yaml", "model.vocab_size=257"]
    peak = plan_rank(validate(load_config("configs/tiny.yaml", args[2:]), 2), 2, "cpu")["peak"]
    log = tmp_path / "srun.log"
    log.write_text(
        "srun: error: n2: task 1: Killed\nslurmstepd: error: Detected 1 oom_kill event in StepId=42.0. Some of "
        "the step tasks have been OOM Killed.\nsrun: error: n1: task 0: Killed\n"
    )
    assert deaths.main(["--srun-log", str(log), "--world-size", "2", "--"] + args) == 0
    assert capsys.readouterr().err == (
        "slurm.sbatch: rank 1 on n2 was killed by SIGKILL: out of memory, SLURM's record: 'slurmstepd: error: "
        "Detected 1 oom_kill event in StepId=42.0. Some of the step tasks have been OOM Killed.'; rmt-plan counts "
        f"{peak / 2**30:,.2f} GiB per rank for this run\n"
    )
    log.write_text("srun: error: n1: task 0: Exited with exit code 1\n")
    assert deaths.main(["--srun-log", str(log), "--"] + args) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "err, reason",
    [
        (
            RuntimeError(
                "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:50817: "
                "Connection reset by peer. This is typically caused by a remote worker hanging"
            ),
            "Read error [127.0.0.1]:50817: Connection reset by peer",
        ),
        (
            RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv"),
            "Timed out waiting 60000ms for recv",
        ),
        (RuntimeError("shape mismatch in gloo-free code"), None),
        (ValueError("Connection reset by peer"), None),
    ],
)
def test_a_collective_that_lost_its_peer(err, reason):
    from rmt.parallel.setup import lost_peer

    assert lost_peer(err) == reason
