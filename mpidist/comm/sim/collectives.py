"""Collectives: blocking, nonblocking and persistent, buffer and object forms, IN_PLACE where MPI allows it.

Each call parses its specs on the calling rank (so a bad argument raises there, as in mpi4py) and posts
them; the last rank to arrive moves every rank's data at once (ranks share memory: one pack per source
block, one reduction pass).
"""

import numpy as np
from mpi4py import MPI

from . import ops, spec
from .request import SimPrequest

__all__ = ["Collectives"]

IN_PLACE = MPI.IN_PLACE


def _in_place(buf):
    """Whether a send (or root receive) buffer means MPI.IN_PLACE: mpi4py reads None there as IN_PLACE."""
    return buf is None or buf is IN_PLACE


_DTNAMES = {}  # predefined datatype handle -> its name in signatures


def _dtname(msg):
    dt = msg.dtype
    name = _DTNAMES.get(dt.handle)
    if name is not None:
        return name
    try:
        name = np.dtype(dt.tocode()).name
    except Exception:  # derived or pair types have no numpy code: ranks may build equal ones apart
        name = dt.Get_name() if dt.is_predefined else f"derived({msg.tm.size} bytes)"
    if dt.is_predefined:
        _DTNAMES[dt.handle] = name
    return name


# Predefined ops whose result numpy computes exactly as MPI's loops do (elementwise a op b), on the predefined
# C types of the kinds listed (MPI.BYTE is not one: MPI allows no arithmetic on it). With one of them the
# first step of a reduction reads the last two inputs and writes the result in one pass, instead of copying
# the last input into the result and reducing into it (one 1 MiB pass fewer). MIN/MAX differ from numpy on NaN
# and complex PROD may differ on infinities: those, and every other op, stay with Reduce_local. Below
# _FUSED_MIN bytes the three numpy views cost more than the copy saves (measured: 8 B 2.1 us fused vs 1.1 us
# copy + Reduce_local; 4 KiB even; 64 KiB 3.8 vs 8.4 us).
_FUSED_OPS = {"SUM": (np.add, "iufc"), "PROD": (np.multiply, "iuf")}
_FUSED_MIN = 4096
_FUSED_TYPES = {}  # datatype handle -> numpy dtype
for _name in ("SIGNED_CHAR", "UNSIGNED_CHAR", "SHORT", "UNSIGNED_SHORT", "INT", "UNSIGNED", "LONG", "UNSIGNED_LONG",
              "LONG_LONG", "UNSIGNED_LONG_LONG", "INT8_T", "INT16_T", "INT32_T", "INT64_T", "UINT8_T", "UINT16_T",
              "UINT32_T", "UINT64_T", "FLOAT", "DOUBLE", "C_FLOAT_COMPLEX", "C_DOUBLE_COMPLEX"):
    _dt = getattr(MPI, _name, None)
    if _dt is not None and _dt != MPI.DATATYPE_NULL:
        _npdt = np.dtype(_dt.tocode())
        if _npdt.itemsize == _dt.Get_size():
            _FUSED_TYPES[_dt.handle] = _npdt


def _fused(opname, dt):
    """The numpy ufunc and dtype computing predefined op ``opname`` on ``dt`` as MPI does, or (None, None)."""
    ufunc, kinds = _FUSED_OPS.get(opname, (None, ""))
    npdt = _FUSED_TYPES.get(dt.handle) if ufunc is not None else None
    if npdt is None or npdt.kind not in kinds:
        return None, None
    return ufunc, npdt


def _reduce_in_place(parts, op, count, root, opname=None):
    """Reduce straight from the ranks' buffers into one result buffer and copy it to the other receivers,
    if every buffer is a contiguous view (ranks share memory: one reduction pass, no packing); return
    whether it did. The result goes into the receive buffer of the last rank (allreduce) or of ``root``,
    reduced in MPI's canonical order a0 op (a1 op (... op a(n-1))) by ``Op.Reduce_local``."""
    if count == 0:
        return False
    n = len(parts)
    inputs, outs = [], []
    for s, out in parts:
        a = (out if s is IN_PLACE else s).view()
        if a is None:
            return False
        inputs.append(a)
        if root is None:
            o = out.view()
            if o is None:
                return False
            outs.append(o)
    t = n - 1 if root is None else root
    target = outs[t] if root is None else parts[root][1].view()
    if target is None:
        return False
    dt = (parts[0][1] if parts[0][0] is IN_PLACE else parts[0][0]).dtype
    last = inputs[n - 1]
    for a in inputs[:-1]:
        if np.may_share_memory(a, target):
            return False  # the result would overwrite an input not yet read: take the packing path
    rest = inputs[:-1]
    if not (t == n - 1 and parts[t][0] is IN_PLACE):  # else the last input is the target itself
        if np.may_share_memory(last, target):
            return False
        ufunc, npdt = _fused(opname, dt) if n > 1 and target.size >= _FUSED_MIN else (None, None)
        if ufunc is not None:
            ufunc(rest[-1].view(npdt), last.view(npdt), out=target.view(npdt))  # a(n-2) op a(n-1)
            rest = rest[:-1]
        else:
            target[:] = last
    for a in reversed(rest):
        op.Reduce_local([a, count, dt], [target, count, dt])
    for o in outs:
        if o is not target:
            o[:] = target
    return True


def _nb(name):
    """Make the nonblocking ("I"+name) and persistent (name+"_init") variants of a blocking collective."""
    method = "_" + name
    iname = "I" + name[0].lower() + name[1:]

    def blocking(self, *args, **kwargs):
        self._run(*getattr(self, method)(name, *args, **kwargs))

    def nonblocking(self, *args, **kwargs):
        return self._start(*getattr(self, method)(iname, *args, **kwargs))

    def persistent(self, *args, **kwargs):
        info = kwargs.pop("info", None)
        del info
        return SimPrequest(lambda: self._start(*getattr(self, method)(name + "_init", *args, **kwargs)), name + "_init")
    blocking.__doc__ = f"Blocking {name}."
    nonblocking.__doc__ = f"Nonblocking {name}: returns a request."
    persistent.__doc__ = f"Persistent {name}: ``Start`` runs it again."
    return blocking, nonblocking, persistent


class Collectives:
    """Collective methods of ``SimComm`` (mixed in).

    Each ``_Name`` method parses its specs on the calling rank and returns the round it posts, (name,
    signature, payload, work); ``_nb`` makes the blocking call (``_run``), the nonblocking one and the
    persistent one of it.
    """

    # -- barrier, broadcast ---------------------------------------------------------------------------
    def _Barrier(self, name):
        return (name, (), None, lambda p: [None] * len(p))

    def _Bcast(self, name, buf, root=0):
        root = self._check_root(name, root)
        msg = spec.simple(buf, readonly=self._rank == root)
        sig = (("root", root), ("count", msg.count), ("dtype", _dtname(msg)))

        def work(msgs):
            data = msgs[root].pack()
            for r, m in enumerate(msgs):
                if r != root:
                    m.unpack(data, 0, name)
            return [None] * len(msgs)
        return (name, sig, msg, work)

    # -- gather / scatter ---------------------------------------------------------------------------------
    def _gather(self, name, sendbuf, recvbuf, root, vector):
        root = self._check_root(name, root)
        size = self.Get_size()
        is_root = self._rank == root
        parse = spec.vector if vector else spec.simple
        recv = parse(recvbuf, readonly=False, blocks=size, null=not is_root)
        send = IN_PLACE if (is_root and _in_place(sendbuf)) else spec.simple(sendbuf, readonly=True)

        def work(parts):
            out = parts[root][1]
            for r, (s, _) in enumerate(parts):
                if s is not IN_PLACE:
                    out.unpack(s.pack(), r, name)
            return [None] * len(parts)
        return (name, (("root", root),), (send, recv), work)

    def _Gather(self, name, sendbuf, recvbuf, root=0):
        return self._gather(name, sendbuf, recvbuf, root, False)

    def _Gatherv(self, name, sendbuf, recvbuf, root=0):
        return self._gather(name, sendbuf, recvbuf, root, True)

    def _scatter(self, name, sendbuf, recvbuf, root, vector):
        root = self._check_root(name, root)
        size = self.Get_size()
        is_root = self._rank == root
        parse = spec.vector if vector else spec.simple
        send = parse(sendbuf, readonly=True, blocks=size, null=not is_root)
        recv = IN_PLACE if (is_root and _in_place(recvbuf)) else spec.simple(recvbuf, readonly=False)

        def work(parts):
            src = parts[root][0]
            for r, (_, out) in enumerate(parts):
                if out is not IN_PLACE:
                    out.unpack(src.pack(r), 0, name)
            return [None] * len(parts)
        return (name, (("root", root),), (send, recv), work)

    def _Scatter(self, name, sendbuf, recvbuf, root=0):
        return self._scatter(name, sendbuf, recvbuf, root, False)

    def _Scatterv(self, name, sendbuf, recvbuf, root=0):
        return self._scatter(name, sendbuf, recvbuf, root, True)

    def _allgather(self, name, sendbuf, recvbuf, vector):
        size = self.Get_size()
        recv = (spec.vector if vector else spec.simple)(recvbuf, readonly=False, blocks=size)
        send = IN_PLACE if _in_place(sendbuf) else spec.simple(sendbuf, readonly=True)
        sig = () if vector else (("count", recv.count), ("dtype", _dtname(recv)))

        def work(parts):
            data = [out.pack(r) if s is IN_PLACE else s.pack() for r, (s, out) in enumerate(parts)]
            for _, out in parts:
                for r, d in enumerate(data):
                    out.unpack(d, r, name)
            return [None] * len(parts)
        return (name, sig, (send, recv), work)

    def _Allgather(self, name, sendbuf, recvbuf):
        return self._allgather(name, sendbuf, recvbuf, False)

    def _Allgatherv(self, name, sendbuf, recvbuf):
        return self._allgather(name, sendbuf, recvbuf, True)

    def _alltoall(self, name, sendbuf, recvbuf, kind):
        size = self.Get_size()
        if kind == "w":
            recv = spec.vector_w(recvbuf, readonly=False, blocks=size).msgs
            send = IN_PLACE if _in_place(sendbuf) else spec.vector_w(sendbuf, readonly=True, blocks=size).msgs
        else:
            parse = spec.vector if kind == "v" else spec.simple
            recv = parse(recvbuf, readonly=False, blocks=size)
            send = IN_PLACE if _in_place(sendbuf) else parse(sendbuf, readonly=True, blocks=size)

        def block(msg, i):
            return (msg[i], 0) if isinstance(msg, list) else (msg, i)

        def work(parts):
            data = []
            for s, out in parts:
                src = out if s is IN_PLACE else s
                data.append([block(src, j)[0].pack(block(src, j)[1]) for j in range(size)])
            for i, (_, out) in enumerate(parts):
                for j in range(size):
                    m, b = block(out, j)
                    m.unpack(data[j][i], b, name)
            return [None] * len(parts)
        return (name, (), (send, recv), work)

    def _Alltoall(self, name, sendbuf, recvbuf):
        return self._alltoall(name, sendbuf, recvbuf, "")

    def _Alltoallv(self, name, sendbuf, recvbuf):
        return self._alltoall(name, sendbuf, recvbuf, "v")

    def _Alltoallw(self, name, sendbuf, recvbuf):
        return self._alltoall(name, sendbuf, recvbuf, "w")

    # -- reductions ---------------------------------------------------------------------------------------
    def _reduction(self, name, sendbuf, recvbuf, op, root=None, kind="all"):
        opname = ops.op_name(op)
        has_recv = root is None or self._rank == root or kind != "reduce"
        if kind == "reduce" and not has_recv:
            send = spec.simple(sendbuf, readonly=True)
            recv = None
        else:
            recv = spec.simple(recvbuf, readonly=False)
            if _in_place(sendbuf):
                send = IN_PLACE
            else:
                send = spec.simple(sendbuf, readonly=True)
                if send.count != recv.count:
                    raise ValueError(f"{name}: mismatch in send count {send.count} and receive count {recv.count}")
                if send.dtype != recv.dtype:
                    raise ValueError(f"{name}: mismatch in send and receive MPI datatypes "
                                     f"({send.dtype.Get_name()}, {recv.dtype.Get_name()})")
        ref = recv if send is IN_PLACE else send
        sig = [("count", ref.count), ("dtype", _dtname(ref)), ("op", opname)]
        if root is not None:
            sig.append(("root", root))

        def work(parts):
            if kind != "scan" and kind != "exscan" and opname not in ("user-op", "REPLACE", "NO_OP") \
                    and _reduce_in_place(parts, op, ref.count, root, opname):
                return [None] * len(parts)
            data = [(out.pack() if s is IN_PLACE else s.pack()) for s, out in parts]
            count, dt = ref.count, parts[0][0].dtype if parts[0][0] is not IN_PLACE else parts[0][1].dtype
            tm = spec.typemap(dt)
            if kind in ("scan", "exscan"):
                prefix = ops.scan_packed(data, op, dt, tm, count)
                for r, (_, out) in enumerate(parts):
                    if kind == "scan":
                        out.unpack(prefix[r], 0, name)
                    elif r > 0:
                        out.unpack(prefix[r - 1], 0, name)
                return [None] * len(parts)
            result = ops.reduce_packed(data, op, dt, tm, count)
            for r, (_, out) in enumerate(parts):
                if root is None or r == root:
                    out.unpack(result, 0, name)
            return [None] * len(parts)
        return (name, tuple(sig), (send, recv), work)

    def _Allreduce(self, name, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduction(name, sendbuf, recvbuf, op)

    def _Reduce(self, name, sendbuf, recvbuf, op=MPI.SUM, root=0):
        root = self._check_root(name, root)
        if sendbuf is IN_PLACE and self._rank != root:
            raise ValueError(f"SimComm.{name}: MPI.IN_PLACE is only valid on the root (rank {self._rank}, root {root})")
        if recvbuf is None and self._rank == root:
            raise ValueError(f"SimComm.{name}: the root needs a receive buffer")
        return self._reduction(name, sendbuf, recvbuf, op, root=root, kind="reduce")

    def _Scan(self, name, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduction(name, sendbuf, recvbuf, op, kind="scan")

    def _Exscan(self, name, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduction(name, sendbuf, recvbuf, op, kind="exscan")

    def _reduce_scatter(self, name, sendbuf, recvbuf, recvcounts, op):
        size = self.Get_size()
        opname = ops.op_name(op)
        in_place = _in_place(sendbuf)
        if recvcounts == "block":
            if in_place:
                whole = spec.simple(recvbuf, readonly=False, blocks=size)
                count = whole.count
                recv = spec.Msg(whole.base, whole.dtype, [count], [whole.starts[0]], whole.bottom)
                send = spec.Msg(whole.base, whole.dtype, [count * size], [whole.starts[0]], whole.bottom)
            else:
                recv = spec.simple(recvbuf, readonly=False)
                send = spec.simple(sendbuf, readonly=True, blocks=size)
                count = recv.count
                send = spec.Msg(send.base, send.dtype, [send.count * size], [send.starts[0]], send.bottom)
            counts = [count] * size
        else:
            recv = spec.simple(recvbuf, readonly=False)
            if in_place:
                if recvcounts is None:
                    raise ValueError(f"SimComm.{name}: MPI.IN_PLACE needs recvcounts")
                counts = [int(c) for c in recvcounts]
                if recv.count < sum(counts):
                    raise ValueError(f"{name}: MPI.IN_PLACE needs room for sum(recvcounts) = {sum(counts)} "
                                     f"elements, the buffer holds {recv.count}")
                send = recv
                recv = spec.Msg(recv.base, recv.dtype, [counts[self._rank]], [recv.starts[0]], recv.bottom)
            else:
                send = spec.simple(sendbuf, readonly=True)
                if send.dtype != recv.dtype:
                    raise ValueError(f"{name}: mismatch in send and receive MPI datatypes "
                                     f"({send.dtype.Get_name()}, {recv.dtype.Get_name()})")
                counts = None if recvcounts is None else [int(c) for c in recvcounts]
                if counts is not None:
                    if len(counts) != size:
                        raise ValueError(f"message: expecting {size} items, got {len(counts)}")
                    if send.count != sum(counts):
                        raise ValueError(f"mismatch in send count {send.count} and sum(counts) {sum(counts)}")
                    if recv.count != counts[self._rank]:
                        raise ValueError(f"mismatch in receive count {recv.count} and counts[{self._rank}] {counts[self._rank]}")
        sig = (("dtype", _dtname(send)), ("op", opname))

        def work(parts):
            all_counts = counts if counts is not None else [p[1].count for p in parts]
            total = sum(all_counts)
            dt = parts[0][0].dtype
            tm = spec.typemap(dt)
            data = [s.pack()[: total * tm.size] for s, _ in parts]
            result = ops.reduce_packed(data, op, dt, tm, total)
            offset = 0
            for r, (_, out) in enumerate(parts):
                nbytes = all_counts[r] * tm.size
                out.unpack(result[offset: offset + nbytes], 0, name)
                offset += nbytes
            return [None] * len(parts)
        return (name, sig, (send, recv), work)

    def _Reduce_scatter_block(self, name, sendbuf, recvbuf, op=MPI.SUM):
        return self._reduce_scatter(name, sendbuf, recvbuf, "block", op)

    def _Reduce_scatter(self, name, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        return self._reduce_scatter(name, sendbuf, recvbuf, recvcounts, op)

    # -- object collectives ---------------------------------------------------------------------------------
    @staticmethod
    def _copy(obj):
        return MPI.pickle.loads(MPI.pickle.dumps(obj))

    def barrier(self):
        """Block until every rank has called barrier."""
        self.Barrier()

    def ibarrier(self):
        return self.Ibarrier()

    def bcast(self, obj, root=0):
        """Broadcast a Python object from ``root``; return it on every rank."""
        root = self._check_root("bcast", root)
        data = MPI.pickle.dumps(obj) if self._rank == root else None
        with self._lock("bcast"):  # mpi4py serializes a rank's object collectives per communicator
            return self._run("bcast", (("root", root),), data,
                             lambda parts: [MPI.pickle.loads(parts[root]) for _ in parts])

    def gather(self, sendobj, root=0):
        """Return the list of every rank's object on ``root``, None elsewhere."""
        root = self._check_root("gather", root)
        with self._lock("gather"):
            return self._run("gather", (("root", root),), MPI.pickle.dumps(sendobj),
                             lambda parts: [[MPI.pickle.loads(p) for p in parts] if r == root else None
                                            for r in range(len(parts))])

    def scatter(self, sendobj, root=0):
        """Give rank i item i of ``sendobj`` on ``root``."""
        root = self._check_root("scatter", root)
        size = self.Get_size()
        payload = None
        if self._rank == root:
            items = [None] * size if sendobj is None else list(sendobj)
            if len(items) != size:
                raise ValueError(f"expecting {size} items, got {len(items)}")
            payload = [MPI.pickle.dumps(x) for x in items]
        with self._lock("scatter"):
            return self._run("scatter", (("root", root),), payload,
                             lambda parts: [MPI.pickle.loads(x) for x in parts[root]])

    def allgather(self, sendobj):
        """Return the list of every rank's object."""
        with self._lock("allgather"):
            return self._run("allgather", (), MPI.pickle.dumps(sendobj),
                             lambda parts: [[MPI.pickle.loads(p) for p in parts] for _ in parts])

    def alltoall(self, sendobj):
        """Send item j of ``sendobj`` to rank j; return the items sent to this rank."""
        size = self.Get_size()
        items = [None] * size if sendobj is None else list(sendobj)
        if len(items) != size:
            raise ValueError(f"expecting {size} items, got {len(items)}")
        payload = [MPI.pickle.dumps(x) for x in items]
        with self._lock("alltoall"):
            return self._run("alltoall", (), payload,
                             lambda parts: [[MPI.pickle.loads(parts[j][i]) for j in range(len(parts))]
                                            for i in range(len(parts))])

    def _object_reduction(self, name, obj, op, root, kind):
        opname = ops.op_name(op)
        sig = (("op", opname),) if root is None else (("op", opname), ("root", root))

        def work(parts):
            objs = [MPI.pickle.loads(p) for p in parts]
            if kind == "all":
                acc = ops.reduce_objects(objs, op)
                return [self._copy(acc) if root is None or r == root else None for r in range(len(objs))]
            out, acc = [], None
            for r, o in enumerate(objs):
                prev = acc
                acc = o if r == 0 else op(acc, o)
                out.append(self._copy(acc) if kind == "scan" else (None if r == 0 else self._copy(prev)))
            return out
        with self._lock(name):
            return self._run(name, sig, MPI.pickle.dumps(obj), work)

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        """Reduce Python objects to ``root``; other ranks get None."""
        root = self._check_root("reduce", root)
        return self._object_reduction("reduce", sendobj, op, root, "all")

    def allreduce(self, sendobj, op=MPI.SUM):
        """Reduce Python objects with ``op`` and return the result on every rank."""
        return self._object_reduction("allreduce", sendobj, op, None, "all")

    def scan(self, sendobj, op=MPI.SUM):
        """Inclusive prefix reduction of Python objects."""
        return self._object_reduction("scan", sendobj, op, None, "scan")

    def exscan(self, sendobj, op=MPI.SUM):
        """Exclusive prefix reduction of Python objects (None on rank 0)."""
        return self._object_reduction("exscan", sendobj, op, None, "exscan")

    # -- neighborhood collectives (topologies) ----------------------------------------------------------------
    def _neighbors(self, name):
        topo = self._live(name).topo
        if topo is None:
            raise NotImplementedError(f"SimComm.{name}: needs a communicator with a topology "
                                      f"(Create_cart, Create_graph, Create_dist_graph)")
        return topo.neighbors(self._rank)

    def _neighbor(self, name, sendbuf, recvbuf, kind):
        sources, dests = self._neighbors(name)
        if kind == "allgather" or kind == "allgatherv":
            send = spec.simple(sendbuf, readonly=True)
            recv = (spec.vector if kind.endswith("v") else spec.simple)(recvbuf, readonly=False, blocks=len(sources))
            send_blocks = [(send, 0)] * len(dests)
        elif kind == "alltoallw":
            send_w = spec.vector_w(sendbuf, readonly=True, blocks=len(dests)).msgs
            recv_w = spec.vector_w(recvbuf, readonly=False, blocks=len(sources)).msgs
            send_blocks = [(m, 0) for m in send_w]
            recv = recv_w
        else:
            parse = spec.vector if kind.endswith("v") else spec.simple
            send = parse(sendbuf, readonly=True, blocks=len(dests))
            recv = parse(recvbuf, readonly=False, blocks=len(sources))
            send_blocks = [(send, j) for j in range(len(dests))]

        def work(parts):
            outbox = {}
            for r, (srcs, dsts, blocks, _) in enumerate(parts):
                for j, d in enumerate(dsts):
                    if d != MPI.PROC_NULL:
                        m, b = blocks[j]
                        outbox.setdefault((r, d), []).append(m.pack(b))
            for r, (srcs, dsts, _, out) in enumerate(parts):
                for i, s in enumerate(srcs):
                    if s == MPI.PROC_NULL:
                        continue
                    queue = outbox.get((s, r))
                    data = queue.pop(0) if queue else np.zeros(0, np.uint8)
                    if isinstance(out, list):
                        out[i].unpack(data, 0, name)
                    else:
                        out.unpack(data, i, name)
            return [None] * len(parts)
        return (name, (), (sources, dests, send_blocks, recv), work)

    def _Neighbor_allgather(self, name, sendbuf, recvbuf):
        return self._neighbor(name, sendbuf, recvbuf, "allgather")

    def _Neighbor_allgatherv(self, name, sendbuf, recvbuf):
        return self._neighbor(name, sendbuf, recvbuf, "allgatherv")

    def _Neighbor_alltoall(self, name, sendbuf, recvbuf):
        return self._neighbor(name, sendbuf, recvbuf, "alltoall")

    def _Neighbor_alltoallv(self, name, sendbuf, recvbuf):
        return self._neighbor(name, sendbuf, recvbuf, "alltoallv")

    def _Neighbor_alltoallw(self, name, sendbuf, recvbuf):
        return self._neighbor(name, sendbuf, recvbuf, "alltoallw")

    def neighbor_allgather(self, sendobj):
        sources, dests = self._neighbors("neighbor_allgather")
        return self._neighbor_objects("neighbor_allgather", [sendobj] * len(dests))

    def neighbor_alltoall(self, sendobj):
        sources, dests = self._neighbors("neighbor_alltoall")
        items = list(sendobj)
        if len(items) != len(dests):
            raise ValueError(f"expecting {len(dests)} items, got {len(items)}")
        return self._neighbor_objects("neighbor_alltoall", items)

    def _neighbor_objects(self, name, items):
        sources, dests = self._neighbors(name)

        def work(parts):
            outbox = {}
            for r, (srcs, dsts, objs) in enumerate(parts):
                for d, o in zip(dsts, objs):
                    if d != MPI.PROC_NULL:
                        outbox.setdefault((r, d), []).append(o)
            results = []
            for r, (srcs, _, _) in enumerate(parts):
                got = []
                for s in srcs:
                    queue = outbox.get((s, r)) if s != MPI.PROC_NULL else None
                    got.append(MPI.pickle.loads(queue.pop(0)) if queue else None)
                results.append(got)
            return results
        return self._run(name, (), (sources, dests, [MPI.pickle.dumps(o) for o in items]), work)


for _name in ("Barrier", "Bcast", "Gather", "Gatherv", "Scatter", "Scatterv", "Allgather", "Allgatherv",
              "Alltoall", "Alltoallv", "Alltoallw", "Allreduce", "Reduce", "Scan", "Exscan",
              "Reduce_scatter_block", "Reduce_scatter", "Neighbor_allgather", "Neighbor_allgatherv",
              "Neighbor_alltoall", "Neighbor_alltoallv", "Neighbor_alltoallw"):
    _b, _i, _p = _nb(_name)
    setattr(Collectives, _name, _b)
    setattr(Collectives, "I" + _name[0].lower() + _name[1:], _i)
    setattr(Collectives, _name + "_init", _p)
