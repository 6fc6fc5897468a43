"""Run a layout for real: build a GPT and the wrappers a ``Layout`` names, step it, count what it communicated.

The planner's numbers are checked against this (tests/test_plan_exact.py: the collectives' bytes; the
validation benchmark: step time and peak memory). It builds the layout exactly as the planner describes it:
``mpidist.parallel.mesh(dp=, pp=, tp=)``, ``models.tensor_parallel`` over the tp ranks, then DDP, FSDP (one unit
per layer) or a Pipeline of DDP chunks; AdamW (``zero1``: sharded by ``ZeroRedundancyOptimizer``); a step is ``num_micro`` micro-batches (accumulated under
``no_sync`` without a pipeline), then the optimizer.
"""
from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections import Counter

import numpy as np

from mpidist import optim, trace
from mpidist.models.gpt import GPT, GPTConfig
from mpidist.models.gpt_parallel import tensor_parallel
from mpidist.nn.precision import Policy, apply_policy
from mpidist.parallel import DDP, FSDP, Pipeline, ZeroRedundancyOptimizer, comm_hooks, mesh
from mpidist.parallel.interface import as_wrapper

from .layouts import Layout
from .model import ModelShape

__all__ = ["LayoutRun", "OneRankOfMany", "traced_calls"]

_OPS = {"iallreduce": "allreduce", "iallgather": "allgather", "ireduce_scatter": "reduce_scatter",
        "isend": "send", "irecv": "recv"}


class LayoutRun:
    """One rank's part of ``layout`` over ``comm`` (collective): ``step()`` trains one step on fixed data."""

    def __init__(self, shape: ModelShape, layout: Layout, comm, seed: int = 0):
        if comm.Get_size() != layout.ranks:
            raise ValueError(f"LayoutRun: layout {layout.name()} needs {layout.ranks} ranks (comm has "
                             f"{comm.Get_size()})")
        self.shape, self.layout = shape, layout
        config = GPTConfig(vocab_size=shape.vocab, block_size=shape.seq, n_layer=shape.layers, n_head=shape.heads,
                           n_embd=shape.hidden, ffn_hidden=shape.ffn_size,
                           tie_weights=shape.tie_weights, bias=shape.bias, dtype=shape.dtype,
                           n_kv_head=shape.kv_heads, dropout=shape.dropout, mlp=shape.mlp, norm=shape.norm,
                           positions=shape.positions)
        model = GPT(config, rng=np.random.default_rng(seed))
        self.grid = mesh(comm, dp=layout.dp, pp=layout.pp, tp=layout.tp)
        if layout.tp > 1:
            tensor_parallel(model, self.grid.tp_comm, sequence_parallel=layout.sequence_parallel)
        if layout.recompute in ("full", "selective"):
            model.checkpoint_blocks(mode=layout.recompute)
        elif layout.recompute != "none":
            raise ValueError(f"LayoutRun: recompute must be none, selective or full (got {layout.recompute!r})")
        if layout.param_dtype or layout.compute_dtype:
            apply_policy(model, Policy(layout.param_dtype or shape.dtype, layout.compute_dtype or None))
        self.model, self.pipeline = model, layout.pp > 1
        dp_comm = self.grid.dp_comm if layout.dp > 1 else None
        if self.pipeline:
            p, v = layout.pp, layout.chunks
            stages = model.pipeline_stages(p * v)
            mine = [stages[s] for s in range(p * v) if s % p == self.grid.pp_rank]
            chunk = mine[0] if v == 1 else mine
            schedule = layout.schedule
            # Every pipeline rank names the tied group (an empty list on the stages holding no copy).
            tied = [t for st in mine for t in st.tied] if shape.tie_weights else None
            # The head's loss only: the other stages' layers are freed with the unsplit model, as in a real run.
            self.wrapper = Pipeline(chunk, self.grid.pp_comm, layout.num_micro, schedule, loss_fn=model.head.loss,
                                    dp_comm=dp_comm, tied_parameters=tied)
            self.model = model = stages = mine = chunk = None
        elif layout.fsdp and dp_comm is not None:
            extra = {"strategy": "hybrid_shard", "shard_size": layout.shard_group} if layout.sharding == "hybrid" else {}
            extra.update({k: getattr(layout, d) for k, d in (("param_dtype", "gather_dtype"),
                                                             ("reduce_dtype", "reduce_dtype")) if getattr(layout, d)})
            self.wrapper = FSDP(model, dp_comm, units=model.fsdp_units(), **extra)
        elif dp_comm is not None:
            self.wrapper = DDP(model, dp_comm)
            if layout.comm_hook != "none":
                self.wrapper.register_comm_hook(*_hook(layout))
        else:
            self.wrapper = model
        self.interface = as_wrapper(self.wrapper)   # what every layout answers (no_sync, memory_stats)
        params = list(self.wrapper.parameters())
        if layout.sharding == "zero1" and dp_comm is not None:
            self.opt = ZeroRedundancyOptimizer(params, optim.AdamW, dp_comm, lr=1e-3)
        else:
            self.opt = optim.AdamW(params, lr=1e-3)
        rng = np.random.default_rng(seed + 1 + self.grid.dp_rank)
        n = layout.micro_batch * layout.num_micro
        self.x = rng.integers(0, shape.vocab, (n, shape.seq))
        self.y = rng.integers(0, shape.vocab, (n, shape.seq))

    def step(self):
        """Train one step (forward and backward of every micro-batch, then AdamW); return the wall seconds."""
        began = time.perf_counter()
        self.opt.zero_grad()
        if self.pipeline:
            self.wrapper.step(self.x, self.y)
        else:
            b, m = self.layout.micro_batch, self.layout.num_micro
            for k in range(m):
                with (contextlib.nullcontext() if k == m - 1 else self.interface.no_sync()):
                    logits = self.wrapper(self.x[k * b:(k + 1) * b])
                    loss = self.model.loss(logits, self.y[k * b:(k + 1) * b]) * (1.0 / m)
                    del logits
                    loss.backward()
        self.opt.step()
        return time.perf_counter() - began


def _hook(layout: Layout):
    """Return ``register_comm_hook``'s (state, hook) for ``layout.comm_hook`` (PowerSGD compressing from the first
    synchronization on, so a short run traces its steady state)."""
    if layout.comm_hook == "powersgd":
        return comm_hooks.PowerSGDState(matrix_approximation_rank=layout.powersgd_rank, start_powerSGD_iter=1), \
            comm_hooks.powerSGD_hook
    return None, {"fp16": comm_hooks.fp16_compress_hook, "bf16": comm_hooks.bf16_compress_hook}[layout.comm_hook]


def traced_calls(run: LayoutRun, comm) -> Counter:
    """Run one step of ``run`` under ``mpidist.trace`` (collective over ``comm``); return this rank's
    Counter of (op, input bytes) of every collective and message it made (blocking and nonblocking alike)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = comm.bcast(tmp if comm.Get_rank() == 0 else None)
        trace.start(path, comm)
        try:
            run.step()
        finally:
            trace.stop()
        events = trace.load(path)
        comm.Barrier()
    rank = comm.Get_rank()
    counts = Counter()
    for e in events.get("traceEvents", events) if isinstance(events, dict) else events:
        if e.get("cat") != "comm" or e.get("pid") != rank or e.get("ph") != "X":
            continue
        op = _OPS.get(e["name"], e["name"])
        counts[(op, int(e["args"]["bytes"]))] += 1
    return counts


def _array(buf):
    """Return the numpy array inside an mpi4py buffer spec ([array, type] or array)."""
    return buf[0] if isinstance(buf, (list, tuple)) else buf


def _stand_in(method):
    """Add the wall time of a stand-in collective to its world's ``local_seconds``."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._shared["seconds"] += time.perf_counter() - began
    return timed


class OneRankOfMany:
    """Rank ``rank`` of a ``size``-rank world in which every rank holds what this one holds (mpi4py's methods):
    one rank of a large layout, stepped in one process without its peers (the exactness tests count its calls,
    ``--calibrate`` times a tensor-parallel rank's work without its transport).

    A reduction returns what ``size`` equal contributions give (SUM: size x), a gather ``size`` copies, a
    reduce-scatter this rank's block of that sum, so agreement checks pass as in a well-behaved run. The time
    these stand-ins spend copying and summing (what a real transport does instead) adds up in
    ``local_seconds``, shared by the world and the groups split from it.

    ``splits``: the group sizes of the ``Split`` calls to come, in order, as the caller declares them from the
    mesh's documented order (``mesh(dp, pp, tp)``: one Split per dimension, dp first; hybrid FSDP: replicate,
    then shard): one rank cannot see the other ranks' colors, so the world's shape is declared, not inferred.
    A Split returns rank ``key`` of a group of the next declared size (so ``key`` must be the rank in the group,
    which MPI does not require). The node (``Split_type``) is the whole world.
    """

    def __init__(self, size, rank=0, splits=(), shared=None):
        from mpi4py import MPI
        self.size, self.rank, self._mpi = size, rank, MPI
        self._shared = shared if shared is not None else {"splits": list(splits), "seconds": 0.0}

    @property
    def local_seconds(self) -> float:
        """Seconds this world's stand-in collectives have spent so far (all its groups)."""
        return self._shared["seconds"]

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Dup(self):
        return OneRankOfMany(self.size, self.rank, shared=self._shared)

    def Split(self, color=0, key=0):
        splits = self._shared["splits"]
        if not splits:
            raise ValueError(f"OneRankOfMany: an undeclared Split (color={color}, key={key}) of {self.size} ranks")
        size = splits[0]
        if self.size % size:
            raise ValueError(f"OneRankOfMany: the declared group size {size} does not divide the {self.size} ranks "
                             f"being split")
        if not 0 <= key < size:
            raise ValueError(f"OneRankOfMany: Split takes key as the rank in the group: key {key} is not in "
                             f"[0, {size}) (the declared group size)")
        splits.pop(0)
        return OneRankOfMany(size, key, shared=self._shared)

    def Split_type(self, split_type, key=0, info=None):
        return self.Dup()

    def Free(self):
        pass

    def Barrier(self):
        pass

    def Mprobe(self, *args, **kwargs):
        raise NotImplementedError("OneRankOfMany: no point-to-point")

    Isend = Mprobe

    def _reduced(self, buf, op):
        return buf * self.size if op in (self._mpi.SUM, None) else buf

    @_stand_in
    def Allreduce(self, sendbuf, recvbuf, op=None):
        send = recvbuf if sendbuf is self._mpi.IN_PLACE else sendbuf
        _array(recvbuf)[...] = self._reduced(_array(send).copy(), op)

    def Iallreduce(self, sendbuf, recvbuf, op=None):
        self.Allreduce(sendbuf, recvbuf, op)
        return self._mpi.REQUEST_NULL

    @_stand_in
    def Allgather(self, sendbuf, recvbuf):
        send, recv = _array(sendbuf), _array(recvbuf)
        recv.reshape(self.size, -1)[...] = send.reshape(1, -1)

    def Iallgather(self, sendbuf, recvbuf):
        self.Allgather(sendbuf, recvbuf)
        return self._mpi.REQUEST_NULL

    @_stand_in
    def Reduce_scatter_block(self, sendbuf, recvbuf, op=None):
        send, recv = _array(sendbuf), _array(recvbuf)
        recv.reshape(-1)[...] = self._reduced(send.reshape(self.size, -1)[self.rank], op)

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=None):
        self.Reduce_scatter_block(sendbuf, recvbuf, op)
        return self._mpi.REQUEST_NULL

    def Bcast(self, buf, root=0):
        pass

    def Ibcast(self, buf, root=0):
        return self._mpi.REQUEST_NULL

    def allgather(self, obj):
        return [obj] * self.size

    def allreduce(self, obj, op=None):
        return obj * self.size if op in (self._mpi.SUM, None) else obj

    def bcast(self, obj, root=0):
        return obj

    def Get_processor_name(self):
        return "node0"
