"""Array collectives over any communicator (mpi4py intracommunicator or SimComm).

Arrays travel through the uppercase (buffer) API of mpi4py, never pickled. Every public function
validates its input on the calling rank and raises ``ValueError``/``TypeError`` naming the value,
so the same bad input on every rank fails on every rank instead of producing garbage.

Device (CuPy) arrays are routed at the top of each public function, after validation, to
``mpidist.gpu`` (``_gpu``), which picks a path per communicator: CUDA-aware MPI, NCCL, CUDA IPC or
pinned host staging. Numpy arrays never import it. ``_on_host`` is for numpy arrays only.
Nonblocking calls on device arrays complete before they return (their handle is already done).

Reductions give one result on every MPI, SimComm and GPU path, whichever rank holds which value
(``mpidist.wire``): NaN propagates through max and min, as numpy's maximum/minimum, and float16 sums,
means and products accumulate in float32 and round once. ``op`` is a name or mpi4py's MPI.SUM/PROD/MIN/MAX.
"""

import atexit
import collections
import contextlib
import functools
import math
import time
import weakref

import numpy as np
from mpi4py import MPI

from . import guard as _guard
from .guard import record as _record
from .comm import CommError, SimComm, check_comm
from . import xp as _xp
from .partition import displacements, split_sizes
from .wire import (DTYPE_CODES as _DTYPE_CODE, REDUCTIONS as _OP_NAMES, SUPPORTED_DTYPES, copy_dtype,
                   copy_view as _wire, reduction_name, resolve as _resolve_op)

__all__ = ["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "send", "recv", "isend", "irecv",
           "barrier", "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "Handle", "split_sizes", "displacements",
           "SUPPORTED_DTYPES"]

# Dtypes and their codes on the wire (headers, fingerprints): mpidist.wire.DTYPES.
_HEADER_LEN = 16  # dtype code, ndim, up to 14 dims
_HEADER_BYTES = _HEADER_LEN * 8
# send/recv payloads up to this size travel in the header's own message: one message instead of two
# halves the latency of small sends (the pipeline's activations of small models, state dict pieces).
_INLINE_MAX = 8192

# How MPI carries each dtype (mpidist/wire.py, shared with the GPU paths): copies carry float16 as uint16;
# float16 sum/mean/prod reduce in float32, rounded once; float min/max reduce order keys, so NaN propagates.


# Communicator types the fast paths take without further checks (COMM_NULL is a plain MPI.Comm and
# intercommunicators an MPI.Intercomm: both go the general way, which refuses them with a clear error).
_PLAIN_COMMS = frozenset({MPI.Intracomm, SimComm})
# Dtypes the broadcast fast path hands to MPI as they are (float16 goes the general way, as uint16).
_NATIVE_COPY = frozenset(dt for dt in SUPPORTED_DTYPES if copy_dtype(dt) == dt)


# -- tracking: the guard's record of every call (flight recorder, watchdog) and its desync check ------
def _is_array(x):
    return isinstance(x, np.ndarray) or _xp.is_device_array(x)


def record_collective(comm, op, x=None, root=-1, reduction="", rows=False, sized=True):
    """Record collective ``op`` with the guard (checking its fingerprint when due); return the record.

    Public for collectives built on these (``mpidist.collectives_hier``): pass the record to ``run_recorded``.

    Runs before input validation, so it must not trip over bad arguments (a list, a scalar, a torch
    tensor whose ``size`` is a method): anything but a numpy or device array is recorded with neutral
    values and left to the validation's own error. A bad communicator is the exception: refused here.
    ``rows``: fingerprint the row size (allgather, alltoall: row counts may differ by rank).
    ``sized``: every rank passes the same bytes, so the size may decide whether to check (see guard).
    """
    check_comm(op, comm)
    if not _record.enabled:
        return None
    if _is_array(x):
        dtype_code = _DTYPE_CODE.get(x.dtype, -1)
        count = _row_size(x) if rows else int(x.size)
        nbytes = int(x.nbytes)
    else:
        x, dtype_code, count, nbytes = None, -1, -1, 0
    root = int(root) if isinstance(root, (int, np.integer)) and not isinstance(root, bool) else -2
    reduction = reduction_name(reduction) or ""  # MPI.SUM and "sum" are one reduction to the desync check
    return _record.enter(comm, op, x, nbytes, dtype_code, count, root, reduction, sized)


def _row_size(x):
    """Elements per row of axis 0 of array ``x``: what every rank of an allgather must agree on."""
    return math.prod(x.shape[1:]) if x.ndim else 1


def _stamp(comm, op):
    """Return (sequence number, op code) of the collective in progress: the fingerprint that rides on a
    metadata exchange every rank makes anyway (allgather's shapes, alltoall's splits)."""
    return _record.sequence(comm), _guard.fingerprint.OP_CODES[op]


def _compare_stamps(comm, stamps):
    """Raise DesyncError on every rank (each sees every row) unless all ranks' stamps agree."""
    if not (stamps == stamps[0]).all():
        _guard.fingerprint.compare_stamps(_record.entry_of(comm).name, stamps)


def run_recorded(token, call, *args):
    """Run ``call(*args)``; the guard forgets ``token`` when the result is complete (a Handle: on wait)."""
    if token is None:
        return call(*args)
    try:
        result = call(*args)
    except BaseException:
        _record.leave(token)
        raise
    if isinstance(result, Handle) and not result._done:
        result._token = token
        _record.hold(token)
    else:
        _record.leave(token)
    return result


def _type_name(x):
    kind = type(x)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def _check_array(fn, x, name="x"):
    if not (isinstance(x, np.ndarray) or _xp.is_device_array(x)):
        # Array-likes (torch tensors, ...) are refused rather than copied: results are written in place.
        hint = ("; pass a numpy view of it, e.g. numpy.asarray(x) (a CPU torch tensor: x.numpy(), which shares "
                "its memory, so in-place results land in the tensor)") if hasattr(x, "__array__") or hasattr(x, "__dlpack__") else ""
        raise TypeError(f"{fn}: {name} must be a numpy or cupy array (got {_type_name(x)}){hint}")
    if x.dtype not in _DTYPE_CODE:
        raise TypeError(f"{fn}: unsupported dtype {x.dtype} (supported: {', '.join(map(str, SUPPORTED_DTYPES))})")


def check_in_place(fn, x):
    """Raise ValueError (prefixed with ``fn``) unless ``x`` can be written in place: writable, no overlapping elements."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{fn}: array is read-only and cannot be written in place (shape: {x.shape})")
    if not x.flags.c_contiguous and any(s == 0 for s, n in zip(x.strides, x.shape) if n > 1):
        raise ValueError(f"{fn}: array has overlapping elements (shape: {x.shape}, strides: {x.strides}) and cannot be used in place")


# (op name, dtype) -> (MPI op, divide by size?, dtype code) for every pair MPI reduces as it is: the allreduce
# fast path's lookup. The rest (float16, float min/max: see mpidist/wire.py) go the general way.
_FAST_ALLREDUCE = {}
for _dtype in SUPPORTED_DTYPES:
    for _name in _OP_NAMES:
        try:
            _reduction = _resolve_op("allreduce", _name, _dtype)
        except TypeError:
            continue
        if not _reduction.converts:
            _FAST_ALLREDUCE[(_name, _dtype)] = (_reduction.mpi, _reduction.mean, _DTYPE_CODE[_dtype])


def _check_rank(fn, value, comm, name):
    """Return rank ``value`` (``name``: root, dest, source) as an int, or raise naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int (got {_type_name(value)} {value!r})")
    size = comm.Get_size()
    if not 0 <= value < size:
        raise ValueError(f"{fn}: {name} {value!r} out of range for a communicator of size {size}")
    return int(value)


def _gpu(x):
    """Return ``mpidist.gpu``'s dispatch module when ``x`` is a device array, else None."""
    if not _xp.is_device_array(x):
        return None
    from .gpu import dispatch
    return dispatch


def _done(result):
    """Return a Handle that has already completed with ``result`` (device arrays complete at once)."""
    return Handle([], lambda: result)


def _host_copy(x):
    """Return numpy array ``x`` as a C-contiguous array (``x`` itself when it already is one)."""
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


@contextlib.contextmanager
def _on_host(x, write_back=True):
    """Yield a contiguous numpy array holding ``x``'s data; copy results back into ``x`` afterwards.

    C-contiguous arrays pass through untouched; non-contiguous ones go through a contiguous copy.
    Device arrays never get here: the public functions route them to ``mpidist.gpu`` first.
    """
    host = _host_copy(x)
    yield host
    if write_back and host is not x:
        x[...] = host


# Requests and buffers of handles dropped before completing. MPI still reads (or writes) those
# buffers; freeing them with the handle would send whatever reuses the memory. They are kept here
# until their requests complete, checked whenever a new handle is made. A deque, and no lock: a
# handle's __del__ can run inside the reaper itself (the garbage collector runs where it likes), so
# it must never wait, and deque appends and pops are atomic.
_orphans = collections.deque()


def _reap_orphans():
    for _ in range(len(_orphans)):
        try:
            requests, keep = _orphans.popleft()
        except IndexError:  # another thread reaped concurrently
            return
        try:
            done = all(r.Test() for r in requests)
        except Exception:  # noqa: BLE001 - a failed operation has nothing left to protect
            done = True
        if not done:
            _orphans.append((requests, keep))


def _drain_orphans(timeout=10.0):
    """At exit, give dropped operations a bounded time to finish before MPI is finalized."""
    deadline = time.monotonic() + timeout
    while _orphans and time.monotonic() < deadline:
        _reap_orphans()
        time.sleep(0.001)


atexit.register(_drain_orphans)  # after mpi4py's finalize hook was registered, so it runs before it


class Handle:
    """Handle of a nonblocking collective: ``wait()`` completes it and returns the result array.

    A handle dropped without ``wait()`` is not an error for its buffers: they live on until MPI is
    done with them. Its result is lost, and a dropped receive is cancelled (see ``irecv``).
    """

    def __init__(self, requests, finish, keep=(), status=None):
        self._requests = requests
        self._status = status  # filled by the first request (receives need source and tag)
        if finish is not None:  # subclasses may define _finish as a method instead
            self._finish = finish
        self._keep = keep  # buffers MPI still reads or writes; must outlive the requests
        self._result = None
        self._error = None
        self._done = False
        self._token = None  # the guard's record of this collective, while it is in flight
        if _orphans:
            _reap_orphans()

    def __del__(self):
        # A handle dropped without wait() is not a hang: the watchdog must stop counting it as in
        # flight, or it would abort the job when its timeout passes.
        token = getattr(self, "_token", None)
        if token is not None:
            _record.leave(token)
        requests = getattr(self, "_requests", None)
        # Only real MPI requests read user memory later; SimComm copies at once and its requests
        # keep their own references.
        if requests and not self._done and isinstance(requests[0], MPI.Request):
            _orphans.append((requests, self._keep))

    def test(self):
        """Return whether the operation has completed (finishing it if so), without blocking."""
        if self._done:
            return True
        if all(r.Test(self._status if i == 0 else None) for i, r in enumerate(self._requests)):
            self._complete()
            return True
        return False

    def wait(self):
        """Block until the operation completes; return its result."""
        if not self._done:
            if self._token is not None and _record.on_wait is not None:
                _record.on_wait(self._token)
            for i, r in enumerate(self._requests):
                r.Wait(self._status if i == 0 else None)
            self._complete()
        if self._error is not None:
            raise self._error
        return self._result

    def wait_or(self, signal):
        """Wait until this operation or MPI request ``signal`` completes; return whether this operation did.

        When it did, it is complete as after ``wait()`` (which raises its error, if any). Lets a thread
        wait inside MPI and still be woken (``signal`` is a generalized request another thread completes).
        Operations on SimComm, and receives (whose status only a Wait fills), are waited for plainly.
        """
        requests = self._requests
        if (not self._done and self._status is None and requests
                and all(isinstance(r, MPI.Request) for r in requests)):
            every = list(requests) + [signal]
            while any(r != MPI.REQUEST_NULL for r in requests):
                if MPI.Request.Waitany(every) == len(requests):
                    return False
        self.wait()
        return True

    def _complete(self):
        # Complete exactly once, even when finishing fails: a second attempt could take another
        # operation's message. The error is raised again by every later wait().
        try:
            self._result = self._finish()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            if self._token is not None:
                _record.leave(self._token)
                self._token = None
            self._done = True
            self._keep = ()


# ---------------------------------------------------------------------------------------------------
def allreduce(x, comm, op="sum"):
    """Reduce ``x`` over all ranks in place with ``op`` (sum, mean, min, max, prod); return ``x``."""
    # The common case (a contiguous, writable numpy array and a valid op) skips the general checks:
    # at small sizes Python overhead is what separates mpidist from a raw comm.Allreduce.
    if type(x) is np.ndarray and x.flags.c_contiguous and x.flags.writeable and type(comm) in _PLAIN_COMMS:
        entry = _FAST_ALLREDUCE.get((op, x.dtype)) if type(op) is str else None  # mpi4py ops are unhashable
        if entry is not None:
            token = None
            try:
                if _record.enabled:
                    token = _record.enter(comm, "allreduce", x, x.nbytes, entry[2], x.size, -1, op)
                comm.Allreduce(MPI.IN_PLACE, x, op=entry[0])
            except MPI.Exception:
                check_comm("allreduce", comm)  # COMM_NULL gets an error that says so, not MPI's
                raise
            finally:
                if token is not None:
                    _record.leave(token)
            if entry[1]:
                x /= comm.Get_size()
            return x
    return run_recorded(record_collective(comm, "allreduce", x, reduction=op), _iallreduce, x, comm, op, True)


def iallreduce(x, comm, op="sum"):
    """Start an in-place allreduce of ``x``; ``wait()`` returns ``x`` holding the result."""
    return run_recorded(record_collective(comm, "iallreduce", x, reduction=op), _iallreduce, x, comm, op, False)


def _iallreduce(x, comm, op, _blocking):
    _check_array("allreduce", x)
    reduction = _resolve_op("allreduce", op, x.dtype)
    mpi_op, mean = reduction.mpi, reduction.mean
    check_in_place("allreduce", x)
    size = comm.Get_size()
    if not isinstance(x, np.ndarray) and _xp.is_device_array(x):
        _gpu(x).allreduce(x, comm, reduction)
        return x if _blocking else _done(x)
    if reduction.converts:
        buf = np.empty(x.shape, dtype=reduction.wire)
        reduction.to_wire(buf, x)
        write_back = functools.partial(reduction.from_wire, x, buf)  # rounds once, after the mean
    elif x.flags.c_contiguous:
        if _blocking:
            comm.Allreduce(MPI.IN_PLACE, x, op=mpi_op)
            if mean:
                x /= size
            return x
        buf, write_back = x, None
    else:
        ctx = _on_host(x)
        buf = ctx.__enter__()
        write_back = functools.partial(ctx.__exit__, None, None, None)

    def finish():
        if mean:
            buf[...] /= size
        if write_back is not None:
            write_back()
        return x

    if _blocking:
        comm.Allreduce(MPI.IN_PLACE, buf, op=mpi_op)
        return finish()
    return Handle([comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op)], finish, keep=(buf,))


def broadcast(x, comm, root=0):
    """Overwrite ``x`` on every rank with ``root``'s ``x``; return ``x``."""
    # Fast path, as for allreduce: a contiguous writable numpy array of a supported dtype and a valid root.
    try:
        fast = (type(x) is np.ndarray and x.flags.c_contiguous and x.flags.writeable and x.dtype in _NATIVE_COPY
                and type(comm) in _PLAIN_COMMS and type(root) is int and 0 <= root < comm.Get_size())
    except MPI.Exception:
        fast = False  # COMM_NULL: the general path refuses it with a clear error
    if fast:
        token = _record.enter(comm, "broadcast", x, x.nbytes, _DTYPE_CODE[x.dtype], x.size, root, "") if _record.enabled else None
        try:
            comm.Bcast(x, root=root)
        finally:
            if token is not None:
                _record.leave(token)
        return x
    return run_recorded(record_collective(comm, "broadcast", x, root=root), _ibroadcast, x, comm, root, True)


def ibroadcast(x, comm, root=0):
    """Start a broadcast of ``x`` from ``root``; ``wait()`` returns ``x``."""
    return run_recorded(record_collective(comm, "ibroadcast", x, root=root), _ibroadcast, x, comm, root, False)


def _ibroadcast(x, comm, root, _blocking):
    _check_array("broadcast", x)
    root = _check_rank("broadcast", root, comm, "root")
    check_in_place("broadcast", x)
    gpu = None if isinstance(x, np.ndarray) else _gpu(x)
    if gpu is not None:
        gpu.broadcast(x, comm, root)
        return x if _blocking else _done(x)
    ctx = _on_host(x)
    buf = ctx.__enter__()

    def finish():
        ctx.__exit__(None, None, None)
        return x

    if _blocking:
        comm.Bcast(_wire(buf), root=root)
        return finish()
    return Handle([comm.Ibcast(_wire(buf), root=root)], finish, keep=(buf,))


def _gather_shapes(x, comm, op):
    """Allgather every rank's leading dim, dtype and trailing shape; raise on every rank if they disagree."""
    shape = x.shape if x.ndim else (1,)
    if len(shape) > _HEADER_LEN - 2:
        raise ValueError(f"allgather: at most {_HEADER_LEN - 2} dims are supported (got shape {x.shape})")
    header = np.zeros(_HEADER_LEN + 2, dtype=np.int64)  # dtype code, ndim, dims; then the guard's stamp
    header[0], header[1] = _DTYPE_CODE[x.dtype], len(shape)
    header[2: 2 + len(shape)] = shape
    header[_HEADER_LEN:] = _stamp(comm, op)
    headers = np.empty((comm.Get_size(), _HEADER_LEN + 2), dtype=np.int64)
    comm.Allgather(header, headers)
    _compare_stamps(comm, headers[:, _HEADER_LEN:])
    described = [(SUPPORTED_DTYPES[h[0]], tuple(h[3: 2 + h[1]])) for h in headers]
    if len(set(described)) > 1:
        parts = ", ".join(f"rank {r}: {dt} (n, {', '.join(map(str, t))})" for r, (dt, t) in enumerate(described))
        raise ValueError(f"allgather: ranks disagree on dtype or trailing shape ({parts})")
    return [int(h[2]) for h in headers], shape[1:]


def _check_allgather_out(x, out, size):
    _check_array("allgather", out, "out")
    check_in_place("allgather", out)
    rows = x.shape[0] if x.ndim else 1
    if out.dtype != x.dtype or out.shape[0] != size * rows or out.size != size * x.size:
        raise ValueError(f"allgather: out must have dtype {x.dtype} and shape ({size} * {rows}, ...) matching x {x.shape} (got {out.dtype} {out.shape})")
    if isinstance(out, np.ndarray) != isinstance(x, np.ndarray):
        raise TypeError(f"allgather: x and out must both be numpy or both device arrays (got {type(x).__name__} and {type(out).__name__})")


def _device_allgather(gpu, x, comm, out, blocking):
    if out is not None:
        counts = [x.size] * comm.Get_size()
        result = gpu.allgather(x, comm, counts, out.shape, out=out)
    else:
        rows, trailing = _gather_shapes(x, comm, "allgather" if blocking else "iallgather")
        row_size = math.prod(trailing)
        result = gpu.allgather(x, comm, [r * row_size for r in rows], (sum(rows),) + tuple(trailing))
    return result if blocking else _done(result)


def allgather(x, comm, out=None):
    """Concatenate every rank's ``x`` along axis 0 (leading dims may differ) and return the result.

    With ``out`` (shape ``(size * n, ...)``) every rank must pass the same shape; no size exchange is needed.
    """
    return run_recorded(record_collective(comm, "allgather", x, rows=out is None, sized=out is not None), _iallgather, x, comm, out, True)


def iallgather(x, comm, out=None):
    """Start an allgather; ``wait()`` returns the concatenated array."""
    return run_recorded(record_collective(comm, "iallgather", x, rows=out is None, sized=out is not None), _iallgather, x, comm, out, False)


def _iallgather(x, comm, out, _blocking):
    _check_array("allgather", x)
    size = comm.Get_size()
    if out is not None:
        _check_allgather_out(x, out, size)
    gpu = None if isinstance(x, np.ndarray) else _gpu(x)
    if gpu is not None:
        return _device_allgather(gpu, x, comm, out, _blocking)
    send = _wire(_host_copy(x).reshape(-1))
    xpm = _xp.get_array_module(x)
    if out is not None and out.flags.c_contiguous:
        recv = out
        request = (comm.Allgather if _blocking else comm.Iallgather)(send, _wire(recv))
        result, finish_out = out, _nothing
    elif out is not None:
        out_ctx = _on_host(out)
        recv = out_ctx.__enter__()
        request = (comm.Allgather if _blocking else comm.Iallgather)(send, _wire(recv))
        result, finish_out = out, (lambda: out_ctx.__exit__(None, None, None))
    else:
        rows, trailing = _gather_shapes(x, comm, "allgather" if _blocking else "iallgather")
        row_size = math.prod(trailing)
        recv = np.empty((sum(rows),) + tuple(trailing), dtype=x.dtype)
        if len(set(rows)) == 1:
            request = (comm.Allgather if _blocking else comm.Iallgather)(send, _wire(recv))
        else:
            counts = [r * row_size for r in rows]
            spec = [_wire(recv), (counts, displacements(counts))]
            request = (comm.Allgatherv if _blocking else comm.Iallgatherv)(send, spec)
        result = recv if xpm is np else None
        finish_out = None

    def finish():
        if finish_out is not None:
            finish_out()
            return result
        return recv if xpm is np else xpm.asarray(recv)

    if _blocking:
        return finish()
    return Handle([request], finish, keep=(send, recv))


def reduce_scatter(x, comm, op="sum"):
    """Reduce ``x`` over all ranks and return this rank's rows of the result.

    Rows (axis 0) are split as ``split_sizes(len(x), size)``: when ``len(x)`` does not divide evenly,
    the first ``len(x) % size`` ranks get one row more. Every rank must pass the same shape.
    """
    return run_recorded(record_collective(comm, "reduce_scatter", x, reduction=op), _ireduce_scatter, x, comm, op, True)


def ireduce_scatter(x, comm, op="sum"):
    """Start a reduce-scatter of ``x`` (rows split as in ``reduce_scatter``); ``wait()`` returns this rank's rows.

    ``x`` must not change until the handle completes: MPI reads it while the operation is in flight.
    """
    return run_recorded(record_collective(comm, "ireduce_scatter", x, reduction=op), _ireduce_scatter, x, comm, op, False)


def _ireduce_scatter(x, comm, op, _blocking):
    _check_array("reduce_scatter", x)
    reduction = _resolve_op("reduce_scatter", op, x.dtype)
    mpi_op, mean = reduction.mpi, reduction.mean
    if x.ndim == 0:
        raise ValueError("reduce_scatter: x must have at least one dimension (got a 0-d array)")
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = split_sizes(x.shape[0], size)
    row_size = math.prod(x.shape[1:])
    gpu = None if isinstance(x, np.ndarray) else _gpu(x)
    if gpu is not None:
        result = gpu.reduce_scatter(x, comm, [r * row_size for r in rows], (rows[rank],) + x.shape[1:], reduction)
        return result if _blocking else _done(result)
    out = np.empty((rows[rank],) + x.shape[1:], dtype=reduction.wire)
    if reduction.converts:
        send = np.empty(x.shape, dtype=reduction.wire)
        reduction.to_wire(send, x)
    else:
        send = _host_copy(x)
    if len(set(rows)) == 1:
        # Equal blocks: MPI_Reduce_scatter_block, which needs no counts array.
        request = (comm.Reduce_scatter_block if _blocking else comm.Ireduce_scatter_block)(send, out, op=mpi_op)
    else:
        counts = [r * row_size for r in rows]
        request = (comm.Reduce_scatter if _blocking else comm.Ireduce_scatter)(send, out, counts, op=mpi_op)

    def finish():
        result = out
        if mean:
            result /= size
        if reduction.converts:
            result = np.empty(out.shape, dtype=x.dtype)
            reduction.from_wire(result, out)
        xpm = _xp.get_array_module(x)
        return result if xpm is np else xpm.asarray(result)

    if _blocking:
        return finish()
    return Handle([request], finish, keep=(send, out))


def alltoall(x, comm, splits=None, return_splits=False, out=None):
    """Send rows of ``x`` to every rank; return the rows every rank sent here, concatenated in rank order.

    ``splits[j]`` consecutive rows (axis 0) go to rank j; by default ``split_sizes(len(x), size)``
    (the first ``len(x) % size`` ranks get one row more). With ``return_splits`` the result is
    ``(rows, received_splits)``: how many rows came from each rank. Ranks must agree on dtype and
    trailing shape. Bad splits or a disagreement raise on every rank (one small metadata exchange
    comes first, so no rank is left waiting). Any dtype; device arrays go through a host copy.
    ``out``: a C-contiguous numpy array of the arriving shape to receive into (no allocation per call).
    """
    return run_recorded(record_collective(comm, "alltoall", x, rows=True, sized=False), _alltoall, x, comm, splits, return_splits, out)


def _alltoall(x, comm, splits, return_splits, out):
    size, rank = comm.Get_size(), comm.Get_rank()
    # Every local problem travels in the metadata exchange, so that all ranks raise, none waits.
    problem = None
    try:
        _check_array("alltoall", x)
        if x.ndim == 0 or x.ndim > _HEADER_LEN - 2:
            raise ValueError(f"alltoall: x must have 1 to {_HEADER_LEN - 2} dimensions (got shape {x.shape})")
        if out is not None and not (type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable
                                    and out.dtype == x.dtype and out.ndim == x.ndim and out.shape[1:] == x.shape[1:]):
            raise ValueError(f"alltoall: out must be a writable C-contiguous numpy array of dtype {x.dtype} and shape "
                             f"(n, {', '.join(map(str, x.shape[1:]))}) (got {type(out).__name__} "
                             f"{getattr(out, 'dtype', '')} {getattr(out, 'shape', '')})")
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    rows, trailing = (x.shape[0], tuple(x.shape[1:])) if problem is None else (0, ())
    if splits is None:
        splits = split_sizes(rows, size)
    elif problem is None:
        ok = (len(splits) == size if hasattr(splits, "__len__") else False) and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in splits)
        if not ok or sum(int(n) for n in splits) != rows:
            problem = f"alltoall: splits must be {size} ints >= 0 summing to len(x) = {rows} (got {splits!r})"
    if problem is not None:
        splits = [0] * size
    # One row per rank: [problem?, dtype code, ndim of the trailing shape, trailing dims (padded),
    # rows of out (-1: none), splits]. Every rank sees every row, so every rank reaches the same verdict.
    meta = np.zeros(4 + _HEADER_LEN + size, dtype=np.int64)  # ..., then the guard's stamp (2 ints)
    meta[0] = problem is not None
    meta[1 + _HEADER_LEN] = -1 if out is None or problem is not None else out.shape[0]
    if problem is None:
        meta[1], meta[2] = _DTYPE_CODE[x.dtype], len(trailing)
        meta[3: 3 + len(trailing)] = trailing
    meta[2 + _HEADER_LEN: 2 + _HEADER_LEN + size] = [int(n) for n in splits]
    meta[-2:] = _stamp(comm, "alltoall")
    everyone = np.empty((size, meta.size), dtype=np.int64)
    comm.Allgather(meta, everyone)
    _compare_stamps(comm, everyone[:, -2:])
    if everyone[:, 0].any():
        bad = np.flatnonzero(everyone[:, 0]).tolist()
        raise ValueError(f"alltoall: bad input on rank(s) {bad}" + (f"; here: {problem}" if problem else ""))
    if not (everyone[:, 1: 1 + _HEADER_LEN] == meta[1: 1 + _HEADER_LEN]).all():
        described = [(SUPPORTED_DTYPES[row[1]], tuple(row[3: 3 + row[2]].tolist())) for row in everyone]
        parts = ", ".join(f"rank {r}: {dt} (n, {', '.join(map(str, t))})" for r, (dt, t) in enumerate(described))
        raise ValueError(f"alltoall: ranks disagree on dtype or trailing shape ({parts})")
    out_rows = everyone[:, 1 + _HEADER_LEN]
    if (out_rows >= 0).any():
        arriving = everyone[:, 2 + _HEADER_LEN: 2 + _HEADER_LEN + size].sum(axis=0)
        wrong = [(r, int(out_rows[r]), int(arriving[r])) for r in range(size) if 0 <= out_rows[r] != arriving[r]]
        if wrong:
            raise ValueError("alltoall: out has the wrong number of rows: " +
                             "; ".join(f"rank {r}: {have} rows for the {want} that arrive" for r, have, want in wrong))
    received = everyone[:, 2 + _HEADER_LEN + rank].tolist()
    row_bytes = math.prod(trailing) * x.dtype.itemsize
    xpm = _xp.get_array_module(x)
    send = _host_copy(_xp.to_numpy(x)).reshape(-1).view(np.uint8)  # bytes: every dtype, float16 included
    if out is None:
        out = np.empty((sum(received),) + trailing, dtype=x.dtype)
    all_splits = everyone[:, 2 + _HEADER_LEN: 2 + _HEADER_LEN + size]
    if (all_splits == all_splits[0, 0]).all():
        # Equal blocks everywhere: MPI_Alltoall, which MPICH runs ~1.8x faster than Alltoallv (64 MiB, 2 ranks).
        comm.Alltoall(send, out.reshape(-1).view(np.uint8))
    else:
        send_counts, recv_counts = [int(n) * row_bytes for n in splits], [n * row_bytes for n in received]
        comm.Alltoallv([send, (send_counts, displacements(send_counts))],
                       [out.reshape(-1).view(np.uint8), (recv_counts, displacements(recv_counts))])
    result = out if xpm is np else xpm.asarray(out)
    return (result, received) if return_splits else result


def barrier(comm):
    """Block until every rank of ``comm`` has called barrier."""
    run_recorded(record_collective(comm, "barrier"), comm.Barrier)


# -- point to point: a small header carries dtype and shape, so the receiver needs to know neither ---
_header_cache = {}  # (dtype, shape) -> the header's bytes: a program sends few distinct shapes, over and over


def _header(fn, x, stamp=None):
    """Return the header of ``x`` (dtype code, ndim, dims; 16 int64) as read-only bytes.

    A ``stamp`` (two ints: the pipeline's step and micro-batch) takes the last two words, leaving
    room for 12 dims; the receiver that expects a stamp compares it before it uses the payload.
    """
    key = (x.dtype, x.shape)
    header = _header_cache.get(key)
    if header is None:
        if x.ndim > _HEADER_LEN - 2:
            raise ValueError(f"{fn}: at most {_HEADER_LEN - 2} dims are supported (got shape {x.shape})")
        words = np.zeros(_HEADER_LEN, dtype=np.int64)
        words[0], words[1] = _DTYPE_CODE[x.dtype], x.ndim
        words[2: 2 + x.ndim] = x.shape
        header = words.view(np.uint8)
        header.flags.writeable = False
        if len(_header_cache) < 4096:
            _header_cache[key] = header
    if stamp is None:
        return header
    if x.ndim > _HEADER_LEN - 4:
        raise ValueError(f"{fn}: a stamped message has at most {_HEADER_LEN - 4} dims (got shape {x.shape})")
    words = header.view(np.int64).copy()
    words[_HEADER_LEN - 2:] = _stamp_words(fn, stamp)
    return words.view(np.uint8)


def _stamp_words(fn, stamp):
    try:
        a, b = (int(v) for v in stamp)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: stamp must be a pair of ints (got {stamp!r})") from None
    return a + 1, b + 1  # stored plus one: a zero word means "not stamped"


def _nothing():
    return None


def isend(x, dest, comm, tag=0, stamp=None):
    """Start sending ``x`` (any shape and supported dtype) to ``dest``; ``wait()`` when the buffer may be reused.

    ``stamp``: a pair of non-negative ints the receiver checks (``recv(..., stamp=)``), e.g. (step, micro-batch).
    """
    return run_recorded(_p2p_begin(comm, "send", x, dest), _isend, x, dest, comm, tag, stamp)


def _p2p_begin(comm, op, x, peer):
    # Point-to-point calls are not matched across all ranks, so they take no fingerprint check;
    # the watchdog still sees a receive that never completes, and the flight recorder records them.
    check_comm(op, comm)
    if not _record.enabled:
        return None
    peer = int(peer) if isinstance(peer, (int, np.integer)) and not isinstance(peer, bool) else -1
    return _record.enter_p2p(comm, op, int(x.nbytes) if _is_array(x) else -1, peer)


def record_p2p(comm, op, x, peer):
    """Record point-to-point ``op`` ("send" or "recv") of ``x`` with ``peer``; return the record for ``run_recorded``.

    Public for messages posted outside ``isend``/``irecv`` (``ring16``'s header-free 16-bit ring)."""
    return _p2p_begin(comm, op, x, peer)


def _isend(x, dest, comm, tag, stamp=None):
    _check_array("send", x)
    dest = _check_rank("send", dest, comm, "dest")
    header = _header("send", x, stamp)
    nbytes = x.size * x.dtype.itemsize
    host = isinstance(x, np.ndarray)
    if nbytes == 0 or (host and nbytes <= _INLINE_MAX):
        # One message, header then payload; the receiver tells it from a header-only message by its
        # length (and an empty array by its shape). Device arrays go through their path's own send.
        message = np.empty(_HEADER_BYTES + nbytes, dtype=np.uint8)
        message[:_HEADER_BYTES] = header
        if nbytes:
            message[_HEADER_BYTES:] = _host_copy(x).reshape(-1).view(np.uint8)
        return Handle([comm.Isend(message, dest, tag)], _nothing, keep=(message,))
    gpu = None if host else _gpu(x)
    if gpu is not None:
        header_request = comm.Isend(header, dest, tag)
        requests, keep = gpu.isend(_wire(x), dest, comm, tag)
        return Handle([header_request] + requests, lambda: None, keep=(header,) + keep)
    data = _wire(_host_copy(x).reshape(-1))
    requests = [comm.Isend(header, dest, tag), comm.Isend(data, dest, tag)]
    return Handle(requests, lambda: None, keep=(header, data))


def send(x, dest, comm, tag=0, stamp=None):
    """Send ``x`` to ``dest``; the receiver learns dtype and shape from a small header."""
    isend(x, dest, comm, tag, stamp).wait()


def irecv(source, comm, tag=0, out=None, stamp=None):
    """Start receiving an array from ``source`` (``MPI.ANY_SOURCE`` allowed); ``wait()`` returns it.

    With ``out`` (an array of the sent shape and dtype) the data lands there and ``wait()`` returns
    ``out``: no allocation per message, which matters for large messages received again and again.
    The handle's ``cancel()`` (or dropping it) withdraws the receive; its message stays queued.
    """
    return run_recorded(_p2p_begin(comm, "recv", out, source), _irecv, source, comm, tag, out, stamp)


def _irecv(source, comm, tag, out, stamp=None):
    _check_recv_args(source, comm, out)
    receive = _ArrayReceive(comm, source, tag, out)
    receive._stamp = stamp
    return receive


def _check_recv_args(source, comm, out):
    if source != MPI.ANY_SOURCE:
        _check_rank("recv", source, comm, "source")
    if out is not None:
        _check_array("recv", out, "out")
        check_in_place("recv", out)


class _ArrayReceive(Handle):
    """A receive of header + payload that matches the header with a matched probe when it completes.

    No receive is posted in advance: a posted header receive could match another array's payload
    when two receives from one source with one tag are outstanding. A matched probe takes the header
    off the queue atomically; the payload is then the next message from that sender with that tag
    (messages between one pair with one tag do not overtake each other).

    Matching follows MPI's rule among the receives started on a communicator: a message goes to the
    earliest started receive that can take it. A later receive never waits for an earlier one that
    cannot take its message (an ANY_TAG receive completes while an earlier tag-5 one still waits).
    A receive handle dropped without completing is cancelled: nothing was posted, and its message
    stays queued for the next receive.
    """

    # id(comm) -> weak references to receives started on it and not complete, oldest first. Weak, so
    # that dropping a handle cancels it (and releases its watchdog record) instead of leaking it here.
    _pending = {}

    _stamp = None  # the (step, micro-batch) the sender must have stamped, when the caller expects one

    def __init__(self, comm, source, tag, out=None):
        super().__init__([], None)
        self._comm, self._source, self._tag, self._out = comm, source, tag, out
        self._probe_status = MPI.Status()
        self._message = None
        self._pending.setdefault(id(comm), []).append(weakref.ref(self))

    @classmethod
    def outstanding(cls, comm, leaving=None):
        """Return whether receives started on ``comm`` are still pending, forgetting dropped ones
        (and ``leaving``, a receive that completes or is cancelled now)."""
        queue = cls._pending.get(id(comm))
        if queue is None:
            return False
        queue[:] = [ref for ref in queue if ref() is not None and ref() is not leaving]
        if not queue:
            cls._pending.pop(id(comm), None)
        return bool(queue)

    def _accepts(self, source, tag):
        return self._source in (MPI.ANY_SOURCE, source) and self._tag in (MPI.ANY_TAG, tag)

    def _overlaps(self, other):
        return (MPI.ANY_SOURCE in (self._source, other._source) or self._source == other._source) and \
               (MPI.ANY_TAG in (self._tag, other._tag) or self._tag == other._tag)

    def _earlier(self):
        """Pending receives started before this one that could take the same messages, oldest first."""
        earlier = []
        for ref in self._pending.get(id(self._comm), ()):
            h = ref()
            if h is self:
                return earlier
            if h is not None and not h._done and self._overlaps(h):
                earlier.append(h)
        return []  # complete already: no longer queued

    def _step(self):
        """Make one non-blocking attempt; return whether this receive is complete."""
        if self._done:
            return True
        earlier = self._earlier()
        if not earlier:
            self._message = self._comm.Improbe(self._source, self._tag, self._probe_status)
        else:
            # Peek at the first message this receive could take; if an earlier receive can take it
            # too, that one has the right to it (or to an even earlier message of its own).
            peek = MPI.Status()
            if not self._comm.Iprobe(self._source, self._tag, peek):
                return False
            source, tag = peek.Get_source(), peek.Get_tag()
            first = next((h for h in earlier if h._accepts(source, tag)), None)
            if first is not None:
                try:
                    first._step()
                except Exception:  # noqa: BLE001 - kept in that handle; its own wait() raises it
                    if not first._done:
                        raise
                return False
            # Messages from one sender with one tag do not overtake: this takes the peeked one.
            self._message = self._comm.Improbe(source, tag, self._probe_status)
        if self._message is None:
            return False
        self._complete()
        return True

    def test(self):
        return self._step()

    def wait(self):
        if not self._done:
            if not self._earlier():
                self._message = self._comm.Mprobe(self._source, self._tag, self._probe_status)
                self._complete()
            else:
                while not self._step():
                    # Block until a message this receive could take is queued (never spin).
                    self._comm.Probe(self._source, self._tag)
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self):
        """Withdraw this receive unless it has completed; return whether it was withdrawn.

        Nothing was posted, so the message it would have taken stays queued for the next receive.
        Dropping the handle does the same when it is freed, which reference cycles can delay.
        """
        if self._done:
            return False
        self.outstanding(self._comm, leaving=self)
        self._done, self._error = True, CommError(f"recv from {self._source} (tag {self._tag}) was cancelled")
        if self._token is not None:
            _record.leave(self._token)
            self._token = None
        return True

    def _finish(self):  # a method, not a bound method stored on the handle: no reference cycle
        self.outstanding(self._comm, leaving=self)
        return _unpack(self._comm, self._message, self._probe_status, self._out, self._stamp)


def _unpack(comm, message, status, out, stamp=None):
    """Receive matched ``message`` (header, with the payload inline or next from the same sender and tag)."""
    source, tag = status.Get_source(), status.Get_tag()
    length = status.Get_count(MPI.BYTE)
    if length == _HEADER_BYTES:
        header, inline = np.empty(_HEADER_LEN, dtype=np.int64), None
        message.Recv(header)
    else:
        buffer = np.empty(length, dtype=np.uint8)
        message.Recv(buffer)
        header, inline = buffer[:_HEADER_BYTES].view(np.int64), buffer[_HEADER_BYTES:]
    dtype, shape = SUPPORTED_DTYPES[header[0]], tuple(header[2: 2 + header[1]].tolist())
    if inline is None and 0 in shape:
        inline = buffer = np.empty(0, dtype=np.uint8)  # empty arrays always travel as one message
    if stamp is not None:
        got, expected = header[_HEADER_LEN - 2:], _stamp_words("recv", stamp)
        if tuple(got.tolist()) != expected:
            if inline is None:  # take the payload off the queue, or the next receive would get it
                comm.Recv(_wire(np.empty(math.prod(shape), dtype=dtype)), source, tag)
            sent = "no stamp" if not got.any() else f"stamp {tuple(int(v) - 1 for v in got)}"
            raise _guard.DesyncError(f"recv: the message from rank {source} (tag {tag}) carries {sent}, but this "
                                     f"receive expects stamp {tuple(int(v) for v in stamp)}: sender and receiver are "
                                     f"at different steps")
    if out is not None and (out.shape != shape or out.dtype != dtype):
        if inline is None:  # take the payload off the queue, or the next receive would get it
            comm.Recv(_wire(np.empty(math.prod(shape), dtype=dtype)), source, tag)
        raise ValueError(f"recv: out has shape {tuple(out.shape)} and dtype {out.dtype}, but the array from "
                         f"rank {source} (tag {tag}) has shape {shape} and dtype {dtype}")
    if inline is not None:
        data = inline.view(dtype).reshape(shape)
        if out is None:
            return data
        if type(out) is np.ndarray:
            np.copyto(out, data)
        else:
            _xp.copy_into(out, data)
        return out
    if out is None:
        out = np.empty(shape, dtype=dtype)
    target = out if isinstance(out, np.ndarray) and out.flags.c_contiguous else np.empty(shape, dtype=dtype)
    comm.Recv(_wire(target.reshape(-1)), source, tag)
    if target is not out:
        _xp.copy_into(out, target)
    return out


def recv(source, comm, tag=0, out=None, stamp=None):
    """Receive an array sent with ``send`` from ``source``; return it (``out``, when given: see ``irecv``).

    With ``stamp`` the sender must have sent the same stamp; otherwise DesyncError (payload discarded).
    """
    if _ArrayReceive.outstanding(comm):
        return irecv(source, comm, tag, out, stamp).wait()
    # No earlier receive to complete first: match and receive directly, without a handle.
    token = _p2p_begin(comm, "recv", out, source)
    try:
        _check_recv_args(source, comm, out)
        status = MPI.Status()
        return _unpack(comm, comm.Mprobe(source, tag, status), status, out, stamp)
    finally:
        if token is not None:
            _record.leave(token)

