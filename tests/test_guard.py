"""The always-on desync check, per-phase time limits, the timeout report, and ranks that leave early.

Without debug mode, a collective whose message has at least ``check_bytes`` bytes compares fingerprints
first: a count, shape, dtype, root or reduction mismatch raises DesyncError on every rank, before any
data moves (the buffers keep their values). allgather and alltoall compare their stamp in the shape
exchange they make anyway. Ranks whose sizes straddle the threshold never exchange wrong numbers: the
simulator reports the mismatch, and under mpiexec the watchdog turns it into DesyncError.
"""

import os
import re
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
LEAVE_JOB = os.path.join(ROOT, "tests", "jobs", "leave_early.py")
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        for bad in (-1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=rf"timeout must be a finite number of seconds >= 0 \(got {bad!r}\)"):
                with guard.phase("evaluation", timeout=bad):
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


@pytest.mark.slow
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


# -- the timeout report names who did not arrive --------------------------------------------------------
class _Entry:
    """The part of a communicator's ``record.Entry`` the report reads."""

    def __init__(self, members, name="comm"):
        self.members, self.name, self.key = tuple(members), name, f"{record.span(members)}:{name}#0"


def _call(entry, seq, count, op="reduce_scatter"):
    """A record of collective ``op`` #seq in flight with ``count`` float64 elements (see ``guard.record``)."""
    float64 = list(guard.fingerprint.dtype_names).index("float64")
    return [seq, op, entry, 8 * count, -1, time.monotonic(), None, float64, count, "sum", record.RUNNING]


def _reply(*records):
    return {"text": "", "calls": [record.summary(r) for r in records]}


def _reporter(rank, size):
    dog = guard.Watchdog.__new__(guard.Watchdog)  # only its report, no thread, no MPI
    dog.rank, dog.size, dog._to_local, dog.departed = rank, size, {r: r for r in range(size)}, {}
    dog.hosts = ["vm"] * size  # one machine; tests/test_cluster_watchdog.py gives ranks hosts of their own
    return dog


def test_the_timeout_report_names_the_missing_members_or_says_how_the_present_ones_differ():
    world, pair = _Entry(range(4), "world"), _Entry([1, 2], "pair")
    dog = _reporter(1, 4)
    # Rank 2 is elsewhere: only members count (ranks 0 and 3 are not in the pair's communicator).
    lines = dog._arrivals(_call(pair, 3, 12), {0: _reply(), 2: _reply(_call(pair, 2, 12)), 3: _reply()})
    assert lines == ["  ranks that arrived: [1]", "  ranks that did not: [2]"]
    # Every member arrived at #0 of the world's reduce_scatter, with 4 and 5 rows of 3 (issue: "did not: []").
    ranks = {r: _call(world, 0, 15 if r == 3 else 12) for r in range(4)}
    lines = dog._arrivals(ranks[1], {r: _reply(ranks[r]) for r in (0, 2, 3)})
    assert lines[0] == "  ranks that arrived: [0, 1, 2, 3]", lines
    assert lines[1].startswith("  ranks that did not: none, every member is in #0 but the calls differ"), lines
    assert lines[1].endswith("ranks 0,1,2: #0 reduce_scatter(dtype=float64, count=12, op=sum); "
                             "rank 3: #0 reduce_scatter(dtype=float64, count=15, op=sum)"), lines
    same = {r: _call(world, 0, 12) for r in range(4)}
    lines = dog._arrivals(same[1], {r: _reply(same[r]) for r in (0, 2, 3)})
    assert lines[1] == ("  ranks that did not: none, every member is in #0 reduce_scatter(dtype=float64, count=12, "
                        "op=sum) with the same arguments: the wait is inside MPI (a slow or failed network or node, "
                        "or a stopped process)"), lines


def run_leave_job(n, kind, tmp_path, timeout):
    env = launcher.env(MPIDIST_COLLECTIVE_TIMEOUT=str(timeout), MPIDIST_FLIGHT_DIR=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run(launcher.mpiexec(n, sys.executable, LEAVE_JOB, kind), capture_output=True, text=True,
                          timeout=timeout + 60, env=env, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("n", [2, 4])
def test_a_reduce_scatter_of_different_row_counts_times_out_naming_how_the_ranks_differ(n, tmp_path):
    job = tmp_path / "rows.py"
    job.write_text("import numpy as np, mpidist\n"
                   "comm, _ = mpidist.init(collective_timeout=2)\n"
                   "mpidist.guard.watchdog.running().reply_wait = 30  # every rank's answer, also under load\n"
                   "x = np.ones((5 if comm.Get_rank() == comm.Get_size() - 1 else 4, 3))\n"
                   "mpidist.reduce_scatter(x, comm)\n")
    proc = subprocess.run(launcher.mpiexec(n, sys.executable, str(job)), capture_output=True, text=True, timeout=60,
                          env=launcher.env(MPIDIST_FLIGHT_DIR=str(tmp_path)), cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "mpidist watchdog: reduce_scatter #0 on MPI_COMM_WORLD did not complete" in out, out
    assert "ranks that did not: []" not in out, out
    odd, others = n - 1, ",".join(map(str, range(n - 1)))
    assert ("every member is in #0 but the calls differ" in out
            and f"{'ranks' if n > 2 else 'rank'} {others}: #0 reduce_scatter(dtype=float64, count=12, op=sum); "
                f"rank {odd}: #0 reduce_scatter(dtype=float64, count=15, op=sum)" in out), out


# -- a rank that leaves early ------------------------------------------------------------------------------
LEFT = (r"mpidist watchdog: rank {left} left the job \(its program ended\) while rank \d+ waits in allreduce #{seq} "
        r"on {comm}, which rank {left} never joins \(its last collective there was #{last} allreduce\)")
LIMIT = 120  # the collective timeout of these jobs: the report must come long before it


@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("kind, seq, n", [("fewer", 3, 2), ("fewer", 3, 4), ("return", 2, 4), ("exit", 2, 2)])
def test_a_rank_that_leaves_early_is_reported_at_once_by_the_ranks_waiting_for_it(kind, seq, n, tmp_path):
    code, out, elapsed = run_leave_job(n, kind, tmp_path, LIMIT)
    left = n - 1
    assert code != 0 and re.search(LEFT.format(left=left, seq=seq, comm="MPI_COMM_WORLD", last=seq - 1), out), out
    assert f"ranks that arrived: {list(range(n - 1))}" in out and f"ranks that did not: [{left}]" in out, out
    assert "aborting the job" in out and out.count(": done") == 1 and f"rank {left}: done" in out, out
    assert elapsed < LIMIT / 2, (elapsed, out)


@pytest.mark.mpi_skip
@launcher.needed
def test_only_the_members_of_its_communicator_wait_for_a_rank_that_left(tmp_path):
    """4 ranks in halves {0, 1} and {2, 3}: rank 3 leaves half 1; ranks 0 and 1 end normally, rank 2 waits."""
    code, out, elapsed = run_leave_job(4, "split", tmp_path, LIMIT)
    assert code != 0 and re.search(LEFT.format(left=3, seq=1, comm="half1", last=0), out), out
    assert "while rank 2 waits" in out and "ranks that arrived: [2]" in out and "ranks that did not: [3]" in out, out
    assert sorted(re.findall(r"rank (\d): done", out)) == ["0", "1", "3"], out
    assert elapsed < LIMIT / 2, (elapsed, out)


@pytest.mark.slow
@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("n", [2, 4])
def test_ranks_that_end_at_different_times_are_no_false_alarm(n, tmp_path):
    """Rank 0 leaves while the others' nonblocking allreduce it joined is still in flight; the last rank ends late."""
    code, out, _ = run_leave_job(n, "normal", tmp_path, LIMIT)
    assert code == 0 and "watchdog" not in out, out
    assert sorted(re.findall(r"rank (\d): done", out)) == [str(r) for r in range(n)], out


@pytest.mark.mpi_skip
@pytest.mark.parametrize("n", [2, 4])
def test_a_simulated_rank_that_returns_early_is_named_in_the_deadlock_report(n):
    def body(comm):
        for _ in range(2 if comm.rank == 1 else 3):
            mpidist.allreduce(np.ones(2), comm)

    with pytest.raises(mpidist.DeadlockError) as info:
        mpidist.simulate(n, body)
    message = str(info.value)
    assert "every live simulated rank is blocked and rank 1 returned without joining them: " in message, message
    for r in range(n):
        if r != 1:
            assert f"rank {r} waits in Allreduce(count=2, dtype=float64, op=SUM) #2 on SIM_WORLD" in message, message
