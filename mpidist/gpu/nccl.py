"""NCCL through ``cupy.cuda.nccl``: every rank has its own GPU.

NCCL kernels run on the current stream, so they are ordered after the producer's kernels and
before the caller's next ones without any host synchronization. NCCL has no bool, int16/uint16 or
complex types: bool reduces as uint8 (max for "or", min for "and"), complex sums as pairs of floats,
and everything else it cannot do (int16, complex products) goes to the staged path. Uneven
allgather/reduce_scatter counts are padded to the largest count. Point-to-point stays on MPI
(its tag matching has no NCCL equivalent).
"""

import numpy as np

from ..partition import displacements
from ..wire import OP_BY_NAME, nccl_type
from .base import Path

__all__ = ["NcclPath"]

# bool as uint8 (0 or 1): "or" is max and "and" is min.
_UINT8_FOR_LOGICAL = {"LOR": "MAX", "LAND": "MIN"}


def nccl_view(x, op_name):
    """Return ``(view, nccl op name)`` to reduce ``x`` with NCCL, or None when NCCL cannot."""
    if x.dtype == np.bool_:
        return x.view(np.uint8), _UINT8_FOR_LOGICAL[OP_BY_NAME[op_name].on_bool]
    if x.dtype.kind == "c":
        return (x.view(np.dtype(f"f{x.dtype.itemsize // 2}")), "SUM") if op_name == "SUM" else None
    return (x, op_name) if nccl_type(x.dtype) is not None else None


class NcclPath(Path):
    """Collectives as NCCL kernels on the current stream."""

    name = "nccl"

    def __init__(self, comm, device, settings=None):
        super().__init__(comm, device, settings)
        unique_id = device.nccl_unique_id() if self.rank == 0 else None
        self.nccl = device.nccl_comm(comm, comm.bcast(unique_id, root=0))

    def allreduce(self, x, op):
        plan = nccl_view(x, op.name)
        if plan is None:
            return self.staged.allreduce(x, op)
        view, name = plan
        self.nccl.allreduce(view, view, name, self.device.current_stream())
        if op.mean:
            self.device.divide(x, self.size)

    def bcast(self, x, root):
        self.nccl.bcast(x.view(np.uint8), root, self.device.current_stream())

    def allgather(self, send, recv, counts):
        d, stream = self.device, self.device.current_stream()
        if len(set(counts)) == 1:
            return self.nccl.allgather(send.view(np.uint8), recv.view(np.uint8), stream)
        m = max(counts)
        pad_send, pad_recv = d.empty(m, send.dtype), d.empty(m * self.size, send.dtype)
        d.copy(pad_send[: send.size], send)
        self.nccl.allgather(pad_send.view(np.uint8), pad_recv.view(np.uint8), stream)
        for r, (c, lo) in enumerate(zip(counts, displacements(counts))):
            d.copy(recv[lo: lo + c], pad_recv[r * m: r * m + c])

    def reduce_scatter(self, send, recv, counts, op):
        if nccl_view(send, op.name) is None:
            return self.staged.reduce_scatter(send, recv, counts, op)
        d, stream = self.device, self.device.current_stream()
        if len(set(counts)) == 1:
            (sv, name), (rv, _) = nccl_view(send, op.name), nccl_view(recv, op.name)
            self.nccl.reduce_scatter(sv, rv, name, stream)
        else:
            m = max(counts)
            padded, mine = d.empty(m * self.size, send.dtype), d.empty(m, send.dtype)
            for r, (c, lo) in enumerate(zip(counts, displacements(counts))):
                d.copy(padded[r * m: r * m + c], send[lo: lo + c])
            (pv, name), (mv, _) = nccl_view(padded, op.name), nccl_view(mine, op.name)
            self.nccl.reduce_scatter(pv, mv, name, stream)  # padding is reduced too, then dropped
            d.copy(recv, mine[: recv.size])
        if op.mean:
            d.divide(recv, self.size)
