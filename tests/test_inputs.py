"""Every public collective with inputs users actually pass (issue 11 item 9).

Lists, scalars, a torch-like tensor (``size()`` a method, ``dtype`` not a numpy dtype), an object whose
``dtype``/``size``/``shape`` are all methods: the same clear TypeError under SimComm and under mpiexec
(the guard records every call before validation and must not trip over them). 0-d, non-contiguous and
read-only arrays: results against numpy, or a ValueError where the array would be written in place.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import guard


@pytest.fixture(params=["default", "debug"])
def guard_mode(request):
    """The guard as shipped, and in debug mode (a fingerprint check before every call, before validation)."""
    before = guard.settings.desync
    guard.configure(desync=request.param == "debug")
    yield request.param
    guard.configure(desync=before)


class _Size(tuple):
    """torch.Size: a tuple subclass."""


class TensorLike:
    """What the collectives see of a torch tensor: ``size()`` is a method, ``dtype`` is torch's own."""

    def __init__(self):
        self.shape = _Size((4,))
        self.dtype = "torch.float32"
        self.nbytes = 16

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def __array__(self, dtype=None, copy=None):
        return np.ones(4, dtype=np.float32)


class AllMethods:
    """An object whose dtype, size and shape are methods."""

    def dtype(self):
        return "float32"

    def size(self):
        return 4

    def shape(self):
        return (4,)


KINDS = ("list", "scalar", "tensor-like", "all-methods", "0-d", "non-contiguous", "read-only")
BAD = {"list": "list", "scalar": "float", "tensor-like": r"test_inputs\.TensorLike", "all-methods": r"test_inputs\.AllMethods"}


def make(kind, rank):
    """Return this rank's input of ``kind`` (arrays hold rank-dependent values) and, for views, their base."""
    if kind == "list":
        return [1.0, 2.0], None
    if kind == "scalar":
        return 3.0, None
    if kind == "tensor-like":
        return TensorLike(), None
    if kind == "all-methods":
        return AllMethods(), None
    if kind == "0-d":
        return np.array(2.5 * (rank + 1)), None
    base = np.arange(24.0).reshape(6, 4) * (rank + 1)
    if kind == "non-contiguous":
        return base[:, ::2], base  # (6, 2), strided
    base.flags.writeable = False
    return base, None


def reference(kind, size):
    """Every rank's input of ``kind`` as fresh numpy arrays."""
    return [np.array(make(kind, r)[0]) for r in range(size)]


def run(op, x, comm, kind):
    rank, size = comm.Get_rank(), comm.Get_size()
    if op == "allreduce":
        return mpidist.allreduce(x, comm)
    if op == "iallreduce":
        return mpidist.iallreduce(x, comm).wait()
    if op == "broadcast":
        return mpidist.broadcast(x, comm, root=size - 1)
    if op == "ibroadcast":
        return mpidist.ibroadcast(x, comm, root=size - 1).wait()
    if op == "allgather":
        return mpidist.allgather(x, comm)
    if op == "iallgather":
        return mpidist.iallgather(x, comm).wait()
    if op == "reduce_scatter":
        return mpidist.reduce_scatter(x, comm)
    if op == "ireduce_scatter":
        return mpidist.ireduce_scatter(x, comm).wait()
    if op == "alltoall":
        return mpidist.alltoall(x, comm)
    if op == "send":  # to the next rank, from the previous one (to itself on one rank)
        handle = mpidist.isend(x, (rank + 1) % size, comm, tag=11)
        got = mpidist.recv((rank - 1) % size, comm, tag=11)
        handle.wait()
        return got
    if op == "recv-into":  # x is the out= array the message (the next rank's input, contiguous) lands in
        handle = mpidist.isend(np.array(make(kind, rank)[0]), (rank + 1) % size, comm, tag=12)
        try:
            return mpidist.recv((rank - 1) % size, comm, tag=12, out=x)
        finally:
            handle.wait()
    raise ValueError(op)


OPS = ("allreduce", "iallreduce", "broadcast", "ibroadcast", "allgather", "iallgather", "reduce_scatter",
       "ireduce_scatter", "alltoall", "send", "recv-into")
IN_PLACE = {"allreduce", "iallreduce", "broadcast", "ibroadcast", "recv-into"}


def expected(op, kind, comm):
    """Return the numpy reference result of ``op`` on this rank (None where the call must raise)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    xs = reference(kind, size)
    if op in ("allreduce", "iallreduce"):
        return sum(xs)
    if op in ("broadcast", "ibroadcast"):
        return xs[size - 1]
    if op in ("allgather", "iallgather"):
        return np.concatenate([x.reshape(1) if x.ndim == 0 else x for x in xs])
    if op in ("reduce_scatter", "ireduce_scatter"):
        return None if kind == "0-d" else np.array_split(sum(xs), size)[rank]
    if op == "alltoall":
        return None if kind == "0-d" else np.concatenate([np.array_split(x, size)[rank] for x in xs])
    if op in ("send", "recv-into"):
        return xs[(rank - 1) % size]
    raise ValueError(op)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", OPS)
def test_every_collective_with_every_kind_of_input(comm, op, kind, guard_mode):
    rank, size = comm.Get_rank(), comm.Get_size()
    x, base = make(kind, rank)
    name = {"iallreduce": "allreduce", "ibroadcast": "broadcast", "iallgather": "allgather", "recv-into": "recv",
            "ireduce_scatter": "reduce_scatter"}.get(op, op)
    if kind in BAD:
        what = "out" if op == "recv-into" else "x"
        message = rf"{name}: {what} must be a numpy or cupy array \(got {BAD[kind]}\)"
        if op == "recv-into":
            handle = mpidist.isend(np.ones(4, dtype=np.float32), (rank + 1) % size, comm, tag=12)
            with pytest.raises(TypeError, match=message):
                mpidist.recv((rank - 1) % size, comm, tag=12, out=x)
            mpidist.recv((rank - 1) % size, comm, tag=12)  # the message is still queued: take it
            handle.wait()
            return
        with pytest.raises((TypeError, ValueError), match=message) as info:
            run(op, x, comm, kind)
        if op != "alltoall":  # alltoall reports every rank's problem at once, as a ValueError
            assert info.type is TypeError
        if kind == "tensor-like":
            assert "pass a numpy view of it, e.g. numpy.asarray(x) (a CPU torch tensor: x.numpy()" in str(info.value)
        return
    want = expected(op, kind, comm)
    if kind == "read-only" and op in IN_PLACE:
        with pytest.raises(ValueError, match=rf"{name}: array is read-only and cannot be written in place \(shape: "
                                             rf"\(6, 4\)\)"):
            run(op, x, comm, kind)
        if op == "recv-into":
            mpidist.recv((rank - 1) % size, comm, tag=12)  # the message is still queued: take it
        return
    if want is None:
        dims = r"at least one dimension \(got a 0-d array\)" if op in ("reduce_scatter", "ireduce_scatter") else r"1 to 14 dimensions \(got shape \(\)\)"
        with pytest.raises(ValueError, match=rf"{name}: .*x must have {dims}"):
            run(op, x, comm, kind)
        return
    before = None if base is None else base.copy()
    got = run(op, x, comm, kind)
    np.testing.assert_array_equal(got, want)
    assert got.shape == want.shape and got.dtype == want.dtype
    if op in IN_PLACE:
        assert got is x
        np.testing.assert_array_equal(x, want)
    if base is not None:  # the columns the view skips are untouched; the view's own hold the result
        untouched = before.copy()
        untouched[:, ::2] = x
        np.testing.assert_array_equal(base, untouched)


def test_a_real_torch_tensor_gets_the_same_message(comm, guard_mode):
    torch = pytest.importorskip("torch")
    t = torch.ones(4)
    with pytest.raises(TypeError, match=r"allreduce: x must be a numpy or cupy array \(got torch\.Tensor\); pass a "
                                        r"numpy view of it"):
        mpidist.allreduce(t, comm)
    mpidist.allreduce(t.numpy(), comm)  # the view the message suggests: results land in the tensor
    assert t.tolist() == [float(comm.Get_size())] * 4


@pytest.mark.parametrize("name", ["SUM", "PROD", "MIN", "MAX"])
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_mpi4py_ops_are_the_reductions_they_name(comm, guard_mode, name, dtype):
    """``op=MPI.SUM`` (an mpi4py op) means ``op="sum"``, on every reducing call; ranks may spell it either way
    (the debug mode's desync check sees one reduction)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    ufunc = {"SUM": np.add, "PROD": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[name]
    xs = [((np.arange(8).reshape(4, 2) + r) % 5 - 2).astype(dtype) for r in range(size)]
    want = ufunc.reduce(np.stack(xs))
    mine = getattr(MPI, name) if rank == 0 else name.lower()
    x = xs[rank].copy()
    np.testing.assert_array_equal(mpidist.allreduce(x, comm, op=mine), want)
    x = xs[rank].copy()
    np.testing.assert_array_equal(mpidist.iallreduce(x, comm, op=mine).wait(), want)
    rows = np.array_split(want, size)[rank]
    np.testing.assert_array_equal(mpidist.reduce_scatter(xs[rank], comm, op=mine), rows)
    np.testing.assert_array_equal(mpidist.ireduce_scatter(xs[rank], comm, op=mine).wait(), rows)


def test_mpi4py_ops_without_an_mpidist_reduction_are_refused_by_name(comm, guard_mode):
    user_op = MPI.Op.Create(lambda a, b, datatype: None, commute=True)
    try:
        for op, shown in ((MPI.BAND, "op MPI.BAND"), (MPI.LOR, "op MPI.LOR"), (MPI.MAXLOC, "op MPI.MAXLOC"),
                          (MPI.OP_NULL, "op MPI.OP_NULL"), (user_op, "a user-defined MPI.Op")):
            for call in (mpidist.allreduce, mpidist.iallreduce, mpidist.reduce_scatter, mpidist.ireduce_scatter):
                fn = call.__name__.removeprefix("i")
                with pytest.raises(ValueError, match=rf"{fn}: {shown} has no mpidist reduction \(expected one of sum, "
                                                     rf"mean, min, max, prod\); mpi4py's MPI.SUM, MPI.PROD, MPI.MIN "
                                                     rf"and MPI.MAX work too"):
                    call(np.ones(comm.Get_size()), comm, op=op)
    finally:
        user_op.Free()
    # Nothing was started: the next reduction matches on every rank.
    np.testing.assert_array_equal(mpidist.allreduce(np.ones(2), comm, op=MPI.SUM), [comm.Get_size()] * 2)


def test_root_dest_and_source_must_be_ints_numpy_ints_included(comm, guard_mode):
    """A bool is not a rank (``root=True`` was rank 1); numpy integers are."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for bad, shown in ((True, "bool True"), (False, "bool False"), (1.0, "float 1.0"), ("0", "str '0'"),
                       (None, "NoneType None")):
        for call in (mpidist.broadcast, mpidist.ibroadcast):
            with pytest.raises(TypeError, match=rf"broadcast: root must be an int \(got {shown}\)"):
                call(np.full(2, float(rank)), comm, root=bad)
    with pytest.raises(TypeError, match=r"send: dest must be an int \(got bool True\)"):
        mpidist.isend(np.ones(2), True, comm)
    with pytest.raises(TypeError, match=r"recv: source must be an int \(got bool False\)"):
        mpidist.recv(False, comm)
    for root in (np.int64(size - 1), np.int32(0), np.uint8(size - 1)):
        x = np.full(3, float(rank))
        np.testing.assert_array_equal(mpidist.broadcast(x, comm, root=root), [float(root)] * 3)
        x = np.full(3, float(rank))
        np.testing.assert_array_equal(mpidist.ibroadcast(x, comm, root=root).wait(), [float(root)] * 3)
    handle = mpidist.isend(np.full(2, float(rank)), np.int64((rank + 1) % size), comm, tag=21)
    np.testing.assert_array_equal(mpidist.recv(np.int64((rank - 1) % size), comm, tag=21), [float((rank - 1) % size)] * 2)
    handle.wait()


def test_allgather_refuses_a_read_only_out(comm, guard_mode):
    rank, size = comm.Get_rank(), comm.Get_size()
    out = np.zeros((2 * size, 3))
    out.flags.writeable = False
    for call in (mpidist.allgather, mpidist.iallgather):
        with pytest.raises(ValueError, match=rf"allgather: array is read-only and cannot be written in place "
                                             rf"\(shape: \({2 * size}, 3\)\)"):
            call(np.full((2, 3), float(rank)), comm, out=out)
        assert not out.any()
    got = mpidist.allgather(np.full((2, 3), float(rank)), comm, out=np.zeros((2 * size, 3)))  # still in step
    np.testing.assert_array_equal(got, np.repeat(np.arange(size, dtype=float), 2)[:, None] * np.ones(3))
