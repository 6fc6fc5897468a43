"""What ``mpidist.collectives`` calls for device arrays (after validating them and resolving the op).

These functions make any layout flat and contiguous (a copy on the current stream, written back
afterwards), hand it to the communicator's path, and return device arrays. They block until MPI is
done with the data; results are ready on the current stream.
"""

from .base import op_from_mpi
from .select import engine, p2p_path

__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter", "isend"]


def _in_place(path, x, run):
    d = path.device
    flat, copied = d.flat(x)
    run(flat)
    if copied:
        d.assign(x, flat)
    return x


def allreduce(x, comm, mpi_op, mean):
    """Reduce device array ``x`` in place over ``comm``; return ``x``."""
    path = engine(comm)
    return _in_place(path, x, lambda flat: path.allreduce(flat, op_from_mpi(mpi_op, mean)))


def broadcast(x, comm, root):
    """Overwrite device array ``x`` with ``root``'s; return ``x``."""
    path = engine(comm)
    return _in_place(path, x, lambda flat: path.bcast(flat, root))


def allgather(x, comm, counts, out_shape, out=None):
    """Return every rank's ``x`` (``counts[r]`` elements from rank r) concatenated, shaped ``out_shape``.

    With ``out`` the result is written there (and ``out`` returned).
    """
    path = engine(comm)
    d = path.device
    send, _ = d.flat(x)
    if out is None:
        recv = d.empty(sum(counts), x.dtype)
        path.allgather(send, recv, counts)
        return recv.reshape(out_shape)
    return _in_place(path, out, lambda flat: path.allgather(send, flat, counts))


def reduce_scatter(x, comm, counts, out_shape, mpi_op, mean):
    """Reduce device array ``x`` over ``comm``; return this rank's ``counts[rank]`` elements shaped ``out_shape``."""
    path = engine(comm)
    d = path.device
    send, _ = d.flat(x)
    recv = d.empty(counts[comm.Get_rank()], x.dtype)
    path.reduce_scatter(send, recv, counts, op_from_mpi(mpi_op, mean))
    return recv.reshape(out_shape)


def isend(x, dest, comm, tag):
    """Start sending device array ``x``'s data; return ``(requests, buffers to keep until they complete)``."""
    path = p2p_path(comm)
    flat, _ = path.device.flat(x)
    requests, keep = path.isend(flat, dest, tag)
    return requests, keep + (flat,)
