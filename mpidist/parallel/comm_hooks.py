"""DDP communication hooks (PyTorch's ``register_comm_hook`` shape): what a gradient bucket becomes on the wire.

Glossary:
  hook      ``hook(state, bucket) -> HookWork``: starts reducing ``bucket.buffer()`` over the ranks and returns a
            future-like handle whose ``wait()`` gives the reduced flat array (DDP copies it into the bucket if it
            is another array) and whose ``test()`` advances it. ``state`` is what ``register_comm_hook`` was given
            (None: the built-ins use the DDP's communicator, ``bucket.comm``).
  buffer    the bucket's flat gradients. DDP folds the mean's division into its copy into the bucket, so a
            buffer holds each rank's share (gradient / world size) and a hook returns the **sum** over ranks
            (PyTorch's hooks divide themselves; here that is done already).
  16-bit ring  how the compression hooks reduce without widening the bytes on the wire (``mpidist.ring16``):
            16-bit chunks point to point, float32 accumulation, half the bytes of a float32 ring.

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

import dataclasses

import numpy as np

from .. import collectives
from ..nn.precision import bfloat16, float16
from ..collectives_hier import ALGORITHMS, HierarchicalAllreduce16
from ..xp import check_dtype, get_array_module

__all__ = ["HookBucket", "HookComms", "HookWork", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "CompressHookState",
           "PowerSGDState", "powerSGD_hook"]

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
        self._allreduce16 = {}  # (id(comm), algorithm) -> the compression hooks' HierarchicalAllreduce16 over its Dup
        self.rings = []  # this DDP's 16-bit rings launched and not yet seen done: a wait() advances them all

    def private(self, comm):
        """Return this DDP's duplicate of ``comm`` (made now, collectively, if it is the first request)."""
        pair = self._dups.get(id(comm))
        if pair is None:
            pair = self._dups[id(comm)] = (comm, comm.Dup())
        return pair[1]

    def allreduce16(self, comm, algorithm):
        """Return this DDP's ``HierarchicalAllreduce16`` over its duplicate of ``comm`` (made now, collectively, at
        the first request: the ranks' ``algorithm`` checked alike, the node placement found)."""
        key = (id(comm), algorithm)
        if key not in self._allreduce16:
            self._allreduce16[key] = HierarchicalAllreduce16(self.private(comm), algorithm)
        return self._allreduce16[key]

    def free(self):
        """Free the duplicates (collective: every rank, once no hook work on them is pending)."""
        allreduce16, self._allreduce16 = self._allreduce16, {}
        for each in allreduce16.values():
            each.free()
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


@dataclasses.dataclass(frozen=True)
class CompressHookState:
    """Settings of ``fp16_compress_hook``/``bf16_compress_hook`` (their state: None or a communicator means these
    defaults). ``comm``: None: the DDP's. ``algorithm``: "auto" (default): node-aware
    (``collectives_hier.HierarchicalAllreduce16``: the node's ranks summed at its leader, a 16-bit ring among
    the leaders, the result sent back) when the communicator spans several nodes and some node holds several
    ranks, else the flat 16-bit ring over all ranks; "flat" or "hierarchical" force one. Alike on every rank."""

    comm: object = None
    algorithm: str = "auto"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"CompressHookState: algorithm must be one of {ALGORITHMS} (got {self.algorithm!r})")


def _comm(state, bucket):
    if isinstance(state, CompressHookState):
        state = state.comm
    return state if state is not None and not isinstance(state, PowerSGDState) else bucket.comm


def allreduce_hook(state, bucket):
    """Sum the bucket over the ranks with MPI (nonblocking); 16-bit floats are summed in float32 (``mpidist.wire``)."""
    comm, flat = _comm(state, bucket), bucket.buffer()
    return HookWork(collectives.iallreduce(flat, comm, op="sum"), lambda: flat)


def _compress_hook(dtype):
    def hook(state, bucket):
        comm, flat = _comm(state, bucket), bucket.buffer()
        if bucket.index() > _TAG_UB:
            raise ValueError(f"{hook.__name__}: bucket index {bucket.index()} exceeds the ring's tags (0..{_TAG_UB}); "
                             f"use fewer, larger buckets")
        check_dtype(flat, dtype, hook.__name__)  # bfloat16 on a CuPy without it: an error naming CuPy's version
        narrow = flat.astype(dtype)
        # On the DDP's private comm (no other DDP's or user's messages there), a tag per bucket: DDP keeps
        # several buckets' rings in flight at once.
        rings = bucket._comms.rings
        if bucket.index() == 0:  # a new synchronization: rings still listed were abandoned (an exception)
            rings.clear()
        algorithm = state.algorithm if isinstance(state, CompressHookState) else "auto"
        ring = bucket._comms.allreduce16(comm, algorithm).start(narrow, tag=bucket.index(), out=narrow, group=rings)

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
