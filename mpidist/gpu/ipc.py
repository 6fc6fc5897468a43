"""Same-node CUDA IPC: ranks on one node read each other's device memory directly.

Glossary:
- arena: a device buffer per (communicator, dtype) in its own cudaMalloc allocation, grown to the
  largest request and never shrunk. Its IPC handle is exchanged over MPI once per allocation and
  every peer's arena stays mapped (the cache, keyed by the arena's pointer and size).
- slice r: elements ``split_sizes(n, k)`` assign to local rank r; rank r reduces slice r.

Why an arena rather than the user's buffer: an IPC handle names a whole allocation, and CuPy's pool
hands out pieces of allocations and reuses (or frees) them behind our back, so a handle cached by
a user pointer can silently name other data later. Copying into the arena costs two device copies
(~2 TB/s), small next to the reduction's reads of peer memory.

Synchronization (host barriers over the node communicator; a stream is synchronized before each):
write own arena -> sync, barrier -> read peers -> sync, barrier -> read peers -> sync, barrier, so
no rank reads data a peer has not finished writing, and no rank overwrites its arena while a peer
may still read it.
"""

from ..comm.agree import raise_if_any
from ..partition import split_sizes
from .base import Path

__all__ = ["IpcPath", "IpcUnavailable"]


class IpcUnavailable(RuntimeError):
    """A peer's IPC handle could not be opened on some rank (raised on every rank of the node)."""


def _bounds(counts):
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


class _Arena:
    def __init__(self, own, peers, n):
        self.own, self.peers, self.n = own, peers, n


class IpcPath(Path):
    """Collectives among the ranks of one node through mapped peer memory."""

    name = "ipc"

    def __init__(self, comm, device, settings=None, local=None):
        super().__init__(comm, device, settings)
        self.local = comm if local is None else local  # the ranks that share memory (one node)
        self.local_size, self.local_rank = self.local.Get_size(), self.local.Get_rank()
        self.arenas = {}
        self.exchanges = 0  # handle exchanges so far (one per arena allocation)

    def _arena(self, dtype, n):
        """Return the arena for ``dtype`` holding at least ``n`` elements, exchanging handles if it grew."""
        arena = self.arenas.get(dtype.str)
        if arena is not None and arena.n >= n:
            return arena
        # n is the same on every rank of the collective, so every rank grows (and exchanges) together.
        d = self.device
        if arena is not None:
            self._drop(arena)
        own = d.ipc_alloc(n, dtype)
        handles = self.local.allgather(d.ipc_handle(own))
        self.exchanges += 1
        peers, error = [], None
        for r, handle in enumerate(handles):
            if r == self.local_rank:
                peers.append(own)
                continue
            try:
                peers.append(d.ipc_open(handle, n, dtype))
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                error = f"cannot open the handle of local rank {r} ({type(exc).__name__}: {exc})"
                break
        try:
            # ranks named by their rank on the node
            raise_if_any(self.local, error, "mpidist.gpu: CUDA IPC unavailable", error=IpcUnavailable)
        except IpcUnavailable:
            for r, peer in enumerate(peers):
                if r != self.local_rank:
                    d.ipc_close(peer)
            raise
        arena = self.arenas[dtype.str] = _Arena(own, peers, n)
        return arena

    def _drop(self, arena):
        for r, peer in enumerate(arena.peers):
            if r != self.local_rank:
                self.device.ipc_close(peer)
        self.local.Barrier()  # every mapping of our arena is closed before it is freed
        arena.peers = []

    def close(self):
        for arena in self.arenas.values():
            self._drop(arena)
        self.arenas = {}
        if self.local is not self.comm:
            self.local.Free()

    def _settle(self):
        """Finish this rank's queued device work, then wait until every local rank has."""
        self.device.synchronize(self.device.current_stream())
        self.local.Barrier()

    # -- the two halves of an allreduce ------------------------------------------------------------
    def _reduce_scatter_phase(self, x, op, counts):
        """Put ``x`` in the arena and reduce this rank's slice over the node; return (arena, bounds)."""
        d = self.device
        arena = self._arena(x.dtype, x.size)
        d.copy(arena.own[: x.size], x)
        self._settle()
        bounds = _bounds(counts)
        lo, hi = bounds[self.local_rank]
        mine = arena.own[lo:hi]
        # Peers never read our slice, so it can be reduced in place.
        for r in range(self.local_size):
            if r != self.local_rank:
                d.reduce_into(mine, arena.peers[r][lo:hi], op.name)
        return arena, bounds

    def _allgather_phase(self, x, arena, bounds):
        """Copy every rank's (reduced) slice from its arena into ``x``."""
        d = self.device
        self._settle()
        for r, (lo, hi) in enumerate(bounds):
            d.copy(x[lo:hi], arena.peers[r][lo:hi])
        self._settle()

    def allreduce(self, x, op):
        counts = split_sizes(x.size, self.local_size)
        arena, bounds = self._reduce_scatter_phase(x, op, counts)
        if op.mean:
            lo, hi = bounds[self.local_rank]
            self.device.divide(arena.own[lo:hi], self.size)
        self._allgather_phase(x, arena, bounds)

    def reduce_scatter(self, send, recv, counts, op):
        arena, bounds = self._reduce_scatter_phase(send, op, counts)
        lo, hi = bounds[self.local_rank]
        self.device.copy(recv, arena.own[lo:hi])
        if op.mean:
            self.device.divide(recv, self.size)
        self._settle()  # peers are done reading our arena before it can be overwritten

    def allgather(self, send, recv, counts):
        d = self.device
        arena = self._arena(send.dtype, recv.size)
        bounds = _bounds(counts)
        lo, hi = bounds[self.local_rank]
        d.copy(arena.own[lo:hi], send)
        self._allgather_phase(recv, arena, bounds)

    def bcast(self, x, root):
        d = self.device
        arena = self._arena(x.dtype, x.size)
        if self.local_rank == root:
            d.copy(arena.own[: x.size], x)
        self._settle()
        if self.local_rank != root:
            d.copy(x, arena.peers[root][: x.size])
        self._settle()

