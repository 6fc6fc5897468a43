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
from mpidist.cli import build_parser, main

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


def test_explore_stops_at_a_failing_fifo_run_with_its_status_and_report(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "fails.py", """
        import sys
        from mpi4py import MPI
        def check(rank):
            if rank == 1:
                sys.exit(3)
            raise ValueError(f"rank {rank} found a bad value")
        check(MPI.COMM_WORLD.Get_rank())
    """)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    # Every run fails the same way: the FIFO run's status (python's for its failure) and report, not 0.
    status, out, err = sim(capsys, monkeypatch, "-n", "2", "--explore", "5", prog, "--flag")
    assert status in (1, 3), (status, err)
    assert out == (f"mpidist sim --explore: the FIFO run failed with exit status {status}\n"
                   f"reproduce with: mpidist sim -n 2 {prog} --flag\n")
    assert "every rank was stopped" in err
    if status == 1:   # rank 0 raised first
        assert f'File "{prog}", line 7, in check' in err and err.endswith("ValueError: rank 0 found a bad value\n")
    assert main(["sim", "-n", "2", prog]) == status  # the command it prints fails the same way


def test_explore_reports_the_first_seed_that_fails(tmp_path, capsys, monkeypatch):
    # Ranks 1..3 send in turn (a token orders them), so FIFO receives 1, 2, 3; a seed may pick any order.
    prog = write(tmp_path, "order.py", """
        import sys
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            order = [comm.recv(source=MPI.ANY_SOURCE, tag=1) for _ in range(comm.size - 1)]
            if order != sorted(order):
                print("out of order:", order, file=sys.stderr)
                sys.exit(4)
        else:
            if comm.rank > 1:
                comm.recv(source=comm.rank - 1, tag=2)
            comm.send(comm.rank, dest=0, tag=1)
            if comm.rank < comm.size - 1:
                comm.send(None, dest=comm.rank + 1, tag=2)
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "4", "--explore", "20", prog)
    assert status == 4, (out, err)
    seed = int(re.fullmatch(r"mpidist sim --explore: seed (\d+) failed with exit status 4\n"
                            rf"reproduce with: mpidist sim -n 4 --seed \1 {re.escape(prog)}\n", out).group(1))
    assert "out of order: [" in err and "rank 0 of 4 exited with status 4" in err
    assert sim(capsys, monkeypatch, "-n", "4", prog)[0] == 0
    assert sim(capsys, monkeypatch, "-n", "4", "--seed", str(seed), prog)[0] == 4


LOOPS = """
from mpi4py import MPI

comm = MPI.COMM_WORLD
def spin():
    while True:
        pass
if comm.Get_rank() in RANKS:
    spin()
comm.Barrier()
"""


def test_timeout_stops_a_rank_that_loops_forever_and_shows_where_every_rank_was(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "loop.py", LOOPS.replace("RANKS", "(0,)"))
    status, out, err = sim(capsys, monkeypatch, "-n", "3", "--timeout", "0.5", prog)
    assert (status, out) == (124, "")
    lines, source = err.splitlines(), LOOPS.splitlines()
    assert lines[0] == "mpidist sim: timed out after 0.5 s; every rank was stopped"
    assert lines[1:4] == ["rank 0 computes (not in a communication call):",
                          f'  File "{prog}", line {source.index("    spin()") + 1}, in <module>', "    spin()"]
    assert re.fullmatch(rf'  File "{re.escape(prog)}", line (6|7), in spin', lines[4]), lines[4]  # while or pass
    for rank in (1, 2):
        at = lines.index(f"rank {rank} waits in Barrier() #0 on SIM_WORLD:")
        assert lines[at + 1:at + 3] == [f'  File "{prog}", line {source.index("comm.Barrier()") + 1}, in <module>',
                                        "    comm.Barrier()"]
    assert "uncaught exception" not in err and "runner.py" not in err


def test_timeout_stops_ranks_that_all_loop(tmp_path, capsys, monkeypatch):
    # Nobody waits, so neither deadlock detection nor a per-wait watchdog could end this run.
    prog = write(tmp_path, "loops.py", LOOPS.replace("RANKS", "(0, 1)"))
    status, out, err = sim(capsys, monkeypatch, "-n", "2", "--timeout", "0.3", prog)
    assert status == 124 and err.count("computes (not in a communication call):\n") == 2, err


@pytest.mark.slow
def test_a_wait_past_mpidist_sim_timeout_is_reported_as_a_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MPIDIST_SIM_TIMEOUT", "0.5")  # the per-wait watchdog: rank 1 waits for the looping rank 0
    prog = write(tmp_path, "loop.py", LOOPS.replace("RANKS", "(0,)"))
    status, out, err = sim(capsys, monkeypatch, "-n", "2", prog)
    assert (status, out) == (1, "")
    assert err.startswith("mpidist sim: rank 1 of 2 timed out (watchdog: rank 1 waited more than 0.5 s in Barrier() "
                          "#0 on SIM_WORLD;"), err
    assert "rank 0 was in:" in err and "uncaught exception" not in err


def test_timeout_is_in_the_help_and_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sim", "--help"])
    assert "--timeout S" in capsys.readouterr().out
    for bad in ("0", "-1", "nan", "inf"):
        assert main(["sim", "-n", "2", "--timeout", bad, __file__]) == 2
        assert f"--timeout S needs a number of seconds > 0 (got {float(bad)})" in capsys.readouterr().err


def test_a_directory_or_a_device_is_named_for_what_it_is(tmp_path, capsys):
    for path, what in ((str(tmp_path), "it is a directory, not a Python file"),
                       (os.devnull, "it is a character device, not a Python file"),
                       (str(tmp_path / "missing.py"), "no such program file")):
        assert main(["sim", "-n", "2", path]) == 2
        assert capsys.readouterr().err == f"mpidist sim: UsageError: cannot run {path!r}: {what}\n"


def test_a_syntax_error_shows_the_programs_line_as_python_does(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "typo.py", "from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 0\n    print('x')\n")
    python = subprocess.run([sys.executable, prog], capture_output=True, text=True, timeout=60)
    assert sim(capsys, monkeypatch, "-n", "2", prog) == (python.returncode, "", python.stderr)
    assert "SyntaxError: expected ':'" in python.stderr and "mpidist" not in python.stderr


THREADED = """
import threading
import time
from mpi4py import MPI

comm = MPI.COMM_WORLD
got = []

def to_itself(k):  # a thread the rank started: MPI.COMM_WORLD is the rank's
    world = MPI.COMM_WORLD
    request = world.isend(10 * world.Get_rank() + k, dest=world.Get_rank(), tag=k)
    got.append(world.recv(source=world.Get_rank(), tag=k))
    request.wait()
    print(f"{world.Get_rank()}: thread {k} main {MPI.Is_thread_main()}")

def late():  # never joined: the rank still ends after it, as a process waits for its threads
    time.sleep(0.2)
    print(f"{comm.Get_rank()}: late thread done")

threads = [threading.Thread(target=to_itself, args=(k,)) for k in (1, 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
threading.Thread(target=late).start()
print(f"{comm.Get_rank()}: main {MPI.Is_thread_main()} got {sorted(got)}")
"""


def test_threads_a_rank_starts_run_as_that_rank(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "threads.py", THREADED)
    status, out, err = sim(capsys, monkeypatch, "-n", "3", "-l", prog)
    assert (status, err) == (0, "")
    assert sorted(out.splitlines()) == sorted(
        [f"[{r}] {r}: thread {k} main False" for r in range(3) for k in (1, 2)] +
        [f"[{r}] {r}: main True got {[10 * r + 1, 10 * r + 2]}" for r in range(3)] +
        [f"[{r}] {r}: late thread done" for r in range(3)])


def test_a_deadlock_left_in_a_thread_a_rank_started_is_reported(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "server.py", """
        import threading
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        def serve():
            comm.recv(source=1, tag=9)  # rank 1 never sends
        if comm.Get_rank() == 0:
            threading.Thread(target=serve, name="server").start()
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "2", prog)
    assert (status, out) == (1, "")
    lines = err.splitlines()
    assert lines[0].startswith("mpidist sim: deadlock: ")
    at = lines.index("rank 0 (its thread server) waits in recv(source=1, tag=9) on SIM_WORLD")
    assert lines[at + 1:at + 3] == [f'  File "{prog}", line 6, in serve',
                                    "    comm.recv(source=1, tag=9)  # rank 1 never sends"]


# mpi4py.rc set before the import, MPI.Init/Finalize, the error handler rc asks for, sessions' process sets.
RC_PROGRAM = """
from mpi4py import rc
rc.initialize = False
rc.errors = "fatal"
from mpi4py import MPI

before = MPI.Is_initialized()
MPI.Init()
world = MPI.COMM_WORLD
rank = world.Get_rank()
handler = world.Get_errhandler()
print(f"{rank}: initialized {before} -> {MPI.Is_initialized()}, fatal errors {handler == MPI.ERRORS_ARE_FATAL}")
handler.Free()
session = MPI.Session.Init()
group = session.Create_group("mpi://WORLD")
comm = MPI.Intracomm.Create_from_group(group)
size = comm.Get_size()  # Get_pset_info: its own test (Open MPI 5 fails the call under mpiexec itself)
print(f"{rank}: session world of {size}, group {group.Get_size()}, sum {comm.allreduce(rank)}")
comm.Free()
group.Free()
session.Finalize()
MPI.Finalize()
print(f"{rank}: finalized {MPI.Is_finalized()}")
"""


@launcher.needed
def test_rc_init_finalize_and_sessions_as_under_mpiexec(tmp_path, capsys, monkeypatch):
    import mpi4py
    prog = write(tmp_path, "rc.py", RC_PROGRAM)
    real = subprocess.run(launcher.mpiexec(3, sys.executable, prog), capture_output=True, text=True, timeout=120,
                          env=line_buffered(launcher.env(OMP_NUM_THREADS="1")))
    assert real.returncode == 0, real.stderr
    status, out, err = sim(capsys, monkeypatch, "-n", "3", prog)
    assert (status, err) == (0, "")
    assert by_rank(out) == by_rank(real.stdout)
    assert "0: initialized False -> True, fatal errors True" in out and "2: session world of 3, group 3, sum 3" in out
    assert (mpi4py.rc.initialize, mpi4py.rc.errors) == (True, "exception")  # the program's settings were undone


@pytest.mark.parametrize("errors", ["exception", "fatal"])
def test_session_pset_info_names_the_simulated_world_and_self(tmp_path, capsys, monkeypatch, errors):
    """mpi://WORLD has the simulated world's size and mpi://SELF one, whatever the MPI library would answer
    (Open MPI 5 fails MPI_Session_get_pset_info with 'MPI_SUCCESS: no errors', even under its own mpiexec)."""
    prog = write(tmp_path, "pset.py", f"""
        from mpi4py import rc
        rc.errors = "{errors}"
        from mpi4py import MPI
        session = MPI.Session.Init()
        sizes = [session.Get_pset_info(name).Get("mpi_size") for name in ("mpi://WORLD", "mpi://SELF")]
        print(MPI.COMM_WORLD.Get_rank(), *sizes)
        session.Finalize()
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "3", prog)
    assert (status, err) == (0, "")
    assert sorted(out.splitlines()) == ["0 3 1", "1 3 1", "2 3 1"]


def test_timeout_shows_a_thread_a_rank_started_that_loops(tmp_path, capsys, monkeypatch):
    prog = write(tmp_path, "spinner.py", """
        import threading
        from mpi4py import MPI
        def spin():
            while True:
                pass
        if MPI.COMM_WORLD.Get_rank() == 0:
            threading.Thread(target=spin, name="spinner").start()
    """)
    status, out, err = sim(capsys, monkeypatch, "-n", "2", "--timeout", "0.3", prog)
    assert status == 124
    assert err.splitlines()[1:3] == ["rank 0 finished (it waits for the threads it started)",
                                     "rank 0 (its thread spinner) computes (not in a communication call):"], err
    assert re.fullmatch(rf'  File "{re.escape(prog)}", line (5|6), in spin', err.splitlines()[3]), err  # while/pass
    assert err.splitlines()[-1] == "rank 1 finished"
