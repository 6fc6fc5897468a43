"""A node-aware allreduce on host buffers: reduce in the node, allreduce across node leaders, broadcast in the node.

Across nodes an allreduce is bound by the links between them. A flat allreduce sends every rank's share over
the node's link (a ring over 2 nodes x 2 ranks moves 1.5x the array over each node's link each way); the
hierarchical one first combines the node's ranks over shared memory, so only one rank per node (its leader,
local rank 0) talks across nodes and each node's link carries one array's worth each way: what NCCL and
Horovod do across nodes. Within a node, and with one rank per node, it would only add steps.

The three steps run pipelined over chunks of ``chunk_bytes``: while chunk k crosses the link (the leaders'
nonblocking allreduce, which MPI advances inside the node's calls) the node reduces chunk k+1 and broadcasts
chunk k-1, so the link is not left idle during the node's steps and large arrays reach the link's rate. Between
the leaders MPI's allreduce of a large array is a reduce-scatter and an allgather, which moves the minimum,
2(N-1)/N of the array, over each node's link each way.

    allreduce = HierarchicalAllreduce(comm)          # collective over comm; "auto": measured, per size
    HierarchicalAllreduce(comm, chunk_bytes=4 << 20) # pipeline chunk (default 1 MiB); the same on every rank
    allreduce(grad)                                  # in place, as mpidist.allreduce(grad, comm)
    allreduce.algorithm_for(grad.nbytes)             # "flat" or "hierarchical", the same on every rank
    allreduce.free()                                 # collective; instances over one comm share its splits

``algorithm="auto"`` times both on the first array of each power-of-two size class (on a copy, every rank
alike) and keeps the faster by the slowest rank's time, so every rank takes the same path; ``"flat"`` is
``mpidist.allreduce`` and ``"hierarchical"`` always takes the three steps. Results are those of
``mpidist.allreduce`` (``mpidist.wire``): float16 sums round once, NaN propagates through min and max,
``mean`` divides by the size of ``comm``; every rank ends with the same bits (the last step is a broadcast).
"""

import threading
import time

import numpy as np
from mpi4py import MPI

from . import collectives
from .comm import check_comm
from .comm.agree import check_same, raise_if_any
from .comm.nodes import node_of_ranks
from .ring16 import Ring16, iring_allreduce_16, post_16, wait_together
from .wire import BFLOAT16, resolve
from .xp import asarray_like, copy_into, is_device_array, to_numpy

__all__ = ["HierarchicalAllreduce", "HierarchicalAllreduce16", "ALGORITHMS"]

ALGORITHMS = ("auto", "flat", "hierarchical")
_TRIALS = 3  # timed calls per algorithm when choosing (after one untimed call each)
# Pipeline chunk: small enough that a 4 MiB array fills the pipeline, large enough that each chunk's fixed
# cost (three calls, one link round trip) is small next to its transfer (8 ms at 1 Gbit/s).
CHUNK_BYTES = 1 << 20
_TAGS = 32768  # HierarchicalAllreduce16 tags its sums 0..32767 in turn: every MPI allows them (MPI_TAG_UB >= 32767)


class HierarchicalAllreduce:
    """Allreduce numpy arrays over ``comm``, through node leaders when that is faster (or when told to)."""

    def __init__(self, comm, algorithm="auto", chunk_bytes=CHUNK_BYTES):
        check_comm("HierarchicalAllreduce", comm)
        problem = None
        if algorithm not in ALGORITHMS:
            problem = f"algorithm must be one of {ALGORITHMS} (got {algorithm!r})"
        elif not isinstance(chunk_bytes, (int, np.integer)) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
            problem = f"chunk_bytes must be a positive int (got {chunk_bytes!r})"
        raise_if_any(comm, problem, "HierarchicalAllreduce")  # every rank raises, none waits in the splits
        # Ranks that chunk differently would pair unlike calls: the settings must agree.
        check_same(comm, [algorithm, int(chunk_bytes)], "HierarchicalAllreduce", what="setting")
        self.comm = comm
        self.algorithm = algorithm
        self.chunk_bytes = int(chunk_bytes)
        self._splits = _NodeSplits.acquire(comm)
        nodes, rank = self._splits.nodes, comm.Get_rank()
        self.nodes = max(nodes) + 1
        self.local_rank = sum(1 for r in range(rank) if nodes[r] == nodes[rank])
        self.node_comm, self.leader_comm = self._splits.node_comm, self._splits.leader_comm
        # Worth doing only with several nodes of which some hold several ranks.
        self.useful = 1 < self.nodes < comm.Get_size()
        self._chosen = {}  # size class (bytes rounded up to a power of two) -> "flat" or "hierarchical"

    def __call__(self, x, op="sum"):
        """Reduce ``x`` over all ranks of ``comm`` in place with ``op``; return ``x``."""
        if type(x) is not np.ndarray:
            raise TypeError(f"HierarchicalAllreduce: x must be a numpy array (got {type(x).__name__}); "
                            f"device arrays go through mpidist.allreduce")
        if x.dtype not in collectives.SUPPORTED_DTYPES:
            raise TypeError(f"HierarchicalAllreduce: dtype {x.dtype} is not supported "
                            f"(supported: {', '.join(d.name for d in collectives.SUPPORTED_DTYPES)})")
        resolve("HierarchicalAllreduce", op, x.dtype)  # a bad op fails here, before any size class is measured
        collectives.check_in_place("HierarchicalAllreduce", x)
        if self.algorithm_for(x.nbytes, x, op) == "flat":
            return collectives.allreduce(x, self.comm, op)
        return collectives.run_recorded(collectives.record_collective(self.comm, "allreduce", x, reduction=op),
                                        self._hierarchical, x, op)

    def algorithm_for(self, nbytes, x=None, op="sum"):
        """Return the algorithm used for arrays of ``nbytes`` ("flat" or "hierarchical"); collective under "auto".

        Under "auto" the first call for a size class measures both on a copy of ``x`` (zeros of ``nbytes``
        float64 bytes when no ``x`` is given); every rank must call it with the same size.
        """
        if self.algorithm != "auto":
            return self.algorithm
        if not self.useful:
            return "flat"
        size_class = 1 << max(int(nbytes) - 1, 0).bit_length()
        chosen = self._chosen.get(size_class)
        if chosen is None:
            chosen = self._chosen[size_class] = self._measure(x, nbytes, op)
        return chosen

    def _measure(self, x, nbytes, op):
        probe = np.array(x, copy=True) if x is not None else np.zeros(max(int(nbytes) // 8, 1))
        seconds = []
        for run in (lambda: collectives.allreduce(probe, self.comm, op), lambda: self._hierarchical(probe, op)):
            run()
            collectives.barrier(self.comm)
            start = time.perf_counter()
            for _ in range(_TRIALS):
                run()
            seconds.append(time.perf_counter() - start)
        # The slowest rank's times decide, so every rank decides alike.
        flat, hier = collectives.allreduce(np.array(seconds), self.comm, "max")
        return "hierarchical" if hier < flat else "flat"

    def _hierarchical(self, x, op):
        reduction = resolve("allreduce", op, x.dtype)
        # The three steps reduce what MPI would (float16 sums in float32, floats' min/max as order keys) and
        # bring it back once at the end, so the result rounds once, as mpidist.allreduce's does.
        if reduction.converts or not x.flags.c_contiguous:
            buf = np.empty(x.shape, dtype=reduction.wire)
            if reduction.converts:
                reduction.to_wire(buf, x)
            else:
                buf[...] = x
        else:
            buf = x
        step = "sum" if reduction.name == "mean" else reduction.name
        flat = buf.reshape(-1)
        per_chunk = max(1, self.chunk_bytes // flat.itemsize)
        chunks = [flat[start:start + per_chunk] for start in range(0, flat.size, per_chunk)]
        leader = self.local_rank == 0
        # Pipelined: chunk k crosses the link (the leaders' nonblocking allreduce) while the node reduces chunk k+1
        # and broadcasts chunk k-1, so the link stays busy; MPI advances the transfer inside those calls. The
        # node's calls come in one order on every rank of it: reduce 0, then (reduce k+1, broadcast k) for each k.
        across = [None] * len(chunks)
        for k in range(len(chunks) + 1):
            if k < len(chunks):
                collectives.allreduce(chunks[k], self.node_comm, step)  # shared memory: as cheap as a reduce
                if leader:
                    across[k] = collectives.iallreduce(chunks[k], self.leader_comm, step)
            if k > 0:
                if leader:
                    across[k - 1].wait()
                collectives.broadcast(chunks[k - 1], self.node_comm, 0)
        if reduction.name == "mean":
            buf /= self.comm.Get_size()
        if buf is not x:
            if reduction.converts:
                reduction.from_wire(x, buf)
            else:
                x[...] = buf
        return x

    def free(self):
        """Release the node and leader communicators: freed (collectively) once no instance over ``comm`` uses them.

        Call it on every rank alike (``DDP.remove()`` does); an instance dropped without it keeps its communicators
        until the process ends, but at most one pair per communicator (later instances share it).
        """
        if self._splits is not None:
            self._splits.release()
            self._splits = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


class HierarchicalAllreduce16:
    """Sum float16/bfloat16 arrays over ``comm`` with 16-bit messages, through node leaders when ``comm`` spans nodes.

    The flat 16-bit ring (``mpidist.ring16``) over ranks on several nodes puts one rank's ring traffic, 2(n-1)/n
    of the 16-bit array, on each node's link: 0.75 of a float32 allreduce's bytes for 2 nodes x 2 ranks, not half.
    Node by node instead, in three steps:

    1. within each node the ranks send their 16-bit arrays to the leader (local rank 0), which adds them in
       float32 in local-rank order (``float32(x_0) + x_1 + x_2 ...``: exact casts, float32 additions; no 16-bit
       rounding);
    2. the leaders run the 16-bit ring over the node sums (``leader_comm``, leaders in node order): each message
       is a float32 partial sum rounded to 16 bits (one rounding per hop, nodes - 1 in all), each receiver adds
       its node's float32 sum to the received 16-bit value in float32, and the owner of a chunk rounds its final
       float32 sum once;
    3. each leader sends the 16-bit result to its node's ranks (bits, exact).

    Only the leaders' ring crosses the links: 2(N-1)/N of the 16-bit array per node for N nodes (the array once for
    2 nodes: half a float32 allreduce's bytes). With one node the result is the float32 sum rounded once (the
    ``mpidist.wire`` rule for 16-bit sums); every rank ends with the same bits.

        allreduce16 = HierarchicalAllreduce16(comm)   # collective; algorithm "auto" | "flat" | "hierarchical"
        allreduce16(x16)                              # blocking, in place; returns x16
        work = allreduce16.start(x16)                 # nonblocking: work.test(), work.wait() -> the sum
        allreduce16.free()                            # collective (or use it as a context manager)

    ``algorithm="auto"`` (the default) takes the node-aware steps when ``comm`` spans several nodes and some node
    holds several ranks (what NCCL does across nodes), else the flat ring: decided from the placement, not timed
    (unlike ``HierarchicalAllreduce``), the same on every rank. ``"flat"`` is always ``ring16``'s ring over
    ``comm``; ``"hierarchical"`` always the three steps. The ranks must agree on it (else every rank raises).
    """

    def __init__(self, comm, algorithm="auto"):
        check_comm("HierarchicalAllreduce16", comm)
        problem = None if algorithm in ALGORITHMS else f"algorithm must be one of {ALGORITHMS} (got {algorithm!r})"
        raise_if_any(comm, problem, "HierarchicalAllreduce16")
        check_same(comm, [algorithm], "HierarchicalAllreduce16", what="setting")
        self.comm, self.algorithm = comm, algorithm
        nodes = node_of_ranks(comm)  # collective; the same on every rank, so every rank chooses alike
        self.nodes = max(nodes) + 1
        useful = 1 < self.nodes < comm.Get_size()
        self.chosen = "hierarchical" if algorithm == "hierarchical" or (algorithm == "auto" and useful) else "flat"
        self._splits = _NodeSplits.acquire(comm) if self.chosen == "hierarchical" else None
        self.node_comm = self._splits.node_comm if self._splits else None
        self.leader_comm = self._splits.leader_comm if self._splits else None
        rank = comm.Get_rank()
        self.local_rank = sum(1 for r in range(rank) if nodes[r] == nodes[rank])

    def __call__(self, x, out=None):
        """Sum the 1-D float16/bfloat16 array ``x`` over ``comm``; return the sum, in ``out`` (default: ``x``).

        Collective; a bad input on any rank (not 1-D 16-bit, ``out`` unfit, ranks disagreeing on the dtype or
        size) raises on every rank."""
        out = x if out is None else out
        problem = _problem(x, out)
        raise_if_any(self.comm, problem, "HierarchicalAllreduce16", error=TypeError)
        check_same(self.comm, [str(x.dtype), x.size], "HierarchicalAllreduce16", what="dtype and size")
        return self.start(x, out=out).wait()

    def start(self, x, tag=None, out=None, group=None):
        """Start summing the 1-D float16/bfloat16 ``x``; return the pending work (``test()``, ``done()``, and
        ``wait()``, which returns the sum in ``out``, a new array if None; ``out`` may be ``x``).

        Checks this rank's input only (the hooks' path: every rank's bucket is alike by construction).
        ``tag``: None: the next of a sequence private to ``comm``'s node and leader communicators (flat: of
        ``ring16``'s private duplicate); an int: the messages' tag (works pending at once need different ones).
        ``group``: a list of pending works this one joins; its ``wait()`` advances them all."""
        if is_device_array(x):
            return _OnDevice16(self.start(to_numpy(x), tag=tag, group=group), x, out)
        problem = _problem(x, x if out is None else out)
        if problem:
            raise TypeError(f"HierarchicalAllreduce16: {problem}")
        if self.chosen == "flat":
            return iring_allreduce_16(x, self.comm, out=out, tag=tag, group=group)
        if tag is None:
            tag = self._splits.take_tag()
        return _NodeAware16(x, self, tag, out, group)

    def free(self):
        """Release the node and leader communicators (collective: every rank alike, no work pending)."""
        if self._splits is not None:
            self._splits.release()
            self._splits = self.node_comm = self.leader_comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def _problem(x, out):
    """Return what makes ``x`` (and ``out``) unfit for a 16-bit sum, or None."""
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float16, BFLOAT16) or x.ndim != 1:
        return (f"x must be a 1-D float16 or bfloat16 numpy array (got {type(x).__name__} "
                f"{getattr(x, 'dtype', '')} of shape {getattr(x, 'shape', '?')})")
    if not x.flags.c_contiguous:
        return f"x must be contiguous (got strides {x.strides})"
    if out is not x and (not isinstance(out, np.ndarray) or out.dtype != x.dtype or out.shape != x.shape
                         or not out.flags.c_contiguous):
        return (f"out must be a contiguous array of x's dtype and shape ({x.dtype}, {x.shape}; got "
                f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')})")
    if not out.flags.writeable:
        return "out is read-only"
    return None


class _OnDevice16:
    """A 16-bit sum of a device (CuPy) array, run on a host copy and copied up once by ``wait()``: as ``ring16``
    stages its ring (messages in host buffers for an MPI that is not CUDA-aware, numpy's float32 accumulation)."""

    def __init__(self, work, like, out):
        self.work, self.like, self.out = work, like, out

    def done(self):
        return self.work.done()

    def test(self):
        return self.work.test()

    def wait(self):
        host = self.work.wait()
        if self.out is None:
            return asarray_like(host, self.like)
        copy_into(self.out, host)
        return self.out


class _NodeAware16:
    """One ``HierarchicalAllreduce16`` sum in flight, a state machine of stages; ``test()`` advances it.

    Leader: ``gather`` (receives from the node's ranks) -> float32 node sum -> ``ring`` (the leaders' 16-bit
    ring, if there are several nodes) -> ``broadcast`` (sends of the result) -> ``done``. Other ranks: ``send``
    (their array to the leader) -> ``receive`` (the result, posted once the send completed: ``out`` may be the
    array being sent) -> ``done``."""

    def __init__(self, x, hier, tag, out, group):
        self.x, self.tag, self.group = x, tag, group
        self.out = np.empty_like(x) if out is None else out
        self.node, self.leaders = hier.node_comm, hier.leader_comm
        self.ring = None
        if hier.local_rank == 0:
            self.stage = "gather"
            self.parts = [np.empty_like(x) for _ in range(1, self.node.Get_size())]
            self.requests = [post_16(self.node, "recv", self.node.Irecv, part, peer, tag)
                             for peer, part in enumerate(self.parts, 1)]
        else:
            self.stage = "send"
            self.requests = [post_16(self.node, "send", self.node.Isend, x, 0, tag)]
        if group is not None:
            group.append(self)

    def _next(self):
        """The stage's messages (or ring) completed: do its work, post the next stage's messages."""
        if self.stage == "send":
            self.stage, self.requests = "receive", [post_16(self.node, "recv", self.node.Irecv, self.out, 0, self.tag)]
        elif self.stage == "gather":
            total = self.x.astype(np.float32)
            for part in self.parts:  # local-rank order: the rounding of float32 additions is reproducible
                total += part
            self.parts = None
            if self.leaders.Get_size() > 1:
                self.stage = "ring"
                self.ring = Ring16(total, self.leaders, self.tag, out=self.out, wire_dtype=self.x.dtype)
            else:
                self.out[...] = total  # one node: the float32 sum rounded once
                self._broadcast()
        elif self.stage == "ring":
            self.ring.wait()  # done already: copies the gathered 16-bit chunks into out
            self.ring = None
            self._broadcast()
        else:
            self.stage = "done"

    def _broadcast(self):
        self.stage = "broadcast"
        self.requests = [post_16(self.node, "send", self.node.Isend, self.out, peer, self.tag)
                         for peer in range(1, self.node.Get_size())]

    def done(self):
        """Whether the sum is complete on this rank (as far as ``test()``/``wait()`` have seen)."""
        return self.stage == "done"

    def test(self):
        """Advance as far as the messages that arrived allow, without blocking; return whether it completed."""
        while self.stage != "done":
            if self.ring is not None:
                if not self.ring.test():
                    return False
            else:
                self.requests = [r for r in self.requests if not r.test()]
                if self.requests:
                    return False
            self._next()
        return True

    def wait(self):
        """Complete the sum; return ``out``. In a ``group`` every pending work of it advances meanwhile."""
        if self.group is not None:
            wait_together(self, self.group)
        while self.stage != "done":
            if self.ring is not None:
                self.ring.wait()
            for r in self.requests:
                r.wait()
            self.requests = []
            self._next()
        return self.out


class _NodeSplits:
    """One communicator's node and leader communicators, shared by the HierarchicalAllreduce instances over it.

    Freeing a communicator is collective and a finalizer runs whenever each rank's collector gets to it, so
    nothing frees them behind the caller's back; sharing bounds what dropped instances leave behind instead.
    """

    _cache = []  # the shared ones, one per communicator (identity: mpi4py communicators are not hashable)
    _lock = threading.Lock()  # SimComm's ranks are threads of one process

    def __init__(self, comm):
        self.comm = comm
        self.nodes = node_of_ranks(comm)  # collective; the same list on every rank
        rank = comm.Get_rank()
        local_rank = sum(1 for r in range(rank) if self.nodes[r] == self.nodes[rank])
        # Ranks in comm's order within their node; leaders in node order: the same on every rank.
        self.node_comm = comm.Split(color=self.nodes[rank], key=rank)
        self.leader_comm = comm.Split(color=0 if local_rank == 0 else MPI.UNDEFINED, key=self.nodes[rank])
        self.users = 0
        self._next_tag = 0  # HierarchicalAllreduce16's point-to-point tags on node_comm and leader_comm

    def take_tag(self):
        """Return the next tag of this pair's sequence (every rank starts the sums over it in one order)."""
        with self._lock:
            tag, self._next_tag = self._next_tag, (self._next_tag + 1) % _TAGS
        return tag

    @classmethod
    def acquire(cls, comm):
        """Return ``comm``'s shared splits, made now if needed (collective: every rank shares or splits alike)."""
        with cls._lock:
            cached = next((s for s in cls._cache if s.comm is comm), None)
        # Splitting is collective: the ranks share only if all of them can, else all split anew.
        if not all(comm.allgather(cached is not None)):
            fresh = cls(comm)
            if cached is None:
                with cls._lock:
                    cls._cache.append(fresh)
            cached = fresh  # where this rank had some already, the fresh ones are this instance's own
        with cls._lock:
            cached.users += 1
        return cached

    def release(self):
        """Drop one user; free the communicators (collective) when none is left."""
        with self._lock:
            self.users -= 1
            if self.users:
                return
            self._cache[:] = [s for s in self._cache if s is not self]
        for sub in (self.node_comm, self.leader_comm):
            if sub != MPI.COMM_NULL:
                sub.Free()
