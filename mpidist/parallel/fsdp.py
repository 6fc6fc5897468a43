"""FSDP: fully sharded data parallel training, gathering one unit of parameters at a time.

Glossary:
- unit: a group of submodules whose parameters are gathered, freed and reduced together (by default one
  child of a ``Sequential``). A unit without parameters (ReLU) is never gathered and is not hooked.
- flat parameter: a unit's parameters concatenated in ``named_parameters()`` order into one 1-D array,
  zero-padded to a multiple of the number of shards so that it splits into equal chunks whatever its size.
- shard: this rank's chunk of a flat parameter (``ceil(numel / world_size)`` elements), held as one
  ``Parameter`` with its own ``grad``. Shards are the only parameter storage that lives between steps and
  the only parameters the optimizer sees, so optimizer state is sharded too.
- gathered: a unit's full flat parameter, rebuilt by all-gathering the shards just before the unit runs.
  While it lives, the module's ``param.data`` are views into it; otherwise a zero-size placeholder.
- unsharded grad: a unit's full-size flat gradient buffer during backward. ``param.grad`` are views into
  it, so layers accumulate straight into it and the reduce-scatter into the shard's grad needs no copy.
  It is freed after the reduce-scatter (kept under ``no_sync``); with NO_SHARD it is the shard grad itself.
- prefetch: starting the nonblocking all-gather of the next unit (the previous one in backward) before the
  current unit computes, so communication overlaps compute; at most two units are gathered at once.
"""

import contextlib
import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .. import collectives
from ..comm import check_comm
from ..nn.module import Module, Parameter, Sequential
from ..nn.utils import clip_grad_norm_
from ..xp import asarray_like, copy_into, get_array_module
from ..comm.agree import raise_if_any
from .agreement import StepStamp, check_same_structure

__all__ = ["FSDP", "ShardingStrategy", "FSDPSettings", "UnitInfo"]

# Point-to-point tag of state-dict transfers; far from the small tags user code tends to pick.
_STATE_TAG = 0x5D5D


class ShardingStrategy(enum.Enum):
    """What stays sharded between the uses of a unit."""

    FULL_SHARD = "full_shard"        # params, grads, optimizer state sharded; re-gather in backward
    SHARD_GRAD_OP = "shard_grad_op"  # as FULL_SHARD, but gathered params live from forward to backward
    NO_SHARD = "no_shard"            # like DDP: full params everywhere, mean-allreduce of gradients

    @classmethod
    def parse(cls, value):
        """Return the strategy named by ``value`` (a ShardingStrategy or its lowercase name)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for s in cls:
                if s.value == value.lower():
                    return s
        valid = ", ".join(repr(s.value) for s in cls)
        raise ValueError(f"FSDP: unknown strategy {value!r} (expected a ShardingStrategy or one of {valid})")


class _UnitState(enum.Enum):
    SHARDED = "sharded"      # only the shard exists; param.data are placeholders
    GATHERING = "gathering"  # a nonblocking all-gather into the gathered buffer is in flight
    GATHERED = "gathered"    # param.data are views into the gathered buffer


@dataclass(frozen=True)
class FSDPSettings:
    """How an FSDP instance shards and communicates."""

    strategy: ShardingStrategy
    prefetch: bool
    world_size: int
    num_shards: int  # world_size, or 1 for NO_SHARD
    backward_prefetch: str = "pre"  # "pre": overlap the previous unit's gather with this unit's backward
                                    # (peak 2 gathered units + 1 unit of gradients); "post": gather it
                                    # after this unit's gradients are reduced and freed (peak 2 units total)


@dataclass(frozen=True)
class UnitInfo:
    """Public description of one unit: its label, parameter names and flat sizes."""

    label: str
    params: tuple
    numel: int        # unpadded flat parameter size
    shard_numel: int  # elements per shard: ceil(numel / num_shards)


class _Unit:
    """One sharding unit: its modules, the layout of its flat parameter and its lifecycle state."""

    def __init__(self, label, modules, named_params, num_shards):
        self.label, self.modules = label, modules
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [tuple(p.data.shape) for p in self.params]
        self.sizes = [int(p.data.size) for p in self.params]
        self.offsets = [0, *itertools.accumulate(self.sizes)][:-1]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // num_shards)
        self.padded = self.shard_numel * num_shards
        self.shard = None             # Parameter holding this rank's shard
        self.placeholder = None       # zero-size array param.data points at while sharded
        self.state = _UnitState.SHARDED
        self.gathered = None
        self.handle = None            # pending all-gather
        self.unsharded_grad = None
        self.pending_reduce = False     # unsharded grad holds local contributions not yet reduced
        self.awaiting_backward = set()  # micro-batches whose gathered params are kept (SHARD_GRAD_OP)
        self.forward_done = {}        # mb -> modules of this unit that finished forward
        self.backward_done = {}       # mb -> modules of this unit that finished backward

    def views(self, flat):
        """Return one view of ``flat`` per parameter, shaped like it."""
        return [flat[o: o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def info(self):
        return UnitInfo(self.label, tuple(self.names), self.numel, self.shard_numel)


class _Transient:
    """Bytes of gathered parameters and unsharded grads alive now, and their peaks since the last reset."""

    def __init__(self):
        self.gathered = self.grads = 0
        self.reset_peak()

    def add(self, gathered=0, grads=0):
        self.gathered += gathered
        self.grads += grads
        self.peak_gathered = max(self.peak_gathered, self.gathered)
        self.peak_grads = max(self.peak_grads, self.grads)
        self.peak_total = max(self.peak_total, self.gathered + self.grads)

    def reset_peak(self):
        self.peak_gathered, self.peak_grads, self.peak_total = self.gathered, self.grads, self.gathered + self.grads


class FSDP:
    """Wrap ``module`` for fully sharded data-parallel training over ``comm``.

    Args:
        module: the model; its parameters are replaced by placeholders and live as shards in this wrapper.
        comm: an mpi4py intracommunicator or a SimComm.
        strategy: a ``ShardingStrategy`` or its name ("full_shard", "shard_grad_op", "no_shard").
        units: None (one unit per child of a Sequential), an int N (consecutive Sequential children grouped
            until each group holds at least N elements), or a list whose items are submodules, child
            indices of a Sequential, or lists of those (one unit each). Units must cover every parameter
            exactly once; list them in execution order so prefetching fetches the unit that runs next.
        prefetch: start the next unit's all-gather while the current unit computes.

    At construction every rank takes rank 0's parameter values. Build the optimizer on
    ``fsdp.parameters()`` (one flat shard Parameter per unit).
    """

    def __init__(self, module, comm, strategy="full_shard", units=None, prefetch=True, backward_prefetch="pre",
                 check_finite=False):
        if not isinstance(module, Module):
            raise TypeError(f"FSDP: module must be an mpidist.nn.Module (got {type(module).__name__})")
        check_comm("FSDP", comm)
        if not isinstance(prefetch, bool):
            raise TypeError(f"FSDP: prefetch must be a bool (got {prefetch!r})")
        if backward_prefetch not in ("pre", "post"):
            raise ValueError(f"FSDP: backward_prefetch must be 'pre' or 'post' (got {backward_prefetch!r})")
        strategy = ShardingStrategy.parse(strategy)
        self.check_finite = check_finite
        self._nonfinite = set()  # parameter names whose local (pre-average) gradient held NaN/Inf this step
        size = comm.Get_size()
        num_shards = 1 if strategy is ShardingStrategy.NO_SHARD else size
        self.module, self.comm = module, comm
        self.settings = FSDPSettings(strategy, prefetch, size, num_shards, backward_prefetch)
        self._sync = True
        self._transient = _Transient()
        # Seconds spent blocked on communication: waiting for all-gathers, and in the gradient
        # reduce-scatters (blocking). What prefetching did not hide.
        self.stats = {"comm_wait_s": 0.0}

        # Before the first broadcast: different models would fail there with MPI's size error, or worse.
        check_same_structure(comm, module.named_parameters(), "FSDP")
        self._stamp = StepStamp(comm, "FSDP")
        self._syncs = 0
        groups = _resolve_units(module, units)
        self._units = self._build_units(module, groups, num_shards)
        self._param_units = [u for u in self._units if u.params]
        for unit in self._param_units:
            self._shard(unit)
            for m in unit.modules:
                self._hook(unit, m)

    # -- construction -----------------------------------------------------------------------------
    @staticmethod
    def _build_units(module, groups, num_shards):
        names = OrderedDict((id(p), n) for n, p in module.named_parameters())
        owner = {}
        units = []
        for index, (label, mods) in enumerate(groups):
            ids = []
            for m in mods:
                for _, p in m.named_parameters():
                    if id(p) in owner and owner[id(p)] != index:
                        raise ValueError(f"FSDP: parameter {names[id(p)]!r} is in unit {owner[id(p)]} "
                                         f"({groups[owner[id(p)]][0]!r}) and unit {index} ({label!r}); units must not overlap")
                    if id(p) not in owner:
                        owner[id(p)] = index
                        ids.append(id(p))
            members = set(ids)
            params = [(n, p) for n, p in module.named_parameters() if id(p) in members]
            dtypes = sorted({str(p.data.dtype) for _, p in params})
            if len(dtypes) > 1:
                raise ValueError(f"FSDP: unit {index} ({label!r}) mixes dtypes {dtypes}; a flat parameter has one dtype, "
                                 f"so put parameters of different dtypes in different units")
            if len({get_array_module(p.data).__name__ for _, p in params}) > 1:
                raise ValueError(f"FSDP: unit {index} ({label!r}) mixes numpy and device arrays")
            units.append(_Unit(label, mods, params, num_shards))
        uncovered = [n for pid, n in names.items() if pid not in owner]
        if uncovered:
            raise ValueError(f"FSDP: units do not cover parameters {uncovered}; add their modules to a unit "
                             f"(units: {[label for label, _ in groups]})")
        return units

    def _shard(self, unit):
        """Build the unit's flat parameter from rank 0's values and keep this rank's shard of it."""
        first = unit.params[0].data
        xp = get_array_module(first)
        flat = xp.zeros(unit.padded, dtype=first.dtype)
        for p, view in zip(unit.params, unit.views(flat)):
            view[...] = p.data
        collectives.broadcast(flat, self.comm)  # every rank starts from rank 0's values, like DDP
        unit.placeholder = xp.empty((0,), dtype=first.dtype)
        for p in unit.params:
            p.grad = None
        if self.settings.strategy is ShardingStrategy.NO_SHARD:
            # The one shard is the whole flat parameter: the module's params stay views into it for good.
            unit.shard = Parameter(flat)
            unit.gathered, unit.state = flat, _UnitState.GATHERED
            for p, view in zip(unit.params, unit.views(flat)):
                p.data = view
            return
        rank = self.comm.Get_rank()
        unit.shard = Parameter(flat[rank * unit.shard_numel: (rank + 1) * unit.shard_numel].copy())
        for p in unit.params:
            p.data = unit.placeholder

    def _hook(self, unit, m):
        """Replace ``m.forward``/``m.backward`` on the instance with versions that gather and reduce around them."""
        if "_fsdp_unit" in m.__dict__:
            raise ValueError(f"FSDP: module {type(m).__name__} (unit {unit.label!r}) is already wrapped by an FSDP")
        inner_forward, inner_backward = m.forward, m.backward

        def forward(x, mb=0):
            self._pre_forward(unit, mb)
            y = inner_forward(x, mb=mb)
            self._post_forward(unit, mb)
            return y

        def backward(grad_out, mb=0):
            self._pre_backward(unit, mb)
            grad_in = inner_backward(grad_out, mb=mb)
            self._post_backward(unit, mb)
            return grad_in

        # object.__setattr__: these are plain attributes, not parameters or children to register.
        object.__setattr__(m, "_fsdp_unit", unit.label)
        object.__setattr__(m, "forward", forward)
        object.__setattr__(m, "backward", backward)

    # -- the module interface -----------------------------------------------------------------------
    def __call__(self, x, mb=0):
        return self.forward(x, mb=mb)

    def forward(self, x, mb=0):
        """Run the wrapped module's forward, gathering each unit just before it runs."""
        if self.module.num_inflight() == 0:
            self._transient.reset_peak()  # a new step begins: the peak covers this forward and backward
        training = self.module.saves_for_backward()
        self._stamp.count_forward(training)
        if training:  # waited for before the first all-gather: a mismatched one must never start
            self._stamp.start(self.parameters())
            self._stamp.finish(f"training forward #{self._stamp.forwards}")
        y = self.module(x, mb=mb)
        self._settle()
        return y

    def backward(self, grad_out, mb=0):
        """Backpropagate; each unit's gradient is reduce-scattered (mean) into its shard's grad as it finishes."""
        self._stamp.count_backward(self._sync)
        self._stamp.start(self.parameters())  # waited for before the first all-gather or reduce-scatter
        self._stamp.finish(f"gradient synchronization #{self._syncs + 1}" if self._sync else
                           f"backward #{self._stamp.backwards} (under no_sync)")
        if self._sync:
            self._syncs += 1
        grad_in = self.module.backward(grad_out, mb=mb)
        self._settle()
        if self.check_finite and self._sync:
            self._raise_if_nonfinite()
        return grad_in

    def _raise_if_nonfinite(self):
        """Raise on every rank, naming parameters and ranks, if any rank's local gradient was not finite."""
        names = [n for unit in self._param_units for n in unit.names]
        local = np.array([[n in self._nonfinite for n in names]], dtype=np.int8)
        self._nonfinite.clear()
        everyone = np.empty((self.comm.Get_size(), len(names)), dtype=np.int8)
        collectives.allgather(local, self.comm, out=everyone)  # each rank sees only its shard: agree first
        bad = np.flatnonzero(everyone.any(axis=0))
        if bad.size:
            culprits = "; ".join(f"{names[i]!r} on rank(s) {np.flatnonzero(everyone[:, i]).tolist()}" for i in bad)
            raise FloatingPointError(f"FSDP: non-finite gradient (NaN or Inf): {culprits}; the optimizer step must not be taken")

    def parameters(self):
        """Yield the shard Parameters (one flat shard per unit with parameters): give these to the optimizer."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix=""):
        """Yield ``(unit label, shard Parameter)``."""
        for u in self._param_units:
            yield (f"{prefix}.{u.label}" if prefix else u.label), u.shard

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients to global norm ``max_norm`` over the whole model; return the norm before.

        Each rank holds a shard of every gradient (padding is zero), so the ranks add up their shards'
        contributions: the norm and scale equal those of the unsharded model. Call after backward.
        """
        self._check_at_rest("clip_grad_norm_")
        sharded = self.settings.strategy is not ShardingStrategy.NO_SHARD
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.comm if sharded else None,
                               error_if_nonfinite)

    @property
    def units(self):
        """Return a ``UnitInfo`` per unit, in order (units without parameters included)."""
        return tuple(u.info() for u in self._units)

    def train(self, mode=True):
        """Set training mode on the wrapped module; return self."""
        self.module.train(mode)
        return self

    def eval(self):
        """Set evaluation mode on the wrapped module; return self."""
        return self.train(False)

    def num_inflight(self):
        """Return how many micro-batches have forwarded without their backward yet."""
        return self.module.num_inflight()

    def zero_grad(self, set_to_none=False):
        """Zero every shard gradient (and any gradient accumulated under ``no_sync``)."""
        for u in self._param_units:
            if set_to_none:
                self._release_unsharded_grad(u)
                u.shard.grad = None
                u.pending_reduce = False
            else:
                for g in {id(g): g for g in (u.shard.grad, u.unsharded_grad) if g is not None}.values():
                    g[...] = 0

    def state_dict(self):
        """Refuse: say which of the two state dicts is meant."""
        raise TypeError("FSDP.state_dict: ambiguous for a sharded model; use full_state_dict() (gathered on rank 0) "
                        "or sharded_state_dict() (this rank's shards)")

    def load_state_dict(self, state_dict, strict=True):
        """Refuse: say which of the two loaders is meant."""
        raise TypeError("FSDP.load_state_dict: ambiguous for a sharded model; use load_full_state_dict() "
                        "or load_sharded_state_dict()")

    def __repr__(self):
        units = ", ".join(f"{u.label}:{u.numel}" for u in self._units)
        return f"FSDP(strategy={self.settings.strategy.value}, prefetch={self.settings.prefetch}, units=[{units}])"

    # -- gathering and freeing ----------------------------------------------------------------------
    def _start_gather(self, unit):
        if unit.state is not _UnitState.SHARDED:
            return
        xp = get_array_module(unit.shard.data)
        unit.gathered = xp.empty(unit.padded, dtype=unit.shard.data.dtype)
        unit.handle = collectives.iallgather(unit.shard.data, self.comm, out=unit.gathered)
        unit.state = _UnitState.GATHERING
        self._transient.add(gathered=unit.gathered.nbytes)

    def _finish_gather(self, unit):
        self._start_gather(unit)
        if unit.state is _UnitState.GATHERING:
            start = time.perf_counter()
            unit.handle.wait()
            self.stats["comm_wait_s"] += time.perf_counter() - start
            unit.handle = None
            for p, view in zip(unit.params, unit.views(unit.gathered)):
                p.data = view
            unit.state = _UnitState.GATHERED

    def _free(self, unit):
        if self.settings.strategy is ShardingStrategy.NO_SHARD or unit.state is _UnitState.SHARDED:
            return
        if unit.handle is not None:
            unit.handle.wait()
            unit.handle = None
        for p in unit.params:
            p.data = unit.placeholder
        self._transient.add(gathered=-unit.gathered.nbytes)
        unit.gathered, unit.state = None, _UnitState.SHARDED

    def _prefetch(self, unit, step):
        """Start the all-gather of the next unit with parameters (``step`` +1: forward order, -1: backward)."""
        i = self._param_units.index(unit) + step
        if 0 <= i < len(self._param_units):
            self._start_gather(self._param_units[i])

    def _progress(self):
        # MPI libraries without an asynchronous progress thread only advance nonblocking collectives
        # inside MPI calls: testing the pending gathers between layers is what makes prefetch overlap.
        for u in self._param_units:
            if u.handle is not None:
                u.handle.test()

    def _settle(self):
        """Complete stray prefetches and free what no pending backward needs (rank-independent order)."""
        for u in self._param_units:
            if u.state is _UnitState.GATHERING:
                self._finish_gather(u)
            if not u.awaiting_backward and not u.forward_done and not u.backward_done:
                self._free(u)

    # -- hooks ------------------------------------------------------------------------------------------
    def _pre_forward(self, unit, mb):
        if unit.forward_done.setdefault(mb, 0) == 0:
            self._finish_gather(unit)
            if self.settings.prefetch:
                self._prefetch(unit, +1)

    def _post_forward(self, unit, mb):
        unit.forward_done[mb] += 1
        if unit.forward_done[mb] == len(unit.modules):
            del unit.forward_done[mb]
            keep = self.settings.strategy is ShardingStrategy.SHARD_GRAD_OP and unit.modules[0].saves_for_backward()
            if keep:
                unit.awaiting_backward.add(mb)
            elif not unit.awaiting_backward and not unit.forward_done:
                self._free(unit)
        self._progress()

    def _pre_backward(self, unit, mb):
        if unit.backward_done.setdefault(mb, 0) > 0:
            return
        self._finish_gather(unit)
        if self.settings.prefetch and self.settings.backward_prefetch == "pre":
            self._prefetch(unit, -1)
        xp = get_array_module(unit.shard.data)
        if self.settings.strategy is ShardingStrategy.NO_SHARD:
            # The shard grad is full size: accumulate straight into it, as DDP does into its buckets.
            # Re-averaging grads already averaged in an earlier backward leaves them unchanged (they are
            # equal on every rank), so accumulating without zero_grad stays correct.
            if unit.shard.grad is None:
                unit.shard.grad = xp.zeros(unit.padded, dtype=unit.shard.data.dtype)
            unit.unsharded_grad = unit.shard.grad
        elif unit.unsharded_grad is None:
            unit.unsharded_grad = xp.zeros(unit.padded, dtype=unit.shard.data.dtype)
            self._transient.add(grads=unit.unsharded_grad.nbytes)
        unit.pending_reduce = True
        for p, view in zip(unit.params, unit.views(unit.unsharded_grad)):
            p.grad = view

    def _post_backward(self, unit, mb):
        unit.backward_done[mb] += 1
        if unit.backward_done[mb] == len(unit.modules):
            del unit.backward_done[mb]
            unit.awaiting_backward.discard(mb)
            if self._sync:
                self._reduce_grad(unit)
            if not unit.awaiting_backward and not unit.backward_done:
                self._free(unit)
            if self.settings.prefetch and self.settings.backward_prefetch == "post":
                self._prefetch(unit, -1)
        self._progress()

    # -- gradients --------------------------------------------------------------------------------------
    def _reduce_grad(self, unit):
        """Mean-reduce the unit's unsharded grad over ranks into its shard grad, then release the buffer."""
        unit.pending_reduce = False
        if self.check_finite:
            # Look before averaging: afterwards every rank holds the NaN and nobody knows its source.
            xp = get_array_module(unit.unsharded_grad)
            for name, view in zip(unit.names, unit.views(unit.unsharded_grad)):
                if not bool(xp.isfinite(view).all()):
                    self._nonfinite.add(name)
        start = time.perf_counter()
        if self.settings.strategy is ShardingStrategy.NO_SHARD:
            collectives.allreduce(unit.shard.grad, self.comm, op="mean")  # the unsharded grad is the shard grad
            self.stats["comm_wait_s"] += time.perf_counter() - start
            return
        # The flat gradient is padded to a multiple of the world size, so every rank gets an equal chunk.
        chunk = collectives.reduce_scatter(unit.unsharded_grad, self.comm, op="mean")
        self.stats["comm_wait_s"] += time.perf_counter() - start
        if unit.shard.grad is None:
            unit.shard.grad = chunk
        else:
            unit.shard.grad += chunk
        self._release_unsharded_grad(unit)

    def _release_unsharded_grad(self, unit):
        if unit.unsharded_grad is None:
            return
        for p in unit.params:
            p.grad = None
        if unit.unsharded_grad is not unit.shard.grad:  # NO_SHARD's is persistent, not transient
            self._transient.add(grads=-unit.unsharded_grad.nbytes)
        unit.unsharded_grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full-size gradients locally; the first backward after the block reduce-scatters the sum."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def sync_gradients(self):
        """Reduce every gradient accumulated under ``no_sync`` into the shard grads now (blocking)."""
        self._syncs += 1
        self._stamp.start(self.parameters())
        self._stamp.finish(f"gradient synchronization #{self._syncs}")
        for u in self._param_units:
            if u.pending_reduce:
                self._reduce_grad(u)

    # -- gathered views ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self):
        """Gather every unit on every rank for the block (module params show full values; edits are discarded)."""
        self._check_at_rest("summon_full_params")
        try:
            for u in self._param_units:
                self._finish_gather(u)
            yield self.module
        finally:
            for u in self._param_units:
                self._free(u)

    # -- state dicts ------------------------------------------------------------------------------------
    def _check_at_rest(self, fn):
        busy = [u.label for u in self._param_units
                if u.forward_done or u.backward_done or u.awaiting_backward or u.handle is not None
                or (u.state is not _UnitState.SHARDED and self.settings.strategy is not ShardingStrategy.NO_SHARD)]
        if busy or self.module.num_inflight():
            raise RuntimeError(f"FSDP.{fn}: micro-batches are in flight (units gathered: {busy}, "
                               f"in flight: {self.module.num_inflight()}); finish their backward first")

    def full_state_dict(self):
        """Gather the full state unit by unit to rank 0 and return it there (other ranks get ``{}``).

        Keys and order equal the wrapped module's ``state_dict()``. Rank 0 holds the full model plus one
        unit in transit; other ranks hold nothing extra.
        """
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        gathered = {}
        for u in self._param_units:
            if self.settings.strategy is ShardingStrategy.NO_SHARD:
                full = u.shard.data
            elif rank == 0:
                xp = get_array_module(u.shard.data)
                full = xp.empty(u.padded, dtype=u.shard.data.dtype)
                full[: u.shard_numel] = u.shard.data
                for r in range(1, size):
                    copy_into(full[r * u.shard_numel: (r + 1) * u.shard_numel],
                              collectives.recv(r, self.comm, tag=_STATE_TAG))
            else:
                collectives.send(u.shard.data, 0, self.comm, tag=_STATE_TAG)
                continue
            if rank == 0:
                for name, view in zip(u.names, u.views(full)):
                    gathered[name] = view.copy()
        if rank != 0:
            return OrderedDict()
        out = OrderedDict((name, gathered[name]) for name, _ in self.module.named_parameters())
        out.update((name, b.copy()) for name, b in self.module.named_buffers())
        return out

    def load_full_state_dict(self, state_dict):
        """Load rank 0's full ``state_dict`` (other ranks may pass None) and re-shard it unit by unit."""
        self._check_at_rest("load_full_state_dict")
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        self._agree_on_error(self._validate_full(state_dict) if rank == 0 else None)
        no_shard = self.settings.strategy is ShardingStrategy.NO_SHARD
        for u in self._param_units:
            if rank == 0:
                flat = u.shard.data if no_shard else get_array_module(u.shard.data).zeros(u.padded, u.shard.data.dtype)
                for name, view in zip(u.names, u.views(flat)):
                    copy_into(view, state_dict[name])
            if no_shard:
                collectives.broadcast(u.shard.data, self.comm)
            elif rank == 0:
                pending = [collectives.isend(flat[r * u.shard_numel: (r + 1) * u.shard_numel], r, self.comm,
                                             tag=_STATE_TAG) for r in range(1, size)]
                u.shard.data[...] = flat[: u.shard_numel]
                for handle in pending:
                    handle.wait()
            else:
                copy_into(u.shard.data, collectives.recv(0, self.comm, tag=_STATE_TAG))
        for name, b in self.module.named_buffers():
            if rank == 0:
                copy_into(b, state_dict[name])
            collectives.broadcast(b, self.comm)

    def _validate_full(self, state_dict):
        """Return what is wrong with ``state_dict`` (a message) or None."""
        fn = "FSDP.load_full_state_dict"
        if not isinstance(state_dict, Mapping):
            return f"{fn}: rank 0 must pass a mapping of name -> array (got {type(state_dict).__name__})"
        shapes = OrderedDict((n, s) for u in self._param_units for n, s in zip(u.names, u.shapes))
        shapes.update((n, tuple(b.shape)) for n, b in self.module.named_buffers())
        missing = [k for k in shapes if k not in state_dict]
        unexpected = [k for k in state_dict if k not in shapes]
        if missing or unexpected:
            return f"{fn}: keys do not match the module (missing: {missing}, unexpected: {unexpected})"
        for name, shape in shapes.items():
            got = tuple(getattr(state_dict[name], "shape", ()))
            if got != shape:
                return f"{fn}: shape mismatch for {name!r} (state_dict: {got}, model: {shape})"
        return None

    def _agree_on_error(self, message):
        """Raise ValueError on every rank if any rank (in practice rank 0, which validates) found ``message``."""
        raise_if_any(self.comm, message, "")

    def sharded_state_dict(self):
        """Return this rank's shards, no communication: ``{unit label: {"shard", "params", "numel", "num_shards", "rank"}}``."""
        rank = 0 if self.settings.num_shards == 1 else self.comm.Get_rank()
        return OrderedDict((u.label, {"shard": u.shard.data.copy(), "params": tuple(u.names), "numel": u.numel,
                                      "num_shards": self.settings.num_shards, "rank": rank})
                           for u in self._param_units)

    def load_sharded_state_dict(self, state_dict):
        """Load shards saved by ``sharded_state_dict()`` on this rank with the same units and world size."""
        fn = "FSDP.load_sharded_state_dict"
        self._check_at_rest("load_sharded_state_dict")
        labels = [u.label for u in self._param_units]
        if not isinstance(state_dict, Mapping) or list(state_dict) != labels:
            got = list(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"{fn}: units do not match (expected: {labels}, got: {got})")
        rank = 0 if self.settings.num_shards == 1 else self.comm.Get_rank()
        for u in self._param_units:
            entry = state_dict[u.label]
            mine = {"params": tuple(u.names), "numel": u.numel, "num_shards": self.settings.num_shards, "rank": rank}
            saved = {k: (tuple(entry.get(k, ())) if k == "params" else entry.get(k)) for k in mine}
            if saved != mine:
                raise ValueError(f"{fn}: unit {u.label!r} was saved with a different layout (saved: {saved}, here: {mine})")
            if tuple(entry["shard"].shape) != (u.shard_numel,):
                raise ValueError(f"{fn}: shard of unit {u.label!r} has shape {tuple(entry['shard'].shape)} "
                                 f"(expected ({u.shard_numel},))")
        for u in self._param_units:
            copy_into(u.shard.data, asarray_like(state_dict[u.label]["shard"], u.shard.data))

    # -- memory -----------------------------------------------------------------------------------------
    def reset_peak(self):
        """Restart peak tracking from what is alive now."""
        self._transient.reset_peak()

    def memory_stats(self, optimizer=None):
        """Return this rank's bytes, counted from the arrays FSDP owns (and ``optimizer``'s state for its shards).

        Keys: param_shard_bytes, grad_shard_bytes, optimizer_state_bytes, persistent_bytes (their sum),
        gathered_bytes and unsharded_grad_bytes (alive now), peak_gathered_bytes, peak_unsharded_grad_bytes
        (since the last step began or ``reset_peak()``), and peak_bytes = persistent + peak of both together.
        """
        shards = [u.shard for u in self._param_units]
        optimizer_bytes = 0
        if optimizer is not None:
            mine = {id(s) for s in shards}
            held = [i for i, p in enumerate(optimizer.params) if id(p) in mine]
            if not held:
                raise ValueError(f"FSDP.memory_stats: {type(optimizer).__name__} holds none of this FSDP's shard "
                                 f"parameters; build it on fsdp.parameters()")
            optimizer_bytes = sum(int(v.nbytes) for i in held for v in optimizer.state.get(i, {}).values()
                                  if hasattr(v, "nbytes"))
        param_bytes = sum(int(s.data.nbytes) for s in shards)
        grad_bytes = sum(int(s.grad.nbytes) for s in shards if s.grad is not None)
        persistent = param_bytes + grad_bytes + optimizer_bytes
        t = self._transient
        return {"param_shard_bytes": param_bytes, "grad_shard_bytes": grad_bytes,
                "optimizer_state_bytes": optimizer_bytes, "persistent_bytes": persistent,
                "gathered_bytes": t.gathered, "unsharded_grad_bytes": t.grads,
                "peak_gathered_bytes": t.peak_gathered, "peak_unsharded_grad_bytes": t.peak_grads,
                "peak_bytes": persistent + t.peak_total}


# -- unit resolution ----------------------------------------------------------------------------------------
def _resolve_units(module, units):
    """Return ``[(label, (module, ...)), ...]`` for the ``units`` argument, or raise naming the bad value."""
    sequential = isinstance(module, Sequential)
    children = list(module.named_children())
    if units is None:
        if not sequential:
            raise ValueError(f"FSDP: units=None splits a Sequential into one unit per child, but the module is a "
                             f"{type(module).__name__}; pass units=[submodules...] (or units=[module] for one unit)")
        return [(name, (child,)) for name, child in children]
    if isinstance(units, (int, np.integer)) and not isinstance(units, bool):
        if not sequential:
            raise ValueError(f"FSDP: a size threshold (units={units}) groups children of a Sequential, but the module "
                             f"is a {type(module).__name__}; pass units=[submodules...]")
        if units < 1:
            raise ValueError(f"FSDP: a size threshold must be >= 1 element (got units={units})")
        groups, current, numel = [], [], 0
        for name, child in children:
            current.append((name, child))
            numel += sum(int(p.data.size) for p in child.parameters())
            if numel >= units:
                groups.append(current)
                current, numel = [], 0
        if current:
            groups.append(current)
        return [("+".join(n for n, _ in g), tuple(c for _, c in g)) for g in groups]
    if not isinstance(units, (list, tuple)) or not units:
        raise TypeError(f"FSDP: units must be None, an int size threshold or a non-empty list (got {units!r})")

    path = {id(m): name for name, m in module.named_modules()}

    def one(item):
        if isinstance(item, Module):
            if id(item) not in path:
                raise ValueError(f"FSDP: unit module {type(item).__name__} is not part of the wrapped module")
            return path[id(item)], item
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not sequential:
                raise TypeError(f"FSDP: unit index {item} needs a Sequential module (got {type(module).__name__})")
            if not 0 <= item < len(children):
                raise ValueError(f"FSDP: unit index {item} out of range for a Sequential of {len(children)} children")
            return children[item]
        raise TypeError(f"FSDP: a unit item must be a Module, a child index or a list of those (got {item!r})")

    groups, seen = [], {}
    for index, entry in enumerate(units):
        items = [one(i) for i in (entry if isinstance(entry, (list, tuple)) else [entry])]
        if not items:
            raise ValueError(f"FSDP: unit {index} is empty")
        for name, m in items:
            if id(m) in seen:
                raise ValueError(f"FSDP: module {name or '<root>'!r} is listed in unit {seen[id(m)]} and unit {index}; "
                                 f"units must not overlap")
            seen[id(m)] = index
        groups.append(("+".join(name or "<root>" for name, _ in items), tuple(m for _, m in items)))
    return groups
