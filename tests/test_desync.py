"""Desynchronized ranks are reported, never a silent hang: the test matrix of issue 6.

Kinds checked with the fingerprint (debug) check, on SimComm and real MPI alike: different op,
dtype, count, root, reduction, a rank that skips a collective, an extra collective, swapped order.
Kinds that no fingerprint can catch because the ranks never meet in one call (different
communicator, point-to-point tag mismatch, a rank that raises before a collective) are caught by the
simulator's deadlock/failure detection and, under a real mpiexec, by the watchdog, which names the
ranks that did and did not arrive and aborts the job.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI  # noqa: F401 - MPI initialized before the launcher tests start jobs

import launcher
import mpidist
from mpidist import guard
from mpidist.guard import DesyncError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def desync_checks():
    previous = guard.settings.desync
    guard.configure(desync=True)
    yield
    guard.configure(desync=previous)


def disagree(kind, comm):
    """Run a short sequence of collectives in which the last rank deviates as ``kind`` says."""
    odd = comm.Get_rank() == comm.Get_size() - 1
    x = np.arange(6, dtype=np.float64)
    mpidist.allreduce(x.copy(), comm)  # one agreed call first: sequence numbers matter
    if kind == "op":
        mpidist.broadcast(x, comm) if odd else mpidist.allreduce(x, comm)
    elif kind == "dtype":
        mpidist.allreduce(x.astype(np.float32) if odd else x, comm)
    elif kind == "count":
        mpidist.allreduce(x[:5].copy() if odd else x, comm)
    elif kind == "root":
        mpidist.broadcast(x, comm, root=1 if odd else 0)
    elif kind == "reduction":
        mpidist.allreduce(x, comm, op="max" if odd else "sum")
    elif kind == "skip":
        if not odd:
            mpidist.allreduce(x, comm)
        mpidist.allgather(x, comm)
    elif kind == "extra":
        if odd:
            mpidist.broadcast(x, comm)
        mpidist.allreduce(x, comm)
    elif kind == "swapped":
        first, second = (mpidist.broadcast, mpidist.allreduce) if odd else (mpidist.allreduce, mpidist.broadcast)
        first(x, comm)
        second(x, comm)


EXPECTED = {
    "op": r"differs in op\b.*expected #1 allreduce\(dtype=float64, count=6, op=sum\) \(rank 0\)",
    "dtype": r"differs in dtype.*: #1 allreduce\(dtype=float32, count=6, op=sum\)",
    "count": r"differs in count.*: #1 allreduce\(dtype=float64, count=5, op=sum\)",
    "root": r"differs in root.*: #1 broadcast\(dtype=float64, count=6, root=1\)",
    "reduction": r"differs in reduction.*: #1 allreduce\(dtype=float64, count=6, op=max\)",
    "skip": r"at call #1 .*differs in op.*allgather",
    "extra": r"at call #1 .*differs in op.*broadcast",
    "swapped": r"at call #1 .*differs in op.*broadcast",
}


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_fingerprint_mismatch_raises_on_every_rank(comm, kind, desync_checks):
    with pytest.raises(DesyncError, match=EXPECTED[kind]) as info:
        disagree(kind, comm)
    size = comm.Get_size()
    assert f"rank{'s' if size > 2 else ''} {','.join(map(str, range(size - 1)))}: #1" in str(info.value)
    assert f"(rank 0), but rank {size - 1} called #1 " in str(info.value)  # the odd rank first, on every rank


def test_agreeing_ranks_pass_the_check(comm, desync_checks):
    x = np.ones(3)
    for _ in range(3):
        mpidist.allreduce(x, comm)
        mpidist.broadcast(x, comm, root=comm.Get_size() - 1)
        mpidist.allgather(x, comm)
        mpidist.reduce_scatter(np.ones(7), comm, op="mean")
        mpidist.barrier(comm)
    if comm.Get_size() > 1:  # point-to-point calls never count as collectives
        if comm.Get_rank() == 0:
            mpidist.send(x, 1, comm)
        elif comm.Get_rank() == 1:
            mpidist.recv(0, comm)
    mpidist.allreduce(x, comm)


# -- kinds the fingerprint cannot see: the simulator names them -----------------------------------------
@pytest.mark.mpi_skip
def test_sim_different_communicator_is_a_reported_deadlock():
    def body(comm):
        other = comm.Dup()
        mpidist.allreduce(np.ones(2), other if comm.rank == 1 else comm)

    with pytest.raises(mpidist.DeadlockError, match=r"rank 0 waits in Allreduce.*on SIM_WORLD;.*rank 1 waits in Allreduce.*SIM_WORLD.Dup"):
        mpidist.simulate(3, body)


@pytest.mark.mpi_skip
def test_sim_tag_mismatch_is_a_reported_deadlock():
    def body(comm):
        if comm.rank == 0:
            mpidist.send(np.ones(2), 1, comm, tag=1)
        else:
            mpidist.recv(0, comm, tag=2)

    with pytest.raises(mpidist.DeadlockError, match=r"rank 1 waits in Mprobe\(source=0, tag=2\)"):
        mpidist.simulate(2, body)


@pytest.mark.mpi_skip
def test_sim_rank_raising_before_a_collective_releases_the_others():
    def body(comm):
        if comm.rank == 1:
            raise RuntimeError("bad batch on rank 1")
        mpidist.allreduce(np.ones(2), comm)

    with pytest.raises(RuntimeError, match="bad batch on rank 1"):
        mpidist.simulate(3, body)


# -- under a real mpiexec: the watchdog ------------------------------------------------------------------
@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("kind, arrived, missing", [
    ("skip", "[0, 1, 3]", "[2]"),
    ("other-comm", None, None),
    ("tag", None, None),
])
@pytest.mark.slow
def test_watchdog_reports_and_aborts(kind, arrived, missing):
    proc = subprocess.run(launcher.mpiexec(4, sys.executable, os.path.join(ROOT, "tests", "jobs", "hang.py"), kind),
                          capture_output=True, text=True, timeout=60, env=launcher.env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "mpidist watchdog:" in out and "did not complete within 2 s" in out and "aborting the job" in out, out
    if arrived:
        assert f"ranks that arrived: {arrived}" in out and f"ranks that did not: {missing}" in out, out
        assert "rank 2: not in an mpidist collective" in out, out
    if kind == "tag":  # point to point: who waits where, no collective "arrived" lists
        assert "mpidist watchdog: recv on MPI_COMM_WORLD did not complete within 2 s (rank 1" in out, out
        assert "ranks that arrived" not in out and "rank 0: not in an mpidist collective" in out, out


def test_uneven_allgather_and_bad_roots_in_debug_mode(comm, desync_checks):
    rank = comm.Get_rank()
    got = mpidist.allgather(np.ones((rank + 1, 3)), comm)  # legal: leading dims may differ
    assert got.shape == (sum(range(1, comm.Get_size() + 1)), 3)
    with pytest.raises(TypeError, match=r"broadcast: root must be an int \(got NoneType None\)"):
        mpidist.broadcast(np.ones(2), comm, root=None)
    mpidist.allreduce(np.ones(2), comm, op="SUM")  # op names are case-insensitive in fingerprints too


def test_a_handle_dropped_without_wait_is_not_reported_as_in_flight(comm, desync_checks):
    import gc

    def mine():  # simulated ranks share one process, and so the guard's records
        return [op for _, op, _, _ in guard.in_flight(comm)]

    x = np.ones(8)
    handle = mpidist.iallreduce(x, comm)
    assert mine() == ["iallreduce"]
    comm.Barrier()  # every rank has started the operation, so MPI completes it without our wait
    del handle
    gc.collect()
    assert mine() == []
    mpidist.iallreduce(x, comm).wait()
    assert mine() == []
