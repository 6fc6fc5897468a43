"""The cases SimComm used to get wrong (issue 17), each checked the same way on SimComm and on real MPI.

Every test takes the ``comm`` fixture: SimComm worlds of 1..4 ranks, or under
``mpiexec -n 2 python -m pytest --with-mpi tests/test_sim_mpi_semantics.py`` the real communicator, so
the expected values (written from MPI's definition with numpy) are what ``mpiexec -n 2`` gives.
"""

import ctypes

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import simulate

# The linked library, for skips that name it (Open MPI 4 ends its version string in the C string's NUL).
LIBRARY = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
OPEN_MPI = LIBRARY.startswith("Open MPI")


def _skip_unless_the_library_has_request_get_status_all(comm):
    if isinstance(comm, MPI.Comm):
        try:
            MPI.Request.Get_status_all([MPI.REQUEST_NULL])
        except NotImplementedError:
            pytest.skip(f"{LIBRARY!r} has no MPI_Request_get_status_all (MPI 4.1): mpi4py raises NotImplementedError")


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
    assert MPI.Get_error_string(MPI.ERR_ROOT) in str(info.value)  # MPICH: "Invalid root"; Open MPI: "MPI_ERR_ROOT: invalid root"


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


# -- mpi4py.util.pkl5 and second handles on one communicator ---------------------------------------------------

def _pkl5_for(comm):
    """mpi4py.util.pkl5 bound to the MPI that ``comm`` belongs to (the simulated namespace for a SimComm)."""
    from mpi4py.util import pkl5
    if isinstance(comm, MPI.Comm):
        return pkl5
    global _SIM_PKL5
    if _SIM_PKL5 is None:
        # A private copy of the module whose `from .. import MPI` sees the simulated namespace, as it does
        # under `mpidist sim` or tests/mpi4py_upstream.py, which swap mpi4py.MPI before it is imported.
        import importlib.util
        import sys

        import mpi4py

        from mpidist.comm.sim import MPI as SIM_MPI
        spec = importlib.util.spec_from_file_location("mpi4py.util._pkl5_sim", pkl5.__file__)
        module = importlib.util.module_from_spec(spec)
        real = sys.modules["mpi4py.MPI"]
        mpi4py.MPI, sys.modules["mpi4py.MPI"] = SIM_MPI, SIM_MPI
        try:
            spec.loader.exec_module(module)
        finally:
            mpi4py.MPI, sys.modules["mpi4py.MPI"] = real, real
        _SIM_PKL5 = module
    return _SIM_PKL5


_SIM_PKL5 = None


def test_pkl5_objects_with_out_of_band_buffers(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    pkl5 = _pkl5_for(comm)
    big = pkl5.Intracomm(comm)  # a second handle on the same communicator
    assert big.Get_rank() == r and big.Get_size() == n
    payload = {"rank": r, "data": np.arange(1000, dtype="d") * (r + 1)}
    sent = big.isend(payload, (r + 1) % n, tag=11)  # 8 kB may go rendezvous under MPI: not a blocking send
    got = big.recv(None, (r - 1) % n, 11)
    sent.wait()
    src = (r - 1) % n
    assert got["rank"] == src and np.array_equal(got["data"], np.arange(1000, dtype="d") * (src + 1))
    # collectives through pkl5's handle and the original one stay in step (one sequence per communicator)
    everyone = big.allgather(np.full(3, r))
    assert [a.tolist() for a in everyone] == [[j] * 3 for j in range(n)]
    assert comm.allreduce(r) == n * (n - 1) // 2
    assert big.bcast("from root" if r == 0 else None, root=0) == "from root"
    dup = big.Dup()
    assert isinstance(dup, pkl5.Intracomm), f"Dup of a pkl5 communicator is a {type(dup).__name__}"
    try:
        assert dup.alltoall([(r, j) for j in range(n)]) == [(j, r) for j in range(n)]
    finally:
        dup.Free()


def test_request_get_status_without_completing(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    _skip_unless_the_library_has_request_get_status_all(comm)
    recvs = [comm.irecv(source=(r - 1) % n, tag=20 + k) for k in range(2)]
    Request = type(recvs[0])  # MPI.Request, or the simulated one (class-level calls take its requests)
    assert Request.Get_status_all(recvs) is False, "nothing was sent yet"
    comm.barrier()
    comm.send("a", (r + 1) % n, 20)
    comm.send("bb", (r + 1) % n, 21)
    statuses = []
    while not Request.Get_status_all(recvs, statuses):
        pass
    assert [s.Get_tag() for s in statuses] == [20, 21]
    assert [s.Get_source() for s in statuses] == [(r - 1) % n] * 2
    assert all(recvs), "Get_status_all must leave the requests active"
    index, flag = Request.Get_status_any(recvs)
    assert (index, flag) == (0, True)
    assert Request.Get_status_some(recvs) == [0, 1]
    assert Request.waitall(recvs) == ["a", "bb"]
    assert Request.Get_status_any(recvs) == (MPI.UNDEFINED, True)
    assert Request.Get_status_some(recvs) is None


# -- buffers without the buffer protocol, long double layouts, None as IN_PLACE --------------------------------

class _DLPackOnly:
    """A CPU tensor reachable only through DLPack (like a torch CPU tensor): no buffer protocol."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


class _HostCAI:
    """Host memory described by ``__cuda_array_interface__`` with explicit (contiguous) strides, as a shim
    for device arrays would hand it over: shape (n, 1, 1), strides (itemsize,) * 3."""

    def __init__(self, array):
        self.array = array
        self.__cuda_array_interface__ = {"version": 3, "data": (array.ctypes.data, False),
                                         "typestr": array.dtype.str, "shape": (array.size, 1, 1),
                                         "strides": (array.itemsize,) * 3}


def test_dlpack_and_strided_cai_buffers(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    send = np.arange(4, dtype="i") + 10 * r
    got = np.full(4, -1, dtype="i")
    comm.Sendrecv(_DLPackOnly(send), (r + 1) % n, 30, _DLPackOnly(got), (r - 1) % n, 30)
    assert got.tolist() == (np.arange(4) + 10 * ((r - 1) % n)).tolist(), f"rank {r}: DLPack receive gave {got.tolist()}"
    total = np.zeros(4, dtype="i")
    comm.Allreduce(_HostCAI(send), _HostCAI(total), op=MPI.SUM)
    want = [sum(10 * j + k for j in range(n)) for k in range(4)]
    assert total.tolist() == want, f"rank {r}: Allreduce over __cuda_array_interface__ gave {total.tolist()}"


def test_long_double_indexed_bcast(comm):
    r = comm.Get_rank()
    # MPICH's Pack moves 10 of a long double's 16 bytes inside derived types; all 16 must arrive
    buf = np.arange(10, dtype=np.longdouble) / 3 if r == 0 else np.full(10, -1, dtype=np.longdouble)
    every_other = MPI.LONG_DOUBLE.Create_indexed_block(1, list(range(0, 10, 2))).Commit()
    try:
        comm.Bcast([buf, 1, every_other], root=0)
    finally:
        every_other.Free()
    want = [k / np.longdouble(3) if (k % 2 == 0 or r == 0) else -1 for k in range(10)]
    assert buf.tolist() == want, f"rank {r}: indexed long double Bcast gave {buf.tolist()}"


def test_none_send_buffer_is_in_place(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    everyone = np.full(2 * n, -1, dtype="i")
    everyone[2 * r: 2 * r + 2] = [r, -r]
    comm.Allgather(None, [everyone, MPI.INT])
    assert everyone.tolist() == [v for j in range(n) for v in (j, -j)]
    values = np.array([r + 1.0, 2.0 * r])
    comm.Allreduce(None, values, op=MPI.SUM)
    assert values.tolist() == [n * (n + 1) / 2, float(n * (n - 1))]
    gathered = np.full(n, -1, dtype="i")
    if r == 0:
        gathered[0] = 7
        comm.Gather(None, [gathered, MPI.INT], root=0)
        assert gathered.tolist() == [7] + list(range(1, n))
    else:
        comm.Gather(np.array([r], dtype="i"), None, root=0)


# -- synchronous sends, object receives, Split_type, handles ----------------------------------------------------

def test_synchronous_send_completes_once_a_posted_receive_matches(comm):
    r = comm.Get_rank()
    # MPI completes Ssend to oneself when a receive was posted before it: nothing else will ever wait on it
    pending = [comm.irecv(source=r, tag=40 + k) for k in range(3)]
    comm.ssend("last posted", r, 42)
    sends = [comm.issend(f"message {k}", r, 40 + k) for k in range(2)]
    type(sends[0]).Waitall(sends)
    assert [req.wait() for req in pending] == ["message 0", "message 1", "last posted"]


def test_empty_buffer_message_reads_as_none_and_recv_buf_warns(comm):
    r = comm.Get_rank()
    sent = comm.Isend([None, 0, MPI.BYTE], r, 43)
    assert comm.recv(None, r, 43) is None
    sent.Wait()
    sent = comm.isend("forty-two", r, 44)
    with pytest.warns(UserWarning, match="'buf' argument is deprecated"):
        assert comm.recv(bytearray(64), r, 44) == "forty-two"
    sent.wait()


@pytest.mark.skipif(MPI.COMM_TYPE_HW_GUIDED == MPI.UNDEFINED, reason=f"{LIBRARY!r} predates MPI 4's guided "
                    "Split_type (mpi4py gives COMM_TYPE_HW_GUIDED the value of MPI.UNDEFINED)")
def test_split_type_guided_needs_the_shared_memory_hint(comm):
    n = comm.Get_size()
    assert comm.Split_type(MPI.COMM_TYPE_HW_GUIDED) == MPI.COMM_NULL
    info = MPI.Info.Create()
    try:
        info.Set("mpi_hw_resource_type", "no-such-resource")
        assert comm.Split_type(MPI.COMM_TYPE_HW_GUIDED, info=info) == MPI.COMM_NULL
        info.Set("mpi_hw_resource_type", "mpi_shared_memory")
        node = comm.Split_type(MPI.COMM_TYPE_HW_GUIDED, info=info)
    finally:
        info.Free()
    try:
        assert node != MPI.COMM_NULL and node.Get_size() == n  # one machine: one shared-memory domain
        assert node.Compare(comm) == MPI.CONGRUENT
    finally:
        node.Free()


def test_graph_index_with_leading_zero_and_topology_maps(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    index, edges = [0], []  # the standard adjacency form: n + 1 offsets starting at 0 (mpi4py takes it)
    for i in range(n):
        index.append(index[-1] + 2)
        edges.extend(((i - 1) % n, (i + 1) % n))
    ring = comm.Create_graph(index, edges)
    try:
        assert ring.Get_dims() == (n, 2 * n), f"{n} nodes and {2 * n} edges, got {ring.Get_dims()}"
        assert ring.Get_neighbors(r) == [(r - 1) % n, (r + 1) % n]
        assert comm.Graph_map(index, edges) == ring.Get_rank() == r
    finally:
        ring.Free()
    assert comm.Cart_map([n], True) == r
    if isinstance(comm, MPI.Comm) and OPEN_MPI and r > 0:
        # Seen with Open MPI 4.1.4 and 5.0.11; MPICH and the standard give MPI_UNDEFINED.
        pytest.skip(f"{LIBRARY!r}: Cart_map gives a process outside the grid its own rank, not MPI_UNDEFINED")
    assert comm.Cart_map([1], None) == (0 if r == 0 else MPI.UNDEFINED)


def _mpi_of(comm):
    """The MPI namespace whose classes take ``comm``: mpi4py's, or the simulated mirror of it."""
    if isinstance(comm, MPI.Comm):
        return MPI
    from mpidist.comm.sim import MPI as SIM_MPI
    return SIM_MPI


def test_handles_round_trip_and_typed_copies(comm):
    r, mpi = comm.Get_rank(), _mpi_of(comm)
    cart = comm.Create_cart([comm.Get_size()], periods=False)
    try:
        again = mpi.Comm.fromhandle(cart.handle)  # the base class gives back the topology's class
        assert type(again) is type(cart) and again == cart and again.Get_coords(r) == [r]
        assert mpi.Comm.f2py(cart.py2f()) == cart
        with pytest.raises(TypeError):
            mpi.Graphcomm(cart)
    finally:
        cart.Free()
    req = comm.Isend(np.zeros(1), MPI.PROC_NULL)
    assert mpi.Request.fromhandle(req.handle) == req
    req.Wait()
    assert mpi.Request.fromhandle(MPI.REQUEST_NULL.handle) == MPI.REQUEST_NULL


def test_buffer_format_byte_order_and_integral_counts(comm):
    r = comm.Get_rank()
    foreign = np.zeros(3, dtype=np.dtype("i").newbyteorder(">" if np.little_endian else "<"))
    with pytest.raises(BufferError):
        comm.Sendrecv(foreign, r, 50, np.zeros(3, "i"), r, 50)
    comm.Sendrecv([np.arange(3, dtype="i"), MPI.INT], r, 51, [foreign, MPI.INT], r, 51)  # explicit type: fine
    assert foreign.view(np.dtype("i")).tolist() == [0, 1, 2]  # MPI moved the bytes; they are native ints
    fortran = np.asfortranarray(np.arange(6, dtype="d").reshape(2, 3))
    got = np.zeros((2, 3), order="F")
    comm.Sendrecv(fortran, r, 52, got, r, 52)
    assert got.tolist() == fortran.tolist()
    with pytest.raises(TypeError):
        comm.Allgatherv(np.zeros(1, "i"), [np.zeros(comm.Get_size(), "i"), [1.5] * comm.Get_size(), MPI.INT])


@pytest.mark.mpi_skip
def test_out_of_scope_calls_name_themselves():
    from mpidist.comm.sim import MPI as SIM_MPI

    def body(comm):
        reasons = []
        for call in (lambda: SIM_MPI.Win.Allocate(8, comm=SIM_MPI.COMM_WORLD),
                     lambda: SIM_MPI.WIN_NULL.Fence(),
                     lambda: SIM_MPI.File.Open(SIM_MPI.COMM_WORLD, "data.bin"),
                     lambda: comm.Spawn("python"),
                     lambda: comm.Create_intercomm(0, comm, 0)):
            with pytest.raises(NotImplementedError) as info:
                call()
            reasons.append(str(info.value))
        return reasons
    assert simulate(1, body)[0] == ["MPI.Win.Allocate: one-sided windows are not simulated",
                                    "MPI.Win.Fence: one-sided windows are not simulated",
                                    "MPI.File.Open: MPI-IO files are not simulated",
                                    "SimComm.Spawn: dynamic processes are not simulated",
                                    "SimComm.Create_intercomm: intercommunicators are not simulated"]


# -- complex numbers as DLPack float pairs, null handles, spec errors, reductions from shared buffers ------------

class _DLPackFloatPairs:
    """A complex array exported through DLPack as pairs of floats (code kDLFloat, lanes 2): how a producer
    without a complex long double type hands one over (mpi4py reads it as complex, format 'Zg')."""

    class _DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                    ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                    ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class _Managed(ctypes.Structure):
        pass

    _Managed._fields_ = [("tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    def __init__(self, array):
        assert array.dtype.kind == "c"
        self.array = array
        self._keep = []

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU

    def __dlpack__(self, stream=None):  # a DLPack 0.x producer: unversioned capsules only
        shape = (ctypes.c_int64 * 1)(self.array.size)
        managed = self._Managed()
        managed.tensor = self._DLTensor(self.array.ctypes.data if self.array.size else None, 1, 0, 1, 2,
                                        8 * self.array.itemsize // 2, 2, shape, None, 0)
        self._keep.append((shape, managed))  # the capsule points into these: alive as long as we are
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(managed), b"dltensor", None)


def test_complex_long_double_from_dlpack_float_pairs_in_vector_collectives(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    value = np.clongdouble(r + 1) + np.clongdouble(1j) * (r + 2) / 3
    for count in range(3):
        send = np.full(count, value, dtype=np.clongdouble)
        recv = np.full(count * n, -1, dtype=np.clongdouble)
        comm.Allgatherv(_DLPackFloatPairs(send), [_DLPackFloatPairs(recv), count])  # count per rank, type read
        want = [np.clongdouble(j + 1) + np.clongdouble(1j) * (j + 2) / 3 for j in range(n) for _ in range(count)]
        assert recv.tolist() == want, f"rank {r}: Allgatherv of {count} complex long doubles gave {recv.tolist()}"
        block = np.full(count * n, value, dtype=np.clongdouble)
        out = np.full(count * n, -1, dtype=np.clongdouble)
        comm.Alltoallv([_DLPackFloatPairs(block), count], [_DLPackFloatPairs(out), count])
        assert out.tolist() == want, f"rank {r}: Alltoallv of {count} complex long doubles gave {out.tolist()}"


def _error_class(call):
    with pytest.raises(MPI.Exception) as info:
        call()
    return info.value.Get_error_class()


def test_null_handles_raise_mpi_exception(comm):
    comm_null = comm.Split(MPI.UNDEFINED)
    assert comm_null == MPI.COMM_NULL
    assert _error_class(lambda: comm_null.Compare(comm_null)) == MPI.ERR_COMM
    assert _error_class(lambda: comm.Compare(comm_null)) == MPI.ERR_COMM
    assert _error_class(lambda: comm_null.Compare(comm)) == MPI.ERR_COMM
    assert _error_class(comm_null.Dup) == MPI.ERR_COMM
    assert _error_class(lambda: comm_null.Split(0, 0)) == MPI.ERR_COMM
    assert _error_class(lambda: comm_null.Create(comm.Get_group())) == MPI.ERR_COMM
    assert _error_class(lambda: comm.Get_attr(MPI.KEYVAL_INVALID)) in (MPI.ERR_KEYVAL, MPI.ERR_OTHER)
    dup = comm.Dup()
    try:
        assert _error_class(lambda: dup.Set_errhandler(MPI.ERRHANDLER_NULL)) in (MPI.ERR_ERRHANDLER, MPI.ERR_ARG)
    finally:
        dup.Free()
    req = comm.Isend(np.zeros(1), MPI.PROC_NULL)
    req.Wait()
    assert req == MPI.REQUEST_NULL
    assert _error_class(req.Free) == MPI.ERR_REQUEST
    assert _error_class(req.Cancel) == MPI.ERR_REQUEST


def test_alltoallw_bottom_needs_counts_and_displacements(comm):
    n = comm.Get_size()
    recv = bytearray(4)
    for send in ([MPI.BOTTOM, None, [0] * n, [MPI.BYTE] * n], [MPI.BOTTOM, [0] * n, None, [MPI.BYTE] * n],
                 [bytearray(4), [0] * n, [0] * n, [MPI.BYTE] * n, None]):
        with pytest.raises(ValueError):
            comm.Alltoallw(send, [recv, [0] * n, [0] * n, [MPI.BYTE] * n])


@pytest.mark.mpi_skip
def test_window_specs_are_read_before_one_sided_calls_refuse():
    from mpidist.comm.sim import MPI as SIM_MPI
    for origin, target in (([None, 0, 0, "B", None], (0, 0, MPI.BYTE)), ([None, 0, "B"], (0, 0, MPI.BYTE, None)),
                           ([None, 0, "B"], {1: 2})):
        with pytest.raises(ValueError):
            SIM_MPI.WIN_NULL.Put(origin, 0, target)
    with pytest.raises(NotImplementedError, match="one-sided windows are not simulated"):
        SIM_MPI.WIN_NULL.Put([None, 0, "B"], 0, (0, 0, MPI.BYTE))


def test_reductions_into_buffers_ranks_share_or_alias(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    inputs = [np.arange(5, dtype="d") * (j + 1) + j for j in range(n)]
    # IN_PLACE on every rank: each rank's result buffer is also its input
    mine = inputs[r].copy()
    comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.SUM)
    assert mine.tolist() == np.sum(inputs, axis=0).tolist()
    # IN_PLACE at a root that is not the last rank: its buffer is an input other ranks' data reduce into
    for root in range(n):
        mine = inputs[r].copy()
        if r == root:
            comm.Reduce(MPI.IN_PLACE, mine, op=MPI.MAX, root=root)
            assert mine.tolist() == np.max(inputs, axis=0).tolist(), f"root {root}: {mine.tolist()}"
        else:
            comm.Reduce(mine, None, op=MPI.MAX, root=root)
            assert mine.tolist() == inputs[r].tolist()  # a send buffer stays as it was
    # one receive buffer for every rank (threads may share it; processes each have their own)
    out = np.zeros(5, "i")
    comm.Allreduce(np.full(5, r + 1, "i"), out, op=MPI.PROD)
    assert out.tolist() == [int(np.prod(np.arange(1, n + 1)))] * 5


def test_ranks_tags_and_roots_are_read_through_int_as_mpi4py_reads_them(comm):
    # mpi4py reads a C int argument with __int__: a float is truncated (osu_multi_lat.py passes size / 2 as a rank).
    n, r = comm.Get_size(), comm.Get_rank()
    got = comm.sendrecv(r, dest=float((r + 1) % n), sendtag=3.7, source=np.float64((r - 1) % n), recvtag=3.2)
    assert got == (r - 1) % n
    assert comm.bcast(r, root=n - 0.5) == n - 1
    buf = np.array([float(r)])
    comm.Bcast(buf, root=np.float32(0.9))
    assert buf[0] == 0.0
    for bad, error in (("0", TypeError), (None, TypeError), (1j, TypeError), (float("nan"), ValueError)):
        with pytest.raises(error):
            comm.send(r, dest=bad)


def test_a_thread_a_rank_starts_runs_as_that_rank():
    import threading

    from mpidist.comm.sim import MPI as SIM_MPI

    def body(comm):
        seen = []
        thread = threading.Thread(target=lambda: seen.append((SIM_MPI.COMM_WORLD.Get_rank(), SIM_MPI.Is_thread_main())))
        thread.start()
        thread.join()
        return seen, SIM_MPI.Is_thread_main()
    assert simulate(3, body) == [([(r, False)], True) for r in range(3)]


def test_split_colors_and_cartesian_dims_are_read_as_mpi4py_reads_them(comm):
    # A color or key is a C int (read through __int__); dims are an int array (read through __index__).
    n, r = comm.Get_size(), comm.Get_rank()
    half = comm.Split(r % 2 + 0.5, key=-r * 1.0)
    assert half.Get_size() == (n + 1 - r % 2) // 2 and half.allgather(r) == sorted(range(r % 2, n, 2), reverse=True)
    half.Free()
    with pytest.raises(TypeError):
        comm.Split("0", 0)
    with pytest.raises(TypeError):
        comm.Create_cart([float(n)])
