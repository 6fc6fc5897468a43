"""The 16-bit ring: sum float16/bfloat16 arrays over a communicator with 16-bit messages, float32 accumulation.

Why a ring of its own: MPI has no bfloat16 and mpidist reduces float16 in float32 (``mpidist.wire``), so a plain
MPI allreduce of 16-bit data moves float32. The ring reduce-scatter sends 16-bit chunks point to point and adds
each received chunk into a float32 accumulator (one rounding per hop, n - 1 in all), then an allgather moves the
finished 16-bit chunks as bytes: 2 (n - 1) / n * (16-bit bytes) per rank, half of a float32 ring. Every rank
ends with the same bits (the owner's chunk is copied, never recomputed).

Glossary:
  ring      ``_Ring16``: the algorithm as a nonblocking state machine. Each step posts one Isend and one Irecv
            of a chunk into buffers of known size; ``test()`` finishes the steps whose messages arrived and
            posts the next, ``wait()`` runs them to the end and returns the result.
  chunk     ``ceil(size / n)`` elements: rank r owns chunk r of the reduce-scatter (the last ones shorter or
            empty when n does not divide the size).

Blocking: ``ring_allreduce_16``, ``ring_reduce_scatter_16``. Pending work (DDP's compression hooks, FSDP's 16-bit
reduce-scatter): ``_ring_allreduce_16_start`` returns the ring, whose ``wait()`` gives the sum.
"""

import time

import numpy as np

from . import collectives, wire

__all__ = ["ring_allreduce_16", "ring_reduce_scatter_16"]

_RING_TAG = 7301  # point-to-point tag of the blocking 16-bit ring
_SIXTEEN_BIT = (np.dtype(np.float16), wire.BFLOAT16)


def _posted(comm, op, start, buf, peer, tag):
    """Start ``start`` (``comm.Irecv`` or ``comm.Isend``) of 16-bit ``buf`` as a collectives Handle: no header (both
    ends know the size), and the guard's flight recorder and watchdog see it as they see ``collectives.isend``."""
    def post():
        return collectives.Handle([start(wire.copy_view(buf), peer, tag)], lambda: None, keep=(buf,))
    return collectives.run_recorded(collectives.record_p2p(comm, op, buf, peer), post)


class _Ring16:
    """The 16-bit ring as a nonblocking state machine: each step posts one Isend and one Irecv of a 16-bit chunk;
    ``test()`` finishes the steps whose messages arrived and posts the next, ``wait()`` runs them to the end and
    returns the result.

    ``flat``: a 1-D float16/bfloat16 array. The reduce-scatter (n - 1 steps) leaves chunk ``rank`` of the float32
    accumulator ``acc`` summed over the ranks (divided by their number with ``mean``); with ``gather`` an
    allgather ring (n - 1 more steps) then forwards the finished 16-bit chunks as they are into ``gathered``.
    The result: with ``gather`` the sum in ``out`` (a new array of ``flat``'s dtype if None), else this rank's
    chunk rounded to ``flat``'s dtype.
    ``tag``: every message's tag. Two rings pending at once on one communicator need different tags (messages
    with one tag from one sender match the receives in the order they were posted). Chunks are equal
    (``ceil(size / n)`` elements, the accumulator zero-padded): both ends know every message's size, so receives
    are posted into their buffers and MPI moves the bytes while the caller computes."""

    def __init__(self, flat, comm, tag, mean=False, gather=True, group=None, out=None):
        self.comm, self.tag, self.mean, self.dtype, self.group = comm, tag, mean, flat.dtype, group
        self.size, self.out, self._result = flat.size, out, None
        n, self.rank = comm.Get_size(), comm.Get_rank()
        self.n, self.chunk = n, -(-flat.size // n)
        self.acc = np.zeros(n * self.chunk, np.float32)
        self.acc[:flat.size] = flat
        self.send16, self.recv16 = np.empty(self.chunk, flat.dtype), np.empty(self.chunk, flat.dtype)
        self.gathered = np.empty(n * self.chunk, flat.dtype) if gather else None
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
        self.requests = [_posted(self.comm, "recv", self.comm.Irecv, receive, left, self.tag),
                         _posted(self.comm, "send", self.comm.Isend, send, right, self.tag)]

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
            while True:
                for ring in list(self.group):
                    if ring.test():
                        self.group.remove(ring)
                if self.done():
                    break
                time.sleep(0)  # let other threads (SimComm's ranks, DDP's poller) run
        return self._finish()

    def _finish(self):
        if self._result is None:
            if self.gathered is not None:
                out = np.empty(self.size, self.dtype) if self.out is None else self.out
                out[...] = self.gathered[:self.size]
                self._result = out
            else:
                self._result = self.acc[self.rank * self.chunk: min((self.rank + 1) * self.chunk, self.size)] \
                    .astype(self.dtype)
        return self._result


def _check_16(fn, flat):
    if flat.dtype not in _SIXTEEN_BIT:
        raise TypeError(f"{fn}: needs a float16 or bfloat16 array (got {flat.dtype})")


def ring_reduce_scatter_16(flat, comm, mean=False):
    """Return this rank's chunk of the sum (or ``mean``) of the 1-D float16/bfloat16 array ``flat`` over ``comm``:
    16-bit messages, float32 accumulation, rounded once at the end to ``flat``'s dtype. Chunks have
    ``ceil(flat.size / ranks)`` elements (the last ones shorter or empty when that does not divide)."""
    _check_16("ring_reduce_scatter_16", flat)
    return _Ring16(flat, comm, _RING_TAG, mean=mean, gather=False).wait()


def ring_allreduce_16(flat, comm, out=None):
    """Sum the 1-D float16/bfloat16 array ``flat`` over ``comm`` with 16-bit messages and float32 accumulation.

    Returns the sum (in ``out`` if given, else in a new array of ``flat``'s dtype), the same bits on every rank.
    See the module's docstring for the bytes it moves. Its messages go over ``comm`` with tag 7301: no receive
    of the caller's with that tag or ``MPI.ANY_TAG`` may be pending there meanwhile."""
    _check_16("ring_allreduce_16", flat)
    return _ring_allreduce_16_start(flat, comm, _RING_TAG, out).wait()


def _ring_allreduce_16_start(flat, comm, tag, out=None, group=None):
    """Start ``ring_allreduce_16`` with message tag ``tag``; return the ring, whose ``wait()`` gives the sum.

    ``group``: the list of pending rings that this one joins (see ``_Ring16.wait``)."""
    return _Ring16(flat, comm, tag, group=group, out=out)
