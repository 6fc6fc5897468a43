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
import operator
import sys
import threading

import numpy as np
from mpi4py import MPI

from .errors import mpi_error

__all__ = ["Msg", "simple", "vector", "vector_w", "typemap", "to_datatype", "c_int"]


def c_int(value):
    """Return ``value`` as mpi4py reads a C int argument (a rank, tag or root): through ``__int__``.

    So a float (or numpy float) is truncated, as mpi4py does, and a str, None or complex raises TypeError;
    NaN raises ValueError (``float.__int__``'s) and a value outside C int's range OverflowError.
    """
    if type(value) is int:
        result = value
    else:
        to_int = getattr(type(value), "__int__", None)
        if to_int is None:
            raise TypeError(f"an integer is required (got {type(value).__name__}: {value!r:.40})")
        result = to_int(value)
    if not -2 ** 31 <= result < 2 ** 31:
        raise OverflowError(f"value too large to convert to int (got {value!r:.40})")
    return result

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
        made = []
        try:
            exact = _byte_exact(dt, made)
            struct = MPI.Datatype.Create_struct([1], [-tlb], [exact])
            made.append(struct)
            shifted = struct.Create_resized(0, span).Commit()
            made.append(shifted)
            k = np.arange(span, dtype=np.int64)
            offsets = np.zeros(size, np.intp)
            out = np.empty(size, np.uint8)
            for plane in range(0, max(1, int(span - 1).bit_length()), 8):
                shifted.Pack(((k >> plane) & 0xFF).astype(np.uint8), out, 0, MPI.COMM_SELF)
                offsets |= out.astype(np.intp) << plane
        finally:
            for t in made:
                t.Free()
        tm = TypeMap(offsets + tlb, extent, size, lb)
    if predefined:
        with _maps_lock:
            _maps[key] = tm
    return tm


# MPICH packs a long double inside a derived type with a typed copy that moves 10 of its 16 bytes, so the
# numbered-buffer trick below would learn garbage offsets: it learns the layout of a stand-in instead in which
# every predefined leaf type is plain bytes (same size, extent and position). Pair types keep their own
# layout (their padding is not data), except long double + int, spelled out.
_PAIR_BYTES = {MPI.LONG_DOUBLE_INT.handle: ([MPI.LONG_DOUBLE.Get_size(), MPI.INT.Get_size()],
                                            [0, MPI.LONG_DOUBLE.Get_extent()[1]])}


def _leaf_bytes(dt):
    """(block lengths, displacements) of the bytes of predefined ``dt``, or None to keep ``dt`` as it is."""
    if dt.handle in _PAIR_BYTES:
        return _PAIR_BYTES[dt.handle]
    lb, extent = dt.Get_extent()
    size = dt.Get_size()
    return ([size], [0]) if size == extent and lb == 0 and size > 0 else None


def _byte_exact(dt, made):
    """``dt`` with its predefined leaf types replaced by bytes of the same layout (rebuilt from MPI's own
    description of ``dt``); new handles are appended to ``made``."""
    base, combiner, params = dt.decode()
    if combiner == "NAMED":
        blocks = _leaf_bytes(dt)
        if blocks is None:
            return dt
        lb, extent = dt.Get_extent()
        raw = MPI.Datatype.Create_struct(blocks[0], blocks[1], [MPI.BYTE] * len(blocks[0]))
        made.append(raw)
        new = raw.Create_resized(lb, extent)
        made.append(new)
        return new
    made.extend(t for t in ([base] + list(params.get("datatypes", []))) if not t.is_predefined)
    if combiner == "STRUCT":
        params = dict(params, datatypes=[_byte_exact(t, made) for t in params["datatypes"]])
    else:
        base = _byte_exact(base, made)
    new = MPI._datatype_create(base, combiner, params)
    made.append(new)
    return new


_FOREIGN_ORDER = ">!" if sys.byteorder == "little" else "<"


def _format_datatype(fmt):
    if fmt and fmt[0] in _FOREIGN_ORDER:
        raise BufferError(f"message: byte order of buffer format {fmt!r} is not the machine's; "
                          f"pass the datatype explicitly ([buf, MPI.INT])")
    if fmt and fmt[0] in "@=<>!":
        fmt = fmt[1:]
    try:
        return _TYPEDICT[fmt]
    except KeyError:
        raise KeyError(f"message: cannot map buffer format {fmt!r} to MPI datatype") from None


_DEVICE_MODULES = ("cupy", "numba", "torch", "jax", "tensorflow")
_DL_HOST_DEVICES = (1, 3, 11)  # kDLCPU, kDLCUDAHost, kDLROCMHost: memory this process can read
_DL_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}  # DLPack type code -> numpy kind


def _dlpack_format(obj):
    """The numpy type of a DLPack tensor's elements (None if it has no plain one), read from a fresh capsule."""
    device = obj.__dlpack_device__()
    stream = None if device[0] == 1 else -1
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__(stream=stream)
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = get_name(capsule)
    # DLManagedTensorVersioned starts with version, manager_ctx, deleter and flags (32 bytes) before the
    # DLTensor; the unversioned DLManagedTensor starts with it. DLTensor's dtype (code, bits, lanes) is at 20.
    tensor = get_pointer(capsule, name) + (32 if name == b"dltensor_versioned" else 0)
    code, bits, lanes = ctypes.c_uint8.from_address(tensor + 20).value, \
        ctypes.c_uint8.from_address(tensor + 21).value, ctypes.c_uint16.from_address(tensor + 22).value
    del capsule
    if lanes == 2 and code == 2 and bits in (32, 64, 8 * np.dtype(np.longdouble).itemsize):
        return np.dtype(f"c{bits // 4}")  # a pair of floats is a complex number, as mpi4py reads it
    if lanes != 1 or code not in _DL_KINDS or bits % 8:
        return None
    try:
        return np.dtype(f"{_DL_KINDS[code]}{bits // 8}")
    except TypeError:
        return None


def _device_buffer(obj, readonly, need_format):
    """(uint8 array, format datatype) of a DLPack or ``__cuda_array_interface__`` object without the buffer
    protocol. mpi4py's own reader (``MPI.buffer.frombuffer``) checks it exactly as MPI calls would (version,
    contiguity, writability) and gives its address; memory a GPU library allocated is not simulated."""
    dlpack = hasattr(obj, "__dlpack_device__")
    on_device = (dlpack and obj.__dlpack_device__()[0] not in _DL_HOST_DEVICES) or (
        not dlpack and hasattr(obj, "__cuda_array_interface__"))
    if on_device and type(obj).__module__.split(".")[0] in _DEVICE_MODULES:
        raise NotImplementedError(f"message: device buffers are not simulated ({type(obj).__module__}."
                                  f"{type(obj).__name__}); stage through host memory")
    # Anything else (test doubles, shims) points at host memory, which we read the way MPI would.
    found = MPI.buffer.frombuffer(obj, readonly=readonly)
    if found.nbytes:
        data = np.frombuffer(MPI.buffer.fromaddress(found.address, found.nbytes, readonly=found.readonly), np.uint8)
    else:
        data = np.zeros(0, np.uint8)
    fmt_dt = None
    if need_format:
        if dlpack:
            dtype = _dlpack_format(obj)
        else:
            typestr = obj.__cuda_array_interface__["typestr"]
            if typestr[:1] not in "<>|=" or typestr[:1] in _FOREIGN_ORDER:
                raise BufferError(f"__cuda_array_interface__: typestr {typestr!r} is not in the machine's byte order")
            dtype = np.dtype("=" + typestr[1:])
        fmt_dt = _TYPEDICT.get(dtype.char, MPI.BYTE) if dtype is not None else MPI.BYTE
    return data, fmt_dt


def _buffer(obj, readonly, need_format=True):
    """Return (uint8 array over the whole buffer, its default datatype)."""
    try:
        view = memoryview(obj)
    except TypeError:
        if hasattr(obj, "__dlpack_device__") or hasattr(obj, "__cuda_array_interface__"):
            return _device_buffer(obj, readonly, need_format)
        raise TypeError(f"message: expecting buffer or list/tuple (got {type(obj).__name__})") from None
    if not view.contiguous:
        raise BufferError(f"message: buffer is not contiguous (shape: {view.shape}, strides: {view.strides})")
    if not readonly and view.readonly:
        raise BufferError(f"message: buffer is not writable ({type(obj).__name__})")
    if not view.nbytes:
        data = np.zeros(0, np.uint8)
    elif view.c_contiguous:
        data = np.frombuffer(view, dtype=np.uint8)
    else:  # Fortran order: the memory itself, in memory order (a view, so receives write through)
        data = np.asarray(view).ravel(order="K").view(np.uint8)
    return data, (_format_datatype(view.format) if need_format else None)


class Msg:
    """One side of a message: a byte view of the buffer, datatype, and per-block counts/displacements."""

    __slots__ = ("base", "dtype", "tm", "counts", "starts", "bottom")

    def __init__(self, base, dtype, counts, starts, bottom=False, tm=None):
        self.base, self.dtype, self.counts, self.starts, self.bottom = base, dtype, counts, starts, bottom
        self.tm = tm if tm is not None else typemap(dtype) if dtype is not None else None

    @property
    def count(self):
        return self.counts[0]

    def nbytes(self, block=0):
        return 0 if self.tm is None else self.counts[block] * self.tm.size

    def _span(self, block):
        """(start, stop) bytes of block ``block`` of a contiguous datatype in ``base`` (bounds checked)."""
        start = self.starts[block]
        stop = start + self.counts[block] * self.tm.size
        if self.base is None:
            raise ValueError(f"message: buffer is None but count is {self.counts[block]}")
        if start < 0 or stop > self.base.size:
            raise ValueError(f"message: {self.counts[block]} elements of {self.dtype.Get_name() or 'the datatype'} "
                             f"(extent {self.tm.extent}) from byte {start} do not fit a buffer of "
                             f"{self.base.size} bytes")
        return start, stop

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
        if self.tm is None or self.counts[block] == 0:
            return _EMPTY
        if self.tm.contiguous and not self.bottom:
            start, stop = self._span(block)
            return self.base[start:stop].copy()
        mem, idx = self._target(block, False)
        return mem[idx]

    def view(self, block=0):
        """Return block ``block`` as a uint8 view (contiguous datatypes only), else None."""
        if self.tm is None or not self.tm.contiguous or self.bottom:
            return None
        if self.counts[block] == 0:
            return _EMPTY
        start, stop = self._span(block)
        return self.base[start:stop]

    def unpack(self, data, block=0, what="message"):
        """Write packed ``data`` into block ``block``; raise ERR_TRUNCATE if it does not fit."""
        nbytes = data.nbytes
        capacity = 0 if self.tm is None else self.counts[block] * self.tm.size
        if nbytes > capacity:
            raise mpi_error(MPI.ERR_TRUNCATE, f"{what}: message truncated ({nbytes} bytes into room for "
                                              f"{capacity} bytes: {self.counts[block]} x "
                                              f"{self.dtype.Get_name() or 'datatype'})")
        if nbytes == 0:
            return 0
        if self.tm.contiguous and not self.bottom:
            start, _ = self._span(block)
            self.base[start: start + nbytes] = data
            return nbytes
        mem, idx = self._target(block, True)
        mem[idx[:nbytes]] = data
        return nbytes


_EMPTY = np.zeros(0, np.uint8)
_EMPTY.flags.writeable = False


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


_NUMPY_TYPES = {}  # numpy dtype -> MPI datatype (None: not a plain native type; the general path decides)


def _numpy_msg(arr, readonly, blocks):
    """The Msg of a plain C-contiguous numpy array of a predefined type, or None (then the general path
    parses it, with its errors). The common case, read without the buffer protocol's detour."""
    dtype = arr.dtype
    try:
        dt, tm = _NUMPY_TYPES[dtype]
    except KeyError:
        plain = dtype.isnative and dtype.fields is None and dtype.subdtype is None
        dt = _TYPEDICT.get(dtype.char) if plain else None
        tm = typemap(dt) if dt is not None else None
        if tm is None or tm.extent != dtype.itemsize:
            dt = tm = None
        _NUMPY_TYPES[dtype] = dt, tm
    if dt is None:
        return None
    flags = arr.flags
    if not flags.c_contiguous or (not readonly and not flags.writeable):
        return None
    count = arr.size
    if blocks >= 2:
        if count % blocks:
            return None
        count //= blocks
    nb = max(blocks, 1)
    step = count * tm.extent
    base = np.frombuffer(arr, np.uint8) if arr.size else _EMPTY  # a view: receives write through
    return Msg(base, dt, [count] * nb, [i * step for i in range(nb)], False, tm)


def numpy_bytes(arr, readonly):
    """The uint8 view (one block) that ``simple`` would make of numpy array ``arr``, or None where ``simple``
    must parse it (not C-contiguous, not a predefined type, read-only for a receive): the check of the
    point-to-point fast paths, without building a ``Msg``."""
    try:
        dt = _NUMPY_TYPES[arr.dtype][0]
    except KeyError:
        _numpy_msg(arr, readonly, 0)  # fills the table
        dt = _NUMPY_TYPES[arr.dtype][0]
    if dt is None:
        return None
    flags = arr.flags
    if not flags.c_contiguous or (not readonly and not flags.writeable):
        return None
    return np.frombuffer(arr, np.uint8) if arr.size else _EMPTY


def simple(spec, readonly=True, blocks=0, null=False):
    """Parse a block-variant spec: ``blocks`` equal blocks (0 or 1: one block)."""
    if null:
        return Msg(None, None, [0] * max(blocks, 1), [0] * max(blocks, 1))
    if type(spec) is np.ndarray:
        msg = _numpy_msg(spec, readonly, blocks)
        if msg is not None:
            return msg
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
        displ = operator.index(displ)
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
        count = operator.index(count)
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
    values = [operator.index(v) for v in values]  # 3.1 is a TypeError, as in mpi4py
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
    elif np.ndim(counts) == 0:  # one count for every block (an int, a numpy scalar or 0-d array)
        counts = [operator.index(counts)] * blocks
    else:
        counts = _int_list(counts, blocks, "counts")
    if displs is None:
        displs = [sum(counts[:i]) for i in range(blocks)]
    elif np.ndim(displs) == 0:
        displs = [operator.index(displs) * i for i in range(blocks)]
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
        if buf is MPI.BOTTOM and (counts is None or displs is None):  # as mpi4py's message_vector_w
            raise ValueError(f"message: BOTTOM requires {'counts' if counts is None else 'displs'}")
        base, _, bottom = _basic(buf, MPI.BYTE, readonly)
        if counts is None and displs is None:
            counts, displs = [1] * blocks, [0] * blocks
        types = list(types)
        if len(types) != blocks:
            raise ValueError(f"message: expecting {blocks} datatypes, got {len(types)}")
        self.msgs = [Msg(base, to_datatype(t), [c], [d], bottom)
                     for t, c, d in zip(types, _int_list(counts, blocks, "counts"), _int_list(displs, blocks, "displacements"))]


def vector_w(spec, readonly=True, blocks=1):
    """Parse an Alltoallw spec."""
    return MsgW(spec, readonly, blocks)
