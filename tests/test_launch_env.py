"""Launcher environments: torchrun, SLURM (srun) and a plain process."""

import socket

from rmt.parallel.launch_env import first_host, read_launch_env


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    e = read_launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == (
        3,
        8,
        1,
        "n1",
        1234,
        "torchrun",
    )


def test_slurm_env_uses_first_node_and_job_port():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NODELIST": "gpu[012-015,020]",
        "SLURM_JOB_ID": "123456",
    }
    e = read_launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.launcher) == (5, 16, 1, "slurm")
    assert e.master_addr == "gpu012" and e.master_port == 20000 + 123456 % 10000
    assert read_launch_env(dict(env, MASTER_ADDR="head", MASTER_PORT="999")).master_addr == "head"


def test_first_host_forms():
    assert first_host("node7") == "node7"
    assert first_host("a[3-5],b1") == "a3"
    assert first_host("rack1-[09,11]") == "rack1-09"


def test_plain_process_is_world_of_one():
    e = read_launch_env({})
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single") and e.master_port > 0


def test_expand_nodelist_and_rank_locations():
    from rmt.parallel.launch_env import expand_nodelist, rank_locations

    assert expand_nodelist("gpu[08-10,12],cpu1") == ["gpu08", "gpu09", "gpu10", "gpu12", "cpu1"]
    slurm = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert rank_locations(4, slurm) == ["node 0 (gpu1)", "node 0 (gpu1)", "node 1 (gpu2)", "node 1 (gpu2)"]
    assert rank_locations(4, {"LOCAL_WORLD_SIZE": "2"}) == ["node 0", "node 0", "node 1", "node 1"]
    assert rank_locations(4, {}) is None


def test_launcher_names_the_worker_that_failed_first():
    """torch's agent stops the other workers with SIGTERM in the same second; a user error
    (exit 2) is the failure to report (and not to restart)."""
    from types import SimpleNamespace as F

    from rmt.parallel.launcher import _describe, _root_failure

    killed = {0: F(exitcode=-15, timestamp=7, pid=-1), 1: F(exitcode=-9, timestamp=7, pid=-1)}
    rank, failure = _root_failure(killed)
    assert rank == 1 and _describe(rank, failure) == (
        f"rank 1 on {socket.gethostname()} was killed by SIGKILL: probably out of memory; the run's peak per "
        f"rank could not be planned"  # no rmt-train arguments were given to this launcher
    )
    assert _describe(0, killed[0]) == "rank 0 was killed by SIGTERM"
    user_error = {0: F(exitcode=-15, timestamp=9), 1: F(exitcode=1, timestamp=8), 2: F(exitcode=2, timestamp=9)}
    assert _root_failure(user_error)[0] == 2
    assert _describe(2, _root_failure(user_error)[1]) == "rank 2 exited with status 2"
    assert _root_failure({3: F(exitcode=-15, timestamp=1)})[0] == 3
    # rank 1 SIGKILLed; rank 0 lost its peer and exited first, with an earlier timestamp
    peer_lost = {0: F(exitcode=1, timestamp=5), 1: F(exitcode=-9, timestamp=6)}
    assert _root_failure(peer_lost)[0] == 1
