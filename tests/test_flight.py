"""The flight recorder (issue 11 item 8): every call recorded per rank, dumped as JSON on a watchdog
timeout, an abort or SIGUSR2, and read back by ``python -m mpidist flight DIR``."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import launcher
import mpidist
from mpidist import guard
from mpidist.guard import flight, record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "jobs", "guard_job.py")


def mine(comm):
    """This rank's records on ``comm`` (simulated ranks share one process and its ring)."""
    return [record.summary(r) for r in record.snapshot() if r[record.COMM].owner() is comm]


def test_every_call_is_recorded_with_sequence_bytes_peer_and_times(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones(6, dtype=np.float32)
    mpidist.allreduce(x, comm)
    mpidist.broadcast(np.ones((2, 3)), comm, root=size - 1)
    handle = mpidist.iallgather(np.ones(5, dtype=np.int16), comm)
    in_flight_ops = [op for _, op, _, _ in guard.in_flight(comm)]
    handle.wait()
    mpidist.reduce_scatter(np.ones(4 * size), comm, op="max")
    if size > 1:
        if rank == 0:
            mpidist.send(np.ones(3), 1, comm, tag=7)
        elif rank == 1:
            mpidist.recv(0, comm, tag=7)
    calls = mine(comm)
    expected = [("allreduce", 0, 24, -1, "sum"), ("broadcast", 1, 48, size - 1, ""), ("iallgather", 2, 10, -1, ""),
                ("reduce_scatter", 3, 32 * size, -1, "max")]
    if size > 1 and rank < 2:
        expected.append(("send", -1, 24, 1, "") if rank == 0 else ("recv", -1, -1, 0, ""))
    assert [(c["op"], c["seq"], c["bytes"], c["peer"], c["reduction"]) for c in calls] == expected
    assert in_flight_ops in (["iallgather"], [])  # in flight until waited for (or done at once on one rank)
    assert all(c["end"] is not None and c["start"] <= c["end"] for c in calls)
    assert [c["start"] for c in calls] == sorted(c["start"] for c in calls)
    assert {c["comm"] for c in calls} == {record.entry_of(comm).key}


def test_the_ring_keeps_the_last_n_calls_and_handles_still_waited_for(comm):
    before = guard.settings.flight_size
    # Simulated ranks share the process's settings: every rank reads the size before any changes it, or a
    # late rank would "restore" the 16 an early one set, and the ring would stay small for the rest of the session.
    comm.Barrier()
    guard.configure(flight_size=16)
    try:
        handle = mpidist.iallreduce(np.ones(3), comm)  # held: must outlive the ring's turnover
        for i in range(40):
            mpidist.allreduce(np.ones(1), comm)
        comm.Barrier()  # every rank has made its 41 calls before any looks
        finished = [r for r in record.snapshot() if r[record.END] is not None]
        assert 0 < len(finished) <= 16  # only the ring keeps finished calls
        seqs = [r[record.SEQ] for r in finished if r[record.COMM].owner() is comm]
        assert seqs == list(range(41 - len(seqs), 41))  # the newest ones, in order
        if comm.Get_size() == 1:
            assert len(seqs) >= 15  # the ring's 16, less the iallreduce if it is still held
        assert [r[record.OP] for r in record.in_flight(comm)] in (["iallreduce"], [])
        handle.wait()
        assert record.in_flight(comm) == []
        comm.Barrier()  # nobody restores the size while another rank still counts
    finally:
        guard.configure(flight_size=before)


@pytest.mark.world_sizes(2)
def test_communicator_keys_are_the_same_on_every_rank(comm):
    """Two unnamed duplicates are told apart by the order this rank first used them, identically on all ranks."""
    a, b = comm.Dup(), comm.Dup()
    mpidist.allreduce(np.ones(1), b)  # first used first
    mpidist.allreduce(np.ones(1), a)
    keys = (record.entry_of(b).key, record.entry_of(a).key)
    assert keys[0] != keys[1]
    assert comm.allgather(keys) == [keys] * comm.Get_size()
    a.Free()
    b.Free()


# -- reading records: against hand-written dumps --------------------------------------------------------
def _call(seq, op="allreduce", end=2.0, comm="0-2#0", count=4, peer=-1, checking=False):
    return {"comm": comm, "op": op, "seq": seq, "bytes": count * 8, "peer": peer, "dtype": 0, "count": count,
            "reduction": "sum" if op == "allreduce" else "", "checking": checking, "start": 1.0, "end": end}


def _dump(rank, calls, started, reason="watchdog", size=3):
    return {"format": flight.FORMAT, "rank": rank, "size": size, "job": "j1", "host": "h", "pid": 100 + rank,
            "reason": reason, "time": 10.0, "phases": [], "dtypes": ["float64"], "calls": calls,
            "communicators": {"0-2#0": {"name": "MPI_COMM_WORLD", "size": size, "rank": rank,
                                        "members": list(range(size)), "calls": started}}}


def test_report_names_the_first_difference_and_the_ranks_that_never_arrived():
    done = [_call(s) for s in range(5)]
    records = [_dump(0, done + [_call(5, end=None)], 6), _dump(1, done + [_call(5, end=None)], 6), _dump(2, done, 5)]
    lines = flight.analyze(records)
    text = "\n".join(lines)
    assert "flight records of 3 of 3 ranks (job j1)" in text
    assert "comm MPI_COMM_WORLD (0-2#0, ranks 0-2): first difference at #5" in text
    assert "ranks [0, 1]: allreduce(float64, count=4, 32 B, op=sum), in flight for 9.0 s" in text
    assert "rank 2 never arrived; its last call here: #4 allreduce, completed" in text


def test_report_names_a_different_call_and_missing_records():
    records = [_dump(0, [_call(0), _call(1, op="broadcast", peer=0, end=None)], 2),
               _dump(1, [_call(0), _call(1, end=None)], 2)]
    text = "\n".join(flight.analyze(records))
    assert "first difference at #1" in text
    assert "ranks [0]: broadcast(float64, count=4, 32 B, root=0), in flight for 9.0 s" in text
    assert "ranks [1]: allreduce(float64, count=4, 32 B, op=sum), in flight for 9.0 s" in text
    assert "no record from ranks [2] (dead, or never asked)" in text


def test_report_says_when_ranks_agree():
    records = [_dump(r, [_call(s) for s in range(3)], 3) for r in range(3)]
    assert "ranks [0, 1, 2] agree on #0..#2; last #2 allreduce(float64, count=4, 32 B, op=sum), completed on every " \
           "rank" in "\n".join(flight.analyze(records))


@pytest.mark.mpi_skip  # one process: under mpiexec the child would inherit the launcher's PMI settings
def test_cli_reads_the_newest_job_and_refuses_what_is_not_a_record(tmp_path):
    for job, reason in (("20260101-000000-1", "old"), ("20260102-000000-2", "new")):
        os.makedirs(tmp_path / job)
        for r in range(3):
            with open(tmp_path / job / f"rank{r:05d}.json", "w") as f:
                json.dump(_dump(r, [_call(0)], 1, reason=reason), f)
    proc = subprocess.run([sys.executable, "-m", "mpidist", "flight", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "newest of 2 jobs" in proc.stdout and ": new" in proc.stdout and ": old" not in proc.stdout
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rank00000.json").write_text('{"format": "something else"}')
    proc = subprocess.run([sys.executable, "-m", "mpidist", "flight", str(tmp_path / "bad")], capture_output=True, text=True)
    assert proc.returncode == 1 and "is not a flight record (format 'something else'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mpidist", "flight", str(tmp_path / "none")], capture_output=True, text=True)
    assert proc.returncode == 1 and "is not a directory" in proc.stderr


def test_a_dump_is_valid_json_with_this_process_calls(tmp_path):
    before = guard.settings.flight_dir
    guard.configure(flight_dir=str(tmp_path))
    try:
        mpidist.simulate(2, lambda c: mpidist.allreduce(np.ones(3), c))
        path = flight.dump("test")
    finally:
        guard.configure(flight_dir=before)
    with open(path) as f:
        content = json.load(f)
    assert content["format"] == flight.FORMAT and content["reason"] == "test"
    assert content["calls"][-1]["op"] == "allreduce" and content["calls"][-1]["bytes"] == 24
    assert content["calls"][-1]["comm"] in content["communicators"]


# -- under mpiexec: the three ways records get written ---------------------------------------------------
def run_job(n, *args, tmp, env=None, timeout=60):
    full = launcher.env(MPIDIST_FLIGHT_DIR=str(tmp), **(env or {}))
    proc = subprocess.run(launcher.mpiexec(n, sys.executable, JOB, *args), capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=str(tmp))
    return proc.returncode, proc.stdout + proc.stderr


def report(tmp):
    proc = subprocess.run([sys.executable, "-m", "mpidist", "flight", str(tmp)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.mpi_skip
@launcher.needed
@pytest.mark.parametrize("n", [2, 3])
def test_watchdog_timeout_writes_every_rank_and_the_report_names_who_never_arrived(n, tmp_path):
    code, out = run_job(n, "skip", tmp=tmp_path, env={"MPIDIST_COLLECTIVE_TIMEOUT": "2"})
    assert code != 0 and "mpidist watchdog: allreduce #3 on comm" in out, out
    assert f"flight records: {tmp_path}/" in out and "python -m mpidist flight" in out, out
    text = report(tmp_path)
    assert f"flight records of {n} of {n} ranks" in text, text
    assert "first difference at #3" in text and f"rank {n - 1} never arrived; its last call here: #2 allreduce, " \
           f"completed" in text, text
    assert f"ranks {list(range(n - 1))}: allreduce(float64, count=16, 128 B, op=sum), in flight" in text, text



@pytest.mark.mpi_skip
@launcher.needed
def test_an_abort_writes_every_rank(tmp_path):
    code, out = run_job(3, "abort", tmp=tmp_path)
    assert code != 0 and "RuntimeError: bad batch on rank 2" in out, out
    assert out.count("mpidist: flight records in ") == 1, out  # one line per job, by the rank that aborts
    text = report(tmp_path)
    assert "flight records of 3 of 3 ranks" in text and "abort: RuntimeError: bad batch on rank 2" in text, text
    assert "first difference at #3" in text and "rank 2 never arrived" in text, text


@pytest.mark.mpi_skip
@launcher.needed
def test_sigusr2_dumps_a_rank_blocked_inside_mpi(tmp_path):
    records = tmp_path / "records"
    proc = subprocess.Popen(launcher.mpiexec(2, sys.executable, JOB, "sigusr2", str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
                            env=launcher.env(MPIDIST_FLIGHT_DIR=str(records)))
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int((tmp_path / "pid0").read_text())
        time.sleep(0.5)  # rank 0 is now waiting inside MPI_Allreduce for rank 1
        os.kill(pid, signal.SIGUSR2)
        dumped = []
        while not dumped and time.monotonic() < deadline:
            dumped = [os.path.join(d, f) for d, _, files in os.walk(records) for f in files if f == "rank00000.json"]
            time.sleep(0.05)
        assert dumped, "no flight record after SIGUSR2"
        assert proc.poll() is None  # written while the rank was still blocked
        with open(dumped[0]) as f:
            content = json.load(f)
        assert content["reason"] == "signal SIGUSR2"
        assert [(c["op"], c["end"]) for c in content["calls"]][-1] == ("allreduce", None)
    finally:
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "rank 0: done" in out and "rank 1: done" in out, out
