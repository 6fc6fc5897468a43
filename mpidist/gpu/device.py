"""The device API the GPU paths are written against, and its CuPy implementation.

The paths (staged.py, ipc.py, hierarchical.py, nccl.py, direct.py) never touch CuPy: they call a
``DeviceAPI``. ``CupyDevice`` is the real one (cupy comes from ``mpidist.xp``, the one module that
imports it); tests/fake_device.py is a numpy-backed one that records every stream sync, copy and
IPC handle and runs queued stream work only when it is synchronized, so a missing sync gives wrong
numbers in a CPU test.

Glossary:
- device array: a flat, C-contiguous array in device memory (a ``cupy.ndarray`` here).
- current stream: the stream the caller's kernels run on; results are ready on it when a
  collective returns.
- pinned buffer: a numpy array in page-locked host memory, so copies to and from it are async.
"""

import threading

import numpy as np

from .. import xp as _xp
from ..wire import OP_BY_NAME, nccl_type

__all__ = ["DeviceAPI", "CupyDevice", "NcclComm"]

# CUDA maps IPC memory per process in 2 MiB granules, and the driver may place small cudaMallocs side by side
# in one granule; a process that opens two such handles of one peer gets cudaErrorAlreadyMapped (seen on an
# H100 with 4 ranks, 2026-11-27). Every arena is therefore a whole number of granules.
IPC_GRANULE_BYTES = 2 << 20

class DeviceAPI:
    """What the GPU paths need from one rank's GPU; every method is one CUDA-level action."""

    name = "abstract"

    def device_key(self):
        """Return a string naming the physical GPU (same GPU on one node <=> same key)."""
        raise NotImplementedError

    def is_device_array(self, x):
        """Return whether ``x`` is an array of this device."""
        raise NotImplementedError

    def empty(self, n, dtype):
        """Return a new flat device array of ``n`` elements."""
        raise NotImplementedError

    def flat(self, x):
        """Return ``(flat, copied)``: a flat C-contiguous view of ``x``, or a contiguous copy made on the current stream."""
        raise NotImplementedError

    def copy(self, dst, src):
        """Copy device array ``src`` into ``dst`` (same size and dtype) on the current stream."""
        raise NotImplementedError

    def assign(self, dst, src):
        """Copy flat ``src`` into ``dst`` of any layout (same size) on the current stream."""
        raise NotImplementedError

    def reduce_into(self, acc, other, op_name):
        """Set ``acc = op(acc, other)`` elementwise on the current stream (``op_name``: a row of ``wire.OPS``)."""
        raise NotImplementedError

    def divide(self, x, n):
        """Divide ``x`` by ``n`` in place on the current stream."""
        raise NotImplementedError

    def elementwise(self, fn, dst, src):
        """Run ``fn(dst, src)`` on the current stream: an elementwise function of array operators writing ``dst``
        (``mpidist.wire``'s conversions, which run as they are on numpy and CuPy arrays)."""
        raise NotImplementedError

    def asarray(self, host):
        """Return a device copy of numpy array ``host`` (synchronous; used by self-tests)."""
        raise NotImplementedError

    def to_numpy(self, x):
        """Return a host copy of ``x`` after the current stream's work on it (synchronous)."""
        raise NotImplementedError

    # -- streams and events ------------------------------------------------------------------------
    def current_stream(self):
        raise NotImplementedError

    def new_stream(self):
        raise NotImplementedError

    def synchronize(self, stream):
        """Block the host until all work queued on ``stream`` has finished."""
        raise NotImplementedError

    def record_event(self, stream):
        """Return an event that completes when the work queued on ``stream`` so far has finished."""
        raise NotImplementedError

    def event_synchronize(self, event):
        """Block the host until ``event`` has completed."""
        raise NotImplementedError

    def wait_event(self, stream, event):
        """Make later work on ``stream`` wait for ``event`` (no host blocking)."""
        raise NotImplementedError

    # -- pinned host staging ------------------------------------------------------------------------
    def pinned_empty(self, n, dtype):
        """Return a numpy array of ``n`` elements in pinned host memory."""
        raise NotImplementedError

    def d2h_async(self, host, dev, stream):
        """Queue a copy of device array ``dev`` into pinned ``host`` (same size) on ``stream``."""
        raise NotImplementedError

    def h2d_async(self, dev, host, stream):
        """Queue a copy of pinned ``host`` into device array ``dev`` (same size) on ``stream``."""
        raise NotImplementedError

    # -- same-node CUDA IPC ---------------------------------------------------------------------------
    def ipc_alloc(self, n, dtype):
        """Return a flat device array in its own allocation (not a pool block), fit for an IPC handle."""
        raise NotImplementedError

    def ipc_handle(self, arr):
        """Return the IPC handle (bytes) of an array made by ``ipc_alloc``."""
        raise NotImplementedError

    def ipc_open(self, handle, n, dtype):
        """Return a device array over a peer's allocation from its IPC handle."""
        raise NotImplementedError

    def ipc_close(self, arr):
        """Release an array returned by ``ipc_open``."""
        raise NotImplementedError

    # -- CUDA-aware MPI and NCCL ----------------------------------------------------------------------
    def mpi_buffer(self, x):
        """Return what to hand to a CUDA-aware MPI for device array ``x`` (never call on another MPI)."""
        raise NotImplementedError

    def nccl_status(self):
        """Return ``(available, reason)`` for NCCL on this rank."""
        raise NotImplementedError

    def nccl_unique_id(self):
        """Return a new NCCL unique id (picklable), made on the rank that broadcasts it."""
        raise NotImplementedError

    def nccl_comm(self, comm, unique_id):
        """Return an ``NcclComm`` over the ranks of ``comm`` (collective over ``comm``)."""
        raise NotImplementedError


class NcclComm:
    """The NCCL calls the NCCL path uses, on device arrays and the current stream."""

    def allreduce(self, send, recv, op_name, stream):
        raise NotImplementedError

    def bcast(self, buf, root, stream):
        raise NotImplementedError

    def reduce_scatter(self, send, recv, op_name, stream):
        """Equal blocks: rank r gets block r (``recv.size`` elements) of the reduction."""
        raise NotImplementedError

    def allgather(self, send, recv, stream):
        """Equal blocks: ``recv`` holds every rank's ``send`` in rank order."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------
class CupyDevice(DeviceAPI):
    """The device API on CuPy's current device (run on an H100 on 2026-11-27; see docs/gpu.md)."""

    name = "cupy"

    def __init__(self):
        cp = _xp.get_cupy()
        if cp is None:
            raise RuntimeError("mpidist.gpu: cupy is not installed (pip install 'mpidist[gpu]')")
        self.cp = cp
        self.rt = cp.cuda.runtime

    def device_key(self):
        # The PCI bus id, not the device index: with CUDA_VISIBLE_DEVICES per rank, index 0 can be
        # a different GPU in every process.
        return str(self.rt.deviceGetPCIBusId(self.cp.cuda.Device().id))

    def is_device_array(self, x):
        return isinstance(x, self.cp.ndarray)

    def empty(self, n, dtype):
        return self.cp.empty(int(n), dtype=dtype)

    def flat(self, x):
        if x.flags.c_contiguous:
            return x.reshape(-1), False
        return self.cp.ascontiguousarray(x).reshape(-1), True

    def _memcpy(self, dst_ptr, src_ptr, nbytes, stream):
        # memcpyDefault lets UVA work out the direction, including peer memory opened over IPC.
        self.rt.memcpyAsync(dst_ptr, src_ptr, nbytes, self.rt.memcpyDefault, stream.ptr)

    def copy(self, dst, src):
        self._memcpy(dst.data.ptr, src.data.ptr, src.nbytes, self.current_stream())

    def assign(self, dst, src):
        dst[...] = src.reshape(dst.shape)

    def reduce_into(self, acc, other, op_name):
        getattr(self.cp, OP_BY_NAME[op_name].ufunc)(acc, other, out=acc)

    def divide(self, x, n):
        x /= n

    def elementwise(self, fn, dst, src):
        fn(dst, src)  # CuPy queues the kernels on the current stream

    def asarray(self, host):
        return self.cp.asarray(host)

    def to_numpy(self, x):
        return self.cp.asnumpy(x)

    def current_stream(self):
        return self.cp.cuda.get_current_stream()

    def new_stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    def synchronize(self, stream):
        stream.synchronize()

    def record_event(self, stream):
        return stream.record()

    def event_synchronize(self, event):
        event.synchronize()

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def pinned_empty(self, n, dtype):
        dtype = np.dtype(dtype)
        mem = self.cp.cuda.alloc_pinned_memory(max(1, int(n)) * dtype.itemsize)
        return np.frombuffer(mem, dtype, int(n))  # the array keeps the pinned block alive

    def d2h_async(self, host, dev, stream):
        self._memcpy(host.ctypes.data, dev.data.ptr, dev.nbytes, stream)

    def h2d_async(self, dev, host, stream):
        self._memcpy(dev.data.ptr, host.ctypes.data, dev.nbytes, stream)

    def ipc_alloc(self, n, dtype):
        dtype = np.dtype(dtype)
        nbytes = -(-max(1, int(n)) * dtype.itemsize // IPC_GRANULE_BYTES) * IPC_GRANULE_BYTES
        mem = self.cp.cuda.Memory(nbytes)  # cudaMalloc: its own allocation, whole granules
        return self.cp.ndarray((int(n),), dtype, self.cp.cuda.MemoryPointer(mem, 0))

    def ipc_handle(self, arr):
        return bytes(self.rt.ipcGetMemHandle(arr.data.ptr))

    def ipc_open(self, handle, n, dtype):
        dtype = np.dtype(dtype)
        ptr = _ipc_mappings.open(self.rt, bytes(handle))
        mem = self.cp.cuda.UnownedMemory(ptr, max(1, int(n)) * dtype.itemsize, self)
        return self.cp.ndarray((int(n),), dtype, self.cp.cuda.MemoryPointer(mem, 0))

    def ipc_close(self, arr):
        _ipc_mappings.close(self.rt, arr.data.ptr)

    def mpi_buffer(self, x):
        return x  # mpi4py passes __cuda_array_interface__'s pointer through

    def nccl_status(self):
        try:
            return True, f"NCCL {_xp.get_nccl().get_version()}"
        except Exception as exc:  # noqa: BLE001 - any failure means no NCCL
            return False, f"cupy.cuda.nccl unusable ({type(exc).__name__}: {exc})"

    def nccl_unique_id(self):
        return _xp.get_nccl().get_unique_id()

    def nccl_comm(self, comm, unique_id):
        return _CupyNcclComm(self, comm.Get_size(), unique_id, comm.Get_rank())


class _IpcMappings:
    """This process's open IPC mappings, counted: CUDA refuses to open one handle twice in a process.

    Two paths (two communicators) of one process may map the same peer arena's handle; the second open
    reuses the first mapping and the last close unmaps it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._by_handle = {}  # handle -> [pointer, count]
        self._by_pointer = {}  # pointer -> handle

    def open(self, rt, handle):
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is None:
                entry = self._by_handle[handle] = [rt.ipcOpenMemHandle(handle), 0]
                self._by_pointer[entry[0]] = handle
            entry[1] += 1
            return entry[0]

    def close(self, rt, pointer):
        with self._lock:
            handle = self._by_pointer.get(pointer)
            if handle is None:
                raise ValueError(f"mpidist.gpu: pointer {pointer:#x} is not an open IPC mapping of this process")
            entry = self._by_handle[handle]
            entry[1] -= 1
            if entry[1] == 0:
                del self._by_handle[handle], self._by_pointer[pointer]
                rt.ipcCloseMemHandle(pointer)


_ipc_mappings = _IpcMappings()


class _CupyNcclComm(NcclComm):
    def __init__(self, device, size, unique_id, rank):
        nccl = self.nccl = _xp.get_nccl()
        self.comm = nccl.NcclCommunicator(size, tuple(unique_id), rank)

    def _type(self, x):
        return getattr(self.nccl, nccl_type(x.dtype))

    def allreduce(self, send, recv, op_name, stream):
        self.comm.allReduce(send.data.ptr, recv.data.ptr, send.size, self._type(send),
                            getattr(self.nccl, OP_BY_NAME[op_name].nccl), stream.ptr)

    def bcast(self, buf, root, stream):
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._type(buf), root, stream.ptr)

    def reduce_scatter(self, send, recv, op_name, stream):
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._type(send),
                                getattr(self.nccl, OP_BY_NAME[op_name].nccl), stream.ptr)

    def allgather(self, send, recv, stream):
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._type(send), stream.ptr)
