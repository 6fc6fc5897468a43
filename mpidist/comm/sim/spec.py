"""Message specs and datatypes: read an mpi4py buffer argument the way mpi4py reads it, move its bytes.

Glossary:
- spec: what a caller passes as a buffer: ``buf``, ``[buf, type]``, ``[buf, count, type]``,
  ``[buf, (count, displ), type]``, ``[buf, count, displ, type]`` (counts and displacements are lists in
  the vector forms), where ``type`` is an ``MPI.Datatype`` or a typecode string like ``'i'``, and ``buf``
  may be ``None`` (no data) or ``MPI.BOTTOM`` (absolute addresses).
- typemap: the byte offsets, relative to the start of one datatype element, that the element's data
  occupies. Derived datatypes (vector, indexed, struct, subarray, resized...) are real MPI datatypes; we
  ask the MPI library itself to pack a numbered scratch buffer once to learn their typemap, so every
  layout MPI knows is applied exactly, never approximated.
- packed: a message in transit, the bytes of its elements in typemap order (what MPI_Pack gives).
"""

import ctypes
import threading

import numpy as np
from mpi4py import MPI

from .errors import mpi_error

__all__ = ["Msg", "simple", "vector", "vector_w", "typemap", "to_datatype"]

_TYPEDICT = MPI._typedict
_maps = {}
_maps_lock = threading.Lock()


class TypeMap:
    """Layout of one element of a datatype: ``offsets`` (bytes), ``extent``, ``size``, ``lb``."""

    __slots__ = ("offsets", "extent", "size", "lb", "contiguous")

    def __init__(self, offsets, extent, size, lb):
        self.offsets, self.extent, self.size, self.lb = offsets, extent, size, lb
        self.contiguous = extent == size and (size == 0 or (offsets[0] == 0 and bool(np.all(np.diff(offsets) == 1))))

    def indices(self, start, count):
        """Byte indices of ``count`` elements from byte ``start``, in pack order."""
        if self.contiguous:
            return np.arange(start, start + count * self.size)
        return (start + (np.arange(count) * self.extent)[:, None] + self.offsets[None, :]).ravel()


def to_datatype(obj, what="message"):
    """Return the ``MPI.Datatype`` for a datatype or a typecode string."""
    if isinstance(obj, MPI.Datatype):
        return obj
    try:
        return _TYPEDICT[obj]
    except (KeyError, TypeError):
        raise KeyError(f"{what}: cannot map {obj!r} to MPI datatype") from None


def typemap(dt):
    """Return the ``TypeMap`` of a committed datatype (asking MPI to pack a numbered buffer)."""
    if dt == MPI.DATATYPE_NULL:
        raise mpi_error(MPI.ERR_TYPE, "message: datatype is MPI.DATATYPE_NULL")
    predefined = dt.is_predefined
    key = dt.handle
    if predefined:
        cached = _maps.get(key)
        if cached is not None:
            return cached
    lb, extent = dt.Get_extent()
    size = dt.Get_size()
    if size == 0:
        tm = TypeMap(np.zeros(0, np.intp), extent, 0, lb)
    elif predefined and size == extent and dt not in (MPI.SHORT_INT, MPI.LONG_DOUBLE_INT):
        tm = TypeMap(np.arange(size, dtype=np.intp), extent, size, lb)
    else:
        tlb, span = dt.Get_true_extent()
        shifted = MPI.Datatype.Create_struct([1], [-tlb], [dt]).Create_resized(0, span).Commit()
        try:
            k = np.arange(span, dtype=np.int64)
            offsets = np.zeros(size, np.intp)
            out = np.empty(size, np.uint8)
            for plane in range(0, max(1, int(span - 1).bit_length()), 8):
                shifted.Pack(((k >> plane) & 0xFF).astype(np.uint8), out, 0, MPI.COMM_SELF)
                offsets |= out.astype(np.intp) << plane
        finally:
            shifted.Free()
        tm = TypeMap(offsets + tlb, extent, size, lb)
    if predefined:
        with _maps_lock:
            _maps[key] = tm
    return tm


def _format_datatype(fmt):
    if fmt and fmt[0] in "@=<>!":
        fmt = fmt[1:]
    try:
        return _TYPEDICT[fmt]
    except KeyError:
        raise KeyError(f"message: cannot map buffer format {fmt!r} to MPI datatype") from None


_DEVICE_MODULES = ("cupy", "numba", "torch", "jax", "tensorflow")


def _host_view(obj):
    """A buffer-protocol view of a DLPack CPU tensor or a host-memory ``__cuda_array_interface__`` object."""
    if hasattr(obj, "__dlpack_device__") and not hasattr(obj, "__cuda_array_interface__"):
        # np.from_dlpack crashed (SIGSEGV) on mpi4py's ctypes DLPack test double: not simulated yet
        raise NotImplementedError(f"message: DLPack-only buffers are not simulated ({type(obj).__name__}); "
                                  f"pass an object with the buffer protocol")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None and not type(obj).__module__.split(".")[0] in _DEVICE_MODULES:
        # mpi4py hands this pointer to MPI as it is; objects that are not a GPU library's arrays (test
        # doubles, shims) point at host memory, which we can read the same way.
        if cai.get("strides") is not None:
            raise BufferError(f"__cuda_array_interface__: buffer is not contiguous (strides: {cai['strides']})")
        itemsize = np.dtype(cai["typestr"]).itemsize
        nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * itemsize
        address, readonly = cai["data"]
        if nbytes == 0:
            return np.zeros(0, np.dtype(cai["typestr"]))
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
        arr = raw.view(np.dtype(cai["typestr"]))
        if readonly:
            arr.flags.writeable = False
        return arr
    raise NotImplementedError(f"message: device buffers are not simulated ({type(obj).__module__}."
                              f"{type(obj).__name__}); stage through host memory")


def _buffer(obj, readonly, need_format=True):
    """Return (uint8 array over the whole buffer, its default datatype)."""
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack_device__") or hasattr(obj, "__cuda_array_interface__"):
            view = memoryview(_host_view(obj))
        else:
            raise TypeError(f"message: expecting buffer or list/tuple (got {type(obj).__name__})") from None
    if not view.contiguous:
        raise BufferError(f"message: buffer is not contiguous (shape: {view.shape}, strides: {view.strides})")
    if not readonly and view.readonly:
        raise BufferError(f"message: buffer is not writable ({type(obj).__name__})")
    data = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.zeros(0, np.uint8)
    if view.nbytes and view.ndim > 1 and not view.c_contiguous:  # Fortran order: the memory itself
        data = np.asarray(view).reshape(-1, order="K").view(np.uint8)
    return data, (_format_datatype(view.format) if need_format else None)


class Msg:
    """One side of a message: a byte view of the buffer, datatype, and per-block counts/displacements."""

    __slots__ = ("base", "dtype", "tm", "counts", "starts", "bottom")

    def __init__(self, base, dtype, counts, starts, bottom=False):
        self.base, self.dtype, self.counts, self.starts, self.bottom = base, dtype, counts, starts, bottom
        self.tm = typemap(dtype) if dtype is not None else None

    @property
    def count(self):
        return self.counts[0]

    def nbytes(self, block=0):
        return 0 if self.tm is None else self.counts[block] * self.tm.size

    def _target(self, block, writing):
        start, count = self.starts[block], self.counts[block]
        if count == 0:
            return None, None
        idx = self.tm.indices(start, count)
        if self.bottom:
            lo, hi = int(idx.min()), int(idx.max()) + 1
            mem = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
            return mem, idx - lo
        if self.base is None:
            raise ValueError(f"message: buffer is None but count is {count}")
        if idx.size and (idx.min() < 0 or idx.max() >= self.base.size):
            raise ValueError(f"message: {count} elements of {self.dtype.Get_name() or 'the datatype'} (extent "
                             f"{self.tm.extent}) from byte {start} do not fit a buffer of {self.base.size} bytes")
        return self.base, idx

    def pack(self, block=0):
        """Return a copy of block ``block``'s elements in pack order (uint8)."""
        mem, idx = self._target(block, False)
        if mem is None:
            return np.zeros(0, np.uint8)
        if self.tm.contiguous:
            return mem[idx[0]: idx[-1] + 1].copy()
        return mem[idx]

    def view(self, block=0):
        """Return block ``block`` as a uint8 view (contiguous datatypes only), else None."""
        if not self.tm.contiguous or self.bottom:
            return None
        mem, idx = self._target(block, True)
        return np.zeros(0, np.uint8) if mem is None else mem[idx[0]: idx[-1] + 1]

    def unpack(self, data, block=0, what="message"):
        """Write packed ``data`` into block ``block``; raise ERR_TRUNCATE if it does not fit."""
        capacity = self.nbytes(block)
        if data.nbytes > capacity:
            raise mpi_error(MPI.ERR_TRUNCATE, f"{what}: message truncated ({data.nbytes} bytes into room for "
                                              f"{capacity} bytes: {self.counts[block]} x "
                                              f"{self.dtype.Get_name() or 'datatype'})")
        if data.nbytes == 0:
            return 0
        mem, idx = self._target(block, True)
        if self.tm.contiguous:
            mem[idx[0]: idx[0] + data.nbytes] = data
        else:
            mem[idx[: data.nbytes]] = data
        return data.nbytes


def _items(spec):
    """Split a spec into (buf, count, displ, type) as mpi4py does (any may be None)."""
    if isinstance(spec, (list, tuple)):
        n = len(spec)
        buf = count = displ = dtype = None
        if n == 2:
            buf, count = spec
            if isinstance(count, (MPI.Datatype, str)):
                count, dtype = None, count
            elif isinstance(count, (tuple, list)):
                count, displ = count
        elif n == 3:
            buf, count, dtype = spec
            if isinstance(count, (tuple, list)):
                count, displ = count
        elif n == 4:
            buf, count, displ, dtype = spec
        else:
            raise ValueError(f"message: expecting 2 to 4 items, got {n}")
        return buf, count, displ, dtype, True
    return spec, None, None, None, False


def _basic(buf, dtype, readonly):
    if buf is MPI.BOTTOM:
        return None, to_datatype(dtype) if dtype is not None else None, True
    if buf is None:
        dt = to_datatype(dtype) if dtype is not None else None
        return None, dt, False
    base, fmt_dt = _buffer(buf, readonly, need_format=dtype is None)
    return base, (to_datatype(dtype) if dtype is not None else fmt_dt), False


def _check_spec(spec):
    if spec is None or spec is MPI.BOTTOM or isinstance(spec, (list, tuple)):
        return
    if hasattr(spec, "__dlpack_device__") or hasattr(spec, "__cuda_array_interface__"):
        return
    try:
        memoryview(spec)
    except TypeError:
        raise TypeError(f"message: expecting buffer or list/tuple (got {type(spec).__name__})") from None


def simple(spec, readonly=True, blocks=0, null=False):
    """Parse a block-variant spec: ``blocks`` equal blocks (0 or 1: one block)."""
    if null:
        return Msg(None, None, [0] * max(blocks, 1), [0] * max(blocks, 1))
    _check_spec(spec)
    buf, count, displ, dtype, _ = _items(spec)
    if spec is None:
        raise TypeError("message: expecting buffer or list/tuple (got None)")
    base, dt, bottom = _basic(buf, dtype, readonly)
    if dt is None and (count or base is not None and base.size):
        raise ValueError("message: cannot infer datatype (buffer is None)")
    tm = typemap(dt) if dt is not None else None
    length = 0 if base is None else base.size
    offset = 0
    if displ is not None:
        displ = int(displ)
        if displ < 0:
            raise ValueError(f"message: negative displacement {displ}")
        if displ > 0:
            if tm.extent <= 0:
                raise ValueError(f"message: cannot handle displacement, datatype extent {tm.extent}")
            if displ * tm.extent > length:
                raise ValueError(f"message: displacement {displ} out of bounds, "
                                 f"number of datatype entries {length // tm.extent}")
            offset = displ * tm.extent
            length -= offset
    if count is not None:
        count = int(count)
        if count < 0:
            raise ValueError(f"message: negative count {count}")
        if count > 0 and buf is None:
            raise ValueError(f"message: buffer is None but count is {count}")
    elif length > 0:
        if tm.extent <= 0:
            raise ValueError(f"message: cannot infer count, datatype extent {tm.extent}")
        if length % tm.extent:
            raise ValueError(f"message: cannot infer count, buffer length {length} is not a multiple of "
                             f"datatype extent {tm.extent}")
        count = length // tm.extent
        if blocks >= 2:
            if count % blocks:
                raise ValueError(f"message: cannot infer count, number of entries {count} is not a multiple of "
                                 f"required number of blocks {blocks}")
            count //= blocks
    else:
        count = 0
    nb = max(blocks, 1)
    step = count * (tm.extent if tm is not None else 0)
    return Msg(base, dt if dt is not None else MPI.BYTE, [count] * nb,
               [offset + i * step for i in range(nb)], bottom)


def _int_list(values, blocks, what):
    values = [int(v) for v in values]
    if len(values) != blocks:
        raise ValueError(f"message: expecting {blocks} {what}, got {len(values)}")
    return values


def vector(spec, readonly=True, blocks=1, null=False):
    """Parse a vector-variant spec (Gatherv, Alltoallv...): per-block counts and displacements."""
    if null:
        return Msg(None, None, [0] * blocks, [0] * blocks)
    _check_spec(spec)
    if spec is None:
        raise TypeError("message: expecting buffer or list/tuple (got None)")
    buf = counts = displs = dtype = None
    if isinstance(spec, (list, tuple)):
        n = len(spec)
        if n == 2:
            buf, counts = spec
            if isinstance(counts, (MPI.Datatype, str)):
                counts, dtype = None, counts
            elif isinstance(counts, tuple):
                counts, displs = counts
        elif n == 3:
            buf, counts, dtype = spec
            if isinstance(counts, tuple):
                counts, displs = counts
        elif n == 4:
            buf, counts, displs, dtype = spec
        else:
            raise ValueError(f"message: expecting 2 to 4 items, got {n}")
    else:
        buf = spec
    base, dt, bottom = _basic(buf, dtype, readonly)
    if dt is None:
        dt = MPI.BYTE
    tm = typemap(dt)
    if counts is None:
        total = 0
        size = 0 if base is None else base.size
        if size:
            if tm.extent <= 0 or size % tm.extent:
                raise ValueError(f"message: cannot infer count, buffer length {size} is not a multiple of "
                                 f"datatype extent {tm.extent}")
            total = size // tm.extent
        counts = [total // blocks + (total % blocks > i) for i in range(blocks)]
    elif isinstance(counts, (int, np.integer)):
        counts = [int(counts)] * blocks
    else:
        counts = _int_list(counts, blocks, "counts")
    if displs is None:
        displs = [sum(counts[:i]) for i in range(blocks)]
    elif isinstance(displs, (int, np.integer)):
        displs = [int(displs) * i for i in range(blocks)]
    else:
        displs = _int_list(displs, blocks, "displacements")
    return Msg(base, dt, counts, [d * tm.extent for d in displs], bottom)


class MsgW:
    """Alltoallw side: per-block count, byte displacement and datatype."""

    def __init__(self, spec, readonly, blocks):
        n = len(spec)
        if n == 2:
            buf, types = spec
            counts = displs = None
        elif n == 3:
            buf, (counts, displs), types = spec
        elif n == 4:
            buf, counts, displs, types = spec
        else:
            raise ValueError(f"message: expecting 2 to 4 items, got {n}")
        if isinstance(types, (MPI.Datatype, str)):
            types = [types] * blocks
        base, _, bottom = _basic(buf, MPI.BYTE, readonly)
        if counts is None:
            counts, displs = [1] * blocks, [0] * blocks
        types = list(types)
        if len(types) != blocks:
            raise ValueError(f"message: expecting {blocks} datatypes, got {len(types)}")
        self.msgs = [Msg(base, to_datatype(t), [c], [d], bottom)
                     for t, c, d in zip(types, _int_list(counts, blocks, "counts"), _int_list(displs, blocks, "displacements"))]


def vector_w(spec, readonly=True, blocks=1):
    """Parse an Alltoallw spec."""
    return MsgW(spec, readonly, blocks)
