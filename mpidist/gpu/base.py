"""The plumbing every GPU path shares: resolved reductions, settings, and the ``Path`` base class.

A path implements the collectives on flat, C-contiguous device arrays of one communicator. Any op a
path does not implement (or cannot do for a dtype) goes to its ``staged`` fallback, which always works.
"""

import dataclasses

from .. import config
from ..wire import copy_view as wire

__all__ = ["Op", "Settings", "Path", "op_of", "wire"]


@dataclasses.dataclass(frozen=True)
class Op:
    """A reduction as a path runs it on its buffers: the MPI op, its name (a row of ``wire.OPS``), divide by the size?"""

    mpi: object
    name: str
    mean: bool = False


def op_of(reduction):
    """Return the ``Op`` a path applies for a ``wire.Reduction`` (to buffers of its ``wire`` dtype)."""
    return Op(reduction.mpi, reduction.mpi_name, reduction.mean)


def _env_chunk_bytes():
    mb = config.get("MPIDIST_GPU_CHUNK_MB")
    return 4 << 20 if mb is None else max(1, int(mb * (1 << 20)))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tuning of the GPU paths.

    chunk_bytes: size of one pipelined chunk of the staged path. Below ~1 MiB the fixed cost of each
    MPI call dominates; much above ~8 MiB the first copy down and the last copy up are not hidden.
    """

    chunk_bytes: int = dataclasses.field(default_factory=_env_chunk_bytes)


class Path:
    """One way of running collectives on device arrays over one communicator."""

    name = "abstract"

    def __init__(self, comm, device, settings=None, staged=None):
        self.comm = comm
        self.device = device
        self.settings = settings or Settings()
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._staged = staged

    @property
    def staged(self):
        """The pinned-host-staging fallback on the same communicator (created on first use)."""
        if self._staged is None:
            from .staged import StagedPath
            self._staged = StagedPath(self.comm, self.device, self.settings)
        return self._staged

    # Every op takes flat contiguous device arrays; results are ready on the current stream on return.
    def allreduce(self, x, op):
        """Reduce ``x`` in place over all ranks."""
        self.staged.allreduce(x, op)

    def bcast(self, x, root):
        """Overwrite ``x`` with ``root``'s ``x``."""
        self.staged.bcast(x, root)

    def allgather(self, send, recv, counts):
        """Fill ``recv`` with every rank's ``send`` (``counts[r]`` elements from rank r) in rank order."""
        self.staged.allgather(send, recv, counts)

    def reduce_scatter(self, send, recv, counts, op):
        """Reduce ``send`` over all ranks; this rank's ``counts[rank]`` elements go to ``recv``."""
        self.staged.reduce_scatter(send, recv, counts, op)

    def isend(self, x, dest, tag):
        """Start sending ``x``; return ``(requests, buffers to keep alive until they complete)``."""
        return self.staged.isend(x, dest, tag)

    def close(self):
        """Release what the path holds (IPC mappings, NCCL communicators)."""


class SelfPath(Path):
    """A communicator of one rank: nothing moves."""

    name = "self"

    def allreduce(self, x, op):
        pass  # the reduction of one rank's x is x, and its mean divides by 1

    def bcast(self, x, root):
        pass

    def allgather(self, send, recv, counts):
        self.device.copy(recv, send)

    def reduce_scatter(self, send, recv, counts, op):
        self.device.copy(recv, send)
