"""DDP communication hooks (PyTorch's ``register_comm_hook`` shape): what a gradient bucket becomes on the wire.

Glossary:
  hook      ``hook(state, bucket) -> HookWork``: starts reducing ``bucket.buffer()`` over the ranks and returns a
            future-like handle whose ``wait()`` gives the reduced flat array (DDP copies it into the bucket if it
            is another array) and whose ``test()`` advances it. ``state`` is what ``register_comm_hook`` was given
            (None: the built-ins use the DDP's communicator, ``bucket.comm``).
  buffer    the bucket's flat gradients. DDP folds the mean's division into its copy into the bucket, so a
            buffer holds each rank's share (gradient / world size) and a hook returns the **sum** over ranks
            (PyTorch's hooks divide themselves; here that is done already).
  16-bit ring  how the compression hooks reduce without widening the bytes on the wire: MPI has no bfloat16
            and mpidist reduces float16 in float32 (``mpidist.wire``), so a plain MPI allreduce of 16-bit data
            moves float32. The ring reduce-scatter sends 16-bit chunks point to point and adds each received
            chunk into a float32 accumulator (one rounding per hop, n - 1 in all), then an allgather moves the
            finished 16-bit chunks as bytes: 2 (n - 1) / n * (16-bit bytes) per rank, half of a float32 ring.
            Every rank ends with the same bits (the owner's chunk is copied, never recomputed).

Built-ins: ``allreduce_hook`` (float32/64 through MPI, nonblocking; a bfloat16 bucket reduced in float32),
``fp16_compress_hook`` and ``bf16_compress_hook`` (the 16-bit ring; the result cast back to the bucket's
dtype), and ``powerSGD_hook`` with ``PowerSGDState`` (rank-r compression with error feedback).
Every hook returns pending work: the ring posts its first step's Isend/Irecv and returns, and each ``test()``
(DDP calls it on every launched bucket whenever a later gradient is ready) finishes the steps whose messages
arrived and posts the next; PowerSGD starts its allreduces of the rest and of P at once and Q's at the first
``test()`` or ``wait()`` after P is summed. DDP waits for them in launch order when backward ends, so the
communication overlaps the rest of backward. They pay where the link, not the CPU, is the bottleneck.
The rings' messages and PowerSGD's Q allreduces run on the DDP's private duplicate of its communicator
(``HookComms``, freed by ``DDP.remove()``): another DDP's over the same communicator, and the user's, never
match theirs.
"""

import time

import numpy as np

from .. import collectives, wire
from ..nn.precision import bfloat16, float16
from ..xp import get_array_module

__all__ = ["HookBucket", "HookComms", "HookWork", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "ring_allreduce_16", "ring_reduce_scatter_16", "PowerSGDState", "powerSGD_hook"]

_RING_TAG = 7301  # point-to-point tag of the blocking 16-bit ring (DDP's other traffic is collective)
_TAG_UB = 32767  # the largest tag every MPI allows: the hooks' rings are tagged by bucket index on a private comm


class HookComms:
    """Communicators private to one DDP's hooks: ``private(comm)`` is a ``comm.Dup()`` made at the first request
    and kept until ``free()`` (DDP.remove()).

    Why: a hook's point-to-point messages and late-started collectives on the DDP's communicator would match
    another DDP's over it (both have a bucket 0) or the user's (ANY_TAG). ``private`` is collective at its
    first call for a ``comm``: hooks are alike on every rank and DDP launches buckets in one order, so every
    rank makes that call at the same bucket of the same backward."""

    def __init__(self):
        self._dups = {}  # id(comm) -> (comm, its Dup): the comm kept, so its id stays its own
        self.rings = []  # this DDP's 16-bit rings launched and not yet seen done: a wait() advances them all

    def private(self, comm):
        """Return this DDP's duplicate of ``comm`` (made now, collectively, if it is the first request)."""
        pair = self._dups.get(id(comm))
        if pair is None:
            pair = self._dups[id(comm)] = (comm, comm.Dup())
        return pair[1]

    def free(self):
        """Free the duplicates (collective: every rank, once no hook work on them is pending)."""
        dups, self._dups = self._dups, {}
        for _, dup in dups.values():
            dup.Free()


class HookBucket:
    """What a hook sees of one DDP bucket (PyTorch's ``GradBucket``): ``buffer()``, ``index()``, ``is_last()``,
    ``parameters()``, ``gradients()``, ``comm``, the DDP's communicator, and ``private_comm(comm)``.

    ``comms``: the DDP's ``HookComms``; None (a bucket made outside DDP): the bucket's hook gets duplicates of
    its own, freed when its work finishes (``release()``): correct, but a collective Dup per bucket."""

    def __init__(self, flat, index, last, params, views, comm, comms=None):
        self._flat, self._index, self._last, self._params, self._views = flat, index, last, params, views
        self.comm = comm
        self._comms, self._owns_comms = (HookComms(), True) if comms is None else (comms, False)

    def private_comm(self, comm):
        """Return a duplicate of ``comm`` private to this DDP's hooks (see ``HookComms``)."""
        return self._comms.private(comm)

    def release(self):
        """Free the bucket's own duplicates (none when DDP gave it its ``HookComms``); call once its work is done."""
        if self._owns_comms:
            self._comms.free()

    def buffer(self):
        """Return the bucket's flat gradients (each rank's share of the mean)."""
        return self._flat

    def index(self):
        """Return the bucket's index (0 is launched first: the last parameters)."""
        return self._index

    def is_last(self):
        """Whether this is the last bucket of the backward."""
        return self._last

    def parameters(self):
        """Return the bucket's parameters."""
        return list(self._params)

    def gradients(self):
        """Return each parameter's gradient: views into ``buffer()``."""
        return list(self._views)


class HookWork:
    """A hook's pending result: ``wait()`` returns the reduced flat array; ``test()`` advances it; ``done()`` says
    whether it completed.

    ``handle``: what is still running (anything with ``test()`` and ``wait()``: a collectives handle, the 16-bit
    ring, PowerSGD's stages; None when the work is done); ``finish``: called once after it completes, returning
    the result."""

    def __init__(self, handle=None, finish=None, value=None):
        self._handle, self._finish, self._value, self._done = handle, finish, value, False
        self._completed = handle is None  # the handle's test() or wait() has returned

    def done(self):
        """Return whether the communication has completed, as far as ``test()``/``wait()`` have seen (no advance)."""
        return self._completed

    def test(self):
        """Advance the work; return whether it completed."""
        if not self._completed:
            self._completed = bool(self._handle.test())
        return self._completed

    def wait(self):
        """Return the reduced flat array (blocking until it is there)."""
        if not self._done:
            if self._handle is not None:
                self._handle.wait()
                self._completed = True
            if self._finish is not None:
                self._value = self._finish()
            self._done = True
        return self._value


def _comm(state, bucket):
    return state if state is not None and not isinstance(state, PowerSGDState) else bucket.comm


def allreduce_hook(state, bucket):
    """Sum the bucket over the ranks with MPI (nonblocking); 16-bit floats are summed in float32 (``mpidist.wire``)."""
    comm, flat = _comm(state, bucket), bucket.buffer()
    return HookWork(collectives.iallreduce(flat, comm, op="sum"), lambda: flat)


def _posted(comm, op, start, buf, peer, tag):
    """Start ``start`` (``comm.Irecv`` or ``comm.Isend``) of 16-bit ``buf`` as a collectives Handle: no header (both
    ends know the size), and the guard's flight recorder and watchdog see it as they see ``collectives.isend``."""
    def post():
        return collectives.Handle([start(wire.copy_view(buf), peer, tag)], lambda: None, keep=(buf,))
    return collectives.run_recorded(collectives.record_p2p(comm, op, buf, peer), post)


class _Ring16:
    """The 16-bit ring as a nonblocking state machine: each step posts one Isend and one Irecv of a 16-bit chunk;
    ``test()`` finishes the steps whose messages arrived and posts the next, ``wait()`` runs them to the end.

    ``flat``: a 1-D float16/bfloat16 array. The reduce-scatter (n - 1 steps) leaves chunk ``rank`` of the float32
    accumulator ``acc`` summed over the ranks (divided by their number with ``mean``); with ``gather`` an
    allgather ring (n - 1 more steps) then forwards the finished 16-bit chunks as they are into ``gathered``.
    ``tag``: every message's tag. Two rings pending at once on one communicator need different tags (messages
    with one tag from one sender match the receives in the order they were posted). Chunks are equal
    (``ceil(size / n)`` elements, the accumulator zero-padded): both ends know every message's size, so receives
    are posted into their buffers and MPI moves the bytes while the caller computes."""

    def __init__(self, flat, comm, tag, mean=False, gather=True, group=None):
        self.comm, self.tag, self.mean, self.dtype, self.group = comm, tag, mean, flat.dtype, group
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
        """Run the remaining steps. In a ``group`` (DDP's pending rings) every ring of it is tested round-robin
        until this one is done: the rings advance together, instead of later buckets' waiting for each step of
        the earlier ones' (the arithmetic, and so the result, is the same). Alone: blocking on each step."""
        if self.group is None:
            while not self.done():
                for r in self.requests:
                    r.wait()
                self.requests = []
                self._advance()
            return
        while True:
            for ring in list(self.group):
                if ring.test():
                    self.group.remove(ring)
            if self.done():
                return
            time.sleep(0)  # let other threads (SimComm's ranks, DDP's poller) run


def _check_16(fn, flat):
    if flat.dtype not in (float16, bfloat16):
        raise TypeError(f"{fn}: needs a float16 or bfloat16 array (got {flat.dtype})")


def ring_reduce_scatter_16(flat, comm, mean=False):
    """Return this rank's chunk of the sum (or ``mean``) of the 1-D float16/bfloat16 array ``flat`` over ``comm``:
    16-bit messages, float32 accumulation, rounded once at the end to ``flat``'s dtype. Chunks have
    ``ceil(flat.size / ranks)`` elements (the last ones shorter or empty when that does not divide)."""
    _check_16("ring_reduce_scatter_16", flat)
    ring = _Ring16(flat, comm, _RING_TAG, mean=mean, gather=False)
    ring.wait()
    rank, chunk = comm.Get_rank(), ring.chunk
    return ring.acc[rank * chunk: min((rank + 1) * chunk, flat.size)].astype(flat.dtype)


def ring_allreduce_16(flat, comm, out=None):
    """Sum the 1-D float16/bfloat16 array ``flat`` over ``comm`` with 16-bit messages and float32 accumulation.

    Returns the sum (in ``out`` if given, else in a new array of ``flat``'s dtype), the same bits on every rank.
    See the module's glossary ("16-bit ring") for the bytes it moves. Its messages go over ``comm`` with tag
    7301: no receive of the caller's with that tag or ``MPI.ANY_TAG`` may be pending there meanwhile."""
    _check_16("ring_allreduce_16", flat)
    return _ring_allreduce_16_start(flat, comm, _RING_TAG, out).wait()


def _ring_allreduce_16_start(flat, comm, tag, out=None, group=None):
    """Start ``ring_allreduce_16`` with message tag ``tag``; return a HookWork whose ``wait()`` gives ``out``.

    ``group``: the list of pending rings that this one joins (see ``_Ring16.wait``)."""
    out = np.empty_like(flat) if out is None else out
    if comm.Get_size() == 1:
        out[...] = flat
        return HookWork(value=out)
    ring = _Ring16(flat, comm, tag, group=group)

    def finish():
        out[...] = ring.gathered[:flat.size]
        return out
    return HookWork(ring, finish)


def _compress_hook(dtype):
    def hook(state, bucket):
        comm, flat = _comm(state, bucket), bucket.buffer()
        if bucket.index() > _TAG_UB:
            raise ValueError(f"{hook.__name__}: bucket index {bucket.index()} exceeds the ring's tags (0..{_TAG_UB}); "
                             f"use fewer, larger buckets")
        narrow = flat.astype(dtype)
        # On the DDP's private comm (no other DDP's or user's messages there), a tag per bucket: DDP keeps
        # several buckets' rings in flight at once.
        rings = bucket._comms.rings
        if bucket.index() == 0:  # a new synchronization: rings still listed were abandoned (an exception)
            rings.clear()
        ring = _ring_allreduce_16_start(narrow, bucket.private_comm(comm), bucket.index(), out=narrow, group=rings)

        def finish():
            flat[...] = ring.wait()
            bucket.release()
            return flat
        return HookWork(ring, finish)
    return hook


fp16_compress_hook = _compress_hook(float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "Sum the bucket as float16 on the wire (16-bit ring, float32 accumulation)."
bf16_compress_hook = _compress_hook(bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = "Sum the bucket as bfloat16 on the wire (16-bit ring, float32 accumulation)."


class PowerSGDState:
    """PowerSGD's settings and memory (Vogels et al. 2019; PyTorch's ``PowerSGDState``).

    ``matrix_approximation_rank``: r; ``start_powerSGD_iter``: plain allreduce for the first buckets' steps
    (PowerSGD needs warmed-up gradients); ``min_compression_rate``: a tensor is compressed only if
    ``(rows + cols) * r`` is that many times smaller than ``rows * cols`` (else it joins the plain allreduce);
    ``warm_start``: reuse last step's Q instead of a fresh random one; ``seed``: the random Q's seed (the same
    on every rank). ``comm``: None: the DDP's. The error feedback, Ps and Qs are per bucket and parameter;
    ``state_dict()``/``load_state_dict()`` save and restore them with a checkpoint.
    """

    def __init__(self, comm=None, matrix_approximation_rank=1, start_powerSGD_iter=10, min_compression_rate=2.0,
                 warm_start=True, seed=0):
        if isinstance(matrix_approximation_rank, bool) or not isinstance(matrix_approximation_rank, int) \
                or matrix_approximation_rank < 1:
            raise ValueError(f"PowerSGDState: matrix_approximation_rank must be an int >= 1 "
                             f"(got {matrix_approximation_rank!r})")
        if isinstance(start_powerSGD_iter, bool) or not isinstance(start_powerSGD_iter, int) or start_powerSGD_iter < 1:
            raise ValueError(f"PowerSGDState: start_powerSGD_iter must be an int >= 1 (got {start_powerSGD_iter!r})")
        self.comm = comm
        self.rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = warm_start
        self.seed = seed
        self.iter = 0  # synchronizations started (counted at bucket 0, which every synchronization launches first)
        self.errors = {}  # bucket index -> flat float array: what compression left out last time
        self.qs = {}  # (bucket index, gradient index) -> Q (cols, r)
        self._waiting_for_p = []  # launched buckets' works whose Q allreduce has not started, in launch order

    def state_dict(self):
        """Return the iteration, the error feedback and the Qs (copies)."""
        return {"iter": self.iter, "errors": {k: v.copy() for k, v in self.errors.items()},
                "qs": {f"{b}/{i}": q.copy() for (b, i), q in self.qs.items()}}

    def load_state_dict(self, state):
        """Restore what ``state_dict`` returned."""
        self.iter = int(state["iter"])
        self.errors = {int(k): np.array(v) for k, v in state["errors"].items()}
        self.qs = {tuple(int(x) for x in k.split("/")): np.array(v) for k, v in state["qs"].items()}


def _orthonormalize(m):
    """Orthonormalize the columns of ``m`` in place: Gram-Schmidt in float64 (in float32 the ill-conditioned P of
    a real gradient kept errors of 1e-4 where full-rank PowerSGD must be exact), column by column as PyTorch."""
    wide = m.astype(np.float64)
    with np.errstate(invalid="ignore"):  # a NaN gradient (a step GradScaler skips) gives NaN factors, quietly
        for i in range(wide.shape[1]):
            col = wide[:, i]
            for j in range(i):
                col -= (wide[:, j] @ col) * wide[:, j]
            norm = np.sqrt(col @ col)
            col /= norm if norm > 0 else 1.0
    m[...] = wide


def powerSGD_hook(state, bucket):
    """Sum the bucket with rank-r compression of its matrices (PowerSGD), plain allreduce for the rest.

    Each gradient of 2 or more dimensions (as a rows x cols matrix M, with the error feedback added) becomes
    P = M Q (allreduced), P orthonormalized, Q = M^T P (allreduced), and M ~ P Q^T: (rows + cols) * r numbers on
    the wire instead of rows * cols. What the approximation misses is kept as error feedback and added to the
    next step's gradient. Until ``start_powerSGD_iter`` synchronizations have run, a plain allreduce.

    Nonblocking: the hook starts the allreduces of the uncompressed rest and of P and returns; Q's allreduce
    starts at the first ``test()`` (DDP's progress at a later bucket) or ``wait()`` that finds P summed."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powerSGD_hook: state must be a PowerSGDState (got {type(state).__name__})")
    comm = _comm(state.comm, bucket)
    if bucket.index() == 0:  # launched first: this synchronization's number, the same for all its buckets
        state.iter += 1
        # Works still waiting were abandoned (an exception ended their backward): never start their Qs.
        state._waiting_for_p.clear()
    if state.iter <= state.start_powerSGD_iter:
        return allreduce_hook(state.comm, bucket)
    work = _PowerSGDWork(state, bucket, comm)
    return HookWork(work, work.finish)


class _PowerSGDWork:
    """One bucket's PowerSGD in three stages: rest and P allreduces started at once, Q's when P is summed, the
    result when both are. Qs start on the DDP's private duplicate of ``comm`` (``HookBucket.private_comm``) in
    launch order: each rank starts them at its own test() points, and MPI
    needs the collectives on one communicator started in one order on every rank, which the launches' are."""

    def __init__(self, state, bucket, comm):
        self.state, self.bucket, self.comm = state, bucket, comm
        flat = bucket.buffer()
        work = flat.astype(np.float32) if flat.dtype != np.float64 else flat.copy()
        error = state.errors.get(bucket.index())
        if error is not None:
            work += error
        self.work, self.before = work, work.copy()
        self.compressed, self.plain = [], []
        at = 0
        for i, g in enumerate(bucket.gradients()):
            span = slice(at, at + g.size)
            at += g.size
            if g.ndim >= 2:
                rows, cols = g.shape[0], g.size // g.shape[0]
                r = min(state.rank, rows, cols)
                if rows * cols >= state.min_compression_rate * (rows + cols) * r:
                    self.compressed.append((i, span, rows, cols, r))
                    continue
            self.plain.append(span)
        # Uncompressed gradients (biases, small matrices) and the stamp-free tail go in one allreduce.
        self.rest = np.concatenate([work[s] for s in self.plain]) if self.plain else np.zeros(0, work.dtype)
        self.rest_handle = collectives.iallreduce(self.rest, comm, op="sum")
        self.p_handle = self.q_handle = None
        if self.compressed:
            ps = []
            for i, span, rows, cols, r in self.compressed:
                m = work[span].reshape(rows, cols)
                q = state.qs.get((bucket.index(), i)) if state.warm_start else None
                if q is None or q.shape != (cols, r):
                    rng = np.random.default_rng([state.seed, bucket.index(), i,
                                                 0 if state.warm_start else state.iter])
                    q = rng.standard_normal((cols, r)).astype(work.dtype)
                    _orthonormalize(q)
                ps.append(m @ q)
            self.p_flat = np.concatenate([p.reshape(-1) for p in ps])
            self.p_handle = collectives.iallreduce(self.p_flat, comm, op="sum")
            self.q_comm = bucket.private_comm(comm)
            state._waiting_for_p.append(self)

    def _start_q(self):
        """P is summed: orthonormalize it, start the allreduce of Q = M^T P."""
        self.ps, qs, at = [], [], 0
        for i, span, rows, cols, r in self.compressed:
            p = self.p_flat[at: at + rows * r].reshape(rows, r).copy()
            at += rows * r
            _orthonormalize(p)
            self.ps.append(p)
            qs.append(self.work[span].reshape(rows, cols).T @ p)
        self.q_flat = np.concatenate([q.reshape(-1) for q in qs])
        self.q_handle = collectives.iallreduce(self.q_flat, self.q_comm, op="sum")

    def _start_qs(self, block):
        """Start the Q allreduces of this state's buckets in launch order, up to this one (``block``: waiting for
        their Ps) or as far as the Ps summed so far allow."""
        pending = self.state._waiting_for_p
        while self.q_handle is None and pending:
            first = pending[0]
            if block:
                first.p_handle.wait()
            elif not first.p_handle.test():
                return
            pending.pop(0)
            first._start_q()

    def test(self):
        """Start Q's allreduce if P is summed; return whether everything is."""
        if self.p_handle is not None:
            self._start_qs(block=False)
            if self.q_handle is None or not self.q_handle.test():
                return False
        return self.rest_handle.test()

    def wait(self):
        """Block until the rest and Q are summed."""
        if self.p_handle is not None:
            self._start_qs(block=True)
            self.q_handle.wait()
        self.rest_handle.wait()

    def finish(self):
        """Put the sums into the bucket and keep the error feedback; return the bucket's buffer."""
        state, bucket, comm, work = self.state, self.bucket, self.comm, self.work
        flat = bucket.buffer()
        at = 0
        for s in self.plain:
            n = s.stop - s.start
            work[s] = self.rest[at: at + n]
            at += n
        new_qs = {}
        if self.compressed:
            at = 0
            for k, (i, span, rows, cols, r) in enumerate(self.compressed):
                q = self.q_flat[at: at + cols * r].reshape(cols, r)
                at += cols * r
                new_qs[(bucket.index(), i)] = q.copy()
                work[span] = (self.ps[k] @ q.T).reshape(-1)
        # A NaN/Inf from any rank reaches every rank's result (the same on all): that step is skipped (GradScaler),
        # so the memory keeps the last finite step's, or the NaN would poison every later step through the feedback.
        if bool(np.isfinite(work).all()):
            state.qs.update(new_qs)
            # Error feedback: this rank's input minus its share of what the ranks agree on (compressed parts only).
            error = self.before - work / comm.Get_size()
            for s in self.plain:
                error[s] = 0
            state.errors[bucket.index()] = error
        flat[...] = get_array_module(flat).asarray(work).astype(flat.dtype, copy=False)
        bucket.release()
        return flat
