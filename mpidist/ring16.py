"""The 16-bit ring: sum float16/bfloat16 arrays over a communicator with 16-bit messages, float32 accumulation.

Why a ring of its own: MPI has no bfloat16 and mpidist reduces float16 in float32 (``mpidist.wire``), so a plain
MPI allreduce of 16-bit data moves float32. The ring reduce-scatter sends 16-bit chunks point to point and adds
each received chunk into a float32 accumulator (one rounding per hop, n - 1 in all), then an allgather moves the
finished 16-bit chunks as bytes: 2 (n - 1) / n * (16-bit bytes) per rank, half of a float32 ring. Every rank
ends with the same bits (the owner's chunk is copied, never recomputed).

Glossary:
  ring      ``Ring16``: the algorithm as a nonblocking state machine. Each step posts one Isend and one Irecv
            of a chunk into buffers of known size; ``test()`` finishes the steps whose messages arrived and
            posts the next, ``wait()`` runs them to the end and returns the result.
  chunk     ``ceil(size / n)`` elements: rank r owns chunk r of the reduce-scatter (the last ones shorter or
            empty when n does not divide the size).

  private duplicate  where a ring runs unless the caller gives a tag: a ``Dup()`` of the caller's communicator,
            made (collectively) at the first ring over it, cached on it as an MPI attribute and freed when it is
            freed. Each ring there takes the next tag of the duplicate's sequence (0, 1, ..., 32767, 0, ...), so
            rings pending at once never match each other's messages, and the caller's messages on its
            communicator (any tag, ``MPI.ANY_TAG`` receives) never match a ring's. As for any MPI collective,
            every rank must start the rings over one communicator in the same order: that keeps the sequences
            equal.

Blocking: ``ring_allreduce_16``, ``ring_reduce_scatter_16``. Pending work (DDP's compression hooks, FSDP's 16-bit
reduce-scatter): ``iring_allreduce_16``, ``iring_reduce_scatter_16`` return the ring, whose ``test()`` advances it
and whose ``wait()`` gives the result. Building blocks of other 16-bit schemes (``collectives_hier``): ``Ring16``
over a communicator and tag of the caller's, ``post_16`` (a header-free recorded message), ``wait_together``.
"""

import threading
import time

import numpy as np
from mpi4py import MPI

from . import collectives, wire
from .xp import asarray_like, check_dtype, copy_into, is_device_array, to_numpy

__all__ = ["ring_allreduce_16", "ring_reduce_scatter_16", "iring_allreduce_16", "iring_reduce_scatter_16",
           "private_comm", "Ring16", "post_16", "wait_together"]

_SIXTEEN_BIT = (np.dtype(np.float16), wire.BFLOAT16)
_SEQUENCE_TAGS = 32768  # tags 0..32767, which every MPI allows (MPI_TAG_UB >= 32767)
_keyvals = {}  # communicator class -> the attribute key caching a communicator's _Private
_keyvals_lock = threading.Lock()


class _Private:
    """A communicator's private duplicate for rings and the tag its next ring takes."""

    __slots__ = ("comm", "next_tag")

    def __init__(self, comm):
        self.comm, self.next_tag = comm, 0

    def take(self):
        """Return (the duplicate, the next ring's tag) and move the sequence on."""
        tag = self.next_tag
        self.next_tag = (tag + 1) % _SEQUENCE_TAGS
        return self.comm, tag


def _free_private(comm, keyval, private):
    """Free the duplicate when the communicator it belongs to is freed (its attributes are deleted)."""
    if not MPI.Is_finalized() and private.comm:
        private.comm.Free()


def private_comm(comm):
    """Return ``comm``'s private duplicate, where rings without a tag run; made now (collectively) at the first request.

    For callers that must name every communicator their work talks over (``mpidist.elastic`` revokes a wrapper's
    ``communicators()`` after a failure; a ring blocked on an unrevoked duplicate would wait forever): they make
    it up front, where every rank is, and list it."""
    return _private_of(comm).comm


def _private(comm):
    """Return (``comm``'s private duplicate for rings, this ring's tag); the first call for ``comm`` is collective."""
    return _private_of(comm).take()


def _private_of(comm):
    cls = type(comm)  # the class's own Create_keyval: SimComm keeps its keys' delete functions itself
    with _keyvals_lock:   # SimComm's ranks are threads: two making a key each would disagree on who has a Dup
        keyval = _keyvals.get(cls)
        if keyval is None:
            keyval = _keyvals[cls] = cls.Create_keyval(delete_fn=_free_private)
    private = comm.Get_attr(keyval)
    if private is None:
        private = _Private(comm.Dup())
        comm.Set_attr(keyval, private)
    return private


def _tag_ub(comm):
    """Return ``comm``'s largest tag (Open MPI sets MPI_TAG_UB on COMM_WORLD only; MPI guarantees 32767)."""
    return comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767


def _route(fn, comm, tag):
    """Return (communicator, tag) of a ring: ``comm`` with the caller's ``tag``, or the private duplicate's next."""
    if tag is None:
        return _private(comm) if comm.Get_size() > 1 else (comm, 0)  # one rank sends nothing
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= _tag_ub(comm):
        raise ValueError(f"{fn}: tag must be an int in 0..{_tag_ub(comm)} (MPI_TAG_UB of the communicator), "
                         f"or None for a private duplicate (got {tag!r})")
    return comm, int(tag)


def post_16(comm, op, start, buf, peer, tag):
    """Start ``start`` (``comm.Irecv`` or ``comm.Isend``) of 16-bit ``buf`` as a collectives Handle: no header (both
    ends know the size), and the guard's flight recorder and watchdog see it as they see ``collectives.isend``."""
    def post():
        return collectives.Handle([start(wire.copy_view(buf), peer, tag)], lambda: None, keep=(buf,))
    return collectives.run_recorded(collectives.record_p2p(comm, op, buf, peer), post)


class Ring16:
    """The 16-bit ring as a nonblocking state machine: each step posts one Isend and one Irecv of a 16-bit chunk;
    ``test()`` finishes the steps whose messages arrived and posts the next, ``wait()`` runs them to the end and
    returns the result.

    ``flat``: a 1-D float16/bfloat16 array, or a float32 one with ``wire_dtype`` (the 16-bit dtype of the
    messages and the result; ``flat``'s values enter the accumulator unrounded, the first message rounds them).
    The reduce-scatter (n - 1 steps) leaves chunk ``rank`` of the float32
    accumulator ``acc`` summed over the ranks (divided by their number with ``mean``); with ``gather`` an
    allgather ring (n - 1 more steps) then forwards the finished 16-bit chunks as they are into ``gathered``.
    The result: with ``gather`` the sum in ``out`` (a new array of ``flat``'s dtype if None), else this rank's
    chunk rounded to ``flat``'s dtype.
    ``tag``: every message's tag. Two rings pending at once on one communicator need different tags (messages
    with one tag from one sender match the receives in the order they were posted). Chunks are equal
    (``ceil(size / n)`` elements, the accumulator zero-padded): both ends know every message's size, so receives
    are posted into their buffers and MPI moves the bytes while the caller computes."""

    def __init__(self, flat, comm, tag, mean=False, gather=True, group=None, out=None, wire_dtype=None):
        self.dtype = flat.dtype if wire_dtype is None else np.dtype(wire_dtype)
        self.comm, self.tag, self.mean, self.group = comm, tag, mean, group
        self.size, self.out, self._result = flat.size, out, None
        n, self.rank = comm.Get_size(), comm.Get_rank()
        self.n, self.chunk = n, -(-flat.size // n)
        self.acc = np.zeros(n * self.chunk, np.float32)
        # A device (CuPy) array is staged through the host, one copy down here and one up in _finish: the ring's
        # messages must be host buffers for an MPI that is not CUDA-aware (the only kind seen on our GPUs), its
        # float32 accumulation is then numpy's (CuPy and numpy results are the same bits), and on the device each
        # of its 2 (n - 1) steps would cost a kernel and a stream sync for a chunk.
        self.like = flat if is_device_array(flat) else None
        if self.like is not None:
            check_dtype(flat, self.dtype, "16-bit ring")
        self.acc[:flat.size] = to_numpy(flat)
        self.send16, self.recv16 = np.empty(self.chunk, self.dtype), np.empty(self.chunk, self.dtype)
        self.gathered = np.empty(n * self.chunk, self.dtype) if gather else None
        self.steps = (n - 1) * (2 if gather else 1)
        self.step, self.requests = 0, []
        self._post()
        if group is not None:
            group.append(self)

    def _span(self, c):
        return slice(c * self.chunk, (c + 1) * self.chunk)

    def _post(self):
        """Post step ``self.step``'s two messages (after the reduce-scatter's last step: finish it first)."""
        n, rank, k = self.n, self.rank, self.step
        if k == n - 1:
            mine = self.acc[self._span(rank)]
            if self.mean:
                mine /= np.float32(n)
            if self.gathered is not None:
                self.gathered[self._span(rank)] = mine  # rounds once; every rank receives these bits as they are
        if k == self.steps:
            return
        right, left = (rank + 1) % n, (rank - 1) % n
        if k < n - 1:
            # Step k sends chunk (rank - k - 1) and adds the left neighbour's chunk (rank - k - 2): after n - 1
            # steps rank r holds the whole sum of chunk r.
            self.send16[...] = self.acc[self._span((rank - k - 1) % n)]
            send, receive = self.send16, self.recv16
        else:
            # Allgather step j forwards chunk (rank - j), finished by its owner, and receives chunk (rank - j - 1).
            j = k - (n - 1)
            send, receive = self.gathered[self._span((rank - j) % n)], self.gathered[self._span((rank - j - 1) % n)]
        self.requests = [post_16(self.comm, "recv", self.comm.Irecv, receive, left, self.tag),
                         post_16(self.comm, "send", self.comm.Isend, send, right, self.tag)]

    def _advance(self):
        """Finish the step whose messages completed and post the next."""
        k = self.step
        if k < self.n - 1:
            c = (self.rank - k - 2) % self.n
            self.acc[self._span(c)] += self.recv16
        self.step += 1
        self._post()

    def done(self):
        """Whether every step has completed (as far as ``test()``/``wait()`` have seen)."""
        return self.step == self.steps

    def test(self):
        """Advance as far as the messages that arrived allow, without blocking; return whether it completed."""
        while not self.done():
            self.requests = [r for r in self.requests if not r.test()]
            if self.requests:
                return False
            self._advance()
        return True

    def wait(self):
        """Run the remaining steps; return the result. In a ``group`` (DDP's pending rings) every ring of it is
        tested round-robin until this one is done: the rings advance together, instead of later buckets' waiting
        for each step of the earlier ones' (the arithmetic, and so the result, is the same). Alone: blocking on
        each step."""
        if self.group is None:
            while not self.done():
                for r in self.requests:
                    r.wait()
                self.requests = []
                self._advance()
        else:
            wait_together(self, self.group)
        return self._finish()

    def _finish(self):
        if self._result is None:
            if self.gathered is not None and (self.out is not None or self.like is None):
                out = np.empty(self.size, self.dtype) if self.out is None else self.out
                copy_into(out, self.gathered[:self.size])  # to the device when ``out`` is a device array
                self._result = out
            else:
                host = self.gathered[:self.size] if self.gathered is not None else \
                    self.acc[self.rank * self.chunk: min((self.rank + 1) * self.chunk, self.size)].astype(self.dtype)
                self._result = host if self.like is None else asarray_like(host, self.like)
        return self._result


def wait_together(work, group):
    """Test every pending work of ``group`` (anything with ``test()``; done ones leave it) round-robin until
    ``work`` is done: works in flight at once advance together (DDP's buckets: the 16-bit rings, the node-aware
    16-bit allreduces of ``collectives_hier``)."""
    while True:
        for other in list(group):
            if other.test():
                group.remove(other)
        if work.done():
            return
        time.sleep(0)  # let other threads (SimComm's ranks, DDP's poller) run


def _check_16(fn, flat):
    if flat.dtype not in _SIXTEEN_BIT:
        raise TypeError(f"{fn}: needs a float16 or bfloat16 array (got {flat.dtype})")
    if flat.ndim != 1:
        raise ValueError(f"{fn}: needs a 1-D array (got shape {flat.shape})")


def ring_reduce_scatter_16(flat, comm, mean=False, tag=None):
    """Return this rank's chunk of the sum (or ``mean``) of the 1-D float16/bfloat16 array ``flat`` over ``comm``:
    16-bit messages, float32 accumulation, rounded once at the end to ``flat``'s dtype. Chunks have
    ``ceil(flat.size / ranks)`` elements (the last ones shorter or empty when that does not divide).

    ``tag``: None (default): the messages go over ``comm``'s private duplicate (see the module's glossary);
    an int: over ``comm`` itself with that tag, which no other message or receive there may use meanwhile."""
    return _start("ring_reduce_scatter_16", flat, comm, tag, mean=mean, gather=False).wait()


def ring_allreduce_16(flat, comm, out=None, tag=None):
    """Sum the 1-D float16/bfloat16 array ``flat`` over ``comm`` with 16-bit messages and float32 accumulation.

    Returns the sum (in ``out`` if given, else in a new array of ``flat``'s dtype), the same bits on every rank.
    See the module's docstring for the bytes it moves. ``tag``: as in ``ring_reduce_scatter_16``."""
    return _start("ring_allreduce_16", flat, comm, tag, out=out).wait()


def iring_reduce_scatter_16(flat, comm, mean=False, tag=None):
    """Start ``ring_reduce_scatter_16``; return the ring: ``test()`` advances it, ``wait()`` returns the chunk.

    ``flat`` is copied at the start (into the float32 accumulator): the caller may reuse it at once."""
    return _start("iring_reduce_scatter_16", flat, comm, tag, mean=mean, gather=False)


def iring_allreduce_16(flat, comm, out=None, tag=None, group=None):
    """Start ``ring_allreduce_16``; return the ring: ``test()`` advances it, ``wait()`` returns the sum.

    ``out`` (which may be ``flat``: it is copied at the start) is written by ``wait()``. ``group``: a list of
    pending rings that this one joins (DDP's buckets): waiting for one advances them all (``Ring16.wait``)."""
    return _start("iring_allreduce_16", flat, comm, tag, group=group, out=out)


def _start(fn, flat, comm, tag, **ring):
    """Check ``fn``'s input and start its ring over ``comm`` or its private duplicate (``tag`` None)."""
    _check_16(fn, flat)
    ring_comm, tag = _route(fn, comm, tag)
    return Ring16(flat, ring_comm, tag, **ring)
