"""Array collectives against numpy references computed from every rank's inputs.

Every rank can compute every other rank's input (``rank_input``), so the reference needs no
communication. Values are multiples of 1/4 in [-8, 8] so that sums, minima and maxima are exact
in every float dtype whatever order MPI reduces in; products and means get a dtype tolerance.
"""

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import mpidist
from mpidist import collectives
from mpidist.collectives import SUPPORTED_DTYPES, split_sizes

REDUCE_FNS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
RTOL = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12, "complex64": 1e-5, "complex128": 1e-12}


def rank_input(rank, shape, dtype, seed=0):
    """Return the deterministic input array of ``rank``."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind == "u":
        return np.asarray(rng.integers(0, 5, size=shape), dtype=dtype)
    if dtype.kind == "i":
        return np.asarray(rng.integers(-5, 6, size=shape), dtype=dtype)
    values = rng.integers(-32, 33, size=shape) / 4
    if dtype.kind == "c":
        values = values + 1j * (rng.integers(-32, 33, size=shape) / 4)
    return np.asarray(values, dtype=dtype)


def reference(op, arrays):
    """Reduce ``arrays`` with numpy the way the collective should."""
    dtype = arrays[0].dtype
    if op == "mean":
        return (np.sum(np.stack(arrays).astype(np.complex128 if dtype.kind == "c" else np.float64), axis=0) / len(arrays)).astype(dtype)
    if dtype.kind == "b":
        fn = np.logical_or if op in ("sum", "max") else np.logical_and
    else:
        fn = REDUCE_FNS[op]
    acc = arrays[0]
    for a in arrays[1:]:
        acc = fn(acc, a)
    return np.asarray(acc, dtype=dtype)


def assert_matches(got, want, op):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if op in ("prod", "mean") and want.dtype.name in RTOL:
        np.testing.assert_allclose(got, want, rtol=RTOL[want.dtype.name], atol=RTOL[want.dtype.name])
    else:
        np.testing.assert_array_equal(got, want)


def valid_ops(dtype):
    dtype = np.dtype(dtype)
    ops = ["sum", "prod", "min", "max"]
    if dtype.kind in "fc":
        ops.append("mean")
    if dtype.kind == "c":
        ops = [o for o in ops if o not in ("min", "max")]
    return ops


# -- deterministic tests, one per collective ---------------------------------------------------------
@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "prod"])
def test_allreduce_float64(comm, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = rank_input(rank, (3, 5), np.float64)
    out = mpidist.allreduce(x, comm, op=op)
    assert out is x
    assert_matches(x, reference(op, [rank_input(r, (3, 5), np.float64) for r in range(size)]), op)


@pytest.mark.parametrize("dtype", [dt.name for dt in SUPPORTED_DTYPES])
def test_allreduce_every_dtype(comm, dtype):
    size, rank = comm.Get_size(), comm.Get_rank()
    for op in valid_ops(dtype):
        x = rank_input(rank, (7,), dtype, seed=3)
        mpidist.allreduce(x, comm, op=op)
        assert_matches(x, reference(op, [rank_input(r, (7,), dtype, seed=3) for r in range(size)]), op)


def test_allreduce_non_contiguous_in_place(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    base = rank_input(rank, (6, 8), np.float64)
    view = base[:, ::2]
    untouched = base[:, 1::2].copy()
    mpidist.allreduce(view, comm)
    want = reference("sum", [rank_input(r, (6, 8), np.float64)[:, ::2] for r in range(size)])
    np.testing.assert_array_equal(base[:, ::2], want)
    np.testing.assert_array_equal(base[:, 1::2], untouched)


def test_broadcast_every_root(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for root in range(size):
        x = rank_input(rank, (4, 2), np.int32, seed=root)
        assert mpidist.broadcast(x, comm, root=root) is x
        np.testing.assert_array_equal(x, rank_input(root, (4, 2), np.int32, seed=root))


def test_allgather_uneven_first_dims(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    shapes = [(r + 1, 3) for r in range(size)]
    got = mpidist.allgather(rank_input(rank, shapes[rank], np.float32), comm)
    want = np.concatenate([rank_input(r, shapes[r], np.float32) for r in range(size)])
    np.testing.assert_array_equal(got, want)


def test_allgather_into_out(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    out = np.empty((2 * size, 2), dtype=np.int64)
    assert mpidist.allgather(rank_input(rank, (2, 2), np.int64), comm, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([rank_input(r, (2, 2), np.int64) for r in range(size)]))


@pytest.mark.world_sizes(2, 3, 4)
def test_allgather_disagreeing_trailing_shape_raises_on_every_rank(comm):
    x = np.zeros((2, 3 if comm.Get_rank() == 0 else 4))
    with pytest.raises(ValueError, match=r"ranks disagree on dtype or trailing shape.*rank 0: float64 \(n, 3\).*rank 1: float64 \(n, 4\)"):
        mpidist.allgather(x, comm)


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_scatter_any_length(comm, rows, op):
    size, rank = comm.Get_size(), comm.Get_rank()
    got = mpidist.reduce_scatter(rank_input(rank, (rows, 2), np.float64), comm, op=op)
    full = reference(op, [rank_input(r, (rows, 2), np.float64) for r in range(size)])
    sizes = split_sizes(rows, size)
    start = sum(sizes[:rank])
    assert_matches(got, full[start: start + sizes[rank]], op)


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_ireduce_scatter_in_flight_together_any_length(comm, rows):
    """Three reduce-scatters in flight at once (even and uneven rows, a non-contiguous input), waited in
    reverse order: each returns this rank's rows of the numpy reduction of every rank's input."""
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = {op: [rank_input(r, (rows, 3), np.float64, seed=i) for r in range(size)]
              for i, op in enumerate(("sum", "mean", "max"))}
    strided = np.zeros((rows, 6))
    strided[:, ::2] = inputs["max"][rank]
    sent = [inputs["sum"][rank].copy(), inputs["mean"][rank].copy(), strided[:, ::2]]
    handles = [collectives.ireduce_scatter(x, comm, op=op) for x, op in zip(sent, ("sum", "mean", "max"))]
    sizes = split_sizes(rows, size)
    start = sum(sizes[:rank])
    for handle, op in reversed(list(zip(handles, ("sum", "mean", "max")))):
        got = handle.wait()
        assert_matches(got, reference(op, inputs[op])[start: start + sizes[rank]], op)
        assert handle.wait() is got  # a second wait returns the same result
    np.testing.assert_array_equal(sent[0], inputs["sum"][rank])  # the input is left as it was


def test_ireduce_scatter_refuses_bad_input_before_starting(comm):
    with pytest.raises(TypeError, match=r"reduce_scatter: x must be a numpy or cupy array \(got list\)"):
        collectives.ireduce_scatter([1.0, 2.0], comm)
    with pytest.raises(ValueError, match=r"reduce_scatter: x must have at least one dimension \(got a 0-d array\)"):
        collectives.ireduce_scatter(np.array(1.0), comm)
    with pytest.raises(ValueError, match=r"reduce_scatter: unknown op 'avg' \(expected one of"):
        collectives.ireduce_scatter(np.ones(4), comm, op="avg")
    with pytest.raises(TypeError, match=r"reduce_scatter: op 'mean' needs a floating or complex array \(got int64\)"):
        collectives.ireduce_scatter(np.ones(4, dtype=np.int64), comm, op="mean")
    # Nothing was started: the next collective on comm matches on every rank.
    size = comm.Get_size()
    np.testing.assert_array_equal(collectives.ireduce_scatter(np.ones(size), comm).wait(), [size])


@pytest.mark.parametrize("mpi_has_float16", [True, False], ids=["mpi_float16", "no_mpi_float16"])
def test_float16_with_and_without_an_mpi_float16_type(comm, mpi_has_float16, monkeypatch):
    """MPI 3.1 (Open MPI 4.1) has no float16 datatype (mpi4py raises ``KeyError: 'e'``), emulated on any MPI:
    copies travel as uint16, reductions in float32 or as int16 order keys, so float16 never reaches MPI."""
    if not mpi_has_float16:
        monkeypatch.delitem(MPI._typedict, "e", raising=False)  # real mpi4py and the simulator look types up here
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_input(r, (5, 3), np.float16, seed=11) for r in range(size)]
    for op in valid_ops("float16"):
        want = reference(op, inputs)
        x = inputs[rank].copy()
        assert mpidist.allreduce(x, comm, op=op) is x
        assert_matches(x, want, op)
        x = inputs[rank].copy()
        assert mpidist.iallreduce(x, comm, op=op).wait() is x
        assert_matches(x, want, op)
        base = np.full((5, 6), 7, dtype=np.float16)
        base[:, ::2] = inputs[rank]
        mpidist.allreduce(base[:, ::2], comm, op=op)
        assert_matches(base[:, ::2], want, op)
        assert (base[:, 1::2] == 7).all()
    sizes = split_sizes(5, size)  # uneven on 2 and 4 ranks
    start = sum(sizes[:rank])
    for op in ("sum", "mean", "max"):
        got = mpidist.reduce_scatter(inputs[rank], comm, op=op)
        assert_matches(got, reference(op, inputs)[start: start + sizes[rank]], op)
        got = collectives.ireduce_scatter(inputs[rank], comm, op=op).wait()
        assert_matches(got, reference(op, inputs)[start: start + sizes[rank]], op)

    # Copies are bit-exact whatever the bits: signed zeros, infinities, NaN payloads, subnormals.
    def bits(r, n=7):
        return ((np.arange(n) * 977 + r * 31) % 65536).astype(np.uint16).view(np.float16)

    root = size - 1
    x = bits(rank)
    assert mpidist.broadcast(x, comm, root=root) is x
    np.testing.assert_array_equal(x.view(np.uint16), bits(root).view(np.uint16))
    x = bits(rank)[::2]
    mpidist.ibroadcast(x, comm, root=root).wait()
    np.testing.assert_array_equal(x.view(np.uint16), bits(root)[::2].view(np.uint16))
    got = mpidist.allgather(bits(rank, rank + 1), comm)
    np.testing.assert_array_equal(got.view(np.uint16), np.concatenate([bits(r, r + 1) for r in range(size)]).view(np.uint16))
    out = np.empty(3 * size, dtype=np.float16)
    assert mpidist.iallgather(bits(rank, 3), comm, out=out).wait() is out
    np.testing.assert_array_equal(out.view(np.uint16), np.concatenate([bits(r, 3) for r in range(size)]).view(np.uint16))
    # send/recv in a ring, inline (small) and as a separate payload (larger than the inline limit), into out too.
    dest, src = (rank + 1) % size, (rank - 1) % size
    for n in (7, 5000):
        handle = mpidist.isend(bits(rank, n), dest, comm, tag=n)
        got = mpidist.recv(src, comm, tag=n)
        handle.wait()
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.view(np.uint16), bits(src, n).view(np.uint16))
        handle = mpidist.isend(bits(rank, n), dest, comm, tag=n)
        out = np.empty(n, dtype=np.float16)
        assert mpidist.recv(src, comm, tag=n, out=out) is out
        handle.wait()
        np.testing.assert_array_equal(out.view(np.uint16), bits(src, n).view(np.uint16))


def nan_inputs(size, dtype, nan_rank):
    """Every rank's (6, 4) input for max/min: finite values, infinities and signed zeros everywhere, NaN of both
    signs on ``nan_rank`` only (columns 0 and 1), and a column where every rank holds NaN."""
    xs = [rank_input(r, (6, 4), dtype, seed=31) for r in range(size)]
    for r, x in enumerate(xs):
        x[:, 2] = [np.inf, -np.inf, 0.0, -0.0, np.inf if r % 2 else -np.inf, -0.0 if r % 2 else 0.0]
        x[:, 3] = np.nan
    xs[nan_rank][::2, 0] = np.nan
    xs[nan_rank][1::2, 1] = -np.nan
    return xs


def assert_nan_propagated(got, want):
    """``got`` equals numpy's result, NaN where it has NaN, and every NaN is numpy's positive one."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN positions must match too
    assert not np.signbit(got[np.isnan(got)]).any()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_max_and_min_propagate_nan_from_whichever_rank_holds_it(comm, dtype):
    """NaN wins max and min, as in numpy's maximum/minimum, on every rank whichever rank holds it (raw MPI does
    not say: MPICH returns NaN or not depending on that rank, and different values on different ranks)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = split_sizes(6, size)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for nan_rank in range(size):
        xs = nan_inputs(size, dtype, nan_rank)
        for op, ufunc, mpi_op in (("max", np.maximum, MPI.MAX), ("min", np.minimum, MPI.MIN)):
            want = ufunc.reduce(np.stack(xs))
            for spelled in (op, mpi_op):
                x = xs[rank].copy()
                assert mpidist.allreduce(x, comm, op=spelled) is x
                assert_nan_propagated(x, want)
            x = xs[rank].copy()
            assert_nan_propagated(mpidist.iallreduce(x, comm, op=op).wait(), want)
            base = np.zeros((6, 8), dtype=dtype)
            base[:, ::2] = xs[rank]
            mpidist.allreduce(base[:, ::2], comm, op=op)  # a strided view: through a contiguous copy
            assert_nan_propagated(base[:, ::2], want)
            assert (base[:, 1::2] == 0).all()
            assert_nan_propagated(mpidist.reduce_scatter(xs[rank], comm, op=op), want[lo:hi])
            assert_nan_propagated(collectives.ireduce_scatter(xs[rank], comm, op=op).wait(), want[lo:hi])


def float16_overflow_case(size, op):
    """Return every rank's (5, 4) float16 input whose float16 partial sums (or products) overflow where the
    result fits, and numpy's result computing in float32 and rounding to float16 once."""
    first_half = (size + 1) // 2

    def inputs(r):
        x = rank_input(r, (5, 4), np.float16, seed=41)  # multiples of 1/4: exact float32 sums and products
        x[:, 0] = 60000  # its sum overflows float16 from two ranks on; its mean never does
        x[:, 1] = 40000 if r < first_half else -40000  # partial sums overflow, the total is 0 or 40000
        x[:, 2] = 256 if r < first_half else 1 / 256  # partial products overflow (256 * 256 > 65504)
        return x

    xs = [inputs(r) for r in range(size)]
    wide = np.stack(xs).astype(np.float32)
    exact = np.prod(wide, axis=0) if op == "prod" else np.sum(wide, axis=0)
    if op == "mean":
        exact /= np.float32(size)
    with np.errstate(over="ignore"):
        return xs, exact.astype(np.float16)


@pytest.mark.parametrize("op", ["sum", "mean", "prod"])
def test_float16_sums_accumulate_in_float32_and_round_once(comm, op):
    """The mean of 60000 and 60000 is 60000 (float16 partial sums overflow): every rank's float16 input is
    reduced in float32 and rounded to float16 once, as numpy computing in float32 then rounding."""
    size, rank = comm.Get_size(), comm.Get_rank()
    xs, want = float16_overflow_case(size, op)
    lo = sum(split_sizes(5, size)[:rank])
    x = xs[rank].copy()
    assert mpidist.allreduce(x, comm, op=op) is x
    np.testing.assert_array_equal(x, want)
    x = xs[rank].copy()
    np.testing.assert_array_equal(mpidist.iallreduce(x, comm, op=op).wait(), want)
    base = np.zeros((5, 8), dtype=np.float16)
    base[:, ::2] = xs[rank]
    mpidist.allreduce(base[:, ::2], comm, op=op)
    np.testing.assert_array_equal(base[:, ::2], want)
    for got in (mpidist.reduce_scatter(xs[rank], comm, op=op), collectives.ireduce_scatter(xs[rank], comm, op=op).wait()):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want[lo: lo + got.shape[0]])
    if size > 1 and op == "mean":
        assert (x[:, 0] == 60000).all()  # the issue's own case, spelled out


def test_split_sizes_formula():
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert split_sizes(3, 4) == [1, 1, 1, 0]
    assert split_sizes(8, 4) == [2, 2, 2, 2]


def test_send_recv_carries_shape_and_dtype(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # A ring (one rank sends to itself): every rank sends a differently shaped array; the receiver knows
    # neither shape nor dtype.
    dtypes = ["float16", "int8", "complex128", "bool"]
    mine = rank_input(rank, (rank + 1, 2, 1), dtypes[rank % 4], seed=9)
    handle = mpidist.isend(mine, (rank + 1) % size, comm, tag=7)
    src = (rank - 1) % size
    got = mpidist.recv(src, comm, tag=7)
    handle.wait()
    want = rank_input(src, (src + 1, 2, 1), dtypes[src % 4], seed=9)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_recv_any_source_pairs_header_with_payload(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    # Rank 0 sends to itself too, so one rank has a sender as well.
    handle = mpidist.isend(np.full((rank + 1, rank + 1), rank, dtype=np.int16), 0, comm, tag=rank)
    if rank == 0:
        seen = set()
        for _ in range(size):
            got = mpidist.recv(MPI.ANY_SOURCE, comm, tag=MPI.ANY_TAG)
            r = int(got.flat[0])
            assert got.shape == (r + 1, r + 1) and (got == r).all()
            seen.add(r)
        assert seen == set(range(size))
    handle.wait()


def test_nonblocking_collectives_overlap(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    a = rank_input(rank, (9,), np.float64)
    b = rank_input(rank, (2, 3), np.float32, seed=1)
    c = rank_input(rank, (3,), np.int64, seed=2)
    root = size - 1
    handles = [mpidist.iallreduce(a, comm, op="mean"), mpidist.ibroadcast(b, comm, root=root), mpidist.iallgather(c, comm)]
    results = [h.wait() for h in handles]
    assert_matches(results[0], reference("mean", [rank_input(r, (9,), np.float64) for r in range(size)]), "mean")
    np.testing.assert_array_equal(results[1], rank_input(root, (2, 3), np.float32, seed=1))
    np.testing.assert_array_equal(results[2], np.concatenate([rank_input(r, (3,), np.int64, seed=2) for r in range(size)]))


def test_barrier_orders_messages(comm):
    # Everything sent before the barrier is receivable after it, whatever the rank count.
    mpidist.barrier(comm)


# -- bad input: a clear error naming the value, on every rank ---------------------------------------
def test_bad_input_errors(comm):
    size = comm.Get_size()
    with pytest.raises(TypeError, match=r"allreduce: x must be a numpy or cupy array \(got list\)"):
        mpidist.allreduce([1.0, 2.0], comm)
    with pytest.raises(ValueError, match=r"allreduce: unknown op 'avg' \(expected one of sum, mean, min, max, prod\)"):
        mpidist.allreduce(np.zeros(2), comm, op="avg")
    with pytest.raises(TypeError, match=r"allreduce: op 'mean' needs a floating or complex array \(got int32\)"):
        mpidist.allreduce(np.zeros(2, dtype=np.int32), comm, op="mean")
    with pytest.raises(TypeError, match=r"op 'max' is not defined for complex arrays"):
        mpidist.allreduce(np.zeros(2, dtype=np.complex64), comm, op="max")
    with pytest.raises(ValueError, match=rf"broadcast: root {size} out of range for a communicator of size {size}"):
        mpidist.broadcast(np.zeros(2), comm, root=size)
    with pytest.raises(ValueError, match=r"broadcast: root -1 out of range"):
        mpidist.broadcast(np.zeros(2), comm, root=-1)
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"allreduce: array is read-only"):
        mpidist.allreduce(frozen, comm)
    with pytest.raises(ValueError, match=r"allreduce: array has overlapping elements"):
        mpidist.allreduce(np.lib.stride_tricks.as_strided(np.zeros(4), (4,), (0,)), comm)
    with pytest.raises(TypeError, match=r"unsupported dtype object"):
        mpidist.allreduce(np.array([None, 1], dtype=object), comm)
    with pytest.raises(ValueError, match=rf"send: dest {size} out of range"):
        mpidist.send(np.zeros(1), size, comm)


# -- property tests: random shapes, dtypes, ops, roots ---------------------------------------------
dtype_names = st.sampled_from([dt.name for dt in SUPPORTED_DTYPES])
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@given(dtype=dtype_names, shape=shapes, data=st.data())
def test_property_allreduce(world, dtype, shape, data):
    op = data.draw(st.sampled_from(valid_ops(dtype)))
    seed = data.draw(st.integers(0, 2**16))

    def body(comm):
        x = rank_input(comm.Get_rank(), shape, dtype, seed)
        mpidist.allreduce(x, comm, op=op)
        assert_matches(x, reference(op, [rank_input(r, shape, dtype, seed) for r in range(comm.Get_size())]), op)
    world.run(body)


@given(dtype=dtype_names, shape=shapes, data=st.data())
def test_property_broadcast(world, dtype, shape, data):
    root = data.draw(st.integers(0, world.size - 1))

    def body(comm):
        x = rank_input(comm.Get_rank(), shape, dtype, seed=root)
        mpidist.broadcast(x, comm, root=root)
        np.testing.assert_array_equal(x, rank_input(root, shape, dtype, seed=root))
    world.run(body)


@given(dtype=dtype_names, trailing=st.lists(st.integers(0, 3), max_size=2).map(tuple), data=st.data())
def test_property_allgather(world, dtype, trailing, data):
    rows = data.draw(st.lists(st.integers(0, 4), min_size=world.size, max_size=world.size))

    def body(comm):
        r = comm.Get_rank()
        got = mpidist.allgather(rank_input(r, (rows[r],) + trailing, dtype), comm)
        want = np.concatenate([rank_input(q, (rows[q],) + trailing, dtype) for q in range(comm.Get_size())])
        np.testing.assert_array_equal(got, want)
    world.run(body)


@given(dtype=dtype_names, rows=st.integers(0, 9), trailing=st.lists(st.integers(1, 3), max_size=2).map(tuple),
       blocking=st.booleans(), data=st.data())
def test_property_reduce_scatter(world, dtype, rows, trailing, blocking, data):
    op = data.draw(st.sampled_from(valid_ops(dtype)))
    shape = (rows,) + trailing

    def body(comm):
        size, rank = comm.Get_size(), comm.Get_rank()
        x = rank_input(rank, shape, dtype)
        got = mpidist.reduce_scatter(x, comm, op=op) if blocking else collectives.ireduce_scatter(x, comm, op=op).wait()
        full = reference(op, [rank_input(r, shape, dtype) for r in range(size)])
        sizes = split_sizes(rows, size)
        assert_matches(got, full[sum(sizes[:rank]): sum(sizes[:rank + 1])], op)
    world.run(body)


@given(dtype=dtype_names, shape=shapes, data=st.data())
def test_property_send_recv(world, dtype, shape, data):
    tag = data.draw(st.integers(0, 100))

    def body(comm):
        size, rank = comm.Get_size(), comm.Get_rank()
        h = mpidist.isend(rank_input(rank, shape, dtype, tag), (rank + 1) % size, comm, tag=tag)
        got = mpidist.recv((rank - 1) % size, comm, tag=tag)
        h.wait()
        want = rank_input((rank - 1) % size, shape, dtype, tag)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    world.run(body)


# Element counts of float64 arrays on both sides of the one-message limit (8192 bytes), and empty ones.
P2P_SIZES = [0, 1, 1024, 1025, 40000, 0, 3]


def test_small_and_large_messages_keep_their_order_and_land_in_out(comm):
    """Small payloads ride in the header's message, large ones follow it: the receiver sees one stream."""
    size, rank = comm.Get_size(), comm.Get_rank()  # a ring; one rank sends to itself
    dest, src = (rank + 1) % size, (rank - 1) % size
    handles = [mpidist.isend(np.arange(n, dtype=np.float64) + 1000 * rank + i, dest, comm, tag=5)
               for i, n in enumerate(P2P_SIZES)]
    for i, n in enumerate(P2P_SIZES):
        want = np.arange(n, dtype=np.float64) + 1000 * src + i
        if i % 2:
            out = np.full(n, -1.0)
            got = mpidist.recv(src, comm, tag=5, out=out)
            assert got is out
        else:
            got = mpidist.recv(src, comm, tag=5)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    for h in handles:
        h.wait()
    # A non-contiguous out receives through a staging array and keeps its identity.
    h = mpidist.isend(np.arange(2000.0).reshape(40, 50), dest, comm, tag=6)
    block = np.zeros((40, 100))
    got = mpidist.recv(src, comm, tag=6, out=block[:, ::2])
    h.wait()
    np.testing.assert_array_equal(block[:, ::2], np.arange(2000.0).reshape(40, 50))
    assert got.base is block and (block[:, 1::2] == 0).all()


@pytest.mark.parametrize("count", [3, 5000])
def test_recv_into_the_wrong_out_says_what_arrived_and_keeps_the_stream(comm, count):
    size, rank = comm.Get_size(), comm.Get_rank()  # a ring; one rank sends to itself
    dest, src = (rank + 1) % size, (rank - 1) % size
    handles = [mpidist.isend(np.ones((count, 2), dtype=np.float32), dest, comm, tag=3),
               mpidist.isend(np.arange(4, dtype=np.int64) + rank, dest, comm, tag=3)]
    pending = mpidist.irecv(src, comm, tag=3, out=np.empty((count, 2), dtype=np.float64))
    message = (rf"recv: out has shape \({count}, 2\) and dtype float64, but the array from rank {src} \(tag 3\) "
               rf"has shape \({count}, 2\) and dtype float32")
    with pytest.raises(ValueError, match=message):
        pending.wait()
    with pytest.raises(ValueError, match=message):  # completed once; the same error again, no second match
        pending.wait()
    np.testing.assert_array_equal(mpidist.recv(src, comm, tag=3), np.arange(4) + src)
    for h in handles:
        h.wait()
    with pytest.raises(TypeError, match="recv"):
        mpidist.irecv(src, comm, out=[1.0, 2.0])
    frozen = np.zeros(2)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"recv: array is read-only and cannot be written in place \(shape: \(2,\)\)"):
        mpidist.recv(src, comm, out=frozen)


def test_outstanding_receives_match_in_the_order_they_were_started(comm):
    rank = comm.Get_rank()
    sender, receiver = 0, 1 % comm.Get_size()  # one rank: it sends to itself
    sends = []
    if rank == sender:
        sends = [mpidist.isend(np.full(i + 2, i, dtype=np.int32), receiver, comm, tag=4) for i in range(3)]
        sends.append(mpidist.isend(np.ones(1), receiver, comm, tag=9))
    if rank == receiver:
        handles = [mpidist.irecv(sender, comm, tag=4) for _ in range(3)]
        other = mpidist.irecv(MPI.ANY_SOURCE, comm, tag=9)
        # Waited newest first: each handle still gets the message MPI would have matched to it.
        got = [h.wait() for h in reversed(handles)][::-1]
        for i, arr in enumerate(got):
            np.testing.assert_array_equal(arr, np.full(i + 2, i, dtype=np.int32))
        while not other.test():
            pass
        np.testing.assert_array_equal(other.wait(), np.ones(1))
    for h in sends:
        h.wait()


def test_a_wildcard_receive_takes_a_message_an_earlier_receive_cannot_match(comm):
    """MPI's rule: a message goes to the earliest started receive that can take it, and only to that one."""
    rank = comm.Get_rank()
    sender, receiver = 0, 1 % comm.Get_size()  # one rank: it sends to itself, in program order
    sends = []
    if rank == sender:
        sends.append(mpidist.isend(np.array([2]), receiver, comm, tag=2))
    if rank == receiver:
        tag_one = mpidist.irecv(sender, comm, tag=1)
        anything = mpidist.irecv(sender, comm, tag=MPI.ANY_TAG)
        assert int(anything.wait()[0]) == 2  # without waiting for tag_one, which would deadlock
    if sender != receiver:  # the tag-1 messages only go out once the receiver has the tag-2 one
        if rank == receiver:
            mpidist.send(np.array([0]), sender, comm, tag=9)
        elif rank == sender:
            mpidist.recv(receiver, comm, tag=9)
    if rank == sender:
        sends += [mpidist.isend(np.array([1]), receiver, comm, tag=1), mpidist.isend(np.array([3]), receiver, comm, tag=1)]
    if rank == receiver:
        # Both later messages carry tag 1: the earlier-started receive gets the first of them.
        later = mpidist.irecv(sender, comm, tag=MPI.ANY_TAG)
        assert int(later.wait()[0]) == 3 and int(tag_one.wait()[0]) == 1
    for h in sends:
        h.wait()


def test_a_dropped_receive_handle_is_cancelled(comm):
    rank = comm.Get_rank()
    sender, receiver = 0, 1 % comm.Get_size()  # one rank: it sends to itself
    send = mpidist.isend(np.arange(3), receiver, comm, tag=6) if rank == sender else None
    if rank == receiver:
        mpidist.irecv(sender, comm, tag=6)  # never waited: nothing was posted, so nothing is lost
        gc.collect()
        assert not mpidist.collectives._ArrayReceive.outstanding(comm)
        np.testing.assert_array_equal(mpidist.recv(sender, comm, tag=6), np.arange(3))
    if send is not None:
        send.wait()
    comm.Barrier()


@pytest.mark.mpi_skip
def test_a_hang_behind_an_earlier_receive_is_reported_not_swallowed():
    from mpidist.comm import DeadlockError

    def body(comm):
        if comm.Get_rank() == 1:
            earlier = mpidist.irecv(0, comm, tag=1)  # noqa: F841 - pending while the later one waits
            mpidist.irecv(0, comm, tag=MPI.ANY_TAG).wait()  # rank 0 never sends

    with pytest.raises(DeadlockError, match=r"rank 1 waits in Probe\(source=0, tag=ANY\)"):
        mpidist.simulate(2, body)


def mpi_matching(message_tags, receive_tags):
    """MPI's matching for one sender: each message, in send order, goes to the earliest started
    receive still pending that accepts its tag. Returns the message index each receive gets (None: none)."""
    got = [None] * len(receive_tags)
    for m, tag in enumerate(message_tags):
        for r, want in enumerate(receive_tags):
            if got[r] is None and want in (tag, MPI.ANY_TAG):
                got[r] = m
                break
    return got


@given(data=st.data())
def test_property_receives_match_like_mpi_whatever_order_they_are_waited_in(world, data):
    tags = st.sampled_from([0, 1, 2])
    message_tags = data.draw(st.lists(tags, min_size=1, max_size=6))
    receive_tags = data.draw(st.lists(st.one_of(tags, st.just(MPI.ANY_TAG)), min_size=1, max_size=len(message_tags)))
    expected = mpi_matching(message_tags, receive_tags)
    if None in expected:  # a receive no message can reach would wait forever, in MPI too
        receive_tags = [t for t, e in zip(receive_tags, expected) if e is not None]
        expected = [e for e in expected if e is not None]
    order = data.draw(st.permutations(range(len(receive_tags))))
    polled = data.draw(st.sets(st.sampled_from(range(len(receive_tags)))) if receive_tags else st.just(set()))
    # Small and large payloads: one-message and two-message sends must pair up alike.
    sizes = [data.draw(st.sampled_from([1, 2000])) for _ in message_tags]

    def body(comm):
        size, rank = comm.Get_size(), comm.Get_rank()
        sender, receiver = 0, 1 % size
        sends = []
        if rank == sender:
            sends = [mpidist.isend(np.full(n, i, dtype=np.int64), receiver, comm, tag=t)
                     for i, (t, n) in enumerate(zip(message_tags, sizes))]
        if rank == receiver:
            handles = [mpidist.irecv(sender, comm, tag=t) for t in receive_tags]
            for r in polled:  # a few are tested before anything is waited on
                handles[r].test()
            got = {}
            for r in order:
                got[r] = int(handles[r].wait()[0])
            assert [got[r] for r in range(len(handles))] == expected
            # Messages nobody asked for stay queued: drain them so the next example starts clean.
            for m in sorted(set(range(len(message_tags))) - set(expected)):
                assert int(mpidist.recv(sender, comm, tag=message_tags[m])[0]) == m
        for h in sends:
            h.wait()
    world.run(body)


# 32 KiB of float64: past the one-message limit, so the payload goes to MPI straight from the caller's
# array, and small enough that the allocator hands a freed buffer's memory to the next array of its size.
DROPPED_SEND_ELEMENTS = 4096


def test_a_dropped_send_handle_keeps_its_buffer_until_the_receive_takes_it():
    """MPI reads a large send's buffer when the receive matches it: dropping the handle must not free it.

    On COMM_SELF, a real MPI communicator in every run (SimComm copies at Isend, so it cannot show this), MPI
    reads the buffer only when the receive starts. Here that is after the handle was dropped, garbage
    collected, and memory of the buffer's size was allocated and filled with -1 again.
    """
    comm, n = MPI.COMM_SELF, DROPPED_SEND_ELEMENTS
    data = np.arange(n, dtype=np.float64)
    buffer = weakref.ref(data)
    mpidist.isend(data, 0, comm, tag=8)  # handle dropped at once
    del data
    gc.collect()
    kept = buffer() is not None
    reuse = [np.full(n, -1.0) for _ in range(4)]  # where a freed buffer's memory goes
    got = mpidist.recv(0, comm, tag=8)
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float64))
    assert kept, "the buffer of a pending send was freed with its handle"
    mpidist.iallreduce(np.ones(1), comm).wait()  # a new handle lets go of the sends MPI is done with
    assert buffer() is None, "the buffer of a completed send is never released"
    del reuse


@pytest.mark.world_sizes(2, 3, 4)
def test_a_dropped_send_handle_still_delivers_to_another_rank(comm):
    """The same across processes: rank 1 starts its receive only after rank 0 dropped the handle, collected
    the garbage and reallocated the memory (it waits for a later message, not for time to pass)."""
    rank, n = comm.Get_rank(), DROPPED_SEND_ELEMENTS
    got = np.arange(n, dtype=np.float64)  # what the ranks that receive nothing compare
    if rank == 0:
        data = np.arange(n, dtype=np.float64)
        mpidist.isend(data, 1, comm, tag=8)  # handle dropped at once
        del data
        gc.collect()
        reuse = [np.full(n, -1.0) for _ in range(4)]  # where a freed buffer's memory goes
        mpidist.send(np.zeros(1), 1, comm, tag=9)
        comm.Barrier()
        del reuse
    else:
        if rank == 1:
            mpidist.recv(0, comm, tag=9)
            got = mpidist.recv(0, comm, tag=8)
        comm.Barrier()
    mpidist.iallreduce(np.ones(1), comm).wait()  # every new handle lets go of orphans MPI is done with
    comm.Barrier()
    mpidist.iallreduce(np.ones(1), comm).wait()
    # Checked after the collectives, so that a wrong array on rank 1 fails the test instead of hanging rank 0.
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float64))
    assert not mpidist.collectives._orphans  # (SimComm requests are never parked)


# -- alltoall ---------------------------------------------------------------------------------------------
def draw_splits(rank, size, seed):
    """Rank ``rank``'s rows per destination: random, zeros included, the same on every process."""
    return np.random.default_rng([seed, rank, 77]).integers(0, 4, size=size).tolist()


@given(dtype=dtype_names, trailing=st.lists(st.integers(0, 3), max_size=2).map(tuple), seed=st.integers(0, 50),
       uneven=st.booleans())
def test_property_alltoall(world, dtype, trailing, seed, uneven):
    def body(comm):
        size, rank = comm.Get_size(), comm.Get_rank()
        splits = [draw_splits(r, size, seed) for r in range(size)]
        inputs = [rank_input(r, (sum(splits[r]),) + trailing, dtype, seed) for r in range(size)]
        if uneven:
            got, received = mpidist.alltoall(inputs[rank], comm, splits=splits[rank], return_splits=True)
        else:  # default splits: split_sizes of each rank's length
            splits = [split_sizes(len(inputs[r]), size) for r in range(size)]
            got, received = mpidist.alltoall(inputs[rank], comm, return_splits=True)
        offsets = [np.cumsum([0] + s) for s in splits]
        want = np.concatenate([inputs[r][offsets[r][rank]: offsets[r][rank + 1]] for r in range(size)])
        assert received == [splits[r][rank] for r in range(size)]
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    world.run(body)


def test_alltoall_of_a_non_contiguous_array(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    base = np.arange(4 * size * 6, dtype=np.float64).reshape(4 * size, 6) + 1000 * rank
    got = mpidist.alltoall(base[:, ::2], comm)  # 4 rows to every rank
    want = np.concatenate([(np.arange(4 * size * 6, dtype=np.float64).reshape(4 * size, 6) + 1000 * r)
                           [4 * rank: 4 * rank + 4, ::2] for r in range(size)])
    np.testing.assert_array_equal(got, want)


def test_alltoall_bad_input_on_one_rank_raises_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    odd = rank == size - 1
    x = np.ones((size, 2))
    with pytest.raises(ValueError, match=rf"alltoall: bad input on rank\(s\) \[{size - 1}\]"):
        mpidist.alltoall(x, comm, splits=[1] * (size + 1) if odd else [1] * size)
    with pytest.raises(ValueError, match=rf"alltoall: bad input on rank\(s\) \[{size - 1}\]"):
        mpidist.alltoall(np.float64(3.0) if odd else x, comm)
    if size > 1:
        with pytest.raises(ValueError, match=rf"ranks disagree on dtype or trailing shape \(.*rank {size - 1}: float32 \(n, 2\)"):
            mpidist.alltoall(x.astype(np.float32) if odd else x, comm)
    if odd:
        with pytest.raises(ValueError, match=r"splits must be \d ints >= 0 summing to len\(x\) = \d+ \(got \[-1"):
            mpidist.alltoall(x, comm, splits=[-1] + [0] * (size - 1))
    else:
        with pytest.raises(ValueError, match=r"bad input on rank"):
            mpidist.alltoall(x, comm)


def test_alltoall_into_out_and_a_wrong_out_raises_everywhere(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.arange(3 * size * 2, dtype=np.int32).reshape(3 * size, 2) + 100 * rank
    out = np.empty((3 * size, 2), dtype=np.int32)
    assert mpidist.alltoall(x, comm, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([(np.arange(3 * size * 2).reshape(3 * size, 2) + 100 * r)
                                                       [3 * rank: 3 * rank + 3] for r in range(size)]))
    short = np.empty((3 * size - (rank == 0), 2), dtype=np.int32)  # rank 0's is one row short
    with pytest.raises(ValueError, match=rf"alltoall: out has the wrong number of rows: rank 0: {3 * size - 1} rows "
                                         rf"for the {3 * size} that arrive"):
        mpidist.alltoall(x, comm, out=short)


def test_a_cancelled_receive_leaves_its_message_for_the_next(comm):
    from mpidist.comm import CommError
    rank = comm.Get_rank()
    sender, receiver = 0, 1 % comm.Get_size()  # one rank: it sends to itself
    send = mpidist.isend(np.arange(4), receiver, comm, tag=12) if rank == sender else None
    if rank == receiver:
        keeper = {"handle": mpidist.irecv(sender, comm, tag=12)}
        keeper["self"] = keeper  # a reference cycle: dropping would not free it now, cancel() is explicit
        assert keeper["handle"].cancel() and not keeper["handle"].cancel()
        with pytest.raises(CommError, match=r"recv from 0 \(tag 12\) was cancelled"):
            keeper["handle"].wait()
        np.testing.assert_array_equal(mpidist.recv(sender, comm, tag=12), np.arange(4))
    if send is not None:
        send.wait()
    comm.Barrier()


@pytest.mark.mpi_skip
def test_parked_operations_are_released_when_done_and_a_failed_one_poisons_nothing():
    from mpidist import collectives

    class Request:
        def __init__(self, outcome):
            self.outcome = outcome

        def Test(self, status=None):
            if self.outcome == "error":
                raise RuntimeError("this operation failed")
            return self.outcome == "done"

    pending = Request("pending")
    collectives._orphans.extend([([Request("done")], ()), ([Request("error")], ()), ([pending], ())])
    try:
        collectives._reap_orphans()
        assert [requests[0] for requests, _ in collectives._orphans] == [pending]
    finally:
        collectives._orphans.clear()


@pytest.mark.world_sizes(2, 4)
def test_handle_wait_or_returns_on_the_signal_and_later_completes_the_operation(comm):
    """wait_or(signal) returns False when the signal completes first, True once the operation completes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    real = isinstance(comm, MPI.Intracomm)  # on SimComm a wait_or is a plain wait
    fired, quiet = (MPI.Grequest.Start(), MPI.Grequest.Start()) if real else (None, None)
    if real:
        fired.Complete()
    x = np.full(3, rank + 1.0)
    collectives.barrier(comm)  # the guard's first call on a communicator is collective (it duplicates it)
    if rank == 0 and real:
        handle = collectives.iallreduce(x, comm)
        # rank 1 joins only after this rank's message: the allreduce cannot finish, the signal has
        assert handle.wait_or(fired) is False
        comm.send(None, dest=1)
    else:
        if rank == 1 and real:
            comm.recv(source=0)
        handle = collectives.iallreduce(x, comm)
    assert handle.wait_or(quiet) is True
    np.testing.assert_array_equal(x, np.full(3, size * (size + 1) / 2))
    if real:
        quiet.Complete()
        MPI.Request.Waitall([fired, quiet])
