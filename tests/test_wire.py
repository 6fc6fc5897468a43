"""mpidist.wire's tables (DTYPES, OPS) against independent facts: numpy, MPI itself, NCCL's list, torch.

Every layer (collectives, gpu, torch backend, guard) reads these tables, so a wrong row would be wrong
everywhere at once; these tests check each row against a source that does not read it. The bfloat16 rule
(copies move its bits, reductions run in float32 and round once) is checked through the collectives against
numpy on every rank's input (SimComm worlds 1..4, mpiexec -n 2 / -n 4).
"""

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import collectives, wire
from mpidist.guard import fingerprint

# The send/recv header codes as released (mpidist 0.x): changing them breaks mixed versions of one job.
# bfloat16 and complex32 had their codes (fingerprints, the torch backend) before numpy arrays of bfloat16 moved.
RELEASED_CODES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                  "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "bfloat16", "complex32")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# ncclDataType_t (NCCL 2.x nccl.h) without aliases: the types cupy.cuda.nccl names NCCL_<NAME>.
NCCL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16")
NCCL_OPS = ("SUM", "PROD", "MIN", "MAX")  # ncclRedOp_t, besides ncclAvg (mpidist divides itself)

NUMPY_ROWS = [row for row in wire.DTYPES if row.dtype is not None]
TORCH_ONLY_ROWS = [row for row in wire.DTYPES if row.dtype is None]


def test_dtype_codes_are_positions_and_keep_the_released_protocol():
    assert [row.code for row in wire.DTYPES] == list(range(len(wire.DTYPES)))
    assert tuple(row.name for row in wire.DTYPES[:len(RELEASED_CODES)]) == RELEASED_CODES
    # the numpy rows come first, so a header's code indexes SUPPORTED_DTYPES too
    assert wire.DTYPES[:len(NUMPY_ROWS)] == tuple(NUMPY_ROWS)
    assert collectives.SUPPORTED_DTYPES == tuple(np.dtype(name) for name in RELEASED_CODES[:-1])
    assert collectives.SUPPORTED_DTYPES[-1] == BFLOAT16
    assert fingerprint.dtype_names == tuple(row.name for row in wire.DTYPES)


@pytest.mark.parametrize("row", wire.DTYPES, ids=lambda row: row.name)
def test_each_dtype_row_is_numpys_dtype_or_none_that_numpy_lacks(row):
    if row.dtype is None:
        # numpy itself lacks it; ml_dtypes (imported for mixed precision, mpidist.nn.precision) registers some such
        # names as extension types, which the collectives do not carry (bfloat16 moves as bytes, comm_hooks)
        try:
            found = np.dtype(row.name)
        except TypeError:
            found = None
        assert found is None or found.type.__module__.startswith("ml_dtypes")
    else:
        assert row.dtype == np.dtype(row.name) and wire.DTYPE_CODES[np.dtype(row.name)] == row.code


@pytest.mark.parametrize("row", NUMPY_ROWS, ids=lambda row: row.name)
def test_each_copy_dtype_has_an_mpi_datatype_of_the_same_size(row):
    datatype = MPI._typedict[row.copy.char]  # what mpi4py hands MPI for a buffer of this dtype
    assert datatype.Get_size() == row.dtype.itemsize == row.copy.itemsize
    # the 16-bit floats travel as their bit patterns (MPI 3.1 has neither); every other dtype as itself
    assert (row.copy == np.dtype(np.uint16)) if row.name in ("float16", "bfloat16") else (row.copy == row.dtype)


@pytest.mark.parametrize("row", NUMPY_ROWS, ids=lambda row: row.name)
def test_each_reduce_dtype_holds_every_value_of_the_dtype(row):
    assert np.can_cast(row.dtype, np.dtype(row.reduce_as), casting="safe")
    assert wire.reduce_dtype(row.name) == row.reduce_as
    assert (row.reduce_as == "float32") if row.name in ("float16", "bfloat16") else (row.reduce_as == row.name)


def test_nccl_types_are_ncclDataType_t_of_the_numpy_dtypes():
    named = {row.name: row.nccl for row in wire.DTYPES if row.nccl is not None}
    assert named == {name: f"NCCL_{name.upper()}" for name in NCCL_TYPES if name != "bfloat16"}
    assert wire.nccl_type(np.dtype(np.int16)) is None and wire.nccl_type(np.dtype(np.float32)) == "NCCL_FLOAT32"


def test_nccl_ops_are_ncclRedOp_t():
    assert {row.mpi_name: row.nccl for row in wire.OPS if row.nccl is not None} == {
        name: f"NCCL_{name}" for name in NCCL_OPS}


def _operands(row, rng):
    """Two arrays an op of ``row`` is defined on in MPI: booleans for logical ops, integers for bitwise ones."""
    if row.ufunc.startswith("logical"):
        return rng.random(64) < 0.5, rng.random(64) < 0.5
    if row.ufunc.startswith("bitwise"):
        return rng.integers(-1000, 1000, 64), rng.integers(-1000, 1000, 64)
    return rng.uniform(-4, 4, 64), rng.uniform(-4, 4, 64)


@pytest.mark.parametrize("row", wire.OPS, ids=lambda row: row.mpi_name)
def test_each_ops_ufunc_computes_what_mpi_computes(row):
    a, b = _operands(row, np.random.default_rng(7))
    expected = b.copy()
    row.mpi.Reduce_local(a, expected)  # MPI's own op: expected = a op b
    np.testing.assert_array_equal(getattr(np, row.ufunc)(a, b), expected)
    assert row.mpi == getattr(MPI, row.mpi_name) and wire.OP_BY_NAME[row.mpi_name] is row


@pytest.mark.parametrize("row", wire.OPS, ids=lambda row: row.mpi_name)
def test_each_ops_boolean_op_means_the_same_on_booleans(row):
    a, b = _operands(wire.OP_BY_NAME["LOR"], np.random.default_rng(8))  # booleans
    on_bool = b.copy()
    wire.OP_BY_NAME[row.on_bool].mpi.Reduce_local(a, on_bool)
    # numpy's ufunc on booleans: add is "or", multiply "and", maximum "or", minimum "and", ...
    np.testing.assert_array_equal(getattr(np, row.ufunc)(a, b).astype(bool), on_bool)


def test_mpidist_reductions_are_the_collectives_names_with_numpys_identities():
    assert wire.REDUCTIONS == ("sum", "mean", "min", "max", "prod")  # collectives' documented op names
    assert wire.REDUCTION_NAMES[:len(wire.REDUCTIONS)] == wire.REDUCTIONS  # fingerprint codes 1..5 unchanged
    stack = np.random.default_rng(9).uniform(-4, 4, (3, 5))  # three ranks' inputs
    numpy_reduction = {"sum": np.sum, "mean": np.mean, "min": np.min, "max": np.max, "prod": np.prod}
    for row in wire.OPS:
        for name in row.names:
            folded = getattr(np, row.ufunc).reduce(stack, axis=0) / (len(stack) if name == "mean" else 1)
            np.testing.assert_allclose(folded, numpy_reduction[name](stack, axis=0), rtol=1e-15)
            assert wire.reduction_name(row.mpi) == row.names[0]


def test_torch_rows_name_torch_dtypes_and_every_reduce_op():
    torch = pytest.importorskip("torch", reason="torch is not installed (optional extra mpidist[torch])")
    for row in wire.DTYPES:
        dtype = getattr(torch, row.name)
        assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{row.name}"
        assert dtype.itemsize == (row.dtype.itemsize if row.dtype is not None else dtype.itemsize)
        if row.dtype is not None and row.dtype != BFLOAT16:  # torch has no numpy view of bfloat16
            assert torch.empty(0, dtype=dtype).numpy().dtype == row.dtype
        if row.reduce_as is not None:  # widening loses nothing
            assert torch.promote_types(dtype, getattr(torch, row.reduce_as)) == getattr(torch, row.reduce_as)
    kinds = [kind for row in wire.OPS for kind, _ in row.torch]
    assert sorted(kinds) == sorted(torch.distributed.ReduceOp.RedOpType.__members__)
    # where a kind runs as an mpidist reduction, it is torch's meaning of that kind
    x = torch.tensor([[1.5, -2.0, 3.0], [0.5, 4.0, -1.0]], dtype=torch.float64)
    torch_meaning = {"SUM": x.sum(0), "AVG": x.mean(0), "PREMUL_SUM": x.sum(0), "PRODUCT": x.prod(0),
                     "MIN": x.min(0).values, "MAX": x.max(0).values}
    mpidist_meaning = {"sum": np.sum, "mean": np.mean, "prod": np.prod, "min": np.min, "max": np.max}
    for row in wire.OPS:
        for kind, name in row.torch:
            if name is not None:
                np.testing.assert_allclose(mpidist_meaning[name](x.numpy(), axis=0), torch_meaning[kind].numpy())
            else:  # bitwise: MPI's op is the same bitwise op torch applies
                a, b = torch.tensor([12, 10, -3]), torch.tensor([10, 6, 5])
                expected = b.numpy().copy()
                row.mpi.Reduce_local(a.numpy(), expected)
                got = {"BAND": a & b, "BOR": a | b, "BXOR": a ^ b}[kind]
                np.testing.assert_array_equal(got.numpy(), expected)


# -- bfloat16 through the collectives: copies move the bits, reductions run in float32 and round once ----------
def bf16_bits(rank, n, seed=0):
    """Return ``n`` bfloat16 values of ``rank`` made of arbitrary bit patterns (NaN payloads, -0, inf, subnormals)."""
    return np.random.default_rng([seed, rank]).integers(0, 2**16, n, dtype=np.uint16).view(BFLOAT16)


def bf16_exact(rank, shape, seed=0):
    """Return bfloat16 values of ``rank`` whose float32 sums over up to 4 ranks are exact (16 bits of range)."""
    rng = np.random.default_rng([seed, rank])
    return (rng.integers(-255, 256, shape) * 2.0 ** rng.integers(-8, 0, shape)).astype(BFLOAT16)


def same_bits(got, want):
    assert got.dtype == want.dtype == BFLOAT16 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_bfloat16_broadcast_allgather_send_alltoall_move_the_bits(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    for root in range(size):
        same_bits(mpidist.broadcast(bf16_bits(rank, 37, seed=root), comm, root=root), bf16_bits(root, 37, seed=root))
    # uneven leading dims (Allgatherv), and into out
    got = mpidist.allgather(bf16_bits(rank, rank + 3).reshape(-1, 1), comm)
    same_bits(got, np.concatenate([bf16_bits(r, r + 3).reshape(-1, 1) for r in range(size)]))
    out = np.empty(5 * size, BFLOAT16)
    assert mpidist.allgather(bf16_bits(rank, 5), comm, out=out) is out
    same_bits(out, np.concatenate([bf16_bits(r, 5) for r in range(size)]))
    handle = mpidist.iallgather(bf16_bits(rank, 4), comm)
    same_bits(handle.wait(), np.concatenate([bf16_bits(r, 4) for r in range(size)]))
    # send/recv: inline (small) and two-message (large) payloads; the receiver learns the dtype from the header
    for n in (9, 9000):
        request = mpidist.isend(bf16_bits(rank, n, seed=n), (rank + 1) % size, comm, tag=11)
        same_bits(mpidist.recv((rank - 1) % size, comm, tag=11), bf16_bits((rank - 1) % size, n, seed=n))
        request.wait()
    got = mpidist.alltoall(bf16_bits(rank, 2 * size).reshape(size, 2), comm)
    same_bits(got, np.stack([bf16_bits(r, 2 * size).reshape(size, 2)[rank] for r in range(size)]))


def test_bfloat16_sum_and_mean_accumulate_in_float32_and_round_once(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [bf16_exact(r, (6, 5)) for r in range(size)]
    wide = np.stack(inputs).astype(np.float32)  # every sum exact in float32: the reference rounds once
    same_bits(mpidist.allreduce(inputs[rank].copy(), comm, op="sum"), wide.sum(0).astype(BFLOAT16))
    same_bits(mpidist.iallreduce(inputs[rank].copy(), comm, op="mean").wait(),
              (wide.sum(0) / np.float32(size)).astype(BFLOAT16))
    rows = collectives.split_sizes(6, size)
    start = sum(rows[:rank])
    same_bits(mpidist.reduce_scatter(inputs[rank], comm, op="sum"), wide.sum(0)[start: start + rows[rank]].astype(BFLOAT16))
    # 256 on rank 0 and 1 on the others: a bfloat16 running sum stays at 256 (256 + 1 rounds to even 256), the
    # float32 sum is 255 + size rounded once: 258 on 3 ranks, 260 on 4 (259 is a tie); 1 or 2 ranks cannot differ
    x = np.full(3, 256.0 if rank == 0 else 1.0, BFLOAT16)
    same_bits(mpidist.allreduce(x, comm), np.full(3, 255.0 + size, np.float32).astype(BFLOAT16))


def test_bfloat16_min_max_are_exact_and_propagate_nan(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [bf16_exact(r, 8, seed=1) for r in range(size)]
    for r, values in enumerate(inputs):
        values[r] = np.nan
    for op, fn in (("min", np.minimum), ("max", np.maximum)):
        want = inputs[0].astype(np.float32)
        for values in inputs[1:]:
            want = fn(want, values.astype(np.float32))
        got = mpidist.allreduce(inputs[rank].copy(), comm, op=op)
        np.testing.assert_array_equal(got.astype(np.float32), want)  # NaN where any rank held one


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BFLOAT16])
def test_float_min_max_of_0d_arrays_are_numpy_over_the_ranks(comm, dtype):
    """A 0-d float min/max went through the order keys as a numpy scalar and raised TypeError (item assignment)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    values = [np.array(v, dtype) for v in (1.5, -2.25, np.inf, -0.0)[:size]]
    for op, fn in (("min", np.minimum), ("max", np.maximum)):
        want = values[0]
        for value in values[1:]:
            want = fn(want, value)
        got = mpidist.allreduce(values[rank].copy(), comm, op=op)
        assert got.shape == () and got.dtype == np.dtype(dtype), (got.shape, got.dtype)
        assert got.tobytes() == np.asarray(want, dtype).tobytes(), (op, got, want)


def test_bfloat16_reductions_name_float32_and_refuse_nothing_of_floats():
    for op in ("sum", "mean", "prod"):
        reduction = wire.resolve("allreduce", op, BFLOAT16)
        assert reduction.converts and reduction.wire == np.dtype(np.float32)
    for op in ("min", "max"):
        assert wire.resolve("allreduce", op, BFLOAT16).wire == np.dtype(np.int16)
    assert wire.copy_view(np.zeros(2, BFLOAT16)).dtype == np.dtype(np.uint16)
    assert BFLOAT16 in wire.FLOATING and wire.reduce_dtype("bfloat16") == "float32"
