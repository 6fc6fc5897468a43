"""Communicator semantics: the same tests on SimComm and on real mpi4py communicators.

Tests taking ``comm`` run on both, which is what proves SimComm behaves like mpi4py. Tests marked
``mpi_skip`` are about the simulator alone (failure release, mismatch and deadlock reports).
"""

import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import CollectiveMismatchError, DeadlockError, RankFailedError, SimAbort, simulate


def test_identity(comm):
    assert comm.Get_size() == comm.size >= 1
    assert 0 <= comm.Get_rank() == comm.rank < comm.size
    assert sorted(comm.allgather(comm.rank)) == list(range(comm.size))


def test_buffer_collectives_match_numpy(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.arange(6, dtype=np.float64) * (rank + 1)
    total = np.arange(6, dtype=np.float64) * sum(range(1, size + 1))

    out = np.empty(6)
    comm.Allreduce(x, out, op=MPI.SUM)
    np.testing.assert_array_equal(out, total)

    y = x.copy()
    comm.Allreduce(MPI.IN_PLACE, y, op=MPI.MAX)
    np.testing.assert_array_equal(y, np.arange(6) * size)

    red = np.zeros(6)
    comm.Reduce(x, red if rank == size - 1 else None, op=MPI.SUM, root=size - 1)
    if rank == size - 1:
        np.testing.assert_array_equal(red, total)

    b = np.full(3, rank, dtype=np.int32)
    comm.Bcast(b, root=size - 1)
    assert (b == size - 1).all()

    g = np.empty(2 * size, dtype=np.int64)
    comm.Allgather(np.array([rank, -rank], dtype=np.int64), g)
    np.testing.assert_array_equal(g, np.array([[r, -r] for r in range(size)]).ravel())

    counts = [r + 1 for r in range(size)]
    displs = [sum(counts[:r]) for r in range(size)]
    gv = np.empty(sum(counts), dtype=np.float32)
    comm.Allgatherv(np.full(rank + 1, rank, dtype=np.float32), [gv, (counts, displs), MPI.FLOAT])
    np.testing.assert_array_equal(gv, np.concatenate([np.full(r + 1, r) for r in range(size)]))

    rs = np.empty(2, dtype=np.int64)
    comm.Reduce_scatter_block(np.arange(2 * size, dtype=np.int64) + rank, rs, op=MPI.SUM)
    expect = (np.arange(2 * size) * size + sum(range(size)))[2 * rank: 2 * rank + 2]
    np.testing.assert_array_equal(rs, expect)

    counts = [1 + (r % 2) for r in range(size)]
    rv = np.empty(counts[rank], dtype=np.float64)
    comm.Reduce_scatter(np.ones(sum(counts)), rv, counts, op=MPI.SUM)
    assert (rv == size).all()

    a = np.empty(2 * size, dtype=np.int64)
    comm.Alltoall(np.arange(2 * size, dtype=np.int64) + 100 * rank, a)  # block j of rank i goes to rank j
    np.testing.assert_array_equal(a, np.array([[100 * r + 2 * rank, 100 * r + 2 * rank + 1] for r in range(size)]).ravel())

    # Alltoallv: rank i sends j + 1 copies of 10 i + j to rank j.
    send_counts = [j + 1 for j in range(size)]
    send = np.concatenate([np.full(j + 1, 10 * rank + j, dtype=np.float64) for j in range(size)])
    recv_counts = [rank + 1] * size
    av = np.empty(sum(recv_counts))
    comm.Alltoallv([send, (send_counts, [sum(send_counts[:j]) for j in range(size)])],
                   [av, (recv_counts, [sum(recv_counts[:j]) for j in range(size)])])
    np.testing.assert_array_equal(av, np.concatenate([np.full(rank + 1, 10 * r + rank) for r in range(size)]))


def test_nonblocking_requests(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    a = np.full(4, rank + 1.0)
    b = np.full(2, rank, dtype=np.int16)
    g = np.empty(size, dtype=np.int32)
    reqs = [comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM), comm.Ibcast(b, root=0),
            comm.Iallgather(np.array([rank * 3], dtype=np.int32), g)]
    MPI.Request.Waitall(reqs) if isinstance(reqs[0], MPI.Request) else type(reqs[0]).Waitall(reqs)
    assert (a == size * (size + 1) / 2).all() and (b == 0).all()
    np.testing.assert_array_equal(g, np.arange(size) * 3)
    r = comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.MIN)
    while not r.Test():
        pass
    assert (a == size * (size + 1) / 2).all()


def test_point_to_point_tags_any_source_status(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # Every rank sends to rank 0, rank 0 to itself as well (nonblocking: a blocking send to oneself can
    # wait forever for the receive). ANY_TAG order follows arrival per source.
    sent = [np.full(3, rank * 10 + 2.0), np.full(3, rank * 10 + 1.0)]
    reqs = [comm.Isend(sent[0], 0, tag=2), comm.Isend(sent[1], 0, tag=1)]
    if rank == 0:
        got = {}
        for _ in range(2 * size):
            buf = np.empty(3, dtype=np.float64)
            status = MPI.Status()
            comm.Recv(buf, MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            assert status.Get_count(MPI.DOUBLE) == 3
            got[(status.Get_source(), status.Get_tag())] = buf[0]
        assert got == {(r, t): r * 10 + t for r in range(size) for t in (1, 2)}
    for req in reqs:
        req.Wait()


def test_messages_with_one_tag_do_not_overtake(comm):
    rank = comm.Get_rank()
    sender = 1 % comm.Get_size()  # one rank: it sends to itself
    sent, sends = [np.array([i], dtype=np.int64) for i in range(5)], []
    if rank == sender:
        sends = [comm.Isend(s, 0, tag=3) for s in sent]
    if rank == 0:
        reqs, bufs = [], []
        for _ in range(5):
            bufs.append(np.empty(1, dtype=np.int64))
            reqs.append(comm.Irecv(bufs[-1], sender, 3))
        for req in reversed(reqs):
            req.Wait()
        assert [int(b[0]) for b in bufs] == [0, 1, 2, 3, 4]
    for req in sends:
        req.Wait()


def test_sendrecv_ring(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    out = np.empty(2, dtype=np.int32)
    comm.Sendrecv(np.array([rank, rank], dtype=np.int32), (rank + 1) % size, 5, out, (rank - 1) % size, 5)
    assert (out == (rank - 1) % size).all()
    assert comm.sendrecv({"r": rank}, dest=(rank + 1) % size, source=(rank - 1) % size) == {"r": (rank - 1) % size}


def test_object_collectives(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    assert comm.bcast({"from": rank} if rank == 0 else None, root=0) == {"from": 0}
    assert comm.allreduce(rank + 1) == size * (size + 1) // 2
    assert comm.allreduce(rank, op=MPI.MAX) == size - 1
    assert comm.allgather((rank, "x")) == [(r, "x") for r in range(size)]
    gathered = comm.gather(rank * 2, root=size - 1)
    assert gathered == ([r * 2 for r in range(size)] if rank == size - 1 else None)
    reduced = comm.reduce(rank + 1, op=MPI.PROD, root=size - 1)
    assert reduced == (int(np.prod(np.arange(1, size + 1))) if rank == size - 1 else None)
    if size > 1:
        if rank == 0:
            comm.send([1, 2, 3], dest=1, tag=4)
        elif rank == 1:
            assert comm.recv(source=0, tag=4) == [1, 2, 3]


def test_split_dup_split_type(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(color=rank % 2, key=-rank)
    members = [r for r in range(size) if r % 2 == rank % 2]
    assert sub.Get_size() == len(members)
    assert sub.Get_rank() == sorted(members, key=lambda r: -r).index(rank)
    total = np.array([rank], dtype=np.int64)
    sub.Allreduce(MPI.IN_PLACE, total)
    assert total[0] == sum(members)
    sub.Free()

    none = comm.Split(MPI.UNDEFINED if rank == 0 else 1, 0)
    assert (none == MPI.COMM_NULL) == (rank == 0)
    if none != MPI.COMM_NULL:
        none.Free()

    dup = comm.Dup()
    assert dup.Get_size() == size and dup.Get_rank() == rank
    # Messages on the duplicate do not reach the original.
    if size > 1 and rank == 0:
        dup.send("dup", dest=1, tag=0)
        comm.send("orig", dest=1, tag=0)
    if size > 1 and rank == 1:
        assert comm.recv(source=0, tag=0) == "orig"
        assert dup.recv(source=0, tag=0) == "dup"
    dup.Free()

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert local.Get_size() >= 1
    local.Free()


def test_mpidist_collectives_accept_split_communicators(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    sub = comm.Split(color=rank // 2, key=rank)
    x = np.array([float(rank)])
    mpidist.allreduce(x, sub)
    group = [r for r in range(size) if r // 2 == rank // 2]
    assert x[0] == sum(group)
    sub.Free()


# -- simulator-only behaviour ------------------------------------------------------------------------
@pytest.mark.mpi_skip
def test_simulate_returns_results_by_rank():
    assert simulate(3, lambda c, k: c.rank * k, 10) == [0, 10, 20]
    assert simulate(2, lambda c, k=1: c.size + k, k=5) == [7, 7]


@pytest.mark.mpi_skip
def test_failure_on_one_rank_releases_the_others():
    released = []

    def body(comm):
        if comm.rank == 2:
            raise KeyError("boom on two")
        try:
            comm.Barrier()
        except RankFailedError as exc:
            released.append((comm.rank, str(exc)))
            raise

    with pytest.raises(KeyError, match="boom on two") as info:
        simulate(4, body)
    assert "rank 2" in str(info.value)
    assert sorted(r for r, _ in released) == [0, 1, 3]
    assert all("simulated rank 2 failed (KeyError" in msg for _, msg in released)


@pytest.mark.mpi_skip
def test_failure_releases_pending_receive():
    def body(comm):
        if comm.rank == 0:
            comm.recv(source=1)
        else:
            raise ValueError("rank one gives up")

    with pytest.raises(ValueError, match=r"rank 1.*rank one gives up|rank one gives up"):
        simulate(2, body)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("kind", ["op", "count", "dtype", "root", "reduce-op", "object-reduce-root"])
def test_mismatched_collectives_raise_on_every_rank(kind):
    errors = {}

    def body(comm):
        r = comm.rank
        try:
            if kind == "op":
                (comm.Bcast(np.zeros(3)) if r == 0 else comm.Allreduce(MPI.IN_PLACE, np.zeros(3)))
            elif kind == "count":
                comm.Allreduce(MPI.IN_PLACE, np.zeros(3 + (r == 1)))
            elif kind == "dtype":
                comm.Bcast(np.zeros(3, dtype=np.float32 if r == 2 else np.float64))
            elif kind == "root":
                comm.Bcast(np.zeros(3), root=r % 2)
            elif kind == "reduce-op":
                comm.Allreduce(MPI.IN_PLACE, np.zeros(3), op=MPI.MAX if r == 0 else MPI.SUM)
            else:
                comm.reduce(r, root=2 if r == 0 else 0)
        except CollectiveMismatchError as exc:
            errors[r] = str(exc)
            raise

    with pytest.raises(CollectiveMismatchError):
        simulate(3, body)
    assert sorted(errors) == [0, 1, 2]
    assert len(set(errors.values())) == 1
    msg = errors[0]
    expected = {
        "op": "rank 0 called Bcast(root=0, count=3, dtype=float64); ranks 1,2 called Allreduce(count=3, dtype=float64, op=SUM)",
        "count": "ranks 0,2 called Allreduce(count=3, dtype=float64, op=SUM); rank 1 called Allreduce(count=4, dtype=float64, op=SUM)",
        "dtype": "ranks 0,1 called Bcast(root=0, count=3, dtype=float64); rank 2 called Bcast(root=0, count=3, dtype=float32)",
        "root": "ranks 0,2 called Bcast(root=0, count=3, dtype=float64); rank 1 called Bcast(root=1, count=3, dtype=float64)",
        "reduce-op": "rank 0 called Allreduce(count=3, dtype=float64, op=MAX); ranks 1,2 called Allreduce(count=3, dtype=float64, op=SUM)",
        "object-reduce-root": "rank 0 called reduce(op=SUM, root=2); ranks 1,2 called reduce(op=SUM, root=0)",
    }[kind]
    assert expected in msg, msg
    assert "collective mismatch on SIM_WORLD (call #0)" in msg


@pytest.mark.mpi_skip
def test_deadlock_is_reported_not_hung():
    def body(comm):
        comm.recv(source=(comm.rank + 1) % comm.size, tag=9)

    with pytest.raises(DeadlockError, match=r"rank 0 waits in recv\(source=1, tag=9\).*rank 1 waits in recv\(source=0, tag=9\)"):
        simulate(2, body)


@pytest.mark.mpi_skip
def test_deadlock_when_a_rank_finishes_early():
    def body(comm):
        if comm.rank == 0:
            comm.Barrier()

    with pytest.raises(DeadlockError, match=r"rank 0 waits in Barrier"):
        simulate(2, body)


@pytest.mark.mpi_skip
def test_abort_releases_everyone():
    def body(comm):
        if comm.rank == 1:
            comm.Abort(3)
        comm.Barrier()

    with pytest.raises(SimAbort, match=r"rank 1 of SIM_WORLD called Abort\(3\)"):
        simulate(3, body)


@pytest.mark.mpi_skip
def test_split_type_follows_simulated_nodes():
    def body(comm):
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        return local.rank, local.size

    assert simulate(4, body, ranks_per_node=2) == [(0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.mpi_skip
@pytest.mark.mpi_skip
def test_object_calls_check_their_root():
    for call in ("bcast", "reduce", "gather", "scatter"):
        with pytest.raises(ValueError, match=rf"SimComm.{call}: root 5 out of range for communicator of size 2"):
            simulate(2, lambda comm: getattr(comm, call)(None, root=5))


def test_simulate_rejects_bad_size():
    with pytest.raises(ValueError, match=r"simulate: n must be a positive int \(got 0\)"):
        simulate(0, lambda c: None)


@pytest.mark.mpi_skip
def test_threads_do_not_leak():
    before = threading.active_count()
    simulate(4, lambda c: c.Barrier())
    assert threading.active_count() == before


@pytest.mark.mpi_skip
def test_sim_watchdog_reports_who_is_missing():
    import time

    from mpidist.comm import WatchdogTimeout

    def body(comm):
        if comm.rank == 1:
            time.sleep(1.0)  # busy elsewhere: never joins the barrier in time
            return
        comm.Barrier()

    with pytest.raises(WatchdogTimeout, match=r"waited more than 0.2 s in Barrier\(\) #0 on SIM_WORLD.*ranks not in a communication call: \[1\]"):
        simulate(3, body, timeout=0.2)


def test_proc_null_and_matched_probes(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # The halo-shift idiom: the ends talk to PROC_NULL, which sends nowhere and receives nothing.
    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    got = np.full(1, -7.0)
    status = MPI.Status()
    comm.Sendrecv(np.array([float(rank)]), right, 3, got, left, 3, status)
    if left == MPI.PROC_NULL:
        assert got[0] == -7.0 and status.Get_source() == MPI.PROC_NULL
    else:
        assert got[0] == left and status.Get_source() == left
    if size > 1:
        if rank == 0:
            comm.Send(np.arange(5, dtype=np.int16), 1, tag=8)
            comm.send({"k": 1}, dest=1, tag=2)
        elif rank == 1:
            status = MPI.Status()
            message = comm.Mprobe(0, 8, status)
            assert status.Get_source() == 0 and status.Get_tag() == 8
            buf = np.empty(5, dtype=np.int16)
            message.Recv(buf)
            np.testing.assert_array_equal(buf, np.arange(5))
            status = MPI.Status()
            assert comm.recv(source=0, tag=2, status=status) == {"k": 1} and status.Get_tag() == 2
    assert comm.Improbe(MPI.ANY_SOURCE, 77) is None


def test_what_is_not_a_communicator_is_refused_by_name(comm):
    import mpidist.nn as nn
    from mpidist.data import DistributedSampler
    calls = {
        "allreduce": lambda c: mpidist.allreduce(np.ones(2), c),
        "iallreduce": lambda c: mpidist.iallreduce(np.ones(2), c),
        "broadcast": lambda c: mpidist.broadcast(np.ones(2), c),
        "allgather": lambda c: mpidist.allgather(np.ones(2), c),
        "reduce_scatter": lambda c: mpidist.reduce_scatter(np.ones(2), c),
        "barrier": lambda c: mpidist.barrier(c),
        "send": lambda c: mpidist.isend(np.ones(2), 0, c),
        "recv": lambda c: mpidist.recv(0, c),
        "DDP": lambda c: mpidist.DDP(nn.Sequential(nn.Linear(2, 2)), c),
        "FSDP": lambda c: mpidist.FSDP(nn.Sequential(nn.Linear(2, 2)), c),
        "DistributedSampler": lambda c: DistributedSampler(10, c),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name}: comm must be an mpi4py intracommunicator .*\(got int: 7\)"):
            call(7)
    if not isinstance(comm, MPI.Comm):
        return
    # Real MPI only: COMM_NULL (what Split gives a rank with color UNDEFINED) and an intercommunicator.
    rank, size = comm.Get_rank(), comm.Get_size()
    outside = comm.Split(MPI.UNDEFINED if rank == 0 else 1, rank)
    if rank == 0:
        with pytest.raises(TypeError, match=r"broadcast: comm is MPI.COMM_NULL \(freed, or this rank is not a member"):
            mpidist.broadcast(np.ones(2), outside)
    else:
        outside.Free()
    if size >= 2:
        half = comm.Split(rank % 2, rank)
        inter = half.Create_intercomm(0, comm, 1 - rank % 2, tag=11)
        for name in ("broadcast", "DDP"):  # a broadcast over an intercomm would hang: refused before any message
            with pytest.raises(TypeError, match=rf"{name}: intercommunicators are not supported .*intercomm.Merge\(\)"):
                calls[name](inter)
        inter.Free()
        half.Free()


# -- what a communicator is: mpidist.comm's is_simulated, comm_key, world_ranks, simulated_rank, node_comm -----
def test_is_simulated_tells_simulated_ranks_from_mpi_processes(comm):
    from mpidist.comm import is_simulated
    # independent fact: an mpi4py communicator is an MPI.Intracomm; a SimComm is not
    assert is_simulated(comm) is (not isinstance(comm, MPI.Intracomm))
    assert is_simulated(MPI.COMM_SELF) is False
    assert is_simulated(MPI.COMM_WORLD) is False


def test_comm_key_is_equal_on_every_rank_and_differs_between_live_communicators(comm):
    from mpidist.comm import comm_key
    rank, size = comm.Get_rank(), comm.Get_size()
    first, second = comm.Dup(), comm.Dup()
    halves = comm.Split(rank % 2, rank)
    keys = [comm_key(c) for c in (comm, first, second, halves)]
    assert [comm_key(c) for c in (comm, first, second, halves)] == keys  # stable: the same on a second call
    everyone = comm.allgather(keys)
    for position in range(3):  # comm and its two duplicates: one key on every rank
        assert len({k[position] for k in everyone}) == 1, everyone
    assert len(set(keys[:3])) == 3, keys  # a Dup is another communicator
    # each half has one key on its members; the two halves (alive at once) have different keys
    by_color = {}
    for r, k in enumerate(everyone):
        by_color.setdefault(r % 2, set()).add(k[3])
    assert all(len(ks) == 1 for ks in by_color.values()), by_color
    assert len(set().union(*by_color.values())) == min(size, 2), by_color
    for c in (first, second, halves):
        c.Free()


def test_world_ranks_of_a_split_are_the_members_computed_by_hand(comm):
    from mpidist.comm import is_simulated, world_ranks
    rank, size = comm.Get_rank(), comm.Get_size()
    sub = comm.Split(rank % 2, -rank)  # members of my color, highest rank first
    try:
        if is_simulated(comm):
            assert world_ranks(comm) is None and world_ranks(sub) is None
        else:
            world = comm.allgather(MPI.COMM_WORLD.Get_rank())  # comm's rank r is world rank world[r]
            assert world_ranks(comm) == tuple(world)
            mine = [world[r] for r in range(size) if r % 2 == rank % 2][::-1]
            assert world_ranks(sub) == tuple(mine)
    finally:
        sub.Free()


def test_simulated_rank_and_world_comm_name_the_thread_s_simulated_rank(comm):
    from mpidist.comm import is_simulated, simulated_rank, world_comm
    if is_simulated(comm):  # the fixture runs each simulated rank's body in that rank's thread
        assert simulated_rank() == comm.Get_rank()
        assert world_comm().Get_size() == comm.Get_size()
    else:
        assert simulated_rank() is None
        assert world_comm() is MPI.COMM_WORLD
    assert simulate(3, lambda c: (simulated_rank(), world_comm() is c)) == [(0, True), (1, True), (2, True)]
    seen = []
    thread = threading.Thread(target=lambda: seen.append(simulated_rank()))
    thread.start()
    thread.join()
    # a thread a simulated rank starts runs as that rank (mpidist sim's rule); under MPI there is none
    assert seen == [comm.Get_rank() if is_simulated(comm) else None]


def test_node_comm_yields_the_ranks_of_this_node_and_frees_them():
    from mpidist.comm import node_comm

    def body(comm):
        with node_comm(comm) as local:
            members = local.allgather(comm.Get_rank())
            held = local
        return members, held == MPI.COMM_NULL

    # ranks_per_node=2 puts ranks 2k and 2k+1 on node k
    assert simulate(6, body, ranks_per_node=2) == [([2 * (r // 2), 2 * (r // 2) + 1], True) for r in range(6)]


@pytest.mark.world_sizes(2, 3, 4)
def test_node_comm_under_mpi_groups_the_ranks_of_one_host(comm):
    from mpidist.comm import is_simulated, node_comm
    if is_simulated(comm):
        pytest.skip("simulated ranks: test_node_comm_yields_the_ranks_of_this_node_and_frees_them")
    hosts = comm.allgather(MPI.Get_processor_name())
    with node_comm(comm) as local:
        members = local.allgather(comm.Get_rank())
        held = local
    assert members == [r for r, host in enumerate(hosts) if host == hosts[comm.Get_rank()]]
    assert held == MPI.COMM_NULL


def test_nothing_above_comm_imports_the_simulator():
    """Only mpidist/comm knows the simulator; cli.py's ``mpidist sim`` command runs it and is the one exception."""
    import ast
    import pathlib
    root = pathlib.Path(mpidist.__file__).parent
    allowed = {root / "cli.py"}  # `mpidist sim prog.py`: the simulator's own command line
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if root / "comm" in path.parents or path in allowed:
            continue
        package = ".".join(("mpidist",) + path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(filter(None, (base, node.module)))
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(n == "mpidist.comm.sim" or n.startswith("mpidist.comm.sim.") for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == [], offenders


def test_only_comm_asks_whether_an_object_is_an_mpi4py_communicator():
    """Above mpidist/comm, "is it simulated?" is ``mpidist.comm.is_simulated``, not an isinstance of MPI.Comm."""
    import pathlib
    import re
    root = pathlib.Path(mpidist.__file__).parent
    allowed = {
        "data.py",               # DistributedSampler: an mpi4py object may be COMM_NULL or an intercomm: check_comm it
        "guard/fingerprint.py",  # the desync waker (issue 27 A4 moves it)
    }
    pattern = re.compile(r"isinstance\([^)]*MPI\.(Comm|Intracomm)\b")
    offenders = [f"{path.relative_to(root)}:{number}"
                 for path in sorted(root.rglob("*.py"))
                 if root / "comm" not in path.parents and path.relative_to(root).as_posix() not in allowed
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == [], offenders
