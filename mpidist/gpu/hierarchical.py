"""Hierarchical allreduce for several nodes with several ranks each (GPUs may be shared).

1. node-local reduce-scatter through CUDA IPC: local rank l holds slice l of its node's sum;
2. inter-node allreduce of slice l among the ranks with local rank l (one per node), staged
   through pinned host memory over MPI;
3. node-local allgather through CUDA IPC.
Every node must have the same number of ranks, so that slice l has the same bounds everywhere.
Other collectives use the staged path on the whole communicator.
"""

from ..partition import split_sizes
from .base import Op, Path
from .ipc import IpcPath
from .staged import StagedPath

__all__ = ["HierarchicalPath"]


class HierarchicalPath(IpcPath):
    """IPC inside each node, host-staged MPI between nodes."""

    name = "hierarchical"

    def __init__(self, comm, device, settings=None, local=None, cross=None):
        super().__init__(comm, device, settings, local=local)
        # cross: the ranks with this rank's local rank, one per node, ordered by node.
        self.cross = cross
        self.cross_path = StagedPath(cross, device, self.settings)

    # Only allreduce is hierarchical; reduce_scatter, allgather and bcast are not IPC-only here.
    reduce_scatter = Path.reduce_scatter
    allgather = Path.allgather
    bcast = Path.bcast

    def allreduce(self, x, op):
        counts = split_sizes(x.size, self.local_size)
        arena, bounds = self._reduce_scatter_phase(x, op, counts)
        lo, hi = bounds[self.local_rank]
        mine = arena.own[lo:hi]
        self.cross_path.allreduce(mine, Op(op.mpi, op.name, mean=False))
        if op.mean:
            self.device.divide(mine, self.size)
        self._allgather_phase(x, arena, bounds)

    def close(self):
        super().close()
        self.cross.Free()
