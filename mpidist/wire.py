"""What MPI carries for an array: its bytes in a copy, and the dtype and op it reduces.

The one table of dtypes (``DTYPES``: wire code, numpy dtype, copy dtype, staged reduce dtype, NCCL type) and
the one table of reduction ops (``OPS``: MPI op, device ufunc, boolean op, NCCL op, mpidist's and torch's
names) live here; the collectives, the GPU paths, the torch backend and the guard's fingerprints read them.

The host collectives (``mpidist.collectives``) and the GPU paths (``mpidist.gpu``) both ask this module, so a
reduction gives one result on every path, on every MPI and on SimComm, whichever rank holds which value:

- The 16-bit floats, float16 and bfloat16 (``ml_dtypes.bfloat16``, mixed precision's dtype on numpy), are
  carried by copies (broadcast, allgather, send/recv, alltoall) as their uint16 bit patterns: exact whatever the
  bits, and MPI 3.1 has neither type (Open MPI 4.1's mpi4py raises ``KeyError: 'e'`` on a float16 buffer; a
  bfloat16 buffer has no buffer-protocol format at all). Callers pass the 16-bit array as it is.
- Their ``sum``, ``mean`` and ``prod`` accumulate in float32 (``reduce_as``) and round to the 16-bit dtype once,
  at the end: float16 partial sums overflow where the result fits (the mean of 60000 and 60000 was inf through
  MPICH's float16), and a bfloat16 running sum drops small addends (256 + 1 is 256). ``min``/``max`` reduce
  order keys (below), exact.
- NaN propagates through ``max`` and ``min``, as in numpy's ``maximum`` and ``minimum``. MPI leaves NaN
  unspecified, and MPICH's MAX returns NaN or not depending on which rank holds it, and different results on
  different ranks of one Allreduce (MPICH 5.0.2, 2 and 4 ranks). So floats reduce as order keys: their bits as
  signed integers that order as the floats do, with every NaN beyond both infinities; MPI reduces integers
  exactly and alike everywhere. A NaN result is numpy's positive quiet NaN whatever NaN went in.

``to_wire``/``from_wire`` use array operators only, so the same functions run on numpy and CuPy arrays.
"""

import dataclasses
from typing import Optional, Tuple

import ml_dtypes
import numpy as np
from mpi4py import MPI

__all__ = ["DtypeRow", "BFLOAT16", "FLOATING", "DTYPES", "DTYPE_BY_NAME", "DTYPE_CODES", "SUPPORTED_DTYPES", "OpRow", "OPS", "OP_BY_NAME",
           "REDUCTIONS", "REDUCTION_NAMES", "Reduction", "resolve", "reduction_name", "reduce_dtype", "nccl_type",
           "copy_view", "copy_dtype"]


@dataclasses.dataclass(frozen=True)
class DtypeRow:
    """One dtype mpidist moves: its code on the wire, and how copies, reductions and NCCL carry it."""

    code: int                  # index in DTYPES: send/recv headers and desync fingerprints name the dtype by it
    name: str                  # numpy's name, and torch's (``torch.<name>``)
    dtype: Optional[np.dtype]  # None: torch only (numpy has no such dtype); such tensors move as bytes
    copy: Optional[np.dtype]   # what a copy carries: 16-bit floats as uint16 (see above), else ``dtype``
    reduce_as: Optional[str]   # what a staged reduction computes in: float32 for 16-bit floats; None: not reducible
    nccl: Optional[str]        # cupy.cuda.nccl's type constant; None: NCCL has no such type


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # numpy has none; its kind is "V", so floating is asked of FLOATING
_COPIED_AS_BITS = ("float16", "bfloat16")  # MPI 3.1 has no 16-bit float datatype


def _dtype_rows(*specs):
    rows = []
    for code, (name, numpy, reduce_as, nccl) in enumerate(specs):
        dtype = (BFLOAT16 if name == "bfloat16" else np.dtype(name)) if numpy else None
        copy = np.dtype(np.uint16) if name in _COPIED_AS_BITS else dtype
        rows.append(DtypeRow(code, name, dtype, copy, reduce_as, nccl))
    return tuple(rows)


# The one table of dtypes. The order of the codes is part of the send/recv protocol: append, never reorder.
DTYPES = _dtype_rows(
    # name       numpy  reduce_as     nccl
    ("float16", True, "float32", "NCCL_FLOAT16"),
    ("float32", True, "float32", "NCCL_FLOAT32"),
    ("float64", True, "float64", "NCCL_FLOAT64"),
    ("int8", True, "int8", "NCCL_INT8"),
    ("int16", True, "int16", None),
    ("int32", True, "int32", "NCCL_INT32"),
    ("int64", True, "int64", "NCCL_INT64"),
    ("uint8", True, "uint8", "NCCL_UINT8"),
    ("uint16", True, "uint16", None),
    ("uint32", True, "uint32", "NCCL_UINT32"),
    ("uint64", True, "uint64", "NCCL_UINT64"),
    ("bool", True, "bool", None),
    ("complex64", True, "complex64", None),
    ("complex128", True, "complex128", None),
    ("bfloat16", True, "float32", None),    # ml_dtypes' on numpy; NCCL_BFLOAT16 needs arrays CuPy lacks
    ("complex32", False, None, None),       # torch only; torch itself reduces it nowhere on CPU
)
DTYPE_BY_NAME = {row.name: row for row in DTYPES}
DTYPE_CODES = {row.dtype: row.code for row in DTYPES if row.dtype is not None}  # numpy dtype -> code
SUPPORTED_DTYPES = tuple(row.dtype for row in DTYPES if row.dtype is not None)  # what the collectives take
# The real floating dtypes: what ``mean`` and the float min/max order keys take (numpy calls bfloat16 kind "V").
FLOATING = frozenset(dt for dt in SUPPORTED_DTYPES if dt.kind == "f" or dt == BFLOAT16)


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One MPI reduction op, and every name it goes by: mpidist's, torch's, the device ufunc's and NCCL's."""

    mpi_name: str                                 # MPI.<mpi_name>
    ufunc: str                                    # the numpy/CuPy ufunc a device reduction applies
    on_bool: str                                  # the op (mpi_name) meaning the same on booleans
    nccl: Optional[str]                           # cupy.cuda.nccl's op constant; None: NCCL has none
    names: Tuple[str, ...] = ()                   # mpidist reductions (the collectives' op names) it carries
    torch: Tuple[Tuple[str, Optional[str]], ...] = ()  # (ReduceOp.RedOpType name, the mpidist reduction it
    #                                                    runs as, or None: the torch backend calls MPI with it)

    @property
    def mpi(self):
        """Return the mpi4py op."""
        return getattr(MPI, self.mpi_name)


# The one table of reduction ops: every op the collectives, the GPU paths and the torch backend hand to MPI,
# a device reduction or NCCL. MPI defines no SUM/PROD/MIN/MAX on C_BOOL: booleans reduce with ``on_bool``.
OPS = (
    OpRow("SUM", "add", "LOR", "NCCL_SUM", ("sum", "mean"), (("SUM", "sum"), ("AVG", "mean"), ("PREMUL_SUM", "sum"))),
    OpRow("MIN", "minimum", "LAND", "NCCL_MIN", ("min",), (("MIN", "min"),)),
    OpRow("MAX", "maximum", "LOR", "NCCL_MAX", ("max",), (("MAX", "max"),)),
    OpRow("PROD", "multiply", "LAND", "NCCL_PROD", ("prod",), (("PRODUCT", "prod"),)),
    OpRow("LOR", "logical_or", "LOR", None),
    OpRow("LAND", "logical_and", "LAND", None),
    OpRow("LXOR", "logical_xor", "LXOR", None),
    OpRow("BAND", "bitwise_and", "LAND", None, (), (("BAND", None),)),
    OpRow("BOR", "bitwise_or", "LOR", None, (), (("BOR", None),)),
    OpRow("BXOR", "bitwise_xor", "LXOR", None, (), (("BXOR", None),)),
)
OP_BY_NAME = {row.mpi_name: row for row in OPS}
# mpidist's reduction names, in the order the desync fingerprint encodes them (1-based).
REDUCTIONS = tuple(name for row in OPS for name in row.names)
# Every name a reduction is fingerprinted by: mpidist's, then torch's kinds (lower case) that differ.
REDUCTION_NAMES = REDUCTIONS + tuple(dict.fromkeys(
    kind.lower() for row in OPS for kind, _ in row.torch if kind.lower() not in REDUCTIONS))
_BY_NAME = {name: row for row in OPS for name in row.names}
_ACCEPTED = f"{', '.join(REDUCTIONS)}); mpi4py's MPI.SUM, MPI.PROD, MPI.MIN and MPI.MAX work too"
# MPI's other predefined ops, to name an op mpidist has no reduction for
_OTHER_MPI_OPS = ("MAXLOC", "MINLOC", "REPLACE", "NO_OP", "OP_NULL")

_COPY_AS = {row.dtype: row.copy for row in DTYPES if row.dtype is not None and row.copy != row.dtype}
# Dtypes whose sum/mean/prod MPI cannot (or must not) compute as they are: the 16-bit floats, staged in float32.
_STAGED = {row.dtype: np.dtype(row.reduce_as) for row in DTYPES if row.dtype is not None and row.reduce_as is not None
           and row.reduce_as != row.name}


def reduce_dtype(name):
    """Return the name of the dtype a staged reduction of dtype ``name`` computes in, or None if none can."""
    row = DTYPE_BY_NAME.get(name)
    return None if row is None else row.reduce_as


def nccl_type(dtype):
    """Return cupy.cuda.nccl's type constant name for numpy ``dtype``, or None if NCCL has no such type."""
    row = DTYPE_BY_NAME.get(dtype.name)
    return None if row is None else row.nccl


def copy_dtype(dtype):
    """Return the dtype MPI carries ``dtype`` as in a copy: uint16 for float16 and bfloat16, else ``dtype``."""
    return _COPY_AS.get(dtype, dtype)


def copy_view(buf):
    """Return host or device buffer ``buf`` as MPI should carry it in a copy: 16-bit floats as uint16, else itself."""
    kind = _COPY_AS.get(buf.dtype)
    return buf if kind is None else buf.view(kind)


def _op_row(op):
    for row in OPS:
        if op == row.mpi:
            return row
    return None


def reduction_name(op):
    """Return mpidist's name (sum, mean, min, max, prod) for ``op``, a name or an mpi4py op, or None if it has none."""
    if isinstance(op, str):
        op = op.lower()
        return op if op in REDUCTIONS else None
    if isinstance(op, MPI.Op):
        row = _op_row(op)
        return row.mpi_name.lower() if row is not None and row.mpi_name.lower() in _BY_NAME else None
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Reduction:
    """A reduction of one dtype as MPI runs it: the op MPI applies, to which dtype, and the way there and back.

    ``wire`` is the dtype MPI reduces: ``dtype`` itself, float32 for float16/bfloat16 sum/mean/prod, or signed integers
    of the float's width for float min/max (order keys). When it differs (``converts``), callers fill a
    buffer of ``wire`` with ``to_wire``, reduce it with ``mpi`` (dividing by the size there for ``mean``) and
    bring the result back with ``from_wire``, which rounds once.
    """

    name: str        # mpidist's name: sum, mean, min, max, prod
    dtype: np.dtype  # the caller's
    mpi: object      # the MPI op applied to ``wire``
    mpi_name: str    # its row in OPS (device reductions and NCCL look ops up by it)
    mean: bool       # divide by the communicator's size after reducing, in ``wire``
    wire: np.dtype

    @property
    def converts(self):
        """Whether MPI reduces a converted copy (``wire`` differs from ``dtype``)."""
        return self.wire != self.dtype

    def to_wire(self, dst, src):
        """Fill ``dst`` (dtype ``wire``) with what MPI reduces for ``src`` (dtype ``dtype``, same shape)."""
        if self.wire.kind == "f":
            dst[...] = src
            return
        ints = src.view(self.wire)
        nan = src != src  # before writing: dst may share src's memory
        shift, magnitude = self.wire.type(self.wire.itemsize * 8 - 1), self.wire.type(np.iinfo(self.wire).max)
        # Negative floats have the sign bit set and order backwards by magnitude: flipping their other bits
        # makes signed-integer order the float order (-inf < ... < -0.0 < +0.0 < ... < +inf).
        dst[...] = ints ^ ((ints >> shift) & magnitude)
        if self.mpi_name == "MAX":  # the NaN key wins: the greatest key for max, the least for min
            dst[nan] = magnitude
        else:
            dst[nan] = self.wire.type(np.iinfo(self.wire).min)

    def from_wire(self, dst, src):
        """Write the reduced ``src`` (dtype ``wire``) into ``dst`` (dtype ``dtype``, same shape), rounding once."""
        if self.wire.kind == "f":
            with np.errstate(over="ignore"):  # a float16 result past 65504 is inf, as a float16 sum would be
                dst[...] = src
            return
        shift, magnitude = self.wire.type(self.wire.itemsize * 8 - 1), self.wire.type(np.iinfo(self.wire).max)
        # The key map is its own inverse. asarray: on a 0-d src numpy's operators return a scalar, not an array.
        ints = np.asarray(src ^ ((src >> shift) & magnitude))
        ints[src == self.wire.type(np.iinfo(self.wire).min)] = magnitude  # min's NaN key -> a positive NaN
        dst.view(self.wire)[...] = ints


def resolve(fn, op, dtype):
    """Return the ``Reduction`` of op (a name or an mpi4py op) on ``dtype``, or raise naming the problem for ``fn``."""
    name = reduction_name(op)
    if name is None:
        if isinstance(op, MPI.Op):
            predefined = tuple(row.mpi_name for row in OPS) + _OTHER_MPI_OPS
            shown = next((f"op MPI.{a}" for a in predefined if op == getattr(MPI, a)), "a user-defined MPI.Op")
            raise ValueError(f"{fn}: {shown} has no mpidist reduction (expected one of {_ACCEPTED}")
        raise ValueError(f"{fn}: unknown op {op!r} (expected one of {_ACCEPTED}")
    if dtype.kind == "b":
        if name == "mean":
            raise TypeError(f"{fn}: op 'mean' needs a floating or complex array (got {dtype})")
        row = OP_BY_NAME[_BY_NAME[name].on_bool]
        return Reduction(name, dtype, row.mpi, row.mpi_name, False, dtype)
    if name == "mean" and dtype not in FLOATING and dtype.kind != "c":
        raise TypeError(f"{fn}: op 'mean' needs a floating or complex array (got {dtype}); use 'sum' and divide")
    if name in ("min", "max") and dtype.kind == "c":
        raise TypeError(f"{fn}: op {name!r} is not defined for complex arrays (got {dtype})")
    row = _BY_NAME[name]
    if dtype in FLOATING and name in ("min", "max"):
        wire = np.dtype(f"i{dtype.itemsize}")
    else:
        wire = _STAGED.get(dtype, dtype)
    return Reduction(name, dtype, row.mpi, row.mpi_name, name == "mean", wire)
