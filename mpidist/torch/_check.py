"""Desync checks for the torch backend: ranks compare each call before it moves data (debug mode).

The fingerprint is the native collectives' (``mpidist.guard.fingerprint``): (call number, op, dtype,
element count, shape, root, reduction) of one call on one group, with the shape left out (torch reduces
tensors of equal element counts, whatever their shapes) and, for operations whose sizes may differ by rank
(gathers, all-to-all), the count too. Checks talk on a private duplicate of the group communicator, so
that a check can never be matched with another rank's data.

When: on every call when the guard's desync checks are on (``MPIDIST_DEBUG=1``, or
``mpidist.guard.configure(desync=True)``); every rank reads the same setting, so all ranks check or none
do. Then ranks that disagree (another op, dtype, size, root or reduction) raise ``DesyncError`` on every
rank, naming each rank's call, instead of hanging or computing garbage. Off by default: a check is one
more small allgather per call; allreduce, broadcast and allgather-into-tensor still get
``mpidist.collectives``' own guard, which checks large messages always.
"""

import numpy as np

from .. import guard
from ..guard import DesyncError, fingerprint
from ..wire import DTYPE_BY_NAME
from ._tensors import dtype_name

__all__ = ["agree", "enabled", "forget"]

_state = {}  # id(comm) -> [comm, check communicator, calls]


def enabled():
    """Return whether every call is checked (the guard's desync setting)."""
    return bool(guard.settings.desync)


def agree(comm, op, tensors, reduction=None, root=-1, rows=False):
    """Raise DesyncError on every rank unless all ranks of ``comm`` make this same call (when enabled).

    ``reduction``: a ``ReduceOp.RedOpType``; ``rows``: ranks may pass different sizes (the count is left out).
    """
    if not guard.settings.desync:
        return
    state = _state.get(id(comm))
    if state is None or state[0] is not comm:
        state = _state[id(comm)] = [comm, comm.Dup(), 0]
    state[2] += 1
    t = tensors[0] if tensors else None
    row = DTYPE_BY_NAME.get(dtype_name(t.dtype)) if t is not None else None
    count = -1 if rows or t is None else sum(x.numel() for x in tensors)
    name = "" if reduction is None else str(reduction).split(".")[-1].lower()  # as wire.REDUCTION_NAMES
    mine = np.array(fingerprint.fingerprint(state[2], op.replace("_coalesced", ""), -1 if row is None else row.code,
                                            count, None, int(root), name), dtype=np.int64)
    every = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    state[1].Allgather(mine, every)
    if (every == every[0]).all():
        return
    raise DesyncError(fingerprint.mismatch_message(f"the mpidist torch group of {comm.Get_size()} ranks", every))


def forget(comm):
    """Free the check communicator of ``comm`` (its group ended)."""
    state = _state.pop(id(comm), None)
    if state is not None and state[0] is comm:
        state[1].Free()
