"""The ``mpidist`` process group: every torch.distributed operation as a nonblocking MPI operation.

Glossary:
- group communicator: the MPI communicator of one process group (a duplicate of COMM_WORLD for the
  default group, ``Create_group`` of its members for a ``new_group``); nothing else talks on it.
- start: each operation is started in the caller's thread, in program order (so every rank starts its
  collectives in the same order, as MPI requires), and returns a ``Work`` at once; see ``_work``.
- kind: torch's reduction (``ReduceOp.RedOpType``): SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM, BAND, BOR, BXOR.

Which path: allreduce, broadcast and allgather-into-tensor go through ``mpidist.collectives`` (its
nonblocking forms, its guard: flight recorder and desync checks). The operations collectives has no
nonblocking or rooted form of (reduce, gather, scatter, reduce-scatter, all-to-all, send/recv, barrier,
the bitwise reductions) call mpi4py's nonblocking methods here, on the same numpy buffers.
"""

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import collectives
from . import _check
from ._tensors import UnsupportedError, as_bytes, as_reducible, check_device, empty_bytes, reduce_dtype
from ._work import Requests, Work, completed

__all__ = ["ProcessGroupMPI", "BACKEND_NAME"]

BACKEND_NAME = "mpidist"

Kind = dist.ReduceOp.RedOpType
# kind -> mpidist.collectives op name (those collectives reduces itself).
_COLLECTIVE_OPS = {Kind.SUM: "sum", Kind.AVG: "mean", Kind.PRODUCT: "prod", Kind.MIN: "min", Kind.MAX: "max",
                   Kind.PREMUL_SUM: "sum"}
# kind -> MPI op for the operations reduced by MPI directly (booleans: MPI has only logical ops on C_BOOL).
_MPI_OPS = {Kind.SUM: MPI.SUM, Kind.AVG: MPI.SUM, Kind.PRODUCT: MPI.PROD, Kind.MIN: MPI.MIN, Kind.MAX: MPI.MAX,
            Kind.PREMUL_SUM: MPI.SUM, Kind.BAND: MPI.BAND, Kind.BOR: MPI.BOR, Kind.BXOR: MPI.BXOR}
_BOOL_OPS = {Kind.SUM: MPI.LOR, Kind.MAX: MPI.LOR, Kind.PRODUCT: MPI.LAND, Kind.MIN: MPI.LAND,
             Kind.BAND: MPI.LAND, Kind.BOR: MPI.LOR, Kind.BXOR: MPI.LXOR}
_BITWISE = (Kind.BAND, Kind.BOR, Kind.BXOR)


def _kind(reduce_op):
    return reduce_op.op if hasattr(reduce_op, "op") else reduce_op


def _check_reduction(op, kind, t):
    """Return the reduce dtype of ``t`` for ``kind``, or raise naming op, reduction, dtype and device."""
    dtype = reduce_dtype(op, t)
    name = str(kind).split(".")[-1]
    where = f"dtype {t.dtype} on device {t.device}"
    if kind in (Kind.AVG, Kind.PREMUL_SUM) and not (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedError(f"mpidist {op}: ReduceOp.{name} needs a floating or complex tensor (got {where}); use SUM and divide")
    if kind in (Kind.MIN, Kind.MAX) and dtype.is_complex:
        raise UnsupportedError(f"mpidist {op}: ReduceOp.{name} is not defined for complex tensors (got {where})")
    if kind in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise UnsupportedError(f"mpidist {op}: ReduceOp.{name} needs an integer or bool tensor (got {where})")
    if kind not in _MPI_OPS:
        raise UnsupportedError(f"mpidist {op}: unsupported reduction {kind!r} (got {where})")
    return dtype


def _mpi_op(kind, dtype):
    return _BOOL_OPS[kind] if dtype == torch.bool else _MPI_OPS[kind]


def _premultiply(buf, reduce_op):
    factor = reduce_op.factor
    if isinstance(factor, torch.Tensor):
        factor = factor.item()
    buf.array *= factor


def _one(op, tensors):
    if len(tensors) != 1:
        raise UnsupportedError(f"mpidist {op}: expected one tensor per process (got {len(tensors)})")
    return tensors[0]


def _write_back(buffers):
    for buf in buffers:
        buf.write_back()


class ProcessGroupMPI(dist.ProcessGroup):
    """A torch.distributed process group whose operations run on an MPI communicator."""

    def __init__(self, comm, rank, size, name=None):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"mpidist: torch gives this process rank {rank} of {size}, MPI rank {comm.Get_rank()} of "
                               f"{comm.Get_size()}: launch with mpiexec/srun and let init_process_group take both from MPI")
        self.comm = comm
        self._rank, self._size = rank, size
        self.name_given = name

    # -- identity ---------------------------------------------------------------------------------
    def getBackendName(self):
        return BACKEND_NAME

    @property
    def group_name(self):
        # Functional collectives (DTensor, FSDP2) look groups up by name; a Python group has no C++ name.
        # The name given at creation outlives torch's table (destroy_process_group asks after removing it).
        return self.name_given or dist.distributed_c10d._world.pg_names[self]

    def _get_backend(self, device):
        # torch >= 2.15 asks the group for its per-device backend (batch_isend_irecv: "supports_coalescing?");
        # this group is its own backend on every device it serves.
        return self

    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def __repr__(self):
        return f"ProcessGroupMPI(rank={self._rank}, size={self._size})"

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return self._allreduce("allreduce", tensors, _kind_of(opts), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self._allreduce("allreduce_coalesced", tensors, _kind_of(opts), opts)

    def _allreduce(self, op, tensors, kind, opts):
        reduce_op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            _check_reduction(op, kind, t)
        _check.agree(self.comm, op, tensors, reduction=kind)
        if not tensors:
            return completed(op, [])
        groups = {}  # one message per reduce dtype: the coalesced form sends each dtype's tensors as one buffer
        for t in tensors:
            groups.setdefault((reduce_dtype(op, t), t.device), []).append(t)
        pending, finishers = [], []
        for (dtype, _device), members in groups.items():
            if len(members) == 1:
                buf = as_reducible(op, members[0])
                flat, unflatten = buf, (lambda b=buf: b.write_back())
            else:
                flat, unflatten = _Flat(op, members, dtype), None
                unflatten = flat.write_back
            if kind == Kind.PREMUL_SUM:
                _premultiply(flat, reduce_op)
            if kind in _BITWISE:
                request = self.comm.Iallreduce(MPI.IN_PLACE, flat.array, op=_mpi_op(kind, dtype))
                pending.append(Requests([request], keep=(flat.array,)))
            else:
                pending.append(collectives.iallreduce(flat.array, self.comm, _COLLECTIVE_OPS[kind]))
            finishers.append(unflatten)

        def finish():
            for f in finishers:
                f()
            return list(tensors)
        return Work(op, pending, finish)

    def reduce(self, tensors, opts):
        op = "reduce"
        t = _one(op, tensors)
        kind, root = _kind(opts.reduceOp), opts.rootRank
        dtype = _check_reduction(op, kind, t)
        _check.agree(self.comm, op, tensors, reduction=kind, root=root)
        buf = as_reducible(op, t)
        if kind == Kind.PREMUL_SUM:
            _premultiply(buf, opts.reduceOp)
        mine = self._rank == root
        send = MPI.IN_PLACE if mine else buf.array
        request = self.comm.Ireduce(send, buf.array if mine else None, op=_mpi_op(kind, dtype), root=root)

        def finish():
            if mine:
                if kind == Kind.AVG:
                    buf.array /= self._size
                buf.write_back()
            return [t]
        return Work(op, [Requests([request], keep=(buf.array,))], finish)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter("reduce_scatter_single", output, [input], _kind_of(opts), opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = "reduce_scatter"
        return self._reduce_scatter(op, _one(op, outputs), _one(op, input_lists), _kind_of(opts), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined("reduce_scatter_single_coalesced", works, list(outputs))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def _reduce_scatter(self, op, output, inputs, kind, opts):
        """Reduce ``inputs`` (one tensor holding every rank's block, or one block per rank) into ``output``."""
        dtype = _check_reduction(op, kind, output)
        for t in inputs:
            if reduce_dtype(op, t) != dtype:
                raise UnsupportedError(f"mpidist {op}: input dtype {t.dtype} differs from the output's {output.dtype}")
        counts = [output.numel()] * self._size if len(inputs) == 1 else [t.numel() for t in inputs]
        total = sum(t.numel() for t in inputs)
        if sum(counts) != total or counts[self._rank] != output.numel():
            raise UnsupportedError(f"mpidist {op}: input of {total} elements does not split into {self._size} blocks "
                                   f"of the output's {output.numel()} (dtype {output.dtype} on device {output.device})")
        _check.agree(self.comm, op, [output], reduction=kind)
        send = as_reducible(op, inputs[0]) if len(inputs) == 1 else _Flat(op, inputs, dtype)
        if kind == Kind.PREMUL_SUM:
            _premultiply(send, opts.reduceOp)
        out = as_reducible(op, output, copy_in=False)
        mpi_op = _mpi_op(kind, dtype)
        if len(set(counts)) == 1:
            request = self.comm.Ireduce_scatter_block(send.array, out.array, op=mpi_op)
        else:
            request = self.comm.Ireduce_scatter(send.array, out.array, counts, op=mpi_op)

        def finish():
            if kind == Kind.AVG:
                out.array /= self._size
            out.write_back()
            return [output]
        return Work(op, [Requests([request], keep=(send.array, out.array))], finish)

    # -- data movement ----------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        op = "broadcast"
        for t in tensors:
            check_device(op, t)
        _check.agree(self.comm, op, tensors, root=opts.rootRank)
        bufs = [as_bytes(op, t) for t in tensors]
        pending = [collectives.ibroadcast(b.array, self.comm, opts.rootRank) for b in bufs if b.array.size]

        def finish():
            _write_back(bufs)
            return list(tensors)
        return Work(op, pending, finish)

    def all_gather_single(self, output, input, opts=None):
        op = "all_gather_single"
        check_device(op, input)
        check_device(op, output)
        if output.numel() != input.numel() * self._size or output.dtype != input.dtype:
            raise UnsupportedError(f"mpidist {op}: output must hold {self._size} x {input.numel()} elements of {input.dtype} "
                                   f"(got {output.numel()} of {output.dtype} on device {output.device})")
        _check.agree(self.comm, op, [input])
        send, out = as_bytes(op, input), as_bytes(op, output, copy_in=False)
        if not send.array.size:
            return completed(op, [output])
        if np.shares_memory(send.array, out.array):
            # FSDP2 gathers in place: its input is this rank's block of the output. MPI forbids aliased
            # buffers, so say IN_PLACE (collectives has no in-place allgather: raw mpi4py here).
            n = send.array.size
            mine = out.array[self._rank * n:(self._rank + 1) * n]
            if mine.__array_interface__["data"][0] != send.array.__array_interface__["data"][0]:
                send.array = send.array.copy()
            else:
                request = self.comm.Iallgather(MPI.IN_PLACE, out.array)

                def finish_in_place():
                    out.write_back()
                    return [output]
                return Work(op, [Requests([request], keep=(out.array,))], finish_in_place)
        handle = collectives.iallgather(send.array, self.comm, out=out.array)

        def finish():
            out.write_back()
            return [output]
        return Work(op, [handle], finish)

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined("all_gather_single_coalesced", works, list(outputs))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def allgather(self, output_lists, inputs, opts=None):
        op = "allgather"
        outputs, t = _one(op, output_lists), _one(op, inputs)
        return self._gather_into(op, outputs, t, root=None)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # output_lists[r][j]: input j of rank r (rank-major, unlike allgather's one list per input).
        op = "allgather_coalesced"
        if len(output_lists) != self._size or any(len(outs) != len(inputs) for outs in output_lists):
            raise UnsupportedError(f"mpidist {op}: expected {self._size} output lists of {len(inputs)} tensors "
                                   f"(got {[len(outs) for outs in output_lists]})")
        works = [self._gather_into(op, [outs[j] for outs in output_lists], t, root=None) for j, t in enumerate(inputs)]
        return _joined(op, works, output_lists)

    def gather(self, output_lists, inputs, opts):
        op = "gather"
        t = _one(op, inputs)
        root = opts.rootRank
        outputs = _one(op, output_lists) if self._rank == root else None
        return self._gather_into(op, outputs, t, root=root)

    def _gather_into(self, op, outputs, t, root):
        """Allgather (``root`` None) or gather ``t`` from every rank into the list ``outputs``."""
        check_device(op, t)
        receiving = root is None or self._rank == root
        if receiving:
            if len(outputs) != self._size:
                raise UnsupportedError(f"mpidist {op}: expected {self._size} output tensors (got {len(outputs)}; "
                                       f"input dtype {t.dtype} on device {t.device})")
            for o in outputs:
                check_device(op, o)
                if o.dtype != t.dtype:
                    raise UnsupportedError(f"mpidist {op}: output dtype {o.dtype} differs from the input's {t.dtype} (device {t.device})")
        _check.agree(self.comm, op, [t], root=-1 if root is None else root, rows=True)
        send = as_bytes(op, t)
        counts = [o.numel() * o.element_size() for o in outputs] if receiving else None
        recv = empty_bytes(sum(counts)) if receiving else None
        if receiving and counts[self._rank] != send.array.size:
            raise UnsupportedError(f"mpidist {op}: output {self._rank} has {outputs[self._rank].numel()} elements, "
                                   f"the input {t.numel()} (dtype {t.dtype} on device {t.device})")
        spec = [recv, (counts, _displacements(counts))] if receiving else None
        if root is None:
            request = self.comm.Iallgatherv(send.array, spec)
        else:
            request = self.comm.Igatherv(send.array, spec, root=root)

        def finish():
            if receiving:
                _unpack(recv, counts, outputs)
            return [outputs] if receiving else []
        return Work(op, [Requests([request], keep=(send.array, recv))], finish)

    def scatter(self, outputs, input_lists, opts):
        op = "scatter"
        t = _one(op, outputs)
        root = opts.rootRank
        check_device(op, t)
        inputs = _one(op, input_lists) if self._rank == root else None
        if inputs is not None:
            if len(inputs) != self._size:
                raise UnsupportedError(f"mpidist {op}: expected {self._size} input tensors (got {len(inputs)}; dtype {t.dtype} on device {t.device})")
            for i in inputs:
                check_device(op, i)
        _check.agree(self.comm, op, [t], root=root, rows=True)
        out = as_bytes(op, t, copy_in=False)
        if inputs is not None:
            counts = [i.numel() * i.element_size() for i in inputs]
            send = _concat_bytes(op, inputs)
            spec = [send, (counts, _displacements(counts))]
        else:
            send, spec = None, None
        request = self.comm.Iscatterv(spec, out.array, root=root)

        def finish():
            out.write_back()
            return [t]
        return Work(op, [Requests([request], keep=(send, out.array))], finish)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        op = "all_to_all_single"
        check_device(op, input)
        check_device(op, output)
        if output.dtype != input.dtype:
            raise UnsupportedError(f"mpidist {op}: output dtype {output.dtype} differs from the input's {input.dtype} (device {input.device})")
        row_in = input.numel() // input.shape[0] * input.element_size() if input.dim() and input.shape[0] else 0
        row_out = output.numel() // output.shape[0] * output.element_size() if output.dim() and output.shape[0] else 0
        send_counts = _split_bytes(op, input, input_splits, self._size, row_in)
        recv_counts = _split_bytes(op, output, output_splits, self._size, row_out)
        _check.agree(self.comm, op, [input], rows=True)
        send, out = as_bytes(op, input), as_bytes(op, output, copy_in=False)
        request = self.comm.Ialltoallv([send.array, (send_counts, _displacements(send_counts))],
                                       [out.array, (recv_counts, _displacements(recv_counts))])

        def finish():
            out.write_back()
            return [output]
        return Work(op, [Requests([request], keep=(send.array, out.array))], finish)

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        return self.all_to_all_single(output, input, output_splits, input_splits, opts)

    def alltoall(self, outputs, inputs, opts=None):
        op = "alltoall"
        if len(outputs) != self._size or len(inputs) != self._size:
            raise UnsupportedError(f"mpidist {op}: expected {self._size} input and output tensors (got {len(inputs)} and {len(outputs)})")
        for t in list(inputs) + list(outputs):
            check_device(op, t)
        _check.agree(self.comm, op, inputs[:1], rows=True)
        send = _concat_bytes(op, inputs)
        send_counts = [t.numel() * t.element_size() for t in inputs]
        recv_counts = [t.numel() * t.element_size() for t in outputs]
        recv = empty_bytes(sum(recv_counts))
        request = self.comm.Ialltoallv([send, (send_counts, _displacements(send_counts))],
                                       [recv, (recv_counts, _displacements(recv_counts))])

        def finish():
            _unpack(recv, recv_counts, outputs)
            return list(outputs)
        return Work(op, [Requests([request], keep=(send, recv))], finish)

    def barrier(self, opts=None):
        _check.agree(self.comm, "barrier", [])
        return Work("barrier", [Requests([self.comm.Ibarrier()])], None, [])

    # -- point to point ---------------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        op = "send"
        t = _one(op, tensors)
        buf = as_bytes(op, t)
        return Work(op, [Requests([self.comm.Isend(buf.array, dst, tag)], keep=(buf.array,))], None, [t])

    def recv(self, tensors, src, tag):
        return self._recv("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._recv("recv_anysource", tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, op, tensors, src, tag):
        t = _one(op, tensors)
        buf = as_bytes(op, t, copy_in=False)
        status = MPI.Status()
        work = None

        def finish():
            if status.Get_count(MPI.BYTE) != buf.array.size:
                raise RuntimeError(f"mpidist {op}: message from rank {status.Get_source()} has {status.Get_count(MPI.BYTE)} bytes, "
                                   f"the tensor {buf.array.size} (dtype {t.dtype}, shape {tuple(t.shape)}, device {t.device})")
            buf.write_back()
            work._source = status.Get_source()
            return [t]
        work = Work(op, [Requests([self.comm.Irecv(buf.array, src, tag)], keep=(buf.array,), status=status)], finish)
        return work


def _kind_of(opts):
    return _kind(opts.reduceOp) if opts is not None else Kind.SUM


class _Flat:
    """Several tensors of one reduce dtype in one contiguous buffer (the coalesced forms send one message)."""

    def __init__(self, op, tensors, dtype):
        self.tensors = tensors
        for t in tensors:
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()
        self.flat = torch.cat([t.detach().reshape(-1).to("cpu", dtype) for t in tensors])
        self.array = self.flat.numpy()

    def write_back(self):
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                n = t.numel()
                t.copy_(self.flat[offset: offset + n].view(t.shape))
                offset += n


def _displacements(counts):
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _split_bytes(op, t, splits, size, row_bytes):
    if splits is None or len(splits) == 0:
        nbytes = t.numel() * t.element_size()
        if nbytes % size:
            raise UnsupportedError(f"mpidist {op}: dim 0 of shape {tuple(t.shape)} does not split evenly over {size} ranks; "
                                   f"pass split sizes (dtype {t.dtype} on device {t.device})")
        return [nbytes // size] * size
    if len(splits) != size or sum(splits) != (t.shape[0] if t.dim() else 1):
        raise UnsupportedError(f"mpidist {op}: splits {list(splits)} must be {size} sizes summing to dim 0 of shape "
                               f"{tuple(t.shape)} (dtype {t.dtype} on device {t.device})")
    return [int(s) * row_bytes for s in splits]


def _concat_bytes(op, tensors):
    """Return the tensors' bytes one after another in a new array (MPI reads it while the caller goes on)."""
    return np.concatenate([as_bytes(op, t).array for t in tensors]) if tensors else empty_bytes(0)


def _unpack(recv, counts, outputs):
    offset = 0
    with torch.no_grad():
        for o, c in zip(outputs, counts):
            if c:  # an empty byte slice cannot be viewed as a wider dtype
                o.copy_(torch.from_numpy(recv[offset: offset + c]).view(o.dtype).view(o.shape))
            offset += c


def _joined(op, works, result):
    """One work completing when every work of ``works`` has (the coalesced forms)."""
    return Work(op, [_WorkPart(w) for w in works], None, result)


class _WorkPart:
    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def test(self):
        return self.work.is_completed()

    def wait(self):
        self.work.wait()
