"""Blocking Send/Recv of numpy arrays and blocking collectives: the paths SimComm takes without a request
object (comm/sim/p2p.py, comm.py ``_run``) give what MPI gives.

Tests taking ``comm`` run on SimComm worlds of 1..4 ranks and, under
``mpiexec -n 2 python -m pytest --with-mpi tests/test_sim_p2p_fast.py``, on the real communicator; the
expected values are written from MPI's definition with numpy. The others are about what only the
simulator reports (deadlocks, failed ranks).
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import DeadlockError, RankFailedError, simulate


def test_send_recv_numpy_shapes_dtypes_and_status(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    for dtype, mpitype in (("f8", MPI.DOUBLE), ("i4", MPI.INT), ("u1", MPI.UNSIGNED_CHAR), ("c16", MPI.C_DOUBLE_COMPLEX)):
        send = (np.arange(12).reshape(3, 4) + 100 * r).astype(dtype)
        recv = np.zeros((3, 4), dtype)
        status = MPI.Status()
        req = comm.Isend(send, dest, tag=7)  # nonblocking send: a size-1 world receives from itself
        comm.Recv(recv, source, 7, status)
        req.Wait()
        want = (np.arange(12).reshape(3, 4) + 100 * source).astype(dtype)
        assert recv.tolist() == want.tolist(), f"rank {r}, {dtype}: got {recv.tolist()}, want {want.tolist()}"
        got = (status.Get_source(), status.Get_tag(), status.Get_count(mpitype))
        assert got == (source, 7, 12), f"rank {r}, {dtype}: status (source, tag, count) {got}, want {(source, 7, 12)}"


def test_recv_into_larger_buffer_writes_the_message_only(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    recv = np.full(6, -1.0)
    status = MPI.Status()
    req = comm.Isend(np.array([r + 0.5, r + 1.5]), dest, 3)
    comm.Recv(recv, MPI.ANY_SOURCE, MPI.ANY_TAG, status)
    req.Wait()
    assert recv.tolist() == [source + 0.5, source + 1.5, -1, -1, -1, -1], f"rank {r}: {recv.tolist()}"
    got = (status.Get_source(), status.Get_tag(), status.Get_count(MPI.DOUBLE))
    assert got == (source, 3, 2), f"rank {r}: status (source, tag, count) {got}, want {(source, 3, 2)}"


def test_recv_truncation_is_err_truncate(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    req = comm.Isend(np.arange(4.0), dest, 2)
    with pytest.raises(MPI.Exception) as info:
        comm.Recv(np.zeros(3), source, 2)
    assert info.value.Get_error_class() == MPI.ERR_TRUNCATE, f"rank {r}: error class {info.value.Get_error_class()}"
    req.Wait()


def test_messages_match_by_tag_and_keep_order_per_sender(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    reqs = [comm.Isend(np.array([10 * r + k], "i"), dest, tag) for k, tag in enumerate((1, 2, 1))]
    first, second, third = (np.zeros(1, "i") for _ in range(3))
    comm.Recv(second, source, 2)   # overtakes the tag-1 messages: tags differ
    comm.Recv(first, source, 1)
    comm.Recv(third, source, 1)    # non-overtaking: the second tag-1 message comes second
    for req in reqs:
        req.Wait()
    got = [int(first[0]), int(second[0]), int(third[0])]
    assert got == [10 * source, 10 * source + 1, 10 * source + 2], f"rank {r}: {got}"


def test_blocking_recv_completes_a_synchronous_send(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("a synchronous send to itself needs a receive posted first")
    if r == 0:
        comm.Ssend(np.array([1.0, 2.0]), 1, 4)
    elif r == 1:
        got = np.zeros(2)
        comm.Recv(got, 0, 4)
        assert got.tolist() == [1.0, 2.0], f"rank 1: {got.tolist()}"
    comm.Barrier()


def test_object_message_into_a_buffer_receive(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    req = comm.isend({"from": r}, dest, 6)
    buf = np.zeros(256, np.uint8)
    status = MPI.Status()
    comm.Recv(buf, source, 6, status)
    req.wait()
    size = status.Get_count(MPI.BYTE)
    assert MPI.pickle.loads(buf[:size].tobytes()) == {"from": source}, f"rank {r}: {buf[:size].tobytes()!r}"


def test_numpy_buffers_the_fast_paths_do_not_take(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    dest, source = (r + 1) % n, (r - 1) % n
    strided = np.arange(8.0)[::2]
    with pytest.raises(BufferError):   # mpi4py: not contiguous
        comm.Send(strided, dest, 1)
    readonly = np.zeros(2)
    readonly.flags.writeable = False
    with pytest.raises(BufferError):   # mpi4py: not writable
        comm.Recv(readonly, source, 1)
    # numpy integer ranks and tags, and PROC_NULL, take the general path with the same meaning
    req = comm.Isend(np.array([r], "i"), np.int64(dest), np.int32(5))
    got = np.zeros(1, "i")
    comm.Recv(got, np.int64(source), np.int32(5))
    req.Wait()
    comm.Send(np.zeros(1), MPI.PROC_NULL, 1)
    status = MPI.Status()
    comm.Recv(got, MPI.PROC_NULL, 1, status)
    assert int(got[0]) == source and status.Get_source() == MPI.PROC_NULL, f"rank {r}: {int(got[0])}, {status.Get_source()}"


def test_bad_peer_and_tag_raise_mpi_errors(comm):
    n = comm.Get_size()
    for call, args, error_class in ((comm.Send, (np.zeros(1), n, 0), MPI.ERR_RANK),
                                    (comm.Send, (np.zeros(1), 0, -5), MPI.ERR_TAG),
                                    (comm.Recv, (np.zeros(1), n, 0), MPI.ERR_RANK),
                                    (comm.Recv, (np.zeros(1), 0, -5), MPI.ERR_TAG)):
        with pytest.raises(MPI.Exception) as info:
            call(*args)
        assert info.value.Get_error_class() == error_class, f"{call.__name__}{args[1:]}: {info.value.Get_error_class()}"


def test_blocking_collectives_interleave_with_nonblocking_ones(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    a, b = np.zeros(3), np.zeros(3)
    mine = np.full(3, r + 1.0)  # held until Wait: MPI may read a nonblocking call's buffer late (Open MPI does)
    req = comm.Iallreduce(mine, a, op=MPI.SUM)
    comm.Allreduce(np.full(3, 10.0 * r), b, op=MPI.MAX)
    req.Wait()
    assert a.tolist() == [n * (n + 1) / 2] * 3 and b.tolist() == [10.0 * (n - 1)] * 3, f"rank {r}: {a}, {b}"
    assert comm.allreduce(r, op=MPI.SUM) == n * (n - 1) // 2


@pytest.mark.mpi_skip
def test_blocked_fast_recv_is_in_the_deadlock_report():
    def body(comm):
        comm.Recv(np.zeros(1), (comm.rank + 1) % 2, 9)

    with pytest.raises(DeadlockError, match=r"rank 0 waits in Recv\(source=1, tag=9\).*rank 1 waits in Recv\(source=0, tag=9\)"):
        simulate(2, body)


@pytest.mark.mpi_skip
def test_failed_rank_releases_a_blocked_fast_recv():
    released = []

    def body(comm):
        if comm.rank == 1:
            raise KeyError("boom on one")
        try:
            comm.Recv(np.zeros(1), 1, 0)
        except RankFailedError as exc:
            released.append(str(exc))
            raise

    with pytest.raises(KeyError, match="boom on one"):
        simulate(2, body)
    assert len(released) == 1 and "simulated rank 1 failed (KeyError" in released[0], released


@pytest.mark.parametrize("size", [33, 4096])  # 4096 elements: at least 4 KiB, SimComm's one-pass first step
@pytest.mark.parametrize("dtype", ["f8", "f4", "i4", "u1", "i8", "c16"])
def test_allreduce_and_reduce_sum_prod_match_numpy(comm, dtype, size):
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(7)
    # integers, so that any summation order MPI picks gives the same floats; every rank draws the same
    data = [np.round(rng.standard_normal(size) * 50).astype(dtype) for _ in range(n)]
    if dtype == "u1":  # no overflow: MPI leaves it undefined (Open MPI's uint8 SUM saturates; ompi#8045)
        data = [rng.integers(0, 4, size).astype(dtype) for _ in range(n)]
    if dtype == "c16":
        data = [d + 1j * np.round(rng.standard_normal(size) * 50) for d in data]
    with np.errstate(over="ignore"):
        for op, fold in ((MPI.SUM, np.add), (MPI.PROD, np.multiply)):
            if op == MPI.PROD and dtype == "c16":
                continue
            want = data[n - 1].copy()
            for d in reversed(data[:-1]):   # MPI's canonical order a0 op (a1 op (... op a(n-1)))
                want = fold(d, want)
            got = np.zeros(size, dtype)
            comm.Allreduce(data[r], got, op=op)
            assert got.tolist() == want.tolist(), f"rank {r}, {dtype} {op}: {got[:4]}, want {want[:4]}"
            inplace = data[r].copy()
            comm.Allreduce(MPI.IN_PLACE, inplace, op=op)
            assert inplace.tolist() == want.tolist(), f"rank {r}, {dtype} {op} in place: {inplace[:4]}"
            root = n - 1
            got = np.zeros(size, dtype) if r == root else None
            comm.Reduce(data[r], got, op=op, root=root)
            if r == root:
                assert got.tolist() == want.tolist(), f"rank {r}, {dtype} {op} Reduce: {got[:4]}, want {want[:4]}"
