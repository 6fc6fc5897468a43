"""The cases SimComm used to get wrong (issue 17), each checked the same way on SimComm and on real MPI.

Every test takes the ``comm`` fixture: SimComm worlds of 1..4 ranks, or under
``mpiexec -n 2 python -m pytest --with-mpi tests/test_sim_mpi_semantics.py`` the real communicator, so
the expected values (written from MPI's definition with numpy) are what ``mpiexec -n 2`` gives.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import simulate


def test_alltoall_count_is_per_rank(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    send = np.array([100 * r + j for j in range(2 * n)], dtype="i")
    recv = np.full(2 * n, -1, dtype="i")
    comm.Alltoall([send, 2, MPI.INT], [recv, 2, MPI.INT])
    want = np.array([100 * j + 2 * r + k for j in range(n) for k in range(2)], dtype="i")
    assert recv.tolist() == want.tolist(), f"rank {r}: Alltoall with count 2 per rank gave {recv.tolist()}"


def test_allgather_and_allgatherv_count_is_per_rank(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    recv = np.full(3 * n + 1, -1, dtype="d")
    comm.Allgather([np.full(3, r, dtype="d"), 3, MPI.DOUBLE], [recv, 3, MPI.DOUBLE])
    assert recv.tolist() == [float(j) for j in range(n) for _ in range(3)] + [-1.0], f"rank {r}: {recv.tolist()}"
    recv[:] = -1
    comm.Allgatherv([np.full(3, r, dtype="d"), MPI.DOUBLE], [recv, 3, MPI.DOUBLE])
    assert recv.tolist() == [float(j) for j in range(n) for _ in range(3)] + [-1.0], f"rank {r}: {recv.tolist()}"


def test_scalar_count_and_displacement(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    data = np.arange(10, dtype="i") + 10 * r
    got = np.full(10, -1, dtype="i")
    # [buf, (count, displ), type]: 3 elements starting at element 2, on both sides
    comm.Sendrecv([data, (3, 2), MPI.INT], (r + 1) % n, 5, [got, (3, 4), MPI.INT], (r - 1) % n, 5)
    src = (r - 1) % n
    want = [-1] * 4 + [10 * src + 2, 10 * src + 3, 10 * src + 4] + [-1] * 3
    assert got.tolist() == want, f"rank {r}: got {got.tolist()}, want {want}"
    # vector form with a scalar count and a scalar (strided) displacement: block i at 4*i
    recv = np.full(4 * n, -1, dtype="i")
    comm.Allgatherv([data[:2], MPI.INT], [recv, (2, 4), MPI.INT])
    want = []
    for j in range(n):
        want += [10 * j, 10 * j + 1, -1, -1]
    assert recv.tolist() == want, f"rank {r}: Allgatherv with (2, 4) gave {recv.tolist()}, want {want}"


def test_indexed_datatype_is_applied(comm):
    r = comm.Get_rank()
    dt = MPI.INT.Create_indexed([1, 2], [0, 3]).Commit()
    try:
        buf = np.arange(6, dtype="i") if r == 0 else np.full(6, -1, dtype="i")
        comm.Bcast([buf, 1, dt], root=0)
    finally:
        dt.Free()
    want = [0, 1, 2, 3, 4, 5] if r == 0 else [0, -1, -1, 3, 4, -1]
    assert buf.tolist() == want, f"rank {r}: Bcast of an indexed type wrote {buf.tolist()}, want {want}"


def test_vector_datatype_send_receive(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    column = MPI.DOUBLE.Create_vector(3, 1, 4).Commit()   # one column of a 3 x 4 matrix
    try:
        matrix = np.arange(12, dtype="d").reshape(3, 4) + 100 * r
        got = np.full(3, -1.0)
        comm.Sendrecv([matrix.reshape(-1)[1:], 1, column], (r + 1) % n, 1, [got, 3, MPI.DOUBLE], (r - 1) % n, 1)
    finally:
        column.Free()
    src = (r - 1) % n
    assert got.tolist() == [100.0 * src + 1, 100.0 * src + 5, 100.0 * src + 9], f"rank {r}: {got.tolist()}"


def test_freed_comm_is_comm_null_and_completed_handles_are_false(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    dup = comm.Dup()
    assert dup != MPI.COMM_NULL and bool(dup)
    dup.Free()
    assert dup == MPI.COMM_NULL, f"rank {r}: a freed communicator compares unequal to COMM_NULL ({dup!r})"
    assert not dup
    req = comm.Isend(np.zeros(1, "i"), (r + 1) % n, 3)
    assert req, "an active request must be true"
    got = np.zeros(1, "i")
    comm.Recv(got, (r - 1) % n, 3)
    req.Wait()
    assert not req and req == MPI.REQUEST_NULL, f"rank {r}: a completed request stays true ({req!r})"
    comm.send("hello", (r + 1) % n, 4)
    msg = comm.mprobe((r - 1) % n, 4)
    assert msg
    assert msg.recv() == "hello"
    assert not msg and msg == MPI.MESSAGE_NULL, f"rank {r}: a received message stays true ({msg!r})"


def test_none_buffers_and_typecodes(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    comm.Send(None, MPI.PROC_NULL)
    status = MPI.Status()
    comm.Recv(None, MPI.PROC_NULL, status=status)
    assert (status.Get_source(), status.Get_count(MPI.BYTE)) == (MPI.PROC_NULL, 0)
    comm.Sendrecv([None, 0, MPI.INT], (r + 1) % n, 7, [None, 0, MPI.INT], (r - 1) % n, 7)
    buf = np.arange(3, dtype="i") if r == 0 else np.zeros(3, "i")
    comm.Bcast([buf, "i"], root=0)
    assert buf.tolist() == [0, 1, 2], f"rank {r}: Bcast([buf, 'i']) gave {buf.tolist()}"
    out = np.zeros(3, "i")
    comm.Allreduce([buf, 3, "i"], [out, "i"], op=MPI.SUM)
    assert out.tolist() == [0, n, 2 * n]


def test_bad_root_raises_mpi_exception_err_root(comm):
    with pytest.raises(MPI.Exception) as info:
        comm.Bcast(np.zeros(1), root=comm.Get_size() + 3)
    assert info.value.Get_error_class() == MPI.ERR_ROOT
    assert str(info.value)


@pytest.mark.mpi_skip
def test_simulate_keeps_mpi_exception_usable():
    def body(comm):
        comm.Bcast(np.zeros(1), root=9)

    with pytest.raises(MPI.Exception) as info:
        simulate(2, body)
    assert info.value.Get_error_class() == MPI.ERR_ROOT
    assert "root 9 out of range for communicator of size 2" in str(info.value)
    assert "Invalid root" in str(info.value)


def test_truncation_is_err_truncate(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    comm.Send(np.zeros(4, "i"), (r + 1) % n, 8)
    with pytest.raises(MPI.Exception) as info:
        comm.Recv(np.zeros(2, "i"), (r - 1) % n, 8)
    assert info.value.Get_error_class() == MPI.ERR_TRUNCATE


def test_maxloc_and_user_op(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    pair = np.zeros(1, dtype=[("v", "f4"), ("i", "i4")])
    pair["v"], pair["i"] = float((r * 7) % n), r
    out = np.zeros_like(pair)
    comm.Allreduce([pair, MPI.FLOAT_INT], [out, MPI.FLOAT_INT], op=MPI.MAXLOC)
    values = [float((k * 7) % n) for k in range(n)]
    best = max(values)
    assert (float(out["v"][0]), int(out["i"][0])) == (best, values.index(best))

    def first(a, b, dt):  # a op b = a: associative, not commutative; MPI's rank order makes it rank 0's value
        np.frombuffer(b, "d")[:] = np.frombuffer(a, "d")
    op = MPI.Op.Create(first, commute=False)
    try:
        got = np.zeros(1)
        comm.Allreduce(np.array([10.0 + r]), got, op=op)
    finally:
        op.Free()
    assert got[0] == 10.0, f"rank {r}: a0 op a1 op ... with op(a, b) = a gave {got[0]}, want 10.0 (rank 0's value)"
