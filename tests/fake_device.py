"""A numpy-backed stand-in for one rank's GPU, to test the GPU paths on the CPU.

- ``FakeDeviceArray`` wraps a numpy array and offers only what the paths use (slicing, reshape,
  view, shape/dtype/size). It has no buffer protocol, so handing one to MPI (real or simulated)
  fails loudly, as it would segfault on a real non-CUDA-aware MPI.
- Streams are queues: device work (copies, reductions, async D2H/H2D) runs only when its stream is
  synchronized, an event recorded after it is synchronized, or a stream that waits on such an event
  runs. So a missing synchronization makes MPI (or a peer) read stale data: wrong numbers, not luck.
- Every action is appended to ``device.log`` as a tuple: ``("sync", stream)``, ``("event_sync",
  stream, index)``, ``("wait_event", stream, on_stream, index)``, ``("d2h"|"h2d", byte offset in
  its pinned buffer, nbytes, stream)``, ``("pinned_alloc", nbytes)``, ``("ipc_alloc", nbytes)``,
  ``("ipc_handle", handle)``, ``("ipc_open", handle)``, ``("ipc_close",)``, ``("mpi_buffer",)``,
  ``("nccl", op)``; ``RecordingComm`` adds ``("mpi", Method)`` for every uppercase MPI call.
- CUDA IPC inside one process: a handle is a key into a process-global registry of arrays, so in
  the simulator (ranks are threads) "opening" a peer's handle maps its numpy memory. Under real
  MPI the ranks are processes and the registry cannot span them: IPC is tested on SimComm only.
"""

import itertools
import sys
import threading
import types

import numpy as np
from mpi4py import MPI

from mpidist.gpu.device import DeviceAPI, NcclComm
from mpidist.wire import OP_BY_NAME

_SENTINEL = 0x5A  # fresh fake memory is filled with this byte, so reading it unwritten shows


class FakeSegfault(RuntimeError):
    """A device buffer reached an MPI that never said it supports CUDA (a real one would crash)."""


class FakeDeviceArray:
    """A 'device array': numpy memory that MPI cannot see."""

    __slots__ = ("a", "device", "__weakref__")

    def __init__(self, a, device):
        self.a, self.device = a, device

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    ndim = property(lambda self: self.a.ndim)
    strides = property(lambda self: self.a.strides)
    flags = property(lambda self: self.a.flags)

    def __len__(self):
        return len(self.a)

    def __getitem__(self, key):
        return type(self)(self.a[key], self.device)

    def reshape(self, *shape):
        return type(self)(self.a.reshape(*shape), self.device)

    def view(self, dtype):
        return type(self)(self.a.view(dtype), self.device)

    def __repr__(self):
        return f"FakeDeviceArray({self.a!r})"


class FakeStream:
    """An in-order queue of device work."""

    def __init__(self, name, eager=False):
        self.name, self.eager = name, eager  # eager: work runs when queued (FakeCupy's host-side ops read at once)
        self.queue = []
        self.done = 0

    def enqueue(self, fn):
        self.queue.append(fn)
        if self.eager:
            self.run_until(len(self.queue))

    def run_until(self, index):
        while self.done < index:
            fn = self.queue[self.done]
            self.done += 1
            fn()

    def __repr__(self):
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self, stream, index):
        self.stream, self.index = stream, index


_ipc_registry = {}
_ipc_ids = itertools.count(1)
_ipc_lock = threading.Lock()


def _fill(n, dtype):
    a = np.empty(int(n), dtype=dtype)
    a.view(np.uint8)[...] = _SENTINEL
    return a


class FakeDevice(DeviceAPI):
    """One rank's fake GPU. ``key`` names the physical GPU (equal keys on one node = shared GPU).

    cuda_aware: the MPI really takes device buffers (``mpi_buffer`` gives MPI the fake memory);
    lying: the MPI says yes but does not (``mpi_buffer`` gives MPI a copy, so results are lost);
    otherwise ``mpi_buffer`` raises ``FakeSegfault``. nccl: NCCL is usable. ipc: peers' handles open.
    """

    name = "fake"

    def __init__(self, key="fake-gpu-0", *, cuda_aware=False, lying=False, nccl=False, ipc=True, arrays=None):
        self.key, self.cuda_aware, self.lying, self.nccl, self.ipc = key, cuda_aware, lying, nccl, ipc
        # arrays: the device array type; FakeCupyArray makes the current stream eager, because nn's arithmetic
        # on FakeCupyArray runs at once on the host, not queued behind the collectives' copies as CuPy's would be.
        self.arrays = arrays or FakeDeviceArray
        self.log = []
        self.current = FakeStream("current", eager=self.arrays is not FakeDeviceArray)
        self._streams = itertools.count(1)
        self.pinned = []

    # -- arrays --------------------------------------------------------------------------------------
    def device_key(self):
        return self.key

    def is_device_array(self, x):
        return isinstance(x, FakeDeviceArray)

    def empty(self, n, dtype):
        return self.arrays(_fill(n, dtype), self)

    def asarray(self, host):
        return self.arrays(np.array(host), self)

    def to_numpy(self, x):
        self.synchronize(self.current)
        return x.a.copy()

    def flat(self, x):
        if x.flags.c_contiguous:
            return x.reshape(-1), False
        out = self.empty(x.size, x.dtype)
        src, dst = x.a, out.a
        self.current.enqueue(lambda: dst.__setitem__(Ellipsis, src.reshape(-1)))
        return out, True

    def _check_pair(self, what, dst, src):
        if dst.size != src.size or dst.dtype != src.dtype:
            raise ValueError(f"FakeDevice.{what}: size/dtype mismatch ({dst.size} {dst.dtype} <- {src.size} {src.dtype})")

    def copy(self, dst, src):
        self._check_pair("copy", dst, src)
        d, s = dst.a, src.a
        self.current.enqueue(lambda: d.__setitem__(Ellipsis, s))

    def assign(self, dst, src):
        self._check_pair("assign", dst, src)
        d, s = dst.a, src.a
        self.current.enqueue(lambda: d.__setitem__(Ellipsis, s.reshape(d.shape)))

    def reduce_into(self, acc, other, op_name):
        self._check_pair("reduce_into", acc, other)
        fn, a, b = getattr(np, OP_BY_NAME[op_name].ufunc), acc.a, other.a
        self.current.enqueue(lambda: fn(a, b, out=a))

    def divide(self, x, n):
        a = x.a
        self.current.enqueue(lambda: np.true_divide(a, n, out=a))

    def elementwise(self, fn, dst, src):
        d, s = dst.a, src.a
        self.current.enqueue(lambda: fn(d, s))

    # -- streams -------------------------------------------------------------------------------------
    def current_stream(self):
        return self.current

    def new_stream(self):
        return FakeStream(f"s{next(self._streams)}")

    def synchronize(self, stream):
        self.log.append(("sync", stream.name))
        stream.run_until(len(stream.queue))

    def record_event(self, stream):
        return FakeEvent(stream, len(stream.queue))

    def event_synchronize(self, event):
        self.log.append(("event_sync", event.stream.name, event.index))
        event.stream.run_until(event.index)

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream.name, event.stream.name, event.index))
        stream.enqueue(lambda: event.stream.run_until(event.index))

    # -- pinned staging ------------------------------------------------------------------------------
    def pinned_empty(self, n, dtype):
        a = _fill(n, dtype)
        self.pinned.append(a)
        self.log.append(("pinned_alloc", a.nbytes))
        return a

    def _offset(self, host):
        ptr = host.__array_interface__["data"][0]
        for base in self.pinned:
            lo = base.__array_interface__["data"][0]
            if lo <= ptr <= lo + base.nbytes:
                return ptr - lo
        raise ValueError(f"FakeDevice: host buffer is not pinned memory from pinned_empty (shape {host.shape})")

    def d2h_async(self, host, dev, stream):
        self._check_pair("d2h_async", host, dev)
        self.log.append(("d2h", self._offset(host), host.nbytes, stream.name))
        h, d = host, dev.a
        stream.enqueue(lambda: h.__setitem__(Ellipsis, d))

    def h2d_async(self, dev, host, stream):
        self._check_pair("h2d_async", dev, host)
        self.log.append(("h2d", self._offset(host), host.nbytes, stream.name))
        h, d = host, dev.a
        stream.enqueue(lambda: d.__setitem__(Ellipsis, h))

    # -- IPC -----------------------------------------------------------------------------------------
    def ipc_alloc(self, n, dtype):
        arr = self.empty(n, dtype)
        self.log.append(("ipc_alloc", arr.nbytes))
        return arr

    def ipc_handle(self, arr):
        with _ipc_lock:
            handle = next(_ipc_ids).to_bytes(64, "little")
            _ipc_registry[handle] = arr.a
        self.log.append(("ipc_handle", handle))
        return handle

    def ipc_open(self, handle, n, dtype):
        self.log.append(("ipc_open", handle))
        if not self.ipc:
            raise RuntimeError("cudaErrorPeerAccessUnsupported (fake)")
        with _ipc_lock:
            a = _ipc_registry[bytes(handle)]
        if a.size < n or a.dtype != np.dtype(dtype):
            raise ValueError(f"FakeDevice.ipc_open: peer buffer is {a.size} {a.dtype}, asked for {n} {np.dtype(dtype)}")
        return self.arrays(a[:n], self)

    def ipc_close(self, arr):
        self.log.append(("ipc_close",))

    # -- CUDA-aware MPI, NCCL --------------------------------------------------------------------------
    def mpi_buffer(self, x):
        self.log.append(("mpi_buffer",))
        if self.lying:
            return x.a.copy()
        if not self.cuda_aware:
            raise FakeSegfault("a device buffer was handed to an MPI that does not support CUDA")
        return x.a

    def nccl_status(self):
        return (True, "fake NCCL") if self.nccl else (False, "fake device without NCCL")

    def nccl_unique_id(self):
        return ("fake-nccl-id",)

    def nccl_comm(self, comm, unique_id):
        if not self.nccl:
            raise RuntimeError("FakeDevice: NCCL is not available")
        return FakeNccl(self, comm.Dup())


FAKE_NCCL_DTYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"}
_NCCL_MPI_OPS = {"SUM": MPI.SUM, "PROD": MPI.PROD, "MIN": MPI.MIN, "MAX": MPI.MAX}


def _mpi_reduction(a):
    """Return the array MPI reduces for fake NCCL's ``a``: a float32 copy for float16, which NCCL reduces but an
    MPI without a float16 datatype (Open MPI 4) cannot; else ``a`` itself."""
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _mpi_copy(a):
    """Return ``a`` as fake NCCL's MPI stand-in copies it: float16 as its uint16 bit patterns."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


class FakeNccl(NcclComm):
    """NCCL calls done with MPI on the fake memory, after the stream's earlier work (stream order)."""

    def __init__(self, device, comm):
        self.device, self.comm = device, comm

    def _start(self, what, stream, *arrays):
        if stream is not self.device.current:
            raise AssertionError(f"FakeNccl.{what}: expected the current stream (got {stream})")
        for a in arrays:
            if a.dtype.name not in FAKE_NCCL_DTYPES:
                raise TypeError(f"FakeNccl.{what}: NCCL has no type for {a.dtype}")
        self.device.log.append(("nccl", what))
        stream.run_until(len(stream.queue))

    def allreduce(self, send, recv, op_name, stream):
        self._start("allreduce", stream, send, recv)
        out = _mpi_reduction(recv.a)
        sbuf = MPI.IN_PLACE if send.a is recv.a or np.shares_memory(send.a, recv.a) else _mpi_reduction(send.a)
        self.comm.Allreduce(sbuf, out, op=_NCCL_MPI_OPS[op_name])
        with np.errstate(over="ignore"):  # a float16 sum past 65504 is inf, as NCCL gives it, without a warning
            recv.a[...] = out

    def bcast(self, buf, root, stream):
        self._start("bcast", stream, buf)
        self.comm.Bcast(_mpi_copy(buf.a), root=root)

    def reduce_scatter(self, send, recv, op_name, stream):
        self._start("reduce_scatter", stream, send, recv)
        if send.size != recv.size * self.comm.Get_size():
            raise ValueError(f"FakeNccl.reduce_scatter: send has {send.size} elements, needs {recv.size} x {self.comm.Get_size()}")
        out = _mpi_reduction(recv.a)
        self.comm.Reduce_scatter_block(_mpi_reduction(send.a), out, op=_NCCL_MPI_OPS[op_name])
        with np.errstate(over="ignore"):
            recv.a[...] = out

    def allgather(self, send, recv, stream):
        self._start("allgather", stream, send, recv)
        self.comm.Allgather(_mpi_copy(send.a), _mpi_copy(recv.a))


class RecordingComm:
    """A communicator that logs every uppercase MPI call into ``log`` as ``("mpi", name)``."""

    _QUIET = {"Get_rank", "Get_size", "Get_name", "Split", "Split_type", "Dup", "Free"}

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr) or not name[:1].isupper() or name in self._QUIET:
            return attr

        def call(*args, **kwargs):
            self._log.append(("mpi", name))
            return attr(*args, **kwargs)
        return call


# -- a numpy-backed CuPy, for nn, DDP and FSDP on "device arrays" ----------------------------------------
# ``install_fake_cupy`` puts ``FakeCupy`` in ``sys.modules["cupy"]``: ``mpidist.xp`` then calls a FakeCupyArray a
# device array (its type's module starts with "cupy") and returns FakeCupy as its array module, so the nn ops,
# the optimizers and DDP/FSDP run their CuPy code paths, and their collectives go through ``mpidist.gpu`` (the
# paths on a FakeDevice whose arrays are FakeCupyArray). As CuPy's arrays, FakeCupyArray refuses implicit
# conversion to numpy (``np.asarray`` raises: host code must call ``.get()``/``mpidist.xp.to_numpy``), has no
# ``__array_interface__``, returns 0-d arrays where numpy returns scalars, and copies host data in ``asarray``.
# ``FakeCupy(bfloat16=False)`` is a CuPy before 14: no bfloat16 arrays.
_fake_cupy_state = {"bfloat16": True, "version": "14.2.0"}


def _unwrap(x):
    if isinstance(x, FakeDeviceArray):
        return x.a
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v) for v in x)
    if type(x) is dict:
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _check_fake_dtype(dtype):
    if not _fake_cupy_state["bfloat16"] and np.dtype(dtype).name == "bfloat16":
        raise TypeError(f"fake CuPy {_fake_cupy_state['version']}: Unsupported dtype bfloat16")


def _wrap(x):
    if type(x) is np.ndarray or isinstance(x, np.generic):
        _check_fake_dtype(x.dtype)
        return FakeCupyArray(np.asarray(x), None)  # CuPy returns 0-d arrays where numpy returns scalars
    if type(x) in (list, tuple):
        return type(x)(_wrap(v) for v in x)
    return x


def _rebuild_fake_cupy(a):
    return FakeCupyArray(a, None)


class FakeCupyArray(np.lib.mixins.NDArrayOperatorsMixin, FakeDeviceArray):
    """A CuPy array of numpy memory: numpy's arithmetic (so results are numpy's bits), CuPy's manners."""

    __slots__ = ()
    __module__ = "cupy._fake"  # what mpidist.xp looks at to call an array a CuPy array

    def __init__(self, a, device=None):
        _check_fake_dtype(a.dtype)
        super().__init__(a, device)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly. (FakeCupyArray, as CuPy)")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out")
        result = getattr(ufunc, method)(*_unwrap(inputs), **_unwrap(kwargs))
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

    def __getattr__(self, name):
        if name in ("a", "device", "__array_interface__", "__array_struct__"):  # a slot not set yet; CuPy has none
            raise AttributeError(name)
        attr = getattr(self.a, name)
        if callable(attr):
            return lambda *args, **kwargs: _wrap(attr(*_unwrap(args), **_unwrap(kwargs)))
        return _wrap(attr)

    @property
    def __cuda_array_interface__(self):
        face = dict(self.a.__array_interface__)
        face["version"] = 3
        return face

    def __getitem__(self, key):
        return _wrap(self.a[_unwrap(key)])

    def __setitem__(self, key, value):
        self.a[_unwrap(key)] = _unwrap(value)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def astype(self, dtype, *args, **kwargs):
        _check_fake_dtype(dtype)
        return _wrap(self.a.astype(dtype, *args, **kwargs))

    def view(self, dtype=None):
        if dtype is not None:
            _check_fake_dtype(dtype)
        return FakeCupyArray(self.a.view() if dtype is None else self.a.view(dtype), self.device)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Return a host copy (CuPy's ``ndarray.get``)."""
        return self.a.copy()

    def __float__(self):
        return float(self.a)

    def __int__(self):
        return int(self.a)

    def __index__(self):
        return self.a.__index__()

    def __bool__(self):
        return bool(self.a)

    def __complex__(self):
        return complex(self.a)

    def __copy__(self):
        return FakeCupyArray(self.a.copy(), self.device)

    def __deepcopy__(self, memo):
        return FakeCupyArray(self.a.copy(), self.device)

    def __reduce__(self):
        return _rebuild_fake_cupy, (self.a,)

    def __repr__(self):
        return f"FakeCupyArray({self.a!r})"


class FakeCupy(types.ModuleType):
    """The ``cupy`` module as mpidist uses it: numpy's functions and ufuncs on FakeCupyArray."""

    def __init__(self, version="14.2.0", bfloat16=True):
        super().__init__("cupy")
        self.__version__, self.supports_bfloat16 = version, bfloat16
        self.ndarray = FakeCupyArray

    def __getattr__(self, name):
        attr = getattr(np, name)
        if isinstance(attr, (np.ufunc, type)) or not callable(attr):
            return attr  # ufuncs dispatch to FakeCupyArray.__array_ufunc__; dtypes and constants are numpy's

        def call(*args, **kwargs):
            if kwargs.get("dtype") is not None:
                _check_fake_dtype(kwargs["dtype"])
            return _wrap(attr(*_unwrap(args), **_unwrap(kwargs)))
        return call

    def asarray(self, x, dtype=None):
        """Return ``x`` as a device array: itself if it is one (of ``dtype``), else a device copy (as CuPy)."""
        if isinstance(x, FakeCupyArray) and (dtype is None or np.dtype(dtype) == x.dtype):
            return x
        return _wrap(np.array(_unwrap(x), dtype=dtype))

    array = asarray

    def asnumpy(self, x):
        return x.get() if isinstance(x, FakeCupyArray) else np.asarray(x)

    def is_available(self):
        return False  # no CUDA here: mpidist.init() and describe() take no GPU for it

    def get_array_module(self, *args):
        return self if any(isinstance(a, FakeCupyArray) for a in args) else np


def install_fake_cupy(monkeypatch, *, version="14.2.0", bfloat16=True):
    """Make ``FakeCupy`` the ``cupy`` module, and fake devices (FakeCupyArray arrays) the GPU paths' default
    device, until the test ends; return the module. ``bfloat16=False``: a CuPy before 14, without bfloat16."""
    import mpidist.gpu.device
    cupy = FakeCupy(version, bfloat16)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(_fake_cupy_state, "bfloat16", bfloat16)
    monkeypatch.setitem(_fake_cupy_state, "version", version)
    # Every communicator's first device collective attaches a path on a new fake device: on SimComm the ranks
    # of one node choose ipc (fake IPC is one process's registry), under mpiexec staged.
    monkeypatch.setattr(mpidist.gpu.device, "CupyDevice", lambda: FakeDevice(arrays=FakeCupyArray))
    return cupy


def to_fake_cupy(module):
    """Move ``module``'s parameters and buffers to FakeCupyArray (same values), as tests/test_gpu.py's to_gpu."""
    for _, p in module.named_parameters():
        p.data = FakeCupyArray(np.array(p.data))
    for m in module.modules():
        for name, b in list(m.named_buffers()):
            if "." not in name:
                setattr(m, name, FakeCupyArray(np.array(b)))
    return module
