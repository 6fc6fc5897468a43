"""What MPI carries for an array: its bytes in a copy, and the dtype and op it reduces.

The host collectives (``mpidist.collectives``) and the GPU paths (``mpidist.gpu``) both ask this module, so a
reduction gives one result on every path, on every MPI and on SimComm, whichever rank holds which value:

- Copies (broadcast, allgather, send/recv) carry float16 as its uint16 bit patterns: exact whatever the bits,
  and MPI 3.1 has no float16 datatype (Open MPI 4.1's mpi4py raises ``KeyError: 'e'`` on such a buffer).
- float16 ``sum``, ``mean`` and ``prod`` accumulate in float32 and round to float16 once, at the end: float16
  partial sums overflow where the result fits (the mean of 60000 and 60000 was inf through MPICH's float16).
- NaN propagates through ``max`` and ``min``, as in numpy's ``maximum`` and ``minimum``. MPI leaves NaN
  unspecified, and MPICH's MAX returns NaN or not depending on which rank holds it, and different results on
  different ranks of one Allreduce (MPICH 5.0.2, 2 and 4 ranks). So floats reduce as order keys: their bits as
  signed integers that order as the floats do, with every NaN beyond both infinities; MPI reduces integers
  exactly and alike everywhere. A NaN result is numpy's positive quiet NaN whatever NaN went in.

``to_wire``/``from_wire`` use array operators only, so the same functions run on numpy and CuPy arrays.
"""

import dataclasses

import numpy as np
from mpi4py import MPI

from .partition import REDUCTIONS

__all__ = ["Reduction", "resolve", "reduction_name", "copy_view", "copy_dtype", "MPI_OP_NAMES"]

# The one table of MPI reduction ops: every op the collectives and the GPU paths hand to MPI (or to a device
# reduction, or to NCCL, which look ops up by these names). The first four are also mpidist's own op names.
MPI_OP_NAMES = ((MPI.SUM, "SUM"), (MPI.PROD, "PROD"), (MPI.MIN, "MIN"), (MPI.MAX, "MAX"),
                (MPI.LOR, "LOR"), (MPI.LAND, "LAND"))
_BY_NAME = {"sum": MPI.SUM, "mean": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
# MPI defines no SUM/PROD/MIN/MAX on C_BOOL; the logical ops mean the same thing for booleans.
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "prod": MPI.LAND, "min": MPI.LAND}
_ACCEPTED = f"{', '.join(REDUCTIONS)}); mpi4py's MPI.SUM, MPI.PROD, MPI.MIN and MPI.MAX work too"
_PREDEFINED = ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "MAXLOC", "MINLOC",
               "REPLACE", "NO_OP", "OP_NULL")  # to name an op mpidist has no reduction for

_FLOAT16 = np.dtype(np.float16)
_FLOAT32 = np.dtype(np.float32)
_COPY_AS = {_FLOAT16: np.dtype(np.uint16)}


def copy_dtype(dtype):
    """Return the dtype MPI carries ``dtype`` as in a copy: uint16 for float16, else ``dtype`` itself."""
    return _COPY_AS.get(dtype, dtype)


def copy_view(buf):
    """Return host or device buffer ``buf`` as MPI should carry it in a copy: float16 as uint16, else itself."""
    kind = _COPY_AS.get(buf.dtype)
    return buf if kind is None else buf.view(kind)


def _mpi_op_name(op):
    for candidate, name in MPI_OP_NAMES:
        if op == candidate:
            return name
    return None


def reduction_name(op):
    """Return mpidist's name (sum, mean, min, max, prod) for ``op``, a name or an mpi4py op, or None if it has none."""
    if isinstance(op, str):
        op = op.lower()
        return op if op in REDUCTIONS else None
    if isinstance(op, MPI.Op):
        name = _mpi_op_name(op)
        return name.lower() if name is not None and name.lower() in _BY_NAME else None
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Reduction:
    """A reduction of one dtype as MPI runs it: the op MPI applies, to which dtype, and the way there and back.

    ``wire`` is the dtype MPI reduces: ``dtype`` itself, float32 for float16 sum/mean/prod, or signed integers
    of the float's width for float min/max (order keys). When it differs (``converts``), callers fill a
    buffer of ``wire`` with ``to_wire``, reduce it with ``mpi`` (dividing by the size there for ``mean``) and
    bring the result back with ``from_wire``, which rounds once.
    """

    name: str        # mpidist's name: sum, mean, min, max, prod
    dtype: np.dtype  # the caller's
    mpi: object      # the MPI op applied to ``wire``
    mpi_name: str    # its name in MPI_OP_NAMES (device reductions and NCCL look ops up by it)
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
        ints = src ^ ((src >> shift) & magnitude)  # the key map is its own inverse
        ints[src == self.wire.type(np.iinfo(self.wire).min)] = magnitude  # min's NaN key -> a positive NaN
        dst.view(self.wire)[...] = ints


def resolve(fn, op, dtype):
    """Return the ``Reduction`` of op (a name or an mpi4py op) on ``dtype``, or raise naming the problem for ``fn``."""
    name = reduction_name(op)
    if name is None:
        if isinstance(op, MPI.Op):
            shown = next((f"op MPI.{a}" for a in _PREDEFINED if op == getattr(MPI, a)), "a user-defined MPI.Op")
            raise ValueError(f"{fn}: {shown} has no mpidist reduction (expected one of {_ACCEPTED}")
        raise ValueError(f"{fn}: unknown op {op!r} (expected one of {_ACCEPTED}")
    if dtype.kind == "b":
        if name == "mean":
            raise TypeError(f"{fn}: op 'mean' needs a floating or complex array (got {dtype})")
        mpi = _BOOL_OPS[name]
        return Reduction(name, dtype, mpi, _mpi_op_name(mpi), False, dtype)
    if name == "mean" and dtype.kind not in "fc":
        raise TypeError(f"{fn}: op 'mean' needs a floating or complex array (got {dtype}); use 'sum' and divide")
    if name in ("min", "max") and dtype.kind == "c":
        raise TypeError(f"{fn}: op {name!r} is not defined for complex arrays (got {dtype})")
    mpi = _BY_NAME[name]
    if dtype.kind == "f" and name in ("min", "max"):
        wire = np.dtype(f"i{dtype.itemsize}")
    elif dtype == _FLOAT16:
        wire = _FLOAT32
    else:
        wire = dtype
    return Reduction(name, dtype, mpi, _mpi_op_name(mpi), name == "mean", wire)
