"""What ``mpidist.collectives`` calls for device arrays (after validating them and resolving the op).

These functions make any layout flat and contiguous (a copy on the current stream, written back
afterwards), hand it to the communicator's path, and return device arrays. They block until MPI is
done with the data; results are ready on the current stream.

Reductions follow ``mpidist.wire`` here, once for every path: a reduction MPI runs on a converted copy
(float16 sums in float32, float min/max as order keys, so NaN propagates) converts on the device before
the path runs and back after it, so no path (NCCL, IPC, CUDA-aware or staged MPI) reduces float16 or
compares NaN itself.
"""

from .base import op_of
from .select import engine, p2p_path

__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter", "isend"]


def _in_place(path, x, run):
    d = path.device
    flat, copied = d.flat(x)
    run(flat)
    if copied:
        d.assign(x, flat)
    return x


def _to_wire(device, reduction, flat):
    """Return ``flat`` as the path reduces it: itself, or a converted copy (``reduction.converts``)."""
    if not reduction.converts:
        return flat
    buf = device.empty(flat.size, reduction.wire)
    device.elementwise(reduction.to_wire, buf, flat)
    return buf


def allreduce(x, comm, reduction):
    """Reduce device array ``x`` in place over ``comm`` with ``reduction`` (a ``wire.Reduction``); return ``x``."""
    path = engine(comm)

    def run(flat):
        buf = _to_wire(path.device, reduction, flat)
        path.allreduce(buf, op_of(reduction))
        if buf is not flat:
            path.device.elementwise(reduction.from_wire, flat, buf)

    return _in_place(path, x, run)


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


def reduce_scatter(x, comm, counts, out_shape, reduction):
    """Reduce device array ``x`` over ``comm`` with ``reduction``; return this rank's ``counts[rank]`` elements
    shaped ``out_shape``."""
    path = engine(comm)
    d = path.device
    send, _ = d.flat(x)
    send = _to_wire(d, reduction, send)  # a copy when converted: x itself is left as it was
    recv = d.empty(counts[comm.Get_rank()], reduction.wire)
    path.reduce_scatter(send, recv, counts, op_of(reduction))
    if reduction.converts:
        result = d.empty(recv.size, x.dtype)
        d.elementwise(reduction.from_wire, result, recv)
        recv = result
    return recv.reshape(out_shape)


def isend(x, dest, comm, tag):
    """Start sending device array ``x``'s data; return ``(requests, buffers to keep until they complete)``."""
    path = p2p_path(comm)
    flat, _ = path.device.flat(x)
    requests, keep = path.isend(flat, dest, tag)
    return requests, keep + (flat,)
