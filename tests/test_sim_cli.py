"""``mpidist sim -n N prog.py``: unmodified mpi4py programs on simulated ranks, held against ``mpiexec``.

The reference for output is the same program under ``mpiexec -n 4``; for exit statuses and stdin it is what
``mpiexec ... python -m mpi4py`` does (stdin to rank 0; an uncaught exception aborts every rank with status
1; ``sys.exit(k)`` with k != 0 aborts with status k). Everything here starts programs or processes of its
own, so it is ``mpi_skip`` (under ``mpiexec pytest --with-mpi`` every rank would start them again).
"""

import io
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

import launcher
from mpidist import simulate
from mpidist.cli import main

pytestmark = pytest.mark.mpi_skip

# Three classics, none of them ours: pi by the midpoint rule with the interval count read from stdin on rank 0
# (MPICH's cpi), a token passed around a ring, and a master handing out tasks to whichever worker answers
# first (ANY_SOURCE). Each line starts with the rank that printed it, so outputs compare rank by rank.
CLASSICS = """
import sys
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

n = int(sys.stdin.readline()) if rank == 0 else None
n = comm.bcast(n, root=0)
h = 1.0 / n
local = sum(4.0 / (1.0 + (h * (i + 0.5)) ** 2) for i in range(rank, n, size)) * h
pi = comm.reduce(local, op=MPI.SUM, root=0)
if rank == 0:
    print(f"0: pi is approximately {pi:.12f}, error {abs(pi - 3.141592653589793):.3e}")

if rank == 0:
    comm.send(["0"], dest=1 % size)
    print("0: ring came back as", "-".join(comm.recv(source=size - 1)))
else:
    token = comm.recv(source=rank - 1)
    comm.send(token + [str(rank)], dest=(rank + 1) % size)

TASKS, STOP = 10, -1
if rank == 0:
    status, results, next_task = MPI.Status(), {}, 0
    for worker in range(1, size):
        comm.send(next_task, dest=worker)
        next_task += 1
    while len(results) < TASKS:
        task, square = comm.recv(source=MPI.ANY_SOURCE, status=status)
        results[task] = square
        comm.send(next_task if next_task < TASKS else STOP, dest=status.Get_source())
        next_task += 1
    print("0: squares", [results[t] for t in range(TASKS)])
else:
    while True:
        task = comm.recv(source=0)
        if task == STOP or task >= TASKS:
            break
        comm.send((task, task * task), dest=0)
    print(f"{rank}: worker stopped")
total = comm.allreduce(rank, op=MPI.SUM)
print(f"{rank}: rank {rank} of {size}, sum of ranks {total}")
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def sim(capsys, monkeypatch, *args, stdin=""):
    """``mpidist sim ARGS`` in this process; return (status, stdout, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(["sim", *args])
    out, err = capsys.readouterr()
    return status, out, err


def by_rank(text):
    """Each rank's lines in order (the rank is the line's first word, before ':').

    mpiexec merges the ranks' writes as they come. A line whose newline came as a separate write can have
    another rank's line after its text ("0: ...2: ..." and an empty line later): split before each "R: "
    (ranks 0-9). A print of several arguments is split further when unbuffered, which no parsing can undo:
    see :func:`line_buffered`.
    """
    ranks = {}
    for line in text.splitlines():
        for part in re.split(r"(?=\d: )", line):
            if part:
                ranks.setdefault(part.split(":")[0], []).append(part)
    return ranks


def line_buffered(env):
    """Return ``env`` without PYTHONUNBUFFERED, so that each rank writes a print's line in one piece.

    Unbuffered, ``print("0: squares", xs)`` is four writes, and under Open MPI 4.1.4 another rank's line landed
    between them ("0: squares2: worker stopped", then " [0, 1, ...]"), 1 run in 6 with PYTHONUNBUFFERED=1.
    """
    env.pop("PYTHONUNBUFFERED", None)
    return env


@launcher.needed
def test_classic_programs_print_what_they_print_under_mpiexec(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "classics.py", CLASSICS)
    real = subprocess.run(launcher.mpiexec(4, sys.executable, prog), input="100000\n", capture_output=True,
                          text=True, timeout=120, env=line_buffered(launcher.env(OMP_NUM_THREADS="1")))
    assert real.returncode == 0, real.stderr
    status, out, err = sim(capsys, monkeypatch, "-n", "4", prog, stdin="100000\n")
    assert (status, err) == (0, "")
    assert by_rank(out) == by_rank(real.stdout)
    assert "0: squares [0, 1, 4, 9, 16, 25, 36, 49, 64, 81]" in out and "0: ring came back as 0-1-2-3" in out


def test_an_exception_on_one_rank_ends_every_rank_with_its_traceback(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "boom.py", """
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        def check(rank):
            if rank == 2:
                raise ValueError(f"rank {rank} found a bad value")
        check(comm.Get_rank())
        comm.Barrier()
        print("not reached")
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "4", prog)
    assert (status, out) == (1, "")
    assert err.startswith("mpidist sim: rank 2 of 4 raised an uncaught exception; every rank was stopped\n"
                          "Traceback (most recent call last):\n")
    assert f'File "{prog}", line 7, in <module>' in err and f'File "{prog}", line 6, in check' in err
    assert err.endswith("ValueError: rank 2 found a bad value\n")
    assert "runner.py" not in err and "program.py" not in err and "RankFailedError" not in err


@pytest.mark.parametrize("call, status, message", [
    ("sys.exit(3)", 3, "mpidist sim: rank 1 of 3 exited with status 3; every rank was stopped\n"),
    ("sys.exit('rank one gives up')", 1, "rank one gives up\nmpidist sim: rank 1 of 3 exited with status 1"),
    ("MPI.COMM_WORLD.Abort(5)", 5, "mpidist sim: rank 1 of 3 called Abort(5); every rank was stopped\n"),
    ("sys.exit(0)", 1, "mpidist sim: deadlock"),   # rank 1 leaves; the others wait for it in the Barrier
])
def test_exit_status_is_what_mpiexec_gives(tmp_path, capsys, monkeypatch, call, status, message):
    prog = write(tmp_path, "leave.py", f"""
        import sys
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            {call}
        MPI.COMM_WORLD.Barrier()
    """)
    got, out, err = sim(capsys, monkeypatch, "-n", "3", prog)
    assert got == status and message in err, err


def test_every_rank_exits_zero_gives_zero_and_the_largest_status_wins(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "fine.py", "import sys\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\nsys.exit(0)\n")
    assert sim(capsys, monkeypatch, "-n", "3", prog) == (0, "", "")


def test_a_deadlock_prints_each_rank_pending_call_and_stack(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "stuck.py", """
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        def wait_for_right_neighbour():
            return comm.recv(source=(comm.Get_rank() + 1) % comm.Get_size(), tag=7)
        if comm.Get_rank() == 2:
            comm.Barrier()
        else:
            wait_for_right_neighbour()
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "3", prog)
    assert (status, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == "mpidist sim: deadlock: every live simulated rank is blocked"
    for rank, neighbour in ((0, 1), (1, 2)):
        at = lines.index(f"rank {rank} waits in recv(source={neighbour}, tag=7) on SIM_WORLD")
        assert lines[at + 1:at + 5] == [
            f'  File "{prog}", line 9, in <module>', "    wait_for_right_neighbour()",
            f'  File "{prog}", line 5, in wait_for_right_neighbour',
            "    return comm.recv(source=(comm.Get_rank() + 1) % comm.Get_size(), tag=7)"]
    at = lines.index("rank 2 waits in Barrier() #0 on SIM_WORLD")
    assert lines[at + 1:at + 3] == [f'  File "{prog}", line 7, in <module>', "    comm.Barrier()"]


def test_stdin_goes_to_rank_zero_and_lines_stay_whole(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "echo.py", """
        import sys
        from dataclasses import dataclass
        from mpi4py import MPI

        @dataclass
        class Note:  # defined in the program: pickles between ranks as under mpiexec
            text: str

        comm = MPI.COMM_WORLD
        words = sys.stdin.read().split()
        notes = comm.allgather(Note(",".join(words)))
        for i in range(20):  # a line in three writes: it must reach stdout whole
            sys.stdout.write(f"line {i} ")
            sys.stdout.write("of rank ")
            print(comm.Get_rank(), [n.text for n in notes], sys.argv[1:])
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "3", "-l", prog, "--flag", "x", stdin="alpha beta\n")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == 60
    for rank in range(3):
        mine = [line for line in lines if line.startswith(f"[{rank}] ")]
        assert mine == [f"[{rank}] line {i} of rank {rank} ['alpha,beta', '', ''] ['--flag', 'x']" for i in range(20)]


def test_usage_errors_name_the_values(tmp_path, capsys):
    assert main(["sim", "-n", "0", "prog.py"]) == 2
    assert "-n must be at least 1 (got 0)" in capsys.readouterr().err
    assert main(["sim", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "no such program file" in capsys.readouterr().err
    assert main(["sim", "-n", "2", "--explore", "3", "--seed", "1", __file__]) == 2
    assert "--explore K needs K >= 1 and no --seed (got --explore 3, --seed 1)" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binding threads to CPUs needs Linux")
def test_cpus_binds_every_rank_thread_and_bad_lists_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MPIDIST_SIM_CPUS", raising=False)
    one = min(os.sched_getaffinity(0))
    prog = write(tmp_path, "where.py", """
        import os
        from mpi4py import MPI
        print(f"{MPI.COMM_WORLD.Get_rank()}: {sorted(os.sched_getaffinity(0))}")
        """)
    status, out, err = sim(capsys, monkeypatch, "-n", "3", "--cpus", str(one), prog)
    assert (status, err) == (0, "") and sorted(out.splitlines()) == [f"{r}: [{one}]" for r in range(3)], out
    assert "MPIDIST_SIM_CPUS" not in os.environ  # the binding ended with the program
    assert sorted(os.sched_getaffinity(0)) != [one] or os.cpu_count() == 1  # the caller's own thread stays free
    allowed = sorted(os.sched_getaffinity(0))
    bad = max(allowed) + 1
    assert main(["sim", "-n", "2", "--cpus", f"{bad}", prog]) == 2
    assert (f"--cpus: simulate: cpus [{bad}] (from '{bad}') must be a non-empty subset of the CPUs this process "
            f"may use: {allowed}") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"cpus must name CPUs like '0', '0,2' or '0-3' \(got 'a-b'\)"):
        simulate(2, lambda comm: None, cpus="a-b")
    assert simulate(2, lambda comm: sorted(os.sched_getaffinity(0)), cpus=[one]) == [[one], [one]]
    assert simulate(1, lambda comm: sorted(os.sched_getaffinity(0)), cpus=one) == [[one]]


def test_python_dash_m_mpidist_sim_runs_a_program(tmp_path):
    prog = write(tmp_path, "hello.py", "from mpi4py import MPI\nprint(MPI.COMM_WORLD.allreduce(1))\n")
    done = subprocess.run([sys.executable, "-m", "mpidist", "sim", "-n", "3", prog], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout) == (0, "3\n3\n3\n"), done.stderr


# The README's pattern: mpidist.init() on the world the launcher (here: the simulator) gives.
INIT_PROGRAM = """
import numpy as np
import mpidist

comm, info = mpidist.init()
total = mpidist.allreduce(np.array([comm.Get_rank() + 1.0]), comm)[0]
print(f"{info.rank}: size {info.size} local {info.local_rank}/{info.local_size} nodes {info.nodes} total {total:g}")
"""


@pytest.mark.parametrize("n", [2, 4])
def test_a_program_calling_init_runs_on_the_simulated_world(tmp_path, capsys, monkeypatch, n):
    prog = write(tmp_path, "init.py", INIT_PROGRAM)
    hooks = sys.excepthook, threading.excepthook
    status, out, err = sim(capsys, monkeypatch, "-n", str(n), prog)
    assert (status, err) == (0, "")
    # One simulated node holds every rank; the allreduce sums 1..n.
    assert sorted(out.splitlines()) == [f"{r}: size {n} local {r}/{n} nodes 1 total {n * (n + 1) // 2}"
                                        for r in range(n)]
    # The simulator ends the ranks itself: init() must not leave its per-process abort hooks in this process.
    assert (sys.excepthook, threading.excepthook) == hooks
