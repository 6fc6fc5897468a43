"""Desync checks for the torch backend: ranks compare each call before it moves data (debug mode).

Glossary:
- fingerprint: (call number, op, dtype, element count, root, reduction) of one call on one group.
  Operations whose sizes may differ by rank (gathers, all-to-all) leave the count out.
- check communicator: a private duplicate of the group communicator the check talks on, so that a
  check can never be matched with another rank's data.

When: on every call when the guard's desync checks are on (``MPIDIST_DEBUG=1``, or
``mpidist.guard.configure(desync=True)``); every rank reads the same setting, so all ranks check or none
do. Then ranks that disagree (another op, dtype, size, root or reduction) raise ``DesyncError`` on every
rank, naming each rank's call, instead of hanging or computing garbage. Off by default: a check is one
more small allgather per call; allreduce, broadcast and allgather-into-tensor still get
``mpidist.collectives``' own guard, which checks large messages always.
"""

import numpy as np
import torch
from mpi4py import MPI

from .. import guard
from ..guard import DesyncError

__all__ = ["agree", "enabled", "forget"]

_OPS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single", "broadcast",
        "all_gather_single", "allgather", "allgather_coalesced", "gather", "scatter", "all_to_all_single",
        "alltoall", "barrier")
_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
           torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
           torch.complex128, torch.complex32)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_state = {}  # id(comm) -> [comm, check communicator, calls]


def enabled():
    """Return whether every call is checked (the guard's desync setting)."""
    return bool(guard.settings.desync)


def agree(comm, op, tensors, reduction=None, root=-1, rows=False):
    """Raise DesyncError on every rank unless all ranks of ``comm`` make this same call (when enabled)."""
    if not guard.settings.desync:
        return
    state = _state.get(id(comm))
    if state is None or state[0] is not comm:
        state = _state[id(comm)] = [comm, comm.Dup(), 0]
    state[2] += 1
    t = tensors[0] if tensors else None
    mine = np.array([state[2], _OPS.index(op.replace("_coalesced", "")) if op.replace("_coalesced", "") in _OPS else len(_OPS),
                     _DTYPE_CODE.get(t.dtype, len(_DTYPES)) if t is not None else 0,
                     -1 if rows or t is None else sum(x.numel() for x in tensors), int(root),
                     -1 if reduction is None else int(reduction)], dtype=np.int64)
    every = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    state[1].Allgather(mine, every)
    if (every == every[0]).all():
        return
    calls = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(every))
    raise DesyncError(f"mpidist torch backend: ranks of a group of {comm.Get_size()} disagree at call #{state[2]} ({calls})")


def forget(comm):
    """Free the check communicator of ``comm`` (its group ended)."""
    state = _state.pop(id(comm), None)
    if state is not None and state[0] is comm:
        state[1].Free()


def _describe(row):
    _, op, dtype, count, root, reduction = (int(v) for v in row)
    name = _OPS[op] if op < len(_OPS) else "?"
    parts = [name]
    if dtype:
        parts.append(str(_DTYPES[dtype]).replace("torch.", "") if dtype < len(_DTYPES) else "other dtype")
    if count >= 0:
        parts.append(f"{count} elements")
    if root >= 0:
        parts.append(f"root {root}")
    if reduction >= 0:
        parts.append(str(torch.distributed.ReduceOp.RedOpType(reduction)).split(".")[-1])
    return " ".join(parts)
