"""A unit's lifecycle: its flat parameter sharded, being gathered, gathered; its gradients accumulating,
reduced into the shard.

Glossary:
- holds: how many users need the unit's gathered parameters now: a unit's forward, its backward, a unit
  that uses a tied parameter this unit owns, ``summon_full_params``. The parameters are freed when the
  last hold is released (never under NO_SHARD, whose one shard is the full flat parameter).
- unsharded grad: the unit's full-size flat gradient buffer while its gradients accumulate; ``param.grad``
  are views into it, so autograd adds straight into it and the reduce-scatter needs no copy. Freed after
  the reduce-scatter (kept under ``no_sync``); with NO_SHARD it is the shard's grad itself.
- final: a backward has delivered every gradient of the unit's trainable parameters (each parameter's
  post-accumulate-grad hook fired once): the unit's gradients can be reduced.
- reduction in flight: the nonblocking reduce-scatter (then, with replicas, allreduce) of a final unit's
  gradient, started at once and finished later (FSDP finishes it when the next unit's starts, so it overlaps
  the next unit's backward, and at the end of backward). ``GradState.REDUCED`` means started in this backward.
"""

import enum
import itertools
import time

import numpy as np

from ... import collectives
from ...nn.deferred import fill_boxes, is_deferred
from ...nn.module import Parameter
from ...nn.placement import FlatShard, placement_of
from ...xp import check_dtype, get_array_module
from ...ring16 import iring_reduce_scatter_16
from .layout import ParamSpan, UnitShard
from .settings import ShardingStrategy

__all__ = ["ParamState", "GradState", "Unit"]


class ParamState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"      # only the shard exists; param.data are zero-size placeholders
    GATHERING = "gathering"  # a nonblocking all-gather into the gathered buffer is in flight
    GATHERED = "gathered"    # param.data are views into the gathered flat parameter


class GradState(enum.Enum):
    """Where a unit's gradients are."""

    NONE = "none"                  # nothing local that is not in the shard's grad
    ACCUMULATING = "accumulating"  # the unsharded grad holds local sums not reduced yet
    REDUCED = "reduced"            # reduced in the backward running now (reset when it ends)


class _Stage(enum.Enum):
    """Which collective of a unit's gradient reduction is in flight."""

    SHARDS = "shards"      # the reduce-scatter over the shard group
    REPLICAS = "replicas"  # the allreduce over the replica group (of the chunk; of the whole grad for NO_SHARD)


class _Reduction:
    """A unit's gradient reduction in flight: the handle of its running collective and which one it is."""

    __slots__ = ("handle", "stage")

    def __init__(self, handle, stage):
        self.handle, self.stage = handle, stage


class Unit:
    """One sharding unit: its modules, its flat parameter's layout, its shard and its lifecycle state."""

    def __init__(self, index, label, modules, named_params, used, ctx):
        self.index, self.label, self.modules, self.used = index, label, modules, used
        self.ctx = ctx  # the owning FSDP's shared pieces: comm, settings, transient, stats
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [tuple(p.data.shape) for p in self.params]
        self.sizes = [int(p.data.size) for p in self.params]
        self.offsets = [0, *itertools.accumulate(self.sizes)][:-1]
        self.numel = sum(self.sizes)
        # All frozen (selection.py puts a unit's frozen parameters in a unit of their own): no gradient storage.
        self.frozen = bool(self.params) and not any(p.requires_grad for p in self.params)
        num_shards = ctx.settings.num_shards
        self.shard_numel = -(-self.numel // num_shards)
        self.padded = self.shard_numel * num_shards
        self.shard = None          # Parameter holding this rank's shard
        self.placeholder = None    # zero-size array param.data points at while sharded
        self.param_state = ParamState.SHARDED
        self.grad_state = GradState.NONE
        self.gathered = None
        self.handle = None         # pending all-gather
        self.holds = 0
        self.unsharded_grad = None
        self.grad_views = None
        self.session = None        # the forward of this unit running now (api._Session)
        self.expected = 0          # parameters expecting a gradient in this backward (0 for a frozen unit)
        self.final = 0             # parameters whose gradient is final in this backward
        self.reduction = None      # the gradient reduction in flight (_Reduction), see start_reduce

    @property
    def no_shard(self):
        return self.ctx.settings.strategy is ShardingStrategy.NO_SHARD

    def param_dtype(self, shard_dtype):
        """Return the dtype the unit is gathered and computes in (``FSDPSettings.param_dtype``, else the shard's)."""
        dtype = self.ctx.settings.param_dtype
        return shard_dtype if dtype is None else dtype

    def reduce_dtype(self):
        """Return the dtype gradients accumulate and are reduced in (``FSDPSettings.reduce_dtype``, else the shard's)."""
        dtype = self.ctx.settings.reduce_dtype
        return self.shard.data.dtype if dtype is None else dtype

    def reduces_in_16_bit(self):
        """Whether this unit's gradients are reduce-scattered by the 16-bit ring (mpidist.ring16), not MPI."""
        dtype = np.dtype(self.reduce_dtype())
        return not self.no_shard and dtype.itemsize == 2 and dtype.kind not in "iu"

    def views(self, flat):
        """Return one view of ``flat`` per parameter, shaped like it."""
        return [flat[o: o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def layout(self):
        """Return the public ``UnitShard`` of this unit on this rank."""
        spans = tuple(ParamSpan(n, s, o, k) for n, s, o, k in zip(self.names, self.shapes, self.offsets, self.sizes))
        groups = self.ctx.groups
        return UnitShard(self.label, spans, self.numel, self.shard_numel, groups.num_shards, groups.shard_index,
                         self.shard, groups.num_replicas, groups.replica_index)

    # -- sharding -------------------------------------------------------------------------------------
    def shard_from_rank0(self):
        """Build the flat parameter from rank 0's values and keep this rank's shard of it (deferred parameters:
        draw this rank's shard alone, see ``shard_deferred``)."""
        if any(is_deferred(p) for p in self.params):
            return self.shard_deferred()
        first = self.params[0].data
        xp = get_array_module(first)
        for what in ("param_dtype", "reduce_dtype"):  # bfloat16 on a CuPy without it: an error, on every rank
            if getattr(self.ctx.settings, what) is not None:
                check_dtype(first, getattr(self.ctx.settings, what), f"FSDP: {what}")
        flat = xp.zeros(self.padded, dtype=first.dtype)
        for p, view in zip(self.params, self.views(flat)):
            view[...] = p.data
        collectives.broadcast(flat, self.ctx.comm)  # every rank starts from rank 0's values, like DDP
        self.placeholder = xp.empty((0,), dtype=self.param_dtype(first.dtype))
        for p in self.params:
            p.grad = None
        if self.no_shard:
            # The one shard is the whole flat parameter: the module's params stay views into it for good.
            self.shard = Parameter(flat, requires_grad=not self.frozen)
            self.gathered, self.param_state = flat, ParamState.GATHERED
            for p, view in zip(self.params, self.views(flat)):
                p.data = view
            return
        index = self.ctx.groups.shard_index
        self.shard = Parameter(flat[index * self.shard_numel: (index + 1) * self.shard_numel].copy(),
                               requires_grad=not self.frozen)
        for p in self.params:
            p.data = self.placeholder

    def shard_deferred(self):
        """Draw this rank's shard of a unit of deferred parameters (``mpidist.nn.deferred``): the elements of each
        parameter that fall in the shard's flat range, keyed by name, so no rank holds the unit whole and
        nothing is broadcast (every layout draws the same values)."""
        eager = [n for n, p in zip(self.names, self.params) if not is_deferred(p)]
        if eager:  # the same model on every rank: every rank raises
            raise ValueError(f"FSDP: unit {self.label!r} mixes deferred and materialized parameters (materialized: "
                             f"{eager}); build the whole model inside mpidist.nn.deferred() or outside it")
        dtype = self.params[0].data.dtype
        start = 0 if self.no_shard else self.ctx.groups.shard_index * self.shard_numel
        flat = np.zeros(self.padded if self.no_shard else self.shard_numel, dtype=dtype)
        for p, offset, size in zip(self.params, self.offsets, self.sizes):
            lo, hi = max(start, offset), min(start + flat.size, offset + size)
            if hi > lo:
                where = FlatShard(placement_of(p), tuple(p.data.shape), lo - offset, hi - lo, lo - start)
                fill_boxes(p.data, where, flat)
        self.placeholder = np.empty((0,), dtype=self.param_dtype(dtype))
        self.shard = Parameter(flat, requires_grad=not self.frozen)
        for p in self.params:
            p.grad = None
        if self.no_shard:
            self.gathered, self.param_state = flat, ParamState.GATHERED
            for p, view in zip(self.params, self.views(flat)):
                p.data = view
            return
        for p in self.params:
            p.data = self.placeholder

    # -- gathering and freeing ------------------------------------------------------------------------
    def start_gather(self):
        """Start the nonblocking all-gather of the flat parameter (nothing if not sharded)."""
        if self.param_state is not ParamState.SHARDED:
            return
        xp = get_array_module(self.shard.data)
        dtype = self.param_dtype(self.shard.data.dtype)
        mine = self.shard.data if dtype == self.shard.data.dtype else self.shard.data.astype(dtype)
        self.gathered = xp.empty(self.padded, dtype=dtype)
        # Nothing is reduced: a 16-bit unit moves as its bits (mpidist.wire), so the gather is exact
        self.handle = collectives.iallgather(mine, self.ctx.groups.shard_comm, out=self.gathered)
        self.param_state = ParamState.GATHERING
        self.ctx.transient.add(gathered=self.gathered.nbytes)

    def finish_gather(self):
        """Gather (or finish gathering) and point ``param.data`` at views of the flat parameter."""
        self.start_gather()
        if self.param_state is ParamState.GATHERING:
            start = time.perf_counter()
            self.handle.wait()
            self.ctx.stats["comm_wait_s"] += time.perf_counter() - start
            self.handle = None
            for p, view in zip(self.params, self.views(self.gathered)):
                p.data = view
            self.param_state = ParamState.GATHERED

    def free(self):
        """Drop the gathered flat parameter; ``param.data`` become placeholders (never under NO_SHARD)."""
        if self.no_shard or self.param_state is ParamState.SHARDED:
            return
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        for p in self.params:
            p.data = self.placeholder
        self.ctx.transient.add(gathered=-self.gathered.nbytes)
        self.gathered, self.param_state = None, ParamState.SHARDED

    def acquire(self):
        """Take a hold on the gathered parameters, gathering them if needed."""
        self.holds += 1
        self.finish_gather()

    def release(self):
        """Give a hold back; the last one frees the gathered parameters."""
        self.holds -= 1
        if self.holds < 0:
            raise RuntimeError(f"FSDP: unit {self.label!r} released more often than acquired (library bug)")
        if self.holds == 0:
            self.free()

    # -- gradients ------------------------------------------------------------------------------------
    def install_grad_views(self):
        """Make sure the unsharded grad exists and ``param.grad`` are views into it (autograd adds in place)."""
        if not self.params:
            return
        if self.no_shard and self.unsharded_grad is not None and self.unsharded_grad is not self.shard.grad:
            self.unsharded_grad = None  # the optimizer set the shard grad to None: start a new one
        if self.unsharded_grad is None:
            xp = get_array_module(self.shard.data)
            if self.no_shard:
                # The shard grad is full size: accumulate straight into it, as DDP does into its buckets.
                # Re-averaging grads already averaged in an earlier backward leaves them unchanged (they are
                # equal on every rank), so accumulating without zero_grad stays correct.
                if self.shard.grad is None:
                    self.shard.grad = xp.zeros(self.padded, dtype=self.shard.data.dtype)
                self.unsharded_grad = self.shard.grad
            else:
                # In reduce_dtype: autograd adds a 16-bit parameter's gradient into a float32 view in place
                self.unsharded_grad = xp.zeros(self.padded, dtype=self.reduce_dtype())
                self.ctx.transient.add(grads=self.unsharded_grad.nbytes)
            self.grad_views = self.views(self.unsharded_grad)
        for p, view in zip(self.params, self.grad_views):
            p.grad = view
        self.grad_state = GradState.ACCUMULATING

    def adopt_grad(self, param, index):
        """Called from ``param``'s post-accumulate-grad hook: keep its gradient in the unsharded grad.

        Autograd added into the view when the unit's backward had installed it; otherwise (a tied
        parameter whose last use ran before its owner's backward) it stored a fresh array, added here.
        """
        if self.unsharded_grad is None or param.grad is not self.grad_views[index]:
            fresh = param.grad
            self.install_grad_views()
            if fresh is not None and fresh is not self.grad_views[index]:
                self.grad_views[index] += fresh
        self.grad_state = GradState.ACCUMULATING

    def start_reduce(self, check_finite=None):
        """Start the mean-reduction of the unsharded grad over all ranks into the shard grad (nonblocking).

        Within the shard group a reduce-scatter, then across replicas an allreduce of the chunk: a mean of
        equal-sized groups' means is the mean over all ranks. ``advance_reduce`` moves it on, ``wait_reduce``
        finishes it; until then the unsharded grad stays alive (MPI reads it) and the shard grad is not updated.

        ``check_finite``: a set receiving the names of parameters whose local gradient is not finite.
        """
        if self.reduction is not None:
            raise RuntimeError(f"FSDP: unit {self.label!r} started a reduction while one is in flight (library bug)")
        if self.unsharded_grad is None or self.no_shard:
            # No gradient reached this unit in this backward (its ranks still take part), or NO_SHARD's
            # shard grad was dropped by the optimizer since: start from zeros.
            self.install_grad_views()
        self.grad_state = GradState.REDUCED
        if check_finite is not None:
            # Look before averaging: afterwards every rank holds the NaN and nobody knows its source.
            xp = get_array_module(self.unsharded_grad)
            for name, view in zip(self.names, self.views(self.unsharded_grad)):
                if not bool(xp.isfinite(view).all()):
                    check_finite.add(name)
        start = time.perf_counter()
        groups = self.ctx.groups
        if self.no_shard:
            # The unsharded grad is the shard grad (averaged in place); the replica group is every rank.
            self.reduction = _Reduction(collectives.iallreduce(self.shard.grad, groups.replicate_comm, op="mean"),
                                        _Stage.REPLICAS)
        elif self.reduces_in_16_bit():
            # 16-bit: MPI would widen float16 to float32 on the wire and has no bfloat16; the ring keeps 16 bits.
            # Pending as MPI's reduce-scatter is: FSDP's progress tests it between layers (each test() posts
            # the ring's next step), and advance_reduce waits for it where it waits for the float32 one.
            self.reduction = _Reduction(iring_reduce_scatter_16(self.unsharded_grad, groups.shard_comm, mean=True),
                                        _Stage.SHARDS)
        else:
            # The flat gradient is padded to a multiple of the shard group size: every rank gets an equal chunk.
            self.reduction = _Reduction(collectives.ireduce_scatter(self.unsharded_grad, groups.shard_comm, op="mean"),
                                        _Stage.SHARDS)
        self.ctx.stats["comm_wait_s"] += time.perf_counter() - start

    def advance_reduce(self):
        """Take the reduction in flight one stage on (blocking on the stage running now); return whether it is done.

        After the reduce-scatter the unsharded grad is freed and, with replicas, their allreduce of the chunk starts.
        """
        r = self.reduction
        if r is None:
            return True
        start = time.perf_counter()
        result = r.handle.wait()
        groups = self.ctx.groups
        if r.stage is _Stage.SHARDS:
            self.release_unsharded_grad()
            if result.dtype != self.shard.data.dtype:
                result = result.astype(self.shard.data.dtype)  # the shard's grad (float32 masters); replicas in it
            if groups.num_replicas > 1:  # a 16-bit shard's replicas average in float32, rounded once (mpidist.wire)
                r.handle, r.stage = collectives.iallreduce(result, groups.replicate_comm, op="mean"), _Stage.REPLICAS
                self.ctx.stats["comm_wait_s"] += time.perf_counter() - start
                return False
        self.reduction = None
        if not self.no_shard:
            if self.shard.grad is None:
                self.shard.grad = result
            else:
                self.shard.grad += result
        self.ctx.stats["comm_wait_s"] += time.perf_counter() - start
        return True

    def wait_reduce(self):
        """Finish the reduction in flight, if any."""
        while not self.advance_reduce():
            pass

    def release_unsharded_grad(self):
        """Drop the unsharded grad (``param.grad`` become None)."""
        if self.unsharded_grad is None:
            return
        for p in self.params:
            p.grad = None
        if self.unsharded_grad is not self.shard.grad:  # NO_SHARD's is persistent, not transient
            self.ctx.transient.add(grads=-self.unsharded_grad.nbytes)
        self.unsharded_grad = self.grad_views = None
