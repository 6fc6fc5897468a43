"""Pinned host staging: the path that works with any MPI.

Allreduce and broadcast are cut into chunks and pipelined over two copy streams: while MPI works on
chunk k in host memory, the copy down (D2H) of chunk k+1 and the copy up (H2D) of chunk k-1 run on
the GPU. The other ops move their buffers in one piece (their MPI calls take different counts per
rank, so there is no common chunking).

Ordering rules, in the order they happen:
1. the current (producing) stream is synchronized before the first copy reads the device buffer;
2. MPI touches host chunk k only after the event recorded after its D2H copy has completed;
3. the current stream waits (on the device) for the last H2D copy, so results are ready on it;
4. a pinned buffer is reused only after the previous call's H2D copies out of it have completed.
"""

from mpi4py import MPI

from ..partition import displacements
from .base import Path, wire

__all__ = ["StagedPath", "StagingPool", "chunk_bounds"]


def chunk_bounds(n, itemsize, chunk_bytes):
    """Return ``[(lo, hi), ...]`` element ranges of at most ``chunk_bytes`` covering ``n`` elements."""
    step = max(1, chunk_bytes // itemsize)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)] or [(0, 0)]


class StagingPool:
    """Pinned host buffers of one communicator: one per (dtype, slot), grown to the largest request, reused."""

    def __init__(self, device):
        self.device = device
        self.buffers = {}
        self.pending = {}   # (dtype, slot) -> event after which copies out of the buffer are done
        self.allocations = 0

    def get(self, dtype, n, slot=0):
        """Return a pinned array of ``n`` elements; previous copies out of it have finished."""
        key = (dtype.str, slot)
        event = self.pending.pop(key, None)
        if event is not None:
            self.device.event_synchronize(event)
        buf = self.buffers.get(key)
        if buf is None or buf.size < n:
            buf = self.buffers[key] = self.device.pinned_empty(n, dtype)
            self.allocations += 1
        return buf[:n]

    def release(self, dtype, event, slot=0):
        """Note that copies out of the buffer finish with ``event`` (the next ``get`` waits for it)."""
        if event is not None:
            self.pending[(dtype.str, slot)] = event


class StagedPath(Path):
    """Collectives through pinned host buffers and the MPI host API."""

    name = "staged"

    def __init__(self, comm, device, settings=None):
        super().__init__(comm, device, settings, staged=self)
        self.pool = StagingPool(device)
        self._d2h = self._h2d = None

    def _streams(self):
        if self._d2h is None:
            self._d2h, self._h2d = self.device.new_stream(), self.device.new_stream()
        return self._d2h, self._h2d

    def _pipeline(self, dev, host, mpi_call, down, up):
        """Move ``dev`` through ``host`` chunk by chunk: D2H (if ``down``), ``mpi_call(chunk)``, H2D (if ``up``)."""
        d = self.device
        d2h, h2d = self._streams()
        current = d.current_stream()
        d.synchronize(current)  # rule 1; also orders our H2D writes after the caller's reads of dev
        chunks = chunk_bounds(dev.size, dev.dtype.itemsize, self.settings.chunk_bytes)
        copied = [None] * len(chunks)

        def copy_down(k):
            lo, hi = chunks[k]
            d.d2h_async(host[lo:hi], dev[lo:hi], d2h)
            copied[k] = d.record_event(d2h)

        if down:
            copy_down(0)
        for k, (lo, hi) in enumerate(chunks):
            if down and k + 1 < len(chunks):
                copy_down(k + 1)  # overlaps the MPI call on chunk k
            if down:
                d.event_synchronize(copied[k])  # rule 2
            mpi_call(host[lo:hi])
            if up:
                d.h2d_async(dev[lo:hi], host[lo:hi], h2d)  # overlaps the MPI call on chunk k+1
        if not up:
            return None
        done = d.record_event(h2d)
        d.wait_event(current, done)  # rule 3
        return done

    def allreduce(self, x, op):
        host = self.pool.get(x.dtype, x.size)
        size = self.size

        def mpi_call(chunk):
            self.comm.Allreduce(MPI.IN_PLACE, chunk, op=op.mpi)
            if op.mean:
                chunk /= size

        self.pool.release(x.dtype, self._pipeline(x, host, mpi_call, down=True, up=True))

    def bcast(self, x, root):
        host = self.pool.get(x.dtype, x.size)
        is_root = self.rank == root
        done = self._pipeline(x, host, lambda chunk: self.comm.Bcast(wire(chunk), root=root), down=is_root, up=not is_root)
        self.pool.release(x.dtype, done)

    def _down(self, dev, slot):
        """Copy all of ``dev`` into a pinned buffer and wait for it (after the producer's work)."""
        d = self.device
        d2h, _ = self._streams()
        d.synchronize(d.current_stream())
        host = self.pool.get(dev.dtype, dev.size, slot)
        d.d2h_async(host, dev, d2h)
        d.event_synchronize(d.record_event(d2h))
        return host

    def _up(self, dev, host, slot):
        d = self.device
        _, h2d = self._streams()
        d.h2d_async(dev, host, h2d)
        done = d.record_event(h2d)
        d.wait_event(d.current_stream(), done)
        self.pool.release(dev.dtype, done, slot)

    def allgather(self, send, recv, counts):
        host_send = self._down(send, 0)
        host_recv = self.pool.get(recv.dtype, recv.size, 1)
        if len(set(counts)) == 1:
            self.comm.Allgather(wire(host_send), wire(host_recv))
        else:
            self.comm.Allgatherv(wire(host_send), [wire(host_recv), (list(counts), displacements(counts))])
        self._up(recv, host_recv, 1)

    def reduce_scatter(self, send, recv, counts, op):
        host_send = self._down(send, 0)
        host_recv = self.pool.get(recv.dtype, recv.size, 1)
        if len(set(counts)) == 1:
            self.comm.Reduce_scatter_block(host_send, host_recv, op=op.mpi)
        else:
            self.comm.Reduce_scatter(host_send, host_recv, list(counts), op=op.mpi)
        if op.mean:
            host_recv /= self.size
        self._up(recv, host_recv, 1)

    def isend(self, x, dest, tag):
        # A fresh pinned buffer per send: several sends can be in flight, each until its wait().
        d = self.device
        d2h, _ = self._streams()
        d.synchronize(d.current_stream())
        host = d.pinned_empty(x.size, x.dtype)
        d.d2h_async(host, x, d2h)
        d.event_synchronize(d.record_event(d2h))
        return [self.comm.Isend(host, dest, tag)], (host,)
