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

import datetime
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import collectives, wire
from . import _check
from ._tensors import UnsupportedError, as_bytes, as_reducible, check_device, empty_bytes, reduce_dtype
from ._work import Abort, AbortedError, Requests, Work, completed

__all__ = ["ProcessGroupMPI", "BACKEND_NAME"]

BACKEND_NAME = "mpidist"

Kind = dist.ReduceOp.RedOpType
# kind -> its row of the one op table (wire.OPS), and the mpidist.collectives op name for the kinds collectives
# reduces itself; the others (bitwise) MPI reduces directly.
_OP_ROWS = {getattr(Kind, kind): row for row in wire.OPS for kind, _ in row.torch}
_COLLECTIVE_OPS = {getattr(Kind, kind): name for row in wire.OPS for kind, name in row.torch if name is not None}
_BITWISE = tuple(kind for kind in _OP_ROWS if kind not in _COLLECTIVE_OPS)


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
    if kind not in _OP_ROWS:
        raise UnsupportedError(f"mpidist {op}: unsupported reduction {kind!r} (got {where})")
    return dtype


def _mpi_op(kind, dtype):
    row = _OP_ROWS[kind]
    return wire.OP_BY_NAME[row.on_bool].mpi if dtype == torch.bool else row.mpi


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

    def __init__(self, comm, rank, size, name=None, store=None, timeout=None):
        super().__init__(rank, size)
        if comm.Get_rank() != rank or comm.Get_size() != size:
            raise RuntimeError(f"mpidist: torch gives this process rank {rank} of {size}, MPI rank {comm.Get_rank()} of "
                               f"{comm.Get_size()}: launch with mpiexec/srun and let init_process_group take both from MPI")
        self._comm = comm
        self._rank, self._size = rank, size
        self.name_given = name
        self._store = store            # torch's store of this group (a PrefixStore), for get_group_store()
        self._timeout = timeout        # torch's timeout of this group (monitored_barrier's default, shutdown's bound)
        self._abort = Abort(name)      # see _work's glossary
        self._pending = weakref.WeakSet()  # works started and not yet complete (abort and shutdown end them)
        # monitored_barrier talks on a communicator of its own, made now: made at the first monitored_barrier
        # it would be collective, and a rank that never arrives would hang the others instead of being named.
        self._monitor = comm.Dup()
        self._monitor_calls = 0
        self._splits = 0

    @property
    def comm(self):
        """The group communicator; raises once the group was aborted or shut down (every operation asks here)."""
        if self._abort.reason is not None:
            raise AbortedError(self._abort.reason)
        return self._comm

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

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self):
        # torch's split_group calls this on the new group's backend; sequence numbers are an NCCL/gloo
        # bookkeeping this backend does not keep (MPI orders a communicator's collectives itself).
        pass

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
        return Work(op, pending, finish, group=self)

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
        return Work(op, [Requests([request], keep=(buf.array,))], finish, group=self)

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
        return Work(op, [Requests([request], keep=(send.array, out.array))], finish, group=self)

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
        return Work(op, pending, finish, group=self)

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
                return Work(op, [Requests([request], keep=(out.array,))], finish_in_place, group=self)
        handle = collectives.iallgather(send.array, self.comm, out=out.array)

        def finish():
            out.write_back()
            return [output]
        return Work(op, [handle], finish, group=self)

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
        return Work(op, [Requests([request], keep=(send.array, recv))], finish, group=self)

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
        return Work(op, [Requests([request], keep=(send, out.array))], finish, group=self)

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
        return Work(op, [Requests([request], keep=(send.array, out.array))], finish, group=self)

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
        return Work(op, [Requests([request], keep=(send, recv))], finish, group=self)

    def barrier(self, opts=None):
        _check.agree(self.comm, "barrier", [])
        return Work("barrier", [Requests([self.comm.Ibarrier()])], None, [], group=self)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """A barrier that names the ranks that did not arrive within ``timeout`` instead of waiting forever.

        As gloo's: every other rank tells group rank 0 it arrived and waits for rank 0's answer; rank 0 waits
        (tests with sleeps in between, never spinning) until all arrived or ``timeout`` passed. Then rank 0
        raises naming the first missing rank ("Rank 2 failed to pass monitoredBarrier in 1000 ms"), or all of
        them with ``wait_all_ranks``; unlike gloo, the ranks that did arrive learn those names from rank 0
        at once and raise them too. A rank whose answer from rank 0 does not come within ``timeout`` plus a
        grace of min(timeout, 1 s) raises saying so (rank 0 missing, or it gave up before this rank came).
        Not checked for desync and not a collective of the group communicator: a missing rank cannot hang it.
        After a failure the group is for diagnosis: a rank that arrives after rank 0 gave up is counted as
        arrived at the next monitored_barrier (a rank that never came leaves nothing behind).
        """
        limit = _seconds(timeout if timeout is not None else self._timeout)
        self.comm  # noqa: B018 - raises when aborted
        comm, rank, size = self._monitor, self._rank, self._size
        self._monitor_calls += 1
        ms = int(round(limit * 1000))
        if size == 1:
            return
        start = time.monotonic()
        if rank == 0:
            notes = {r: np.zeros(1, np.int32) for r in range(1, size)}
            waiting = {r: comm.Irecv(notes[r], source=r, tag=_ARRIVED) for r in range(1, size)}
            _poll(lambda: _drop_completed(waiting), start + limit, self._abort)
            for r, request in list(waiting.items()):
                if not _cancelled(request):
                    del waiting[r]  # it arrived while we gave up
            missing = sorted(waiting)
            answer = np.full(size, -1, np.int32)
            answer[0] = len(missing)
            answer[1:1 + len(missing)] = missing
            MPI.Request.Waitall([comm.Isend(answer, r, _ANSWER) for r in range(1, size) if r not in waiting])
            if missing:
                raise RuntimeError(_monitor_failure(missing, ms, wait_all_ranks, size))
            return
        answer = np.empty(size, np.int32)
        here = np.ones(1, np.int32)
        reply = comm.Irecv(answer, source=0, tag=_ANSWER)
        arrival = comm.Isend(here, 0, _ARRIVED)
        grace = min(limit, 1.0)
        if not _poll(reply.Test, start + limit + grace, self._abort) and _cancelled(reply):
            if not arrival.Test():
                _work_abandoned(arrival, here)
            raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                               f"for send/recv from rank 0: no answer within {ms} ms (+{int(grace * 1000)} ms grace): rank 0 "
                               f"did not reach the barrier, or gave up before rank {rank} arrived (group of {size})")
        arrival.Wait()
        if answer[0]:
            missing = [int(r) for r in answer[1:1 + answer[0]]]
            raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                               f"for send/recv from rank 0: rank 0 reports {_monitor_failure(missing, ms, wait_all_ranks, size)}")

    # -- splitting, abort, shutdown ---------------------------------------------------------------
    @property
    def supports_splitting(self):
        return True

    @property
    def options(self):
        # torch's split_group deep-copies the parent's options and hands them to split_group (unused here).
        return _Options(self._timeout)

    def comm_split_count(self):
        return self._splits

    def perform_nocolor_split(self, device=None):
        # torch calls this on the ranks left out of a new_group when the default group has a bound device
        # (NCCL's ncclCommSplit needs every rank); our new_group is MPI_Comm_create_group over the members
        # only, so the others have nothing to do.
        pass

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """Split this group (collective over all of it): ``ranks`` (ranks of this group) become a new group.

        torch's ``dist.split_group`` calls this on every rank of the parent with the rank's own split (or the
        first split for a rank in none); one ``MPI_Comm_split``, colour = the split's lowest rank, so disjoint
        splits become disjoint communicators at once. Returns the new group, or None for a rank in no split.
        """
        comm = self.comm
        ranks = sorted(int(r) for r in ranks)
        if not ranks or ranks[0] < 0 or ranks[-1] >= self._size or len(set(ranks)) != len(ranks):
            raise ValueError(f"mpidist split_group: split {ranks} must be distinct ranks of this group of {self._size}")
        mine = self._rank in ranks
        sub = comm.Split(ranks[0] if mine else MPI.UNDEFINED, self._rank)
        self._splits += 1
        if not mine:
            return None
        members = MPI.Group.Translate_ranks(sub.Get_group(), list(range(sub.Get_size())), comm.Get_group())
        if list(members) != ranks:
            sub.Free()
            raise ValueError(f"mpidist split_group: rank {self._rank} was given the split {ranks}, but the ranks that "
                             f"joined it gave {list(members)}: every rank must pass the same split_ranks")
        name = str(group_name) if group_name is not None else f"{self.group_name}:split:{self._splits}"
        sub.Set_name(f"torch:{name}")
        store = dist.PrefixStore(f"{name}/", self._store) if self._store is not None else None
        group = ProcessGroupMPI(sub, sub.Get_rank(), sub.Get_size(), name=name, store=store,
                                timeout=timeout if timeout is not None else self._timeout)
        if group_desc is not None:
            group._set_group_desc(group_desc)
        return group

    def abort(self):
        """End this group at once, locally: every pending and later operation raises, blocked waits return.

        What MPI allows without the peers: waits blocked inside MPI are released (see _work's abort signal),
        pending receives are cancelled, collectives and sends that cannot be cancelled are abandoned with
        their buffers kept alive (a late peer may still complete them), and the communicators are freed
        (MPI_Comm_free lets pending operations finish). Peers are not told: they abort on their own
        timeouts, as with NCCL's ncclCommAbort.
        """
        self._end(f"mpidist: process group {self.name_given or ''} (rank {self._rank} of {self._size}) was aborted")

    def shutdown(self):
        """End this group after its pending operations complete (destroy_process_group calls it).

        Waits for the operations still in flight at most the group's timeout, then aborts what is left, and
        frees the group's communicators, so destroying many groups does not run MPI out of communicators.
        """
        if self._abort.reason is None:
            deadline = time.monotonic() + _seconds(self._timeout)
            for work in list(self._pending):
                try:
                    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                except Exception:  # noqa: BLE001 - its own waiter sees the error; shutdown goes on
                    pass
        self._end(f"mpidist: process group {self.name_given or ''} (rank {self._rank} of {self._size}) was shut down")

    def _end(self, reason):
        if not self._abort.fire(reason):
            return
        for work in list(self._pending):
            work._abandon()
        _check.forget(self._comm)
        for comm in (self._comm, self._monitor):
            if comm != MPI.COMM_NULL:
                comm.Free()

    # -- point to point ---------------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        op = "send"
        t = _one(op, tensors)
        buf = as_bytes(op, t)
        return Work(op, [Requests([self.comm.Isend(buf.array, dst, tag)], keep=(buf.array,))], None, [t], group=self)

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
        work = Work(op, [Requests([self.comm.Irecv(buf.array, src, tag)], keep=(buf.array,), status=status)], finish, group=self)
        return work


# monitored_barrier's messages on its own communicator: "I arrived" to rank 0, rank 0's answer back.
_ARRIVED, _ANSWER = 1, 2


class _Options:
    """What torch's split_group copies from a parent group and passes to the split (the timeout)."""

    def __init__(self, timeout):
        self._timeout = timeout


def _seconds(timeout):
    if timeout is None:
        return float(dist.distributed_c10d.default_pg_timeout.total_seconds())
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _poll(done, deadline, abort):
    """Call ``done()`` with sleeps of 50 us growing to 1 ms in between until true or ``deadline``; return it."""
    delay = 5e-5
    while not done():
        abort.check()
        if time.monotonic() >= deadline:
            return done()
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
    return True


def _drop_completed(waiting):
    for r in [r for r, request in waiting.items() if request.Test()]:
        del waiting[r]
    return not waiting


def _monitor_failure(missing, ms, wait_all_ranks, size):
    if wait_all_ranks:
        return f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms"
    return (f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms (Rank 0 timed out in "
            f"monitoredBarrier after {ms} ms; of {size} ranks, {len(missing)} did not arrive: {missing})")


def _cancelled(request):
    """Cancel a pending receive; return False if it had matched a message after all (then it is complete)."""
    status = MPI.Status()
    request.Cancel()
    request.Wait(status)
    return status.Is_cancelled()


def _work_abandoned(request, buffer):
    from . import _work
    _work._abandoned.append(([request], (buffer,)))


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

    def wait_or(self, signal):
        self.work.wait()  # its own parts wait in the progress thread or the caller: nothing to wake here
        return True
