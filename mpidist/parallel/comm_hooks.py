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
The compression hooks run their ring when DDP launches the bucket (blocking), so they do not overlap with the
rest of backward; they pay where the link, not the CPU, is the bottleneck.
"""

import numpy as np

from .. import collectives
from ..nn.precision import bfloat16, float16
from ..xp import get_array_module

__all__ = ["HookBucket", "HookWork", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "ring_allreduce_16", "ring_reduce_scatter_16", "PowerSGDState", "powerSGD_hook", "as_bytes"]

_RING_TAG = 7301  # point-to-point tag of the 16-bit ring (DDP's other traffic is collective)


def as_bytes(array):
    """Return ``array`` as MPI can copy it: bfloat16 as its uint16 bit patterns (MPI has no bfloat16), else itself."""
    return array.view(np.uint16) if array.dtype == bfloat16 else array


class HookBucket:
    """What a hook sees of one DDP bucket (PyTorch's ``GradBucket``): ``buffer()``, ``index()``, ``is_last()``,
    ``parameters()``, ``gradients()``, and ``comm``, the DDP's communicator."""

    def __init__(self, flat, index, last, params, views, comm):
        self._flat, self._index, self._last, self._params, self._views = flat, index, last, params, views
        self.comm = comm

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
    """A hook's pending result: ``wait()`` returns the reduced flat array; ``test()`` advances it.

    ``handle``: a collectives handle still running (or None when the work is done); ``finish``: called once after
    it completes, returning the result."""

    def __init__(self, handle=None, finish=None, value=None):
        self._handle, self._finish, self._value, self._done = handle, finish, value, False

    def test(self):
        """Advance the work; return whether it completed."""
        return True if self._handle is None else self._handle.test()

    def wait(self):
        """Return the reduced flat array (blocking until it is there)."""
        if not self._done:
            if self._handle is not None:
                self._handle.wait()
            if self._finish is not None:
                self._value = self._finish()
            self._done = True
        return self._value


def _comm(state, bucket):
    return state if state is not None and not isinstance(state, PowerSGDState) else bucket.comm


def allreduce_hook(state, bucket):
    """Sum the bucket over the ranks with MPI (nonblocking); a bfloat16 bucket is summed in float32."""
    comm, flat = _comm(state, bucket), bucket.buffer()
    if flat.dtype != bfloat16:
        return HookWork(collectives.iallreduce(flat, comm, op="sum"), lambda: flat)
    wide = flat.astype(np.float32)

    def finish():
        flat[...] = wide  # rounds once, to nearest even
        return flat
    return HookWork(collectives.iallreduce(wide, comm, op="sum"), finish)


def _ring_reduce_scatter(flat, comm, mean):
    """The ring's first half: return (float32 accumulator of ``n * chunk`` elements, ``flat`` zero-padded to equal
    chunks, and ``chunk``) with chunk ``rank`` summed over the ranks (divided by their number with ``mean``).
    Equal chunks let the allgather that follows run without exchanging shapes first."""
    dtype = flat.dtype
    n, rank = comm.Get_size(), comm.Get_rank()
    chunk = -(-flat.size // n)
    acc = np.zeros(n * chunk, np.float32)
    acc[:flat.size] = flat
    send16, recv16 = np.empty(chunk, dtype), np.empty(chunk, dtype)
    right, left = (rank + 1) % n, (rank - 1) % n
    # Step k sends chunk (rank - k - 1) and adds the left neighbour's chunk (rank - k - 2): after n - 1 steps
    # rank r holds the whole sum of chunk r.
    for k in range(n - 1):
        s, c = (rank - k - 1) % n, (rank - k - 2) % n
        send16[...] = acc[s * chunk: (s + 1) * chunk]
        request = collectives.isend(send16.view(np.uint16), right, comm, tag=_RING_TAG)
        collectives.recv(left, comm, tag=_RING_TAG, out=recv16.view(np.uint16))
        acc[c * chunk: (c + 1) * chunk] += recv16
        request.wait()
    if mean:
        acc[rank * chunk: (rank + 1) * chunk] /= np.float32(n)
    return acc, chunk


def _check_16(fn, flat):
    if flat.dtype not in (float16, bfloat16):
        raise TypeError(f"{fn}: needs a float16 or bfloat16 array (got {flat.dtype})")


def ring_reduce_scatter_16(flat, comm, mean=False):
    """Return this rank's chunk of the sum (or ``mean``) of the 1-D float16/bfloat16 array ``flat`` over ``comm``:
    16-bit messages, float32 accumulation, rounded once at the end to ``flat``'s dtype. Chunks have
    ``ceil(flat.size / ranks)`` elements (the last ones shorter or empty when that does not divide)."""
    _check_16("ring_reduce_scatter_16", flat)
    acc, chunk = _ring_reduce_scatter(flat, comm, mean)
    rank = comm.Get_rank()
    return acc[rank * chunk: min((rank + 1) * chunk, flat.size)].astype(flat.dtype)


def ring_allreduce_16(flat, comm, out=None):
    """Sum the 1-D float16/bfloat16 array ``flat`` over ``comm`` with 16-bit messages and float32 accumulation.

    Returns the sum (in ``out`` if given, else in a new array of ``flat``'s dtype), the same bits on every rank.
    See the module's glossary ("16-bit ring") for the bytes it moves."""
    _check_16("ring_allreduce_16", flat)
    out = np.empty_like(flat) if out is None else out
    if comm.Get_size() == 1:
        out[...] = flat
        return out
    acc, chunk = _ring_reduce_scatter(flat, comm, mean=False)
    rank, n = comm.Get_rank(), comm.Get_size()
    mine = acc[rank * chunk: (rank + 1) * chunk].astype(flat.dtype)
    # The second half: every finished chunk copied as bytes, so every rank holds its owner's bits.
    gathered = np.empty(n * chunk, flat.dtype)
    collectives.allgather(mine.view(np.uint16), comm, out=gathered.view(np.uint16))
    out[...] = gathered[:flat.size]
    return out


def _compress_hook(dtype):
    def hook(state, bucket):
        comm, flat = _comm(state, bucket), bucket.buffer()
        narrow = flat.astype(dtype)
        ring_allreduce_16(narrow, comm, out=narrow)
        flat[...] = narrow
        return HookWork(value=flat)
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
    next step's gradient. Until ``start_powerSGD_iter`` synchronizations have run, a plain allreduce."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powerSGD_hook: state must be a PowerSGDState (got {type(state).__name__})")
    comm, flat = _comm(state.comm, bucket), bucket.buffer()
    if bucket.index() == 0:  # launched first: this synchronization's number, the same for all its buckets
        state.iter += 1
    if state.iter <= state.start_powerSGD_iter:
        return allreduce_hook(state.comm, bucket)
    xp = get_array_module(flat)
    work = flat.astype(np.float32) if flat.dtype != np.float64 else flat.copy()
    error = state.errors.get(bucket.index())
    if error is not None:
        work += error
    compressed, plain = [], []
    at = 0
    for i, g in enumerate(bucket.gradients()):
        span = slice(at, at + g.size)
        at += g.size
        if g.ndim >= 2:
            rows, cols = g.shape[0], g.size // g.shape[0]
            r = min(state.rank, rows, cols)
            if rows * cols >= state.min_compression_rate * (rows + cols) * r:
                compressed.append((i, span, rows, cols, r))
                continue
        plain.append(span)
    # Uncompressed gradients (biases, small matrices) and the stamp-free tail go in one allreduce.
    rest = np.concatenate([work[s] for s in plain]) if plain else np.zeros(0, work.dtype)
    collectives.allreduce(rest, comm, op="sum")
    before = work.copy()
    at = 0
    for s in plain:
        n = s.stop - s.start
        work[s] = rest[at: at + n]
        at += n
    new_qs = {}
    if compressed:
        ps, qs = [], []
        for i, span, rows, cols, r in compressed:
            m = work[span].reshape(rows, cols)
            q = state.qs.get((bucket.index(), i)) if state.warm_start else None
            if q is None or q.shape != (cols, r):
                rng = np.random.default_rng([state.seed, bucket.index(), i, 0 if state.warm_start else state.iter])
                q = rng.standard_normal((cols, r)).astype(work.dtype)
                _orthonormalize(q)
            qs.append(q)
            ps.append(m @ q)
        p_flat = np.concatenate([p.reshape(-1) for p in ps])
        collectives.allreduce(p_flat, comm, op="sum")
        at = 0
        for k, (i, span, rows, cols, r) in enumerate(compressed):
            ps[k] = p_flat[at: at + rows * r].reshape(rows, r).copy()
            at += rows * r
            _orthonormalize(ps[k])
            qs[k] = work[span].reshape(rows, cols).T @ ps[k]
        q_flat = np.concatenate([q.reshape(-1) for q in qs])
        collectives.allreduce(q_flat, comm, op="sum")
        at = 0
        for k, (i, span, rows, cols, r) in enumerate(compressed):
            q = q_flat[at: at + cols * r].reshape(cols, r)
            at += cols * r
            new_qs[(bucket.index(), i)] = q.copy()
            work[span] = (ps[k] @ q.T).reshape(-1)
    # A NaN/Inf from any rank reaches every rank's result (the same on all): that step is skipped (GradScaler), so
    # the memory keeps the last finite step's, or the NaN would poison every later step through the feedback.
    if bool(np.isfinite(work).all()):
        state.qs.update(new_qs)
        # Error feedback: this rank's input minus its share of what the ranks agree on (compressed parts only).
        error = before - work / comm.Get_size()
        for s in plain:
            error[s] = 0
        state.errors[bucket.index()] = error
    flat[...] = xp.asarray(work).astype(flat.dtype, copy=False)
    return HookWork(value=flat)
