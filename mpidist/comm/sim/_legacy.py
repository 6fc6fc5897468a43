"""SimComm: an in-process stand-in for an mpi4py intracommunicator, one thread per rank.

Glossary:
- universe: everything one ``simulate`` call shares: the lock, the failure flag and the
  deadlock bookkeeping. All communicators derived by Split/Dup live in the same universe.
- context: the shared state of one communicator (its members, collective rounds, mailboxes).
- round: one collective call, matched across ranks by its per-communicator sequence number.
  The last rank to arrive checks that every rank called the same thing and computes all results.

Semantics follow MPI: collectives match in call order per communicator; point-to-point messages
match posted receives in posting order and are non-overtaking per (source, tag). Sends are eager
(buffered), so ``Send`` never blocks; that can hide a deadlock that a large message would cause
under real MPI with a rendezvous protocol.
"""

import itertools
import os
import pickle
import threading
import time

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatchError, DeadlockError, RankFailedError, SimAbort, WatchdogTimeout

__all__ = ["SimComm", "SimRequest", "simulate"]

_OPS = [
    (MPI.SUM, "SUM", np.add), (MPI.PROD, "PROD", np.multiply),
    (MPI.MIN, "MIN", np.minimum), (MPI.MAX, "MAX", np.maximum),
    (MPI.LAND, "LAND", np.logical_and), (MPI.LOR, "LOR", np.logical_or),
    (MPI.LXOR, "LXOR", np.logical_xor), (MPI.BAND, "BAND", np.bitwise_and),
    (MPI.BOR, "BOR", np.bitwise_or), (MPI.BXOR, "BXOR", np.bitwise_xor),
]
_PY_OPS = {"SUM": lambda a, b: a + b, "PROD": lambda a, b: a * b, "MIN": min, "MAX": max,
           "LAND": lambda a, b: a and b, "LOR": lambda a, b: a or b}


def _op_entry(op):
    for entry in _OPS:
        if op == entry[0]:
            return entry
    raise TypeError(f"SimComm: unsupported reduction op ({op!r}); supported: {[e[1] for e in _OPS]}")


def _reduce(arrays, op):
    """Fold arrays in rank order with the numpy function of ``op``, keeping the dtype."""
    _, name, fn = _op_entry(op)
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = fn(acc, a)
    return acc.astype(arrays[0].dtype, copy=False)


def _as_array(obj, what):
    """Return a flat numpy view of a buffer (array, bytes-like) for reading and writing."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous and not obj.flags.f_contiguous:
            raise ValueError(f"SimComm.{what}: buffer is not contiguous (shape: {obj.shape}, strides: {obj.strides})")
        return obj.reshape(-1, order="A")
    if hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(f"SimComm.{what}: device buffers are not accepted by the simulated communicator ({type(obj).__name__}); stage through host memory")
    return np.frombuffer(memoryview(obj), dtype=np.uint8)


def _parse(spec, what):
    """Split an mpi4py buffer spec ``buf`` / ``[buf, type]`` / ``[buf, count, type]`` / ``[buf, counts, displs, type]``.

    Returns (flat array, counts or None, displs or None).
    """
    if spec is MPI.IN_PLACE or spec is None:
        return spec, None, None
    if isinstance(spec, (list, tuple)):
        items = [s for s in spec if not isinstance(s, MPI.Datatype)]
        arr = _as_array(items[0], what)
        if len(items) == 1:
            return arr, None, None
        if len(items) == 2:
            counts = items[1]
            if isinstance(counts, tuple) and len(counts) == 2 and not np.isscalar(counts[0]):
                return arr, list(counts[0]), list(counts[1])
            if np.isscalar(counts):
                return arr[: int(counts)], None, None
            return arr, list(counts), None
        return arr, list(items[1]), list(items[2])
    return _as_array(spec, what), None, None


def _displs(counts):
    return [0] + list(itertools.accumulate(counts))[:-1]


def _describe(name, sig):
    fields = ", ".join(f"{k}={v}" for k, v in sig)
    return f"{name}({fields})"


class _Universe:
    """State shared by every simulated rank of one ``simulate`` run."""

    def __init__(self, size, timeout=None):
        self.cond = threading.Condition()
        self.size = size
        self.timeout = timeout       # watchdog: seconds one wait may last (None: forever)
        self.alive = size
        self.failure = None          # (world rank, exception) of the first rank that failed
        self.epoch = 0               # bumped on every state change, for deadlock detection
        self.waiting = {}            # world rank -> (epoch it last found its wait unsatisfied, description)
        self.deadlock = None

    def changed(self):
        self.epoch += 1
        self.cond.notify_all()

    def wait_until(self, world_rank, ready, what):
        """Block (lock held) until ``ready()``; raise if another rank failed, all ranks are stuck, or the watchdog fires."""
        started = time.monotonic()
        try:
            while not ready():
                if self.timeout is not None and time.monotonic() - started > self.timeout:
                    busy = [r for r in range(self.size) if r not in self.waiting and r != world_rank]
                    lines = "; ".join(f"rank {r} waits in {self.waiting[r][1]}" for r in sorted(self.waiting))
                    raise WatchdogTimeout(f"watchdog: rank {world_rank} waited more than {self.timeout:g} s in {what}; "
                                          f"{lines}{'; ' if lines else ''}ranks not in a communication call: {busy}")
                if self.failure is not None and self.failure[0] != world_rank:
                    r, exc = self.failure
                    raise RankFailedError(f"simulated rank {r} failed ({type(exc).__name__}: {exc}); rank {world_rank} was released from {what}")
                if self.deadlock is not None:
                    raise DeadlockError(self.deadlock)
                self.waiting[world_rank] = (self.epoch, what)
                stuck = [r for r, (e, _) in self.waiting.items() if e == self.epoch]
                if len(stuck) == self.alive:
                    lines = "; ".join(f"rank {r} waits in {self.waiting[r][1]}" for r in sorted(stuck))
                    self.deadlock = f"deadlock: every live simulated rank is blocked: {lines}"
                    self.changed()
                    raise DeadlockError(self.deadlock)
                self.cond.wait(timeout=5.0 if self.timeout is None else min(5.0, self.timeout / 4))
        finally:
            self.waiting.pop(world_rank, None)


class _Round:
    def __init__(self, size):
        self.calls = [None] * size
        self.arrived = 0
        self.departed = 0
        self.done = False
        self.error = None
        self.results = [None] * size


class _Context:
    """Shared state of one communicator: members, collective rounds and point-to-point queues."""

    _ids = itertools.count()

    def __init__(self, universe, world_ranks, name):
        self.universe = universe
        self.world_ranks = list(world_ranks)
        self.name = name
        self.id = next(self._ids)
        self.rounds = {}
        self.unexpected = [[] for _ in world_ranks]   # per destination: messages nobody has asked for yet
        self.posted = [[] for _ in world_ranks]       # per destination: receives waiting for a message


class SimRequest:
    """Request of a nonblocking simulated operation (``Wait``/``Test`` like ``MPI.Request``)."""

    def __init__(self, comm, ready, finish, what):
        self._comm = comm
        self._ready = ready
        self._finish = finish
        self._what = what
        self._result = None
        self._completed = False

    def _complete(self, status=None):
        if not self._completed:
            self._result = self._finish(status)
            self._completed = True
        return self._result

    def Wait(self, status=None):
        """Block until the operation completes."""
        comm = self._comm
        u = comm._ctx.universe
        with u.cond:
            u.wait_until(comm._world_rank, self._ready, self._what)
            self._complete(status)
        return True

    def Test(self, status=None):
        """Complete the operation if it can complete now; return whether it did."""
        u = self._comm._ctx.universe
        with u.cond:
            if not self._ready():
                return False
            self._complete(status)
        return True

    def wait(self, status=None):
        """Block until the operation completes and return its object result."""
        self.Wait(status)
        return self._result

    def test(self, status=None):
        """Return (completed, result)."""
        done = self.Test(status)
        return done, (self._result if done else None)

    Get_status = Test

    @staticmethod
    def Waitall(requests, statuses=None):
        """Wait for every request."""
        for i, req in enumerate(requests):
            req.Wait(None if statuses is None else statuses[i])
        return True

    @staticmethod
    def Testall(requests):
        """Return whether every request has completed (completing those that can)."""
        return all([req.Test() for req in requests])

    waitall = Waitall


class SimMessage:
    """A message taken off the queue by ``Mprobe``/``Improbe``; ``Recv`` delivers it (like ``MPI.Message``)."""

    def __init__(self, comm, source, tag, payload):
        self._comm, self.source, self.tag, self._payload = comm, source, tag, payload

    def _fill(self, status):
        if status is not None:
            status.Set_source(self.source)
            status.Set_tag(self.tag)
            if isinstance(self._payload, np.ndarray):
                status.Set_elements(MPI.BYTE, self._payload.nbytes)

    def Recv(self, buf, status=None):
        """Copy the message into ``buf``."""
        self._comm._buffer_deliverer(buf, "Message.Recv")(self._payload)
        self._fill(status)

    def recv(self, status=None):
        """Return the message's Python object."""
        self._fill(status)
        return self._payload


class SimComm:
    """Simulated intracommunicator with mpi4py's method names and semantics (the subset mpidist uses)."""

    def __init__(self, ctx, rank):
        self._ctx = ctx
        self._rank = rank
        self._seq = 0
        self._freed = False

    # -- identity -------------------------------------------------------------------------------
    @property
    def _world_rank(self):
        return self._ctx.world_ranks[self._rank]

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return len(self._ctx.world_ranks)

    def Get_rank(self):
        """Return this rank's index in the communicator."""
        return self._rank

    def Get_size(self):
        """Return the number of ranks in the communicator."""
        return self.size

    def Get_name(self):
        """Return the communicator's name."""
        return self._ctx.name

    def Is_intra(self):
        return True

    def Is_inter(self):
        return False

    def __repr__(self):
        return f"<SimComm {self._ctx.name} rank {self._rank} of {self.size}>"

    # -- collective machinery ---------------------------------------------------------------------
    def _check_usable(self, what):
        if self._freed:
            raise ValueError(f"SimComm.{what}: communicator {self._ctx.name} was freed")

    def _start(self, name, sig, payload, work):
        """Post this rank's part of collective ``name``; the last rank to arrive computes every result.

        ``sig`` is a tuple of (field, value) pairs that must be equal on all ranks; ``work`` maps the
        list of payloads by rank to the list of results by rank.
        """
        self._check_usable(name)
        ctx, u = self._ctx, self._ctx.universe
        with u.cond:
            seq = self._seq
            self._seq += 1
            rnd = ctx.rounds.setdefault(seq, _Round(self.size))
            rnd.calls[self._rank] = (name, tuple(sig), payload)
            rnd.arrived += 1
            if rnd.arrived == self.size:
                self._finish_round(seq, rnd, work)
                u.changed()

        def ready():
            return rnd.done

        def finish(status):
            rnd.departed += 1
            if rnd.departed == self.size:
                ctx.rounds.pop(seq, None)
            if rnd.error is not None:
                raise CollectiveMismatchError(rnd.error)
            return rnd.results[self._rank]

        return SimRequest(self, ready, finish, f"{_describe(name, sig)} #{seq} on {ctx.name}")

    def _finish_round(self, seq, rnd, work):
        calls = {(c[0], c[1]) for c in rnd.calls}
        if len(calls) > 1:
            groups = {}
            for r, (name, sig, _) in enumerate(rnd.calls):
                groups.setdefault(_describe(name, sig), []).append(r)
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} called {d}" for d, rs in groups.items())
            rnd.error = f"collective mismatch on {self._ctx.name} (call #{seq}): {parts}"
        else:
            try:
                rnd.results = work([c[2] for c in rnd.calls])
            except Exception as exc:  # a bad buffer on some rank: every rank gets the message
                rnd.error = f"{rnd.calls[0][0]} on {self._ctx.name} (call #{seq}) failed: {exc}"
        rnd.done = True

    def _run(self, name, sig, payload, work):
        return self._start(name, sig, payload, work).wait()

    # -- buffer collectives -------------------------------------------------------------------------
    def Barrier(self):
        """Block until every rank has called Barrier."""
        self._run("Barrier", (), None, lambda p: [None] * len(p))

    def Ibarrier(self):
        """Start a nonblocking barrier."""
        return self._start("Ibarrier", (), None, lambda p: [None] * len(p))

    def _bcast(self, name, buf, root):
        self._check_root(name, root)
        arr, _, _ = _parse(buf, name)

        def work(bufs):
            src = bufs[root].copy()
            for b in bufs:
                b[...] = src
            return [None] * len(bufs)
        return self._start(name, (("root", root), ("count", arr.size), ("dtype", arr.dtype)), arr, work)

    def Bcast(self, buf, root=0):
        """Broadcast ``buf`` from ``root`` to every rank."""
        self._bcast("Bcast", buf, root).Wait()

    def Ibcast(self, buf, root=0):
        """Start a nonblocking broadcast."""
        return self._bcast("Ibcast", buf, root)

    def _allreduce(self, name, sendbuf, recvbuf, op, root=None):
        send, _, _ = _parse(sendbuf, name)
        recv, _, _ = _parse(recvbuf, name)
        src = recv if send is MPI.IN_PLACE else send
        opname = _op_entry(op)[1]
        sig = [("count", src.size), ("dtype", src.dtype), ("op", opname)]
        if root is not None:
            self._check_root(name, root)
            sig.append(("root", root))

        def work(parts):
            result = _reduce([s.copy() for s, _ in parts], op)
            for r, (_, out) in enumerate(parts):
                if root is None or r == root:
                    out[: result.size] = result  # MPI writes count elements, not the whole buffer
            return [None] * len(parts)
        return self._start(name, sig, (src, recv), work)

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Reduce ``sendbuf`` of all ranks with ``op`` into every rank's ``recvbuf`` (``MPI.IN_PLACE`` allowed)."""
        self._allreduce("Allreduce", sendbuf, recvbuf, op).Wait()

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a nonblocking allreduce."""
        return self._allreduce("Iallreduce", sendbuf, recvbuf, op)

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        """Reduce ``sendbuf`` of all ranks into ``recvbuf`` on ``root``."""
        if sendbuf is MPI.IN_PLACE and self._rank != root:
            raise ValueError(f"SimComm.Reduce: MPI.IN_PLACE is only valid on the root (rank {self._rank}, root {root})")
        if recvbuf is None:
            recvbuf = np.empty_like(_parse(sendbuf, "Reduce")[0])
        self._allreduce("Reduce", sendbuf, recvbuf, op, root=root).Wait()

    def _allgather(self, name, sendbuf, recvbuf):
        send, _, _ = _parse(sendbuf, name)
        recv, counts, displs = _parse(recvbuf, name)
        if send is MPI.IN_PLACE:
            raise NotImplementedError(f"SimComm.{name}: MPI.IN_PLACE is not supported")
        variable = counts is not None
        if variable:
            displs = displs if displs is not None else _displs(counts)
            sig = [("counts", tuple(int(c) for c in counts)), ("dtype", send.dtype)]
            if send.size != counts[self._rank]:
                raise ValueError(f"SimComm.{name}: send count {send.size} differs from counts[{self._rank}] = {counts[self._rank]}")
        else:
            sig = [("count", send.size), ("dtype", send.dtype)]
            if recv.size < send.size * self.size:
                raise ValueError(f"SimComm.{name}: receive buffer too small ({recv.size} < {self.size} x {send.size})")

        def work(parts):
            pieces = [s.copy() for s, _ in parts]
            for _, out in parts:
                offsets = displs if variable else [r * pieces[0].size for r in range(len(pieces))]
                for off, piece in zip(offsets, pieces):
                    out[off: off + piece.size] = piece
            return [None] * len(parts)
        return self._start(name, sig, (send, recv), work)

    def Allgather(self, sendbuf, recvbuf):
        """Gather equal-size ``sendbuf`` of all ranks into every rank's ``recvbuf`` in rank order."""
        self._allgather("Allgather", sendbuf, recvbuf).Wait()

    def Iallgather(self, sendbuf, recvbuf):
        """Start a nonblocking allgather."""
        return self._allgather("Iallgather", sendbuf, recvbuf)

    def Allgatherv(self, sendbuf, recvbuf):
        """Gather variable-size buffers: ``recvbuf`` is ``[buf, counts, displs, type]`` or ``[buf, (counts, displs), type]``."""
        self._allgather("Allgatherv", sendbuf, recvbuf).Wait()

    def Iallgatherv(self, sendbuf, recvbuf):
        """Start a nonblocking Allgatherv."""
        return self._allgather("Iallgatherv", sendbuf, recvbuf)

    def _alltoall(self, name, sendbuf, recvbuf):
        send, send_counts, send_displs = _parse(sendbuf, name)
        recv, recv_counts, recv_displs = _parse(recvbuf, name)
        if send is MPI.IN_PLACE:
            raise NotImplementedError(f"SimComm.{name}: MPI.IN_PLACE is not supported")
        n = self.size
        if send_counts is None:  # Alltoall: equal blocks
            if send.size % n or recv.size < send.size:
                raise ValueError(f"SimComm.{name}: send buffer of {send.size} elements does not split into {n} "
                                 f"equal blocks, or the receive buffer ({recv.size}) is smaller")
            block = send.size // n
            send_counts = recv_counts = [block] * n
            sig = [("count", send.size), ("dtype", send.dtype)]
        else:
            sig = [("dtype", send.dtype)]  # counts differ by rank by nature
        send_displs = send_displs if send_displs is not None else _displs(send_counts)
        recv_displs = recv_displs if recv_displs is not None else _displs(recv_counts)
        for what, arr, counts, displs in (("send", send, send_counts, send_displs), ("receive", recv, recv_counts, recv_displs)):
            if len(counts) != n or any(d + c > arr.size for c, d in zip(counts, displs)):
                raise ValueError(f"SimComm.{name}: {what} counts {list(counts)} / displacements {list(displs)} do not fit "
                                 f"a buffer of {arr.size} elements for {n} ranks")
        mine = (send, list(send_counts), list(send_displs), recv, list(recv_counts), list(recv_displs))

        def work(parts):
            for i, (_, _, _, out, r_counts, r_displs) in enumerate(parts):
                for j, (src, s_counts, s_displs, _, _, _) in enumerate(parts):
                    if s_counts[i] != r_counts[j]:
                        raise ValueError(f"rank {j} sends {s_counts[i]} elements to rank {i}, which expects {r_counts[j]}")
            pieces = [[src[d: d + c].copy() for c, d in zip(s_counts, s_displs)] for src, s_counts, s_displs, *_ in parts]
            for i, (_, _, _, out, r_counts, r_displs) in enumerate(parts):
                for j in range(len(parts)):
                    out[r_displs[j]: r_displs[j] + r_counts[j]] = pieces[j][i]
            return [None] * len(parts)
        return self._start(name, sig, mine, work)

    def Alltoall(self, sendbuf, recvbuf):
        """Send block j of ``sendbuf`` to rank j; block i of ``recvbuf`` comes from rank i (equal blocks)."""
        self._alltoall("Alltoall", sendbuf, recvbuf).Wait()

    def Alltoallv(self, sendbuf, recvbuf):
        """Variable-size Alltoall: each buffer is ``[buf, (counts, displs)]`` (or ``[buf, counts, displs, type]``)."""
        self._alltoall("Alltoallv", sendbuf, recvbuf).Wait()

    def _reduce_scatter(self, name, sendbuf, recvbuf, counts, op):
        send, _, _ = _parse(sendbuf, name)
        recv, _, _ = _parse(recvbuf, name)
        in_place = send is MPI.IN_PLACE
        src = recv if in_place else send
        total = sum(counts)
        if src.size < total:
            raise ValueError(f"SimComm.{name}: send buffer has {src.size} elements, counts need {total}")
        sig = [("counts", tuple(counts)), ("dtype", src.dtype), ("op", _op_entry(op)[1])]
        displs = _displs(counts)

        def work(parts):
            result = _reduce([s[:total].copy() for s, _ in parts], op)
            for r, (_, out) in enumerate(parts):
                out[: counts[r]] = result[displs[r]: displs[r] + counts[r]]
            return [None] * len(parts)
        return self._start(name, sig, (src, recv), work)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Reduce, then give rank i block i (every block the size of ``recvbuf``)."""
        recv = _parse(recvbuf, "Reduce_scatter_block")[0]
        if sendbuf is MPI.IN_PLACE:
            count = recv.size // self.size
        else:
            count = recv.size
        self._reduce_scatter("Reduce_scatter_block", sendbuf, recvbuf, [count] * self.size, op).Wait()

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a nonblocking Reduce_scatter_block."""
        recv = _parse(recvbuf, "Ireduce_scatter_block")[0]
        count = recv.size // self.size if sendbuf is MPI.IN_PLACE else recv.size
        return self._reduce_scatter("Ireduce_scatter_block", sendbuf, recvbuf, [count] * self.size, op)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Reduce, then give rank i ``recvcounts[i]`` elements."""
        if recvcounts is None:
            raise ValueError("SimComm.Reduce_scatter: recvcounts is required")
        counts = [int(c) for c in recvcounts]
        self._reduce_scatter("Reduce_scatter", sendbuf, recvbuf, counts, op).Wait()

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Start a nonblocking Reduce_scatter."""
        counts = [int(c) for c in recvcounts]
        return self._reduce_scatter("Ireduce_scatter", sendbuf, recvbuf, counts, op)

    def _check_root(self, name, root):
        if not 0 <= root < self.size:
            raise ValueError(f"SimComm.{name}: root {root} out of range for communicator of size {self.size}")

    # -- object collectives (lowercase) -----------------------------------------------------------
    @staticmethod
    def _copy(obj):
        return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def bcast(self, obj, root=0):
        """Broadcast a Python object from ``root``; return it on every rank."""
        self._check_root("bcast", root)
        return self._run("bcast", (("root", root),), obj if self._rank == root else None,
                         lambda objs: [self._copy(objs[root]) for _ in objs])

    def allreduce(self, obj, op=MPI.SUM):
        """Reduce Python objects with ``op`` (Python operators, like mpi4py) and return the result on every rank."""
        return self._reduce_objects("allreduce", obj, op, None)

    def reduce(self, obj, op=MPI.SUM, root=0):
        """Reduce Python objects to ``root``; other ranks get None."""
        self._check_root("reduce", root)
        return self._reduce_objects("reduce", obj, op, root)

    def _reduce_objects(self, call, obj, op, root):
        name = _op_entry(op)[1]
        fn = _PY_OPS.get(name)
        if fn is None:
            raise TypeError(f"SimComm.{call}: op {name} is not supported for objects")

        def work(objs):
            acc = self._copy(objs[0])
            for o in objs[1:]:
                acc = fn(acc, self._copy(o))
            return [self._copy(acc) if root is None or r == root else None for r in range(len(objs))]
        signature = (("op", name),) if root is None else (("op", name), ("root", root))
        return self._run(call, signature, obj, work)

    def allgather(self, obj):
        """Return the list of every rank's object."""
        return self._run("allgather", (), obj, lambda objs: [self._copy(objs) for _ in objs])

    def gather(self, obj, root=0):
        """Return the list of every rank's object on ``root``, None elsewhere."""
        self._check_root("gather", root)
        return self._run("gather", (("root", root),), obj,
                         lambda objs: [self._copy(objs) if r == root else None for r in range(len(objs))])

    def scatter(self, objs, root=0):
        """Give rank i item i of ``objs`` from ``root``."""
        self._check_root("scatter", root)

        def work(parts):
            items = parts[root]
            if items is None or len(items) != len(parts):
                raise ValueError(f"scatter: root needs a sequence of {len(parts)} items, got {None if items is None else len(items)}")
            return [self._copy(x) for x in items]
        return self._run("scatter", (("root", root),), objs if self._rank == root else None, work)

    def barrier(self):
        """Block until every rank has called barrier."""
        self.Barrier()

    # -- point to point -----------------------------------------------------------------------------
    def _matches(self, want_source, want_tag, source, tag):
        return (want_source in (MPI.ANY_SOURCE, source)) and (want_tag in (MPI.ANY_TAG, tag))

    def _post_send(self, payload, dest, tag, name):
        self._check_usable(name)
        if dest == MPI.PROC_NULL:  # MPI: a send to PROC_NULL completes at once and goes nowhere
            return SimRequest(self, lambda: True, lambda status: None, name)
        if not 0 <= dest < self.size:
            raise ValueError(f"SimComm.{name}: dest {dest} out of range for communicator of size {self.size}")
        ctx, u = self._ctx, self._ctx.universe
        with u.cond:
            for i, recv in enumerate(ctx.posted[dest]):
                if self._matches(recv["source"], recv["tag"], self._rank, tag):
                    del ctx.posted[dest][i]
                    recv["message"] = (self._rank, tag, payload)
                    break
            else:
                ctx.unexpected[dest].append((self._rank, tag, payload))
            u.changed()
        return SimRequest(self, lambda: True, lambda status: None, name)

    def _post_recv(self, source, tag, deliver, name):
        self._check_usable(name)
        if source not in (MPI.ANY_SOURCE, MPI.PROC_NULL) and not 0 <= source < self.size:
            raise ValueError(f"SimComm.{name}: source {source} out of range for communicator of size {self.size}")
        ctx, u = self._ctx, self._ctx.universe
        if source == MPI.PROC_NULL:  # MPI: completes at once, empty, from PROC_NULL with ANY_TAG
            def finish_null(status):
                if status is not None:
                    status.Set_source(MPI.PROC_NULL)
                    status.Set_tag(MPI.ANY_TAG)
                    status.Set_elements(MPI.BYTE, 0)
            return SimRequest(self, lambda: True, finish_null, name)
        recv = {"source": source, "tag": tag, "message": None}
        with u.cond:
            queue = ctx.unexpected[self._rank]
            for i, (src, t, payload) in enumerate(queue):
                if self._matches(source, tag, src, t):
                    recv["message"] = queue.pop(i)
                    break
            else:
                ctx.posted[self._rank].append(recv)

        def finish(status):
            src, t, payload = recv["message"]
            count = deliver(payload)
            if status is not None:
                status.Set_source(src)
                status.Set_tag(t)
                if count is not None:  # object messages have no element count
                    status.Set_elements(MPI.BYTE, count)
            return payload if count is None else None
        what = f"{name}(source={'ANY' if source == MPI.ANY_SOURCE else source}, tag={'ANY' if tag == MPI.ANY_TAG else tag}) on {ctx.name}"
        return SimRequest(self, lambda: recv["message"] is not None, finish, what)

    def _buffer_deliverer(self, buf, name):
        arr = _parse(buf, name)[0]

        def deliver(data):
            if data.nbytes > arr.nbytes:
                raise ValueError(f"SimComm.{name}: message truncated ({data.nbytes} bytes into a {arr.nbytes}-byte buffer)")
            arr.view(np.uint8)[: data.nbytes] = data.view(np.uint8).reshape(-1)
            return data.nbytes
        return deliver

    def Improbe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Take the first matching message off the queue if there is one (``SimMessage``), else return None."""
        self._check_usable("Improbe")
        return self._probe(source, tag, status, take=True)

    def _probe(self, source, tag, status, take):
        """Return the first queued message matching (source, tag) as a ``SimMessage`` (or None),
        taking it off the queue when ``take``; fill ``status`` from it."""
        with self._ctx.universe.cond:
            queue = self._ctx.unexpected[self._rank]
            for i, (src, t, payload) in enumerate(queue):
                if self._matches(source, tag, src, t):
                    if take:
                        del queue[i]
                    message = SimMessage(self, src, t, payload)
                    message._fill(status)
                    return message
        return None

    def Iprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Return whether a matching message is queued, leaving it there; fill ``status`` for the first."""
        self._check_usable("Iprobe")
        return self._probe(source, tag, status, take=False) is not None

    def Probe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Block until a matching message is queued, leaving it there; fill ``status``."""
        self._check_usable("Probe")
        u = self._ctx.universe
        what = f"Probe(source={'ANY' if source == MPI.ANY_SOURCE else source}, tag={'ANY' if tag == MPI.ANY_TAG else tag}) on {self._ctx.name}"
        with u.cond:
            u.wait_until(self._world_rank, lambda: self.Iprobe(source, tag, status), what)
        return True

    def Mprobe(self, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Block until a matching message arrives and take it off the queue (``SimMessage``)."""
        self._check_usable("Mprobe")
        ctx, u = self._ctx, self._ctx.universe
        found = []

        def ready():
            message = self.Improbe(source, tag, status) if not found else None
            if message is not None:
                found.append(message)
            return bool(found)
        what = f"Mprobe(source={'ANY' if source == MPI.ANY_SOURCE else source}, tag={'ANY' if tag == MPI.ANY_TAG else tag}) on {ctx.name}"
        with u.cond:
            u.wait_until(self._world_rank, ready, what)
        return found[0]

    def Isend(self, buf, dest, tag=0):
        """Start a send of ``buf`` to ``dest`` (eager: the data is copied at once)."""
        return self._post_send(_parse(buf, "Isend")[0].copy(), dest, tag, "Isend")

    def Send(self, buf, dest, tag=0):
        """Send ``buf`` to ``dest`` (eager)."""
        self.Isend(buf, dest, tag)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Start a receive into ``buf``."""
        return self._post_recv(source, tag, self._buffer_deliverer(buf, "Irecv"), "Irecv")

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Receive into ``buf``; fill ``status`` (source, tag, count) when given."""
        self._post_recv(source, tag, self._buffer_deliverer(buf, "Recv"), "Recv").Wait(status)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        """Send to ``dest`` and receive from ``source`` without deadlock."""
        self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)

    def isend(self, obj, dest, tag=0):
        """Start sending a Python object."""
        return self._post_send(self._copy(obj), dest, tag, "isend")

    def send(self, obj, dest, tag=0):
        """Send a Python object."""
        self.isend(obj, dest, tag)

    def irecv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        """Start receiving a Python object; ``wait()`` returns it."""
        return self._post_recv(source, tag, lambda obj: None, "irecv")

    def recv(self, buf=None, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        """Receive a Python object."""
        return self._post_recv(source, tag, lambda obj: None, "recv").wait(status)

    def sendrecv(self, sendobj, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG, status=None):
        """Send and receive Python objects."""
        self.isend(sendobj, dest, sendtag)
        return self.recv(None, source, recvtag, status)

    # -- communicator management --------------------------------------------------------------------
    def _derive(self, name, color, key):
        def work(parts):
            universe = self._ctx.universe
            by_color = {}
            for r, (c, k) in enumerate(parts):
                if c != MPI.UNDEFINED:
                    by_color.setdefault(c, []).append((k, r))
            results = [None] * len(parts)
            for c, members in sorted(by_color.items()):
                members.sort()
                ctx = _Context(universe, [self._ctx.world_ranks[r] for _, r in members],
                               f"{self._ctx.name}.{name}({c})")
                for new_rank, (_, r) in enumerate(members):
                    results[r] = (ctx, new_rank)
            return results
        got = self._run(name, (), (color, key), work)
        return MPI.COMM_NULL if got is None else SimComm(*got)

    def Split(self, color=0, key=0):
        """Partition ranks by ``color``, ordered by ``key`` then rank; ``MPI.UNDEFINED`` gives ``MPI.COMM_NULL``."""
        return self._derive("Split", color, key)

    def Split_type(self, split_type, key=0, info=None):
        """Split by shared-memory node (``MPI.COMM_TYPE_SHARED``): simulated nodes come from ``simulate(ranks_per_node=)``."""
        if split_type != MPI.COMM_TYPE_SHARED:
            raise ValueError(f"SimComm.Split_type: only MPI.COMM_TYPE_SHARED is simulated (got {split_type})")
        node = self._world_rank // self._ctx.universe.ranks_per_node
        return self._derive("Split_type", node, key)

    def Dup(self):
        """Return a new communicator with the same ranks and a separate message space."""
        return self._derive("Dup", 0, self._rank)

    Clone = Dup

    def Free(self):
        """Mark the communicator as freed (later calls raise)."""
        self._freed = True

    def Abort(self, errorcode=1):
        """Abort the simulated job: this rank raises and every other rank is released with an error."""
        raise SimAbort(f"rank {self._rank} of {self._ctx.name} called Abort({errorcode})")


def simulate(n, fn, *args, ranks_per_node=None, timeout=None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``n`` threads, one per simulated rank; return the results by rank.

    The first rank to raise makes every other rank's pending communication raise ``RankFailedError``;
    ``simulate`` then re-raises that first exception with its rank noted in the message.
    ``ranks_per_node`` groups consecutive ranks into simulated nodes for ``Split_type``.
    ``timeout`` (seconds; default ``MPIDIST_SIM_TIMEOUT`` or none) makes a wait that lasts longer raise
    ``WatchdogTimeout`` describing what every rank is doing.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate: n must be a positive int (got {n!r})")
    if timeout is None and os.environ.get("MPIDIST_SIM_TIMEOUT"):
        timeout = float(os.environ["MPIDIST_SIM_TIMEOUT"])
    universe = _Universe(n, timeout)
    universe.ranks_per_node = ranks_per_node or n
    world = _Context(universe, range(n), "SIM_WORLD")
    results = [None] * n
    errors = [None] * n

    def run(rank):
        comm = SimComm(world, rank)
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - any failure must release the other ranks
            errors[rank] = exc
            with universe.cond:
                if universe.failure is None and not isinstance(exc, (RankFailedError, DeadlockError)):
                    universe.failure = (rank, exc)
                universe.changed()
        finally:
            with universe.cond:
                universe.alive -= 1
                universe.changed()

    threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if universe.failure is not None:
        rank, exc = universe.failure
    else:
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return results
        rank, exc = failed[0]
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on simulated rank {rank} of {n})")
    if not exc.args or f"rank {rank}" not in str(exc.args[0]):
        try:
            exc.args = (f"[simulated rank {rank}] {exc.args[0] if exc.args else ''}",) + tuple(exc.args[1:])
        except (AttributeError, TypeError):
            pass
    raise exc.with_traceback(exc.__traceback__)
