"""CUDA-aware MPI: device buffers go straight to MPI.

Chosen only when the MPI library says it supports CUDA *and* a device-buffer self-test returned
the right values (or MPIDIST_CUDA_AWARE=1 says so). On any other MPI a device pointer is read as a
host pointer: a segfault, which no exception handler can catch.
"""

from mpi4py import MPI

from ..partition import displacements
from .base import Path, wire

__all__ = ["DirectPath"]


class DirectPath(Path):
    """Collectives on device buffers handed to a CUDA-aware MPI."""

    name = "cuda_aware"

    def _ready(self, *arrays):
        # MPI knows nothing of streams: the producer's kernels must be done before it reads.
        self.device.synchronize(self.device.current_stream())
        return [self.device.mpi_buffer(a) for a in arrays]

    def allreduce(self, x, op):
        (buf,) = self._ready(x)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=op.mpi)
        if op.mean:
            self.device.divide(x, self.size)

    def bcast(self, x, root):
        (buf,) = self._ready(wire(x))
        self.comm.Bcast(buf, root=root)

    def allgather(self, send, recv, counts):
        sbuf, rbuf = self._ready(wire(send), wire(recv))
        if len(set(counts)) == 1:
            self.comm.Allgather(sbuf, rbuf)
        else:
            self.comm.Allgatherv(sbuf, [rbuf, (list(counts), displacements(counts))])

    def reduce_scatter(self, send, recv, counts, op):
        sbuf, rbuf = self._ready(send, recv)
        if len(set(counts)) == 1:
            self.comm.Reduce_scatter_block(sbuf, rbuf, op=op.mpi)
        else:
            self.comm.Reduce_scatter(sbuf, rbuf, list(counts), op=op.mpi)
        if op.mean:
            self.device.divide(recv, self.size)

    def isend(self, x, dest, tag):
        (buf,) = self._ready(x)
        return [self.comm.Isend(buf, dest, tag)], (x,)
