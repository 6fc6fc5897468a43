"""Reduction operations: every predefined ``MPI.Op`` and ``MPI.Op.Create`` ops, applied by the MPI library.

Buffers are reduced with ``Op.Reduce_local`` on the real datatype, so MAXLOC on pair types, logical ops on
integers, user functions and MPI's type checks behave exactly as under mpiexec; the simulator only decides
the order: MPI's canonical a0 op a1 op ... op a(n-1), which non-commutative ops rely on.
"""

import numpy as np
from mpi4py import MPI

from .errors import mpi_error
from .spec import Msg

__all__ = ["op_name", "reduce_packed", "scan_packed", "reduce_objects"]

_NAMES = {}
for _name in ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR", "MAXLOC", "MINLOC",
              "REPLACE", "NO_OP"):
    _NAMES[getattr(MPI, _name).handle] = _name


def op_name(op):
    """Name of a predefined op (``SUM``...), or ``user-op`` for one made by ``Op.Create``."""
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op: expecting an MPI.Op, got {type(op).__name__} ({op!r:.40})")
    if op == MPI.OP_NULL:
        raise mpi_error(MPI.ERR_OP, "op: MPI.OP_NULL is not a reduction")
    return _NAMES.get(op.handle, "user-op")  # each rank creates its own: handles differ


def _layout(packed, dt, tm, count):
    """Return (layout bytes, msg) so that Reduce_local can run on ``dt`` itself."""
    if tm.contiguous:
        return packed, None
    scratch = np.zeros(count * tm.extent, np.uint8)
    msg = Msg(scratch, dt, [count], [-tm.lb])
    msg.unpack(packed)
    return scratch, msg


def _apply(op, a, acc, dt, count):
    """acc := a op acc (MPI's in/inout order)."""
    if op == MPI.REPLACE:
        acc[...] = a
    elif op != MPI.NO_OP:
        op.Reduce_local([a, count, dt], [acc, count, dt])


def reduce_packed(parts, op, dt, tm, count):
    """Reduce packed messages (rank order) and return the packed result."""
    layouts = [_layout(p, dt, tm, count) for p in parts]
    acc = layouts[-1][0].copy()
    for data, _ in reversed(layouts[:-1]):
        _apply(op, data, acc, dt, count)
    msg = layouts[0][1]
    if msg is None:
        return acc
    return Msg(acc, dt, [count], [-tm.lb]).pack()


def scan_packed(parts, op, dt, tm, count):
    """Return the inclusive prefix reductions (packed, rank order)."""
    layouts = [_layout(p, dt, tm, count)[0].copy() for p in parts]
    for r in range(1, len(layouts)):
        _apply(op, layouts[r - 1], layouts[r], dt, count)
    if tm.contiguous:
        return layouts
    return [Msg(x, dt, [count], [-tm.lb]).pack() for x in layouts]


def reduce_objects(objs, op):
    """Fold Python objects in rank order with the op's Python meaning (``MPI.SUM(a, b)`` is ``a + b``)."""
    acc = objs[0]
    for obj in objs[1:]:
        acc = op(acc, obj)
    return acc
