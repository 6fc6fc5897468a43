"""Launch detection: world layout from the communicator, launcher from the environment, misconfigurations stop."""

import os
import subprocess
import sys

import pytest

import launcher
import mpidist
from mpidist.launch import LaunchError, _check_world, detect_launcher, expected_world_size

SRUN = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"}
HYDRA = {"PMI_RANK": "0", "PMI_SIZE": "4"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}


def test_detect_launcher_and_expected_size():
    assert detect_launcher(SRUN) == "srun" and expected_world_size(SRUN) == 4
    assert detect_launcher(HYDRA) == "mpiexec" and expected_world_size(HYDRA) == 4
    assert detect_launcher(OPEN_MPI) == "mpiexec" and expected_world_size(OPEN_MPI) == 2
    assert detect_launcher({}) == "none" and expected_world_size({}) is None
    # Inside an sbatch script (no srun step) Slurm says how many tasks the job has, not this process's world.
    assert expected_world_size({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}) is None
    # `mpiexec -n 1` in a 2-node allocation: Hydra starts its 2 proxies with srun; the world is PMI_SIZE's 1.
    hydra_over_srun = dict(SRUN, SLURM_STEP_NUM_TASKS="2", PMI_RANK="0", PMI_SIZE="1", MPI_LOCALRANKID="0")
    assert expected_world_size(hydra_over_srun) == 1 and detect_launcher(hydra_over_srun) == "mpiexec"
    _check_world(1, hydra_over_srun)  # no false alarm
    # A foreign MPI under that mpiexec: the hint is about the mpiexec, not about srun's --mpi.
    with pytest.raises(LaunchError, match=r"started 4 processes.*mpiexec that started this job belongs to a different MPI"):
        _check_world(1, dict(hydra_over_srun, PMI_SIZE="4"))


def test_world_of_one_under_srun_with_several_tasks_stops_with_the_fix():
    with pytest.raises(LaunchError, match=r"started 4 processes but MPI reports a world of 1.*srun --mpi=pmi2.*srun --mpi=pmix"):
        _check_world(1, SRUN)


def test_world_of_one_under_a_foreign_mpiexec_stops():
    with pytest.raises(LaunchError, match=r"started 4 processes but MPI reports a world of 1.*mpiexec of the same installation"):
        _check_world(1, HYDRA)


def test_consistent_worlds_pass():
    _check_world(4, SRUN)
    _check_world(1, {})
    _check_world(1, {"SLURM_NTASKS": "4"})  # a plain `python train.py` in a batch script is a world of one


def test_init_describes_the_world(comm):
    world, info = mpidist.init(comm, abort_on_error=False)
    assert world is comm
    assert (info.rank, info.size) == (comm.Get_rank(), comm.Get_size())
    assert 0 <= info.local_rank < info.local_size <= info.size
    # Every node's ranks add up to the world, counted independently of init's own node count.
    leaders = comm.allgather(info.local_size if info.local_rank == 0 else 0)
    assert sum(leaders) == info.size and info.nodes == sum(1 for s in leaders if s)
    assert info.mpi_version.count(".") == 1 and info.mpi_library


@pytest.mark.mpi_skip
def test_simulated_nodes_give_local_ranks():
    infos = mpidist.simulate(4, lambda c: mpidist.init(c, abort_on_error=False)[1], ranks_per_node=2)
    assert [(i.local_rank, i.local_size, i.nodes) for i in infos] == [(0, 2, 2), (1, 2, 2), (0, 2, 2), (1, 2, 2)]


@pytest.mark.mpi_skip
def test_init_names_the_library_without_open_mpi_4s_trailing_nul(monkeypatch):
    from mpi4py import MPI
    debian = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022"
    monkeypatch.setattr(MPI, "Get_library_version", lambda: debian + "\0")  # as Debian's Open MPI 4.1.4 returns it
    infos = mpidist.simulate(2, lambda c: mpidist.init(c, abort_on_error=False)[1])
    assert [i.mpi_library for i in infos] == [debian, debian]


@pytest.mark.mpi_skip
def test_srun_mpi_none_is_refused_at_start_up():
    """A process that believes it is one of 4 srun tasks, but whose MPI says 1, exits with the fix."""
    env = dict(os.environ, **SRUN)
    proc = subprocess.run([sys.executable, "-c", "import mpidist; mpidist.init(); print('trained anyway')"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "trained anyway" not in proc.stdout
    assert "LaunchError" in proc.stderr and "--mpi=pmi2" in proc.stderr


@pytest.mark.mpi_skip
def test_abort_waits_until_the_launcher_has_read_the_traceback(tmp_path):
    """Bytes left in a stdio pipe when MPI_Abort kills the launcher are lost: wait for the reader first."""
    import threading
    import time

    from mpidist.guard import wait_until_pipes_drained

    read_end, write_end = os.pipe()
    os.write(write_end, b"[rank 2] Traceback ...\n")
    got = []
    reader = threading.Timer(0.3, lambda: got.append(os.read(read_end, 1024)))
    start = time.monotonic()
    reader.start()
    wait_until_pipes_drained([write_end], timeout=10)
    waited = time.monotonic() - start
    reader.join()
    assert got == [b"[rank 2] Traceback ...\n"] and 0.25 < waited < 5, waited

    # Nobody reads: the wait is bounded. A regular file, or a closed descriptor, needs no wait at all.
    os.write(write_end, b"x")
    start = time.monotonic()
    wait_until_pipes_drained([write_end], timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3
    with open(tmp_path / "log", "w") as f:
        start = time.monotonic()
        wait_until_pipes_drained([f.fileno(), 987654], timeout=5)
        assert time.monotonic() - start < 1
    os.close(read_end)
    os.close(write_end)


@pytest.mark.mpi_skip
def test_abort_happens_even_when_nobody_reads_the_traceback():
    """A launcher that stopped reading stderr must not turn one rank's error into a hang."""
    import time
    code = ("from mpi4py import MPI\n"
            "from mpidist.launch import install_abort_on_error\n"
            "install_abort_on_error(MPI.COMM_WORLD, backstop=1.0)\n"
            "raise ValueError('x' * 300_000)  # far more than a pipe holds: the report blocks\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=launcher.env())
    start = time.monotonic()
    try:
        status = proc.wait(timeout=30)  # stderr is never read while it runs
    finally:
        proc.kill()
        proc.stderr.close()
    assert status != 0 and time.monotonic() - start < 20
