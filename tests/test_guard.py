"""The always-on desync check (issue 11 item 7) and per-phase time limits (item 8).

Without debug mode, a collective whose message has at least ``check_bytes`` bytes compares fingerprints
first: a count, shape, dtype, root or reduction mismatch raises DesyncError on every rank, before any
data moves (the buffers keep their values). allgather and alltoall compare their stamp in the shape
exchange they make anyway. Ranks whose sizes straddle the threshold never exchange wrong numbers: the
simulator reports the mismatch, and under mpiexec the watchdog turns it into DesyncError.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import launcher
import mpidist
from mpidist import CollectiveMismatchError, checkpoint, guard
from mpidist.guard import DesyncError, phases, record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "guard_job.py")
THRESHOLD = 4096  # bytes; small, so that tests stay fast


@pytest.fixture
def always_on():
    """The check as shipped (debug off), with a small threshold."""
    before = guard.settings
    guard.configure(desync=False, check_bytes=THRESHOLD)
    yield
    guard.configure(desync=before.desync, check_bytes=before.check_bytes)


def deviate(kind, comm):
    """Make the last rank's collective differ from the others' as ``kind`` says; return (call, buffers)."""
    odd = comm.Get_rank() == comm.Get_size() - 1
    n = 2048  # 16 KiB of float64: above THRESHOLD
    x = np.arange(n, dtype=np.float64) + comm.Get_rank()
    if kind == "count":
        x = x[:-1].copy() if odd else x
        return (lambda: mpidist.allreduce(x, comm)), x
    if kind == "dtype":
        x = x.astype(np.float32) if odd else x  # 8 KiB: still above the threshold
        return (lambda: mpidist.allreduce(x, comm)), x
    if kind == "shape":  # same count, other layout: positional sums would be wrong
        x = x.reshape(32, 64) if odd else x.reshape(64, 32)
        return (lambda: mpidist.allreduce(x, comm)), x
    if kind == "reduction":
        return (lambda: mpidist.allreduce(x, comm, op="max" if odd else "sum")), x
    if kind == "root":
        return (lambda: mpidist.broadcast(x, comm, root=1 if odd else 0)), x
    if kind == "op":
        if odd:
            return (lambda: mpidist.reduce_scatter(x, comm)), x
        return (lambda: mpidist.allreduce(x, comm)), x
    if kind == "nonblocking":  # iallreduce vs iallreduce of another count: raised before anything is posted
        x = x[:-8].copy() if odd else x
        return (lambda: mpidist.iallreduce(x, comm)), x
    if kind == "broadcast-count":
        x = x[:1024].copy() if odd else x
        return (lambda: mpidist.ibroadcast(x, comm)), x
    if kind == "allgather-out":
        x = x[:-1].copy() if odd else x
        out = np.empty(comm.Get_size() * x.size)
        return (lambda: mpidist.allgather(x, comm, out=out)), x
    raise ValueError(kind)


MISMATCHES = {
    "count": r"differs in count\): expected #1 allreduce\(dtype=float64, count=2048, op=sum\) \(rank 0\), but "
             r"rank {odd} called #1 allreduce\(dtype=float64, count=2047, op=sum\)",
    "dtype": r"differs in dtype\): .* but rank {odd} called #1 allreduce\(dtype=float32, count=2048, op=sum\)",
    "shape": r"differs in shape\): expected #1 allreduce\(dtype=float64, count=2048, shape=\(64, 32\), op=sum\) "
             r"\(rank 0\), but rank {odd} called #1 allreduce\(dtype=float64, count=2048, shape=\(32, 64\), op=sum\)",
    "reduction": r"differs in reduction\): .* but rank {odd} called #1 allreduce\(dtype=float64, count=2048, op=max\)",
    "root": r"differs in root\): expected #1 broadcast\(dtype=float64, count=2048, root=0\) \(rank 0\), but "
            r"rank {odd} called #1 broadcast\(dtype=float64, count=2048, root=1\)",
    "op": r"differs in op\): .* but rank {odd} called #1 reduce_scatter\(dtype=float64, count=2048, op=sum\)",
    "nonblocking": r"differs in count\): .* but rank {odd} called #1 iallreduce\(dtype=float64, count=2040, op=sum\)",
    "broadcast-count": r"differs in count\): .* but rank {odd} called #1 ibroadcast\(dtype=float64, count=1024, root=0\)",
    "allgather-out": r"differs in count\): .* but rank {odd} called #1 allgather\(dtype=float64, count=2047\)",
}


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_large_mismatch_raises_on_every_rank_without_debug(comm, kind, always_on):
    odd = comm.Get_size() - 1
    mpidist.allreduce(np.ones(4), comm)  # call #0, small and agreed: sequence numbers matter
    call, x = deviate(kind, comm)
    before = x.copy()
    with pytest.raises(DesyncError, match=MISMATCHES[kind].format(odd=odd)) as info:
        call()
    assert f"collective desync on {record.entry_of(comm).name} at call #1" in str(info.value)
    np.testing.assert_array_equal(x, before)  # no data moved: no rank holds wrong numbers


def test_agreeing_large_collectives_pass_and_compute(comm, always_on):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.arange(4096, dtype=np.float64) + rank
    expected = np.arange(4096, dtype=np.float64) * size + sum(range(size))
    np.testing.assert_array_equal(mpidist.allreduce(x.copy(), comm), expected)
    np.testing.assert_array_equal(mpidist.iallreduce(x.copy(), comm).wait(), expected)
    np.testing.assert_array_equal(mpidist.broadcast(x.copy(), comm, root=size - 1),
                                  np.arange(4096, dtype=np.float64) + size - 1)
    rows = mpidist.reduce_scatter(x.reshape(64, 64).copy(), comm)
    np.testing.assert_array_equal(rows, np.array_split(expected.reshape(64, 64), size)[rank])
    out = np.empty((size * 64, 64))
    mpidist.allgather(x.reshape(64, 64), comm, out=out)
    np.testing.assert_array_equal(out, np.concatenate([np.arange(4096.).reshape(64, 64) + r for r in range(size)]))


@pytest.mark.world_sizes(2, 3)
def test_small_messages_are_checked_only_in_debug_mode(comm, always_on):
    odd = comm.Get_rank() == comm.Get_size() - 1
    x = np.ones((4, 8)) if odd else np.ones((8, 4))  # 256 B: below the threshold
    mpidist.allreduce(x, comm)  # same count, other shape: not checked (the cost would exceed 2%)
    np.testing.assert_array_equal(x, np.full(x.shape, comm.Get_size()))
    guard.configure(desync=True)
    with pytest.raises(DesyncError, match=r"differs in shape"):
        mpidist.allreduce(x, comm)


@pytest.mark.world_sizes(2, 3, 4)
def test_allgather_and_alltoall_compare_stamps_at_every_size(comm, always_on):
    """A rank whose call failed before communicating is one call ahead: the next shape exchange says so."""
    odd = comm.Get_rank() == comm.Get_size() - 1
    if odd:
        with pytest.raises(TypeError):
            mpidist.allreduce([1.0], comm)  # counts as call #0 here only
    with pytest.raises(DesyncError, match=rf"differs in sequence\): expected #0 allgather \(rank 0\), but rank "
                                          rf"{comm.Get_size() - 1} called #1 allgather"):
        mpidist.allgather(np.ones(3), comm)
    comm2 = comm.Dup()
    kind = mpidist.iallgather if odd else mpidist.allgather  # a nonblocking call never matches a blocking one
    with pytest.raises(DesyncError, match=r"differs in op\): expected #0 allgather \(rank 0\), but .* called #0 iallgather"):
        kind(np.ones(2), comm2)
    comm3 = comm.Dup()
    if odd:
        with pytest.raises(TypeError):
            mpidist.broadcast("not an array", comm3)
    with pytest.raises(DesyncError, match=r"differs in sequence\): expected #0 alltoall"):
        mpidist.alltoall(np.ones((comm.Get_size(), 2)), comm3)
    comm2.Free()
    comm3.Free()


@pytest.mark.mpi_skip
@pytest.mark.parametrize("large", [0, 1])
def test_straddling_sizes_on_the_simulator_move_no_data(large):
    """Rank ``large`` checks (1M elements), the others do not (10): the simulator names both calls."""
    before = guard.settings
    guard.configure(desync=False, check_bytes=65536)
    results = {}

    def body(comm):
        mpidist.allreduce(np.ones(2), comm)
        x = np.full(1 << 20 if comm.rank == large else 10, comm.rank + 1.0, dtype=np.float32)
        try:
            mpidist.allreduce(x, comm)
        finally:
            results[comm.rank] = x
    try:
        with pytest.raises(CollectiveMismatchError, match=r"collective mismatch on SIM_WORLD"):
            mpidist.simulate(3, body)
    finally:
        guard.configure(desync=before.desync, check_bytes=before.check_bytes)
    for rank, x in results.items():
        assert (x == rank + 1).all(), f"rank {rank} got wrong numbers"


def run_job(*args, env=None, timeout=60):
    full_env = launcher.env(**(env or {}))
    proc = subprocess.run(launcher.mpiexec(args[0], sys.executable, JOB, *map(str, args[1:])), capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=env.get("TMP_CWD") if env else None)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("n, large", [(2, 0), (2, 1), (3, 1)])
def test_straddling_sizes_under_mpiexec_end_in_desync_error(n, large, tmp_path):
    code, out = run_job(n, "straddle", large, env={"MPIDIST_CHECK_BYTES": "65536",
                                                   "MPIDIST_FLIGHT_DIR": str(tmp_path), "TMP_CWD": str(tmp_path)})
    assert code != 0, out
    assert "returned" not in out, out  # no rank came back from the mismatched allreduce
    small = [r for r in range(n) if r != large]
    assert (f"[rank {large}] mpidist.guard.fingerprint.DesyncError: collective desync on MPI_COMM_WORLD at call #1 "
            f"(differs in count): rank {large} called #1 allreduce(dtype=float32, count=1048576, op=sum) (4194304 B, "
            f"at least the 65536 B from which ranks check) and waits in its desync check, but ") in out, out
    for r in small:
        assert f"rank {r} called #1 allreduce(dtype=float32, count=10, op=sum) (40 B) and went ahead without a check" in out, out
        assert f"[rank {r}] mpidist: DesyncError: collective desync on MPI_COMM_WORLD at call #1" in out, out
        assert f"[rank {r}] mpidist: this rank is blocked inside MPI and cannot raise it; rank {large} raises it" in out, out


@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("n, large", [(2, 0), (3, 1)])
def test_a_caught_straddle_desync_aborts_at_exit_instead_of_hanging_in_finalize(n, large, tmp_path):
    # The ranks that went ahead wait inside MPI for ever; MPI_Finalize on rank LARGE would wait for them until
    # their collective timeout (30 s here), which then blamed rank LARGE for never arriving.
    start = time.monotonic()
    code, out = run_job(n, "straddle-caught", large, env={"MPIDIST_CHECK_BYTES": "65536", "MPIDIST_COLLECTIVE_TIMEOUT": "30",
                                                          "MPIDIST_FLIGHT_DIR": str(tmp_path), "TMP_CWD": str(tmp_path)},
                        timeout=90)
    elapsed = time.monotonic() - start
    ahead = [r for r in range(n) if r != large]
    assert code != 0 and f"rank {large}: caught DesyncError" in out and "did not complete within" not in out, out
    assert (f"[rank {large}] mpidist: this rank caught a DesyncError on MPI_COMM_WORLD that left rank(s) {ahead} "
            f"blocked inside MPI, in a collective it never joins; MPI_Finalize would wait for them, so the job is "
            f"aborted at exit") in out, out
    assert "done" not in out.replace(f"rank {large}: done", ""), out  # only rank LARGE got to the end
    assert elapsed < 25, (elapsed, out)


# -- phases --------------------------------------------------------------------------------------------
def test_phase_limits_and_defaults():
    before = guard.settings
    guard.configure(checkpoint_timeout=123, collective_timeout=7)
    dog = guard.Watchdog.__new__(guard.Watchdog)  # only its limit(), no thread, no MPI
    dog.timeout = None
    try:
        assert dog.limit() == 7
        with guard.phase("checkpoint"):
            assert [name for name, _, _ in phases.active_phases()] == ["checkpoint"]
            assert dog.limit() == 123
            with guard.phase("evaluation", timeout=5):
                assert dog.limit() == 5
            assert dog.limit() == 123
        assert phases.active_phases() == [] and dog.limit() == 7
        with pytest.raises(ValueError, match=r"guard.phase: phase 'evaluation' has no default time limit; pass timeout="):
            with guard.phase("evaluation"):
                pass
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds >= 0 \(got -1\)"):
            with guard.phase("evaluation", timeout=-1):
                pass
        with pytest.raises(TypeError, match=r"guard.configure: unexpected argument 'colective_timeout'"):
            guard.configure(colective_timeout=3)
    finally:
        guard.configure(checkpoint_timeout=before.checkpoint_timeout, collective_timeout=before.collective_timeout)


class _PhaseProbe:
    """A state entry whose state_dict notes the phases open while checkpoint saves or loads it."""

    def __init__(self):
        self.seen = []

    def state_dict(self):
        self.seen.append([name for name, _, _ in phases.active_phases()])
        return {"x": 1}

    def load_state_dict(self, state):
        self.seen.append([name for name, _, _ in phases.active_phases()])


def test_checkpoint_save_and_load_run_in_the_checkpoint_phase(comm, tmp_path):
    path = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    probe = _PhaseProbe()
    checkpoint.save(path, {"probe": probe}, comm, step=1)
    checkpoint.load(path, {"probe": probe}, comm)
    assert probe.seen and all(seen == ["checkpoint"] for seen in probe.seen), probe.seen
    assert phases.active_phases() == []


@pytest.mark.mpi_skip
@launcher.needed
def test_a_checkpoint_phase_has_its_own_limit(tmp_path):
    env = {"MPIDIST_FLIGHT_DIR": str(tmp_path), "TMP_CWD": str(tmp_path)}
    # 3 s inside the checkpoint phase: fine with a 30 s checkpoint limit though collectives get 1 s.
    code, out = run_job(2, "phase-ok", env=dict(env, MPIDIST_COLLECTIVE_TIMEOUT="1", MPIDIST_CHECKPOINT_TIMEOUT="30"))
    assert code == 0 and "rank 0: done" in out and "rank 1: done" in out and "watchdog" not in out, out
    # The same wait with a 1 s checkpoint limit and a 60 s collective one is reported after about 1 s.
    code, out = run_job(2, "phase-limit", env=dict(env, MPIDIST_COLLECTIVE_TIMEOUT="60", MPIDIST_CHECKPOINT_TIMEOUT="1"))
    assert code != 0 and "done" not in out, out
    assert "did not complete within 1 s" in out and "aborting the job" in out, out
    assert ("mpidist watchdog: phase checkpoint did not complete within 1 s" in out
            or "mpidist watchdog: barrier #0 on MPI_COMM_WORLD did not complete within 1 s" in out), out
    assert "raise the limit: mpidist.init(collective_timeout=...)" in out, out
