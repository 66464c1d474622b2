"""Jobs that survive failures, proven by killing and signalling real processes: a rank killed
with SIGKILL under the launcher is restarted and the run ends as an uninterrupted one would;
SIGTERM/SIGUSR1 save at a step boundary and exit 0; a missing node or rank is named when the
join timeout expires; user errors are said once with exit 2; no process outlives its job (killed
trainer, killed launcher); launch/slurm.sbatch on a CPU partition, with requeue (srun/scontrol
stand-ins)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from conftest import ROOT, _env, free_port, tiny_overrides

pytestmark = pytest.mark.slow

FAKE_SLURM = os.path.join(ROOT, "tests", "fake_slurm")


def _config(cache_dir, tmp_path, steps):
    return tiny_overrides(cache_dir, steps=steps) + [
        f"train.save={tmp_path}/ckpt",
        "train.save_interval=5",
        f"train.log_file={tmp_path}/log.jsonl",
    ]


def _start(cmd, **env):
    """``cmd`` in a session of its own, tagged so that every process of it can be found."""
    tag = uuid.uuid4().hex
    full_env = dict(_env(), RMT_TEST_JOB=tag, **env)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    proc.tag = tag
    return proc


def _finish(proc, timeout=600):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, err


def _tagged(tag):
    """Pids of live processes whose environment carries ``RMT_TEST_JOB=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RMT_TEST_JOB={tag}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            pass
    return found


def _kill_and_expect_no_survivors(job):
    """SIGKILL the job's first process; within 10 s no process of the job may be left."""
    os.kill(job.pid, signal.SIGKILL)
    job.communicate()
    deadline = time.monotonic() + 10
    while _tagged(job.tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged(job.tag) == []


def _wait_for(predicate, proc, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _log(tmp_path):
    with open(tmp_path / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def _logged(tmp_path, steps):
    """A predicate: the run under ``tmp_path`` has logged ``steps`` steps."""
    return lambda: (tmp_path / "log.jsonl").exists() and len(_log(tmp_path)) >= steps


def _worker(launcher_pid, rank):
    """The pid of the launcher's worker of global rank ``rank``."""
    for child in psutil.Process(launcher_pid).children():
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no worker of rank {rank}")


def _single_node(args, nproc=2, **env):
    return _start(["bash", "launch/torchrun_single_node.sh"] + args, NPROC=str(nproc), **env)


@pytest.fixture(scope="module")
def uninterrupted_run(cache_dir, tmp_path_factory):
    """A 30-step 2-rank run under the launcher, never interrupted: its directory."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = _finish(_single_node(_config(cache_dir, tmp, 30)))
    assert code == 0, err[-3000:]
    return tmp


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    """The losses of that run."""
    return [m["lm loss"] for m in _log(uninterrupted_run)]


def test_killed_rank_is_restarted_and_the_run_matches_an_uninterrupted_one(uninterrupted, cache_dir, tmp_path):
    job = _single_node(_config(cache_dir, tmp_path, 30), MAX_RESTARTS="2")
    # torchrun's launcher script execs the launcher, so the job's pid is the launcher's.
    _wait_for(lambda: (tmp_path / "ckpt" / "iter_0000010").is_dir(), job, "the step-10 checkpoint")
    victim = _worker(job.pid, 1)
    os.kill(victim, signal.SIGKILL)
    code, out, err = _finish(job)
    assert code == 0, err[-3000:]
    assert (
        f"rmt-launch: rank 1 on {socket.gethostname()} was killed by SIGKILL: probably out of memory; "
        f"rmt-plan counts {_planned(_config(cache_dir, tmp_path, 30), 2)}; restarting the workers (restart 1 of 2)"
    ) in err
    resumed = [line for line in out.splitlines() if line.startswith("resumed from iteration ")]
    assert len(resumed) == 1 and int(resumed[0].split()[3]) >= 10
    log = _log(tmp_path)
    assert [m["step"] for m in log] == list(range(1, 31))
    assert [m["lm loss"] for m in log] == uninterrupted
    assert _tagged(job.tag) == []  # no worker, writer or server outlives the job


def _planned(overrides, ranks):
    """The run's planned peak per rank, as the launchers' line states it."""
    from rmt.config import load_config
    from rmt.config_checks import validate
    from rmt.planner.rank import plan_rank, with_vocabulary

    peak = plan_rank(with_vocabulary(validate(load_config(None, overrides), ranks)), ranks, "cpu")["peak"]
    return f"{peak / 2**30:,.2f} GiB per rank for this run"


def test_rank_killed_in_a_step_is_named_and_the_run_resumes_from_its_checkpoint(uninterrupted, cache_dir, tmp_path):
    """SIGKILL in the middle of step 8 (the last checkpoint at 5), no restart left: the launcher's
    one line names the rank, its host, the signal and the plan; the surviving rank is stopped at
    once; the same command then continues from step 5 and ends as an uninterrupted run."""
    job = _single_node(_config(cache_dir, tmp_path, 30), MAX_RESTARTS="0")
    _wait_for(_logged(tmp_path, 7), job, "seven steps")
    os.kill(_worker(job.pid, 1), signal.SIGKILL)
    code, _, err = _finish(job, timeout=120)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"rmt-launch: rank 1 on {socket.gethostname()} was killed by SIGKILL: probably out of memory; rmt-plan "
        f"counts {_planned(_config(cache_dir, tmp_path, 30), 2)}; no restart is left (--max-restarts 0); see its "
        f"output above"
    )
    assert _tagged(job.tag) == []
    code, out, err = _finish(_single_node(_config(cache_dir, tmp_path, 30)))
    assert code == 0, err[-3000:]
    resumed = [line for line in out.splitlines() if line.startswith("resumed from iteration ")]
    assert resumed == [f"resumed from iteration 5 of 30: '{tmp_path}/ckpt/iter_0000005'"]
    assert [m["lm loss"] for m in _log(tmp_path)] == uninterrupted


def test_kill_during_a_save_leaves_the_checkpoints_before_it_whole(cache_dir, tmp_path):
    """SIGKILL while a checkpoint is being written (its ``.tmp`` directory exists): every
    published checkpoint verifies, and the same command continues from the newest of them,
    removing the torn save."""
    from rmt.training import checkpoint_dirs

    config = _config(cache_dir, tmp_path, 200) + ["train.save_interval=1"]
    job = _start([sys.executable, "-m", "rmt.training.cli"] + config)
    ckpt = tmp_path / "ckpt"
    saving = lambda: ckpt.is_dir() and [n for n in os.listdir(ckpt) if n.endswith(".tmp") and n > "iter_0000002"]  # noqa: E731
    _wait_for(saving, job, "a save in progress after step 2", timeout=600)
    os.kill(job.pid, signal.SIGKILL)
    job.communicate()
    torn = [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
    assert len(torn) == 1, os.listdir(ckpt)
    complete, skipped = checkpoint_dirs.complete_checkpoints(str(ckpt))
    newest = checkpoint_dirs.iterations(str(ckpt))[0][1]
    assert complete and complete[0] == newest and skipped == []
    assert all(checkpoint_dirs.verify(path) is None for _, path in checkpoint_dirs.iterations(str(ckpt)))
    code, out, err = _finish(
        _start([sys.executable, "-m", "rmt.training.cli"] + config + ["train.steps=" + str(int(newest[-7:]) + 2)])
    )
    assert code == 0, err[-3000:]
    assert f"resumed from iteration {int(newest[-7:])} of " in out
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]


def test_survivors_of_a_killed_rank_stop_with_one_line(cache_dir, tmp_path):
    """Two ranks with no launcher to stop them (SLURM's environment, started by hand): rank 1
    killed in a step, rank 0 stops within seconds, in one line, not in a collective until a
    timeout."""
    env = dict(
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="n1",
        SLURM_TASKS_PER_NODE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    cmd = (
        [sys.executable, "-m", "rmt.training.cli"] + _config(cache_dir, tmp_path, 2000) + ["parallel.timeout_minutes=5"]
    )
    ranks = [_start(cmd, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **env) for r in (0, 1)]
    _wait_for(_logged(tmp_path, 3), ranks[0], "three steps")
    os.kill(ranks[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    code, _, err = _finish(ranks[0], timeout=300)
    assert time.monotonic() - killed < 60
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert (
        err.strip().splitlines()[-1].startswith("rmt-train: rank 0: error: a collective with the other ranks failed (")
    )
    ranks[1].communicate()


def test_sigterm_to_the_launcher_saves_and_exits_0(cache_dir, tmp_path):
    """(The same command then finishes the run: see the slurm.sbatch requeue test.)"""
    job = _single_node(_config(cache_dir, tmp_path, 30))
    _wait_for(_logged(tmp_path, 3), job, "three steps")
    job.send_signal(signal.SIGTERM)
    code, out, err = _finish(job)
    assert code == 0, err[-3000:]
    assert "rmt-launch: received SIGTERM: asking the workers to save and stop" in err
    stopped = len(_log(tmp_path))
    assert stopped < 30
    assert (
        f"stopped on SIGTERM after step {stopped} of 30; checkpoint "
        f"'{tmp_path}/ckpt/iter_{stopped:07d}'; run the same command to continue"
    ) in out
    assert (tmp_path / "ckpt" / f"iter_{stopped:07d}" / "manifest.json").is_file()


def test_killed_launcher_takes_its_workers_with_it(cache_dir, tmp_path):
    job = _single_node(_config(cache_dir, tmp_path, 200))
    _wait_for(_logged(tmp_path, 2), job, "two steps")
    workers = [c.pid for c in psutil.Process(job.pid).children()]
    assert len(workers) == 2
    _kill_and_expect_no_survivors(job)


CTRL_C = "rmt: Ctrl-C: stopping after this step (with a checkpoint where train.save is set); Ctrl-C again quits at once"


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT])
def test_stop_signal_stops_a_plain_run_with_a_checkpoint(cache_dir, tmp_path, sig):
    """SIGUSR1, and a first Ctrl-C (SIGINT) alike: a checkpoint at the next step boundary (not
    only at the save interval), exit 0, no traceback; Ctrl-C says so in one line."""
    job = _start([sys.executable, "-m", "rmt.training.cli"] + _config(cache_dir, tmp_path, 200))
    _wait_for(_logged(tmp_path, 2), job, "two steps")
    job.send_signal(sig)
    code, out, err = _finish(job)
    stopped = len(_log(tmp_path))
    assert code == 0, err[-3000:]
    assert err.count(CTRL_C) == (sig == signal.SIGINT)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"stopped on {sig.name} after step {stopped} of 200" in out
    assert (tmp_path / "ckpt" / f"iter_{stopped:07d}" / "manifest.json").is_file()


def test_second_ctrl_c_quits_at_once_under_the_launcher(cache_dir, tmp_path):
    """Under ``rmt-launch`` Ctrl-C reaches the launcher (its workers run in sessions of their
    own): it passes it on, the workers stop at the next step; a second one passes on too and the
    workers quit at once, each side saying so in one line; the job exits 130, no traceback."""
    job = _single_node(_config(cache_dir, tmp_path, 200))
    _wait_for(_logged(tmp_path, 2), job, "two steps")
    job.send_signal(signal.SIGINT)
    time.sleep(0.3)  # the workers are still finishing their step or saving
    job.send_signal(signal.SIGINT)
    code, out, err = _finish(job, timeout=120)
    assert code == 130, err[-3000:]
    assert "rmt-launch: received SIGINT: asking the workers to save and stop" in err
    assert "rmt-launch: received SIGINT again: the workers quit now, without a checkpoint" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert _tagged(job.tag) == []


def test_killed_trainer_leaves_no_process_behind(cache_dir, tmp_path):
    """megatron-core's checkpoint writer used to leave a ~300 MB server process per kill."""
    job = _start(
        [sys.executable, "-m", "rmt.training.cli"] + _config(cache_dir, tmp_path, 200) + ["train.save_interval=1"]
    )
    _wait_for(lambda: (tmp_path / "ckpt" / "iter_0000003").is_dir(), job, "three checkpoints")
    _kill_and_expect_no_survivors(job)


def test_user_errors_under_the_launcher_are_said_once_with_exit_2(uninterrupted_run, cache_dir):
    # Before any worker starts: the config for the launch's world size.
    code, out, err = _finish(_single_node(tiny_overrides(cache_dir) + ["parallel.tensor_model_parallel_size=3"]))
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        "rmt-train: error: world size 2 is not divisible by tensor x pipeline parallel size 3 x 1 = 3"
    ]
    # Found by the workers (a checkpoint of another model): rank 0 says it, nothing restarts.
    other = uninterrupted_run / "ckpt"
    code, out, err = _finish(_single_node(tiny_overrides(cache_dir) + ["model.hidden_size=48", f"train.load={other}"]))
    assert code == 2 and "Traceback" not in err and "restarting" not in err
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == [
        f"rmt-train: error: model.hidden_size is 48 here but 32 in checkpoint '{other}/iter_0000030', "
        f"which holds another model; a checkpoint cannot change its model (train another in a "
        f"new train.save directory)"
    ]


def test_missing_node_is_named_when_the_join_timeout_expires(cache_dir):
    node0 = _start(
        ["bash", "launch/torchrun_multi_node.sh"] + tiny_overrides(cache_dir),
        NNODES="2",
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        NPROC="1",
        JOIN_TIMEOUT="3",
    )
    code, _, err = _finish(node0)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rmt-launch: 1 of 2 nodes did not join the rendezvous at 127.0.0.1:")
    assert "within 3 s (JOIN_TIMEOUT / --join-timeout): node rank 1 missing (joined: 0 (" in err


def test_two_nodes_on_one_machine_train_like_two_ranks(uninterrupted, cache_dir, tmp_path):
    port = str(free_port())
    nodes = [
        _start(
            ["bash", "launch/torchrun_multi_node.sh"] + _config(cache_dir, tmp_path, 30),
            NNODES="2",
            NODE_RANK=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            NPROC="1",
            JOIN_TIMEOUT="120",
        )
        for n in (0, 1)
    ]
    for node in nodes:
        code, _, err = _finish(node)
        assert code == 0, err[-3000:]
    assert [m["lm loss"] for m in _log(tmp_path)] == uninterrupted


def test_missing_rank_is_named_when_the_join_timeout_expires(cache_dir):
    """A SLURM task whose peer never starts: rank 0 names rank 1 and its node."""
    env = dict(
        SLURM_PROCID="0",
        SLURM_NTASKS="2",
        SLURM_LOCALID="0",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_TASKS_PER_NODE="1(x2)",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    code, _, err = _finish(
        _start(
            [sys.executable, "-m", "rmt.training.cli"]
            + tiny_overrides(cache_dir)
            + ["parallel.join_timeout_minutes=0.05"],
            **env,
        )
    )
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "rmt-train: rank 0: error: 1 of 2 ranks did not join the process group within 3 s "
        "(parallel.join_timeout_minutes): rank 1, expected on node 1 (n2)"
    )


def _sbatch(args, tmp_path, **env):
    slurm = dict(
        PATH=f"{FAKE_SLURM}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="127.0.0.1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_CPUS_PER_TASK="1",
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
        MASTER_PORT=str(free_port()),
        PY=os.path.join(ROOT, ".venv", "bin", "python"),
    )
    slurm.update(env)
    return _start(["bash", "launch/slurm.sbatch"] + args, **slurm)


def test_slurm_script_on_a_cpu_partition_requeues_after_sigusr1(uninterrupted, cache_dir, tmp_path):
    args = _config(cache_dir, tmp_path, 30)
    job = _sbatch(args, tmp_path)
    _wait_for(_logged(tmp_path, 3), job, "three steps")
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends before the time limit
    code, out, err = _finish(job)
    assert code == 0, err[-3000:]
    assert "rmt-train: config OK; the run would start from step 0" in out
    stopped = len(_log(tmp_path))
    assert f"stopped on SIGUSR1 after step {stopped} of 30" in out
    with open(tmp_path / "slurm.log") as f:
        assert f.read() == "requeue 4242\n"
    code, out, err = _finish(_sbatch(args, tmp_path))  # the requeued job
    assert code == 0, err[-3000:]
    assert f"resumed from iteration {stopped} of 30: '{tmp_path}/ckpt/iter_{stopped:07d}'" in out
    assert [m["lm loss"] for m in _log(tmp_path)] == uninterrupted


def test_slurm_script_names_a_task_killed_by_a_signal(cache_dir, tmp_path):
    """A task killed by SIGKILL under srun: srun ends the others, and the script names the rank,
    its node, the signal, the likely cause and the plan in one line."""
    args = _config(cache_dir, tmp_path, 200)
    job = _sbatch(args, tmp_path)
    _wait_for(_logged(tmp_path, 3), job, "three steps")
    srun = next(
        c for c in psutil.Process(job.pid).children(recursive=True) if os.path.join(FAKE_SLURM, "srun") in c.cmdline()
    )
    task = next(c for c in srun.children() if c.environ().get("SLURM_PROCID") == "1")
    os.kill(task.pid, signal.SIGKILL)
    code, _, err = _finish(job)
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert f"srun: error: {socket.gethostname()}: task 1: Killed" in err
    assert err.strip().splitlines()[-1] == (
        f"slurm.sbatch: rank 1 on {socket.gethostname()} was killed by SIGKILL: probably out of memory; "
        f"rmt-plan counts {_planned(args, 2)}"
    )
    assert _tagged(job.tag) == []


def test_slurm_script_wants_one_task_per_gpu(tmp_path):
    code, _, err = _finish(
        _sbatch(["--config", "configs/tiny.yaml"], tmp_path, SLURM_GPUS_ON_NODE="4", SLURM_NTASKS_PER_NODE="1")
    )
    assert code == 2
    assert err.strip() == (
        "slurm.sbatch: error: 4 GPUs per node but 1 tasks per node; submit with --ntasks-per-node=4 (one task per GPU)"
    )
