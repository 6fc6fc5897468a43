"""Seeded wildcard matching (``simulate(..., seed=k)``, ``mpidist sim --seed k / --explore K``).

The references are MPI's rules, written out here: a wildcard receive may take the oldest matching message
of any sender; messages from one sender on one communicator and tag arrive in the order sent
(non-overtaking); a receive posted earlier matches first; a probed message is the one a following receive
with the probe's arguments gets. All of it runs on simulated ranks in this process (``mpi_skip``: under
``mpiexec pytest --with-mpi`` there is nothing of the real library to compare).
"""

import io
import textwrap

import pytest
from mpi4py import MPI

from mpidist import simulate
from mpidist.cli import main

pytestmark = pytest.mark.mpi_skip

SEEDS = range(12)


def arrival_order(comm):
    """Rank 0 receives one message from every other rank with ANY_SOURCE; returns their order."""
    if comm.Get_rank() == 0:
        return [comm.recv(source=MPI.ANY_SOURCE) for _ in range(comm.Get_size() - 1)]
    comm.send(comm.Get_rank(), dest=0)
    return None


def test_fifo_is_the_default_and_seeds_reorder_a_race():
    orders = {tuple(simulate(4, arrival_order, seed=seed)[0]) for seed in SEEDS}
    assert all(sorted(order) == [1, 2, 3] for order in orders)
    assert len(orders) >= 3, f"12 seeds gave only the orders {orders}: the seed does not reach the choice"


def test_a_seed_reproduces_its_order():
    for seed in (3, 7):
        first = simulate(4, arrival_order, seed=seed)[0]
        assert all(simulate(4, arrival_order, seed=seed)[0] == first for _ in range(3))


def test_non_overtaking_holds_under_every_seed():
    """Each worker sends numbered messages on two tags; every wildcard receive order keeps, per sender
    (ANY_TAG) and per sender and tag, the order they were sent in."""
    count = 6

    def body(comm):
        rank, size = comm.Get_rank(), comm.Get_size()
        if rank != 0:
            for i in range(count):
                comm.send((rank, i), dest=0, tag=i % 2)
            comm.Barrier()
            for i in range(count):
                comm.send((rank, i), dest=0, tag=5 + i % 2)
            return None
        status = MPI.Status()
        any_tag = []
        for _ in range((size - 1) * count):
            sender, i = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            assert status.Get_source() == sender and status.Get_tag() == i % 2
            any_tag.append((sender, i))
        comm.Barrier()
        one_tag = [comm.recv(source=MPI.ANY_SOURCE, tag=tag) for tag in (6, 5) for _ in range((size - 1) * count // 2)]
        return any_tag, one_tag

    interleavings = set()
    for seed in (None, *SEEDS):
        any_tag, one_tag = simulate(4, body, seed=seed)[0]
        for sender in (1, 2, 3):
            assert [i for s, i in any_tag if s == sender] == list(range(count))
            assert [i for s, i in one_tag if s == sender] == [1, 3, 5, 0, 2, 4]
        interleavings.add(tuple(s for s, _ in any_tag))
    assert len(interleavings) > 2, "the seeds never interleaved the senders differently"


def test_an_earlier_posted_receive_matches_first():
    """irecv(ANY_SOURCE) posted before irecv(source=1): whichever sender the wildcard takes, rank 1's two
    messages go to the two receives in posting order when both take from rank 1."""
    def body(comm):
        rank = comm.Get_rank()
        if rank == 1:
            comm.send("first", dest=0)
            comm.send("second", dest=0)
        elif rank == 2:
            comm.send("other", dest=0)
        else:
            wild = comm.irecv(source=MPI.ANY_SOURCE)
            from_one = comm.irecv(source=1)
            last = comm.irecv(source=MPI.ANY_SOURCE)
            got = [last.wait(), from_one.wait(), wild.wait()]  # waited in reverse posting order
            return got[::-1]

    for seed in (None, *SEEDS):
        wild, from_one, last = simulate(3, body, seed=seed)[0]
        from_rank_one = [m for m in (wild, from_one, last) if m in ("first", "second")]
        assert from_rank_one == ["first", "second"], (seed, wild, from_one, last)
        assert sorted((wild, from_one, last)) == ["first", "other", "second"]


def test_probe_then_receive_get_the_same_message():
    def body(comm):
        if comm.Get_rank() != 0:
            comm.send(comm.Get_rank(), dest=0, tag=comm.Get_rank())
            return None
        pairs = []
        status = MPI.Status()
        for _ in range(comm.Get_size() - 1):
            comm.probe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            pairs.append((status.Get_source(), comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)))
        return pairs

    firsts = set()
    for seed in (None, *SEEDS):
        pairs = simulate(4, body, seed=seed)[0]
        assert all(source == value for source, value in pairs), (seed, pairs)
        firsts.add(pairs[0][0])
    assert len(firsts) > 1


def test_a_synchronous_send_completes_under_a_seed():
    def body(comm):
        if comm.Get_rank() == 0:
            return sorted(comm.recv(source=MPI.ANY_SOURCE) for _ in range(comm.Get_size() - 1))
        comm.ssend(comm.Get_rank(), dest=0)
        return None

    for seed in (None, 1, 2):
        assert simulate(4, body, seed=seed)[0] == [1, 2, 3]


RACY = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.rank == 0:
    print("arrival order:", [comm.recv(source=MPI.ANY_SOURCE) for _ in range(comm.size - 1)])
else:
    comm.send(comm.rank, dest=0)
"""

RACE_FREE = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.rank == 0:
    got = sorted(comm.recv(source=MPI.ANY_SOURCE) for _ in range(comm.size - 1))
    print("sum:", sum(got), "from", got)
else:
    comm.send(comm.rank * 10, dest=0)
print(comm.rank, "done")
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def no_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))


def test_explore_reports_the_first_seed_that_differs(tmp_path, capsys, no_stdin):
    racy = write(tmp_path, "racy.py", RACY)
    assert main(["sim", "-n", "4", "--explore", "20", racy]) == 1
    out = capsys.readouterr().out
    assert "differs from the FIFO run: rank 0 stdout line 1: 'arrival order: [" in out
    seed = int(out.split("seed ")[1].split()[0])
    # The report's seed gives that output again; FIFO gives senders in the order they sent.
    assert main(["sim", "-n", "4", racy]) == 0
    assert capsys.readouterr().out == "arrival order: [1, 2, 3]\n"
    assert main(["sim", "-n", "4", "--seed", str(seed), racy]) == 0
    assert capsys.readouterr().out != "arrival order: [1, 2, 3]\n"


def test_explore_finds_nothing_in_a_race_free_program(tmp_path, capsys, no_stdin):
    assert main(["sim", "-n", "4", "--explore", "20", write(tmp_path, "free.py", RACE_FREE)]) == 0
    assert "20 seeds give the FIFO run's output and exit status 0" in capsys.readouterr().out
