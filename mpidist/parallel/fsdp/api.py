"""FSDP: fully sharded data parallel training, attached to the model through hooks.

Glossary (see also lifecycle.py and layout.py):
- unit: a group of submodules whose parameters are gathered, freed and reduced together (by default one
  child of a ``Sequential``). A unit that neither owns nor uses parameters (ReLU) is never hooked.
- session: one forward of one unit and, later, that forward's backward: the holds it took on its own and
  its used (tied) units' gathered parameters. Several sessions of a unit may await their backward at once
  (micro-batches).
- pass: one run of autograd's engine (``loss.backward()``). FSDP notices it when the first gradient reaches
  a unit's output and finishes it in a callback queued for the pass's end.

How FSDP attaches (never replacing a method of the user's modules):
- forward pre-hook on each unit module: gather the unit (and the units owning tied parameters it uses);
  prefetch the next unit.
- forward hook: register a gradient hook (``Tensor.register_hook``) on each output that requires grad, then
  free the unit (FULL_SHARD) or keep it for backward (SHARD_GRAD_OP and its hybrid twin).
- gradient hook on a unit's outputs, first firing per pass: gather the unit again, point ``param.grad`` at
  views of a flat gradient buffer, prefetch the previous unit. Autograd runs nodes in reverse creation order,
  so every session that ran its forward later has finished its backward by then: their holds are released.
- frozen unit: one whose parameters are all frozen (``requires_grad=False`` at construction; a unit mixing both
  has its frozen ones split off into a frozen part, see selection.py). Its shard Parameter is frozen too: it is
  gathered for forward and backward like any unit, but gets no gradient buffer, no reduction and no shard grad,
  so an optimizer given it (weight decay included) leaves it as it is.
- post-accumulate-grad hook on each trainable parameter: count; when all of a unit's parameters are final,
  finish the reduction in flight (the unit before it in backward order) and start a nonblocking
  reduce-scatter of this unit's flat gradient into its shard, then free the unit. So a unit's reduce-scatter
  runs while the next unit's backward computes, as in PyTorch's FSDP; one is in flight at a time (two
  unsharded grads alive), none with ``backward_prefetch="post"`` once the next unit's backward starts.
- ``queue_callback`` at the pass's end: reduce units that got no gradient, finish every reduction in flight
  (so the optimizer sees final shard grads), release what is still held, complete stray prefetches, raise on
  non-finite gradients.
- forward pre-hook and hook on the root module: step stamps and peak tracking per step, and settling.

Deferred weight gradients (zero-bubble pipelines: ``nn.backward_input`` now, ``DeferredWeightGrads.run()``
later): a backward_input pass gathers each unit it reaches for the input gradients, as any backward does, but
installs no gradient buffers and reduces nothing at its end (no parameter gradient exists yet); it queues a
weight callback. When the weight pass starts, that callback gathers those units again (all at once: the
weight pass computes every deferred node before accumulating) and installs their gradient buffers; from
there the weight pass is an ordinary backward to FSDP: units reduce as their gradients become final, the
rest at its end. An output whose whole backward was deferred (a first stage) fires its gradient hook in
the weight pass, which then gathers as usual.
"""

import contextlib
import itertools
import weakref
from dataclasses import dataclass

from ...comm import check_comm
from ...comm.mesh import DeviceMesh
from ...nn.autograd import Tensor, is_grad_enabled, queue_callback, queue_weight_callback, weights_deferred
from ...nn.module import Module
from ...nn.precision import as_dtype
from ...nn.placement import FlatShard, placement_of
from ...ring16 import private_comm
from ..agreement import TrainableAtBuild, check_same_shards, check_same_structure
from ..grad_sync import GradSync
from ..interface import PlacedParameter, Wrapper, dimensions, placement_comms, refuse_mesh
from . import state_dict as _state
from .groups import build_groups
from .lifecycle import GradState, ParamState, Unit
from .memory import Transient, memory_stats
from .selection import assign_parameters, resolve_units
from .settings import BackwardPrefetch, FSDPSettings, ShardingStrategy

__all__ = ["FSDP", "UnitInfo"]

# Modules some FSDP already hooks: wrapping one twice would gather and reduce twice.
_WRAPPED = weakref.WeakSet()


@dataclass(frozen=True)
class UnitInfo:
    """Public description of one unit: its label, the parameters it owns, flat sizes, units it uses."""

    label: str
    params: tuple     # names of the parameters it owns (flat order)
    numel: int        # unpadded flat parameter size
    shard_numel: int  # elements per shard: ceil(numel / num_shards)
    uses: tuple = ()  # labels of the units owning tied parameters its modules also hold


def _groups_of_mesh(mesh, strategy, shard_size, shard_comm, replicate_comm):
    """Return (comm, strategy, shard_comm, replicate_comm) that ``mesh`` stands for; raise on every rank if its
    dimensions do not fit (see ``FSDP``'s ``comm``)."""
    names, problem = mesh.names, None
    given = [name for name, value in (("shard_size", shard_size), ("shard_comm", shard_comm),
                                      ("replicate_comm", replicate_comm)) if value is not None]
    if len(names) not in (1, 2):
        problem = (f"a mesh must have one dimension (shard over it) or two (replicate over the first, shard over the "
                   f"second) (got {dimensions(mesh)}); pass the data-parallel ones, e.g. mesh.submesh('dp')")
    elif len(names) == 2 and given:
        problem = (f"a 2-D mesh ({dimensions(mesh)}) gives the shard and replica groups: pass no "
                   f"{', '.join(given)} with it")
    elif len(names) == 2 and strategy is ShardingStrategy.NO_SHARD:
        problem = (f"a 2-D mesh ({dimensions(mesh)}) shards over its second dimension but strategy='no_shard' "
                   f"shards nothing: pass its ranks as one dimension")
    elif len(names) == 2 and mesh.comm is None:
        problem = f"a 2-D mesh ({dimensions(mesh)}) needs a communicator holding all its ranks (mesh.comm is None)"
    refuse_mesh(mesh, problem, "FSDP")
    if len(names) == 1:
        return mesh[names[0]], strategy, shard_comm, replicate_comm
    hybrid = {ShardingStrategy.FULL_SHARD: ShardingStrategy.HYBRID_SHARD,
              ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy.HYBRID_SHARD_GRAD_OP}.get(strategy, strategy)
    return mesh.comm, hybrid, mesh[names[1]], mesh[names[0]]


def _mesh_of(comm, strategy, groups):
    """Return the DeviceMesh of ``groups``: ("replicate", "shard") under hybrid sharding, else ``comm`` as the one
    dimension its strategy uses it for ("shard", or "replicate" under NO_SHARD)."""
    if strategy.hybrid:  # build_groups split comm into these, or checked that the given pair tiles it
        return DeviceMesh.from_dimensions({"replicate": groups.replicate_comm, "shard": groups.shard_comm}, comm)
    return DeviceMesh.from_comm(comm, "replicate" if groups.shard_comm is None else "shard")


class _Context:
    """What all units of one FSDP share."""

    def __init__(self, comm, settings, groups):
        self.comm, self.settings, self.groups = comm, settings, groups
        self.transient = Transient()
        # Seconds spent blocked on communication: waiting for all-gathers and for the gradient
        # reductions (starting them counts too). What prefetching and overlap did not hide.
        self.stats = {"comm_wait_s": 0.0}


class _Forward:
    """One training forward of the wrapped module; in flight until a backward reaches it."""

    __slots__ = ("hooked", "started")

    def __init__(self):
        self.hooked = self.started = False


class _Session:
    """One forward of one unit and its backward: the units it holds gathered (see the glossary)."""

    __slots__ = ("unit", "order", "forward", "done", "own", "used", "hooked", "kept", "pass_id")

    def __init__(self, unit, order, forward):
        self.unit, self.order, self.forward = unit, order, forward
        self.done = set()     # ids of the unit's modules whose forward finished
        self.own = False      # holds the unit itself
        self.used = []        # units owning tied parameters it holds
        self.hooked = False   # registered a gradient hook on some output
        self.kept = False     # holds kept from forward to backward (SHARD_GRAD_OP, HYBRID_SHARD_GRAD_OP)
        self.pass_id = None   # the backward pass that reached it


class FSDP(Wrapper):
    """Wrap ``module`` for fully sharded data-parallel training over ``comm``.

    Args:
        module: the model; its parameters are replaced by placeholders and live as shards in this wrapper.
        comm: an mpi4py intracommunicator or a SimComm: all data-parallel ranks; or a ``DeviceMesh`` of them:
            1-D (as its communicator) or 2-D, hybrid sharding: replicate over the first dimension, shard over
            the second (``strategy`` "full_shard"/"shard_grad_op" then mean their hybrid twins; no
            ``shard_size``/``shard_comm``/``replicate_comm`` with it). Other meshes raise on every rank.
        strategy: a ``ShardingStrategy`` or its name ("full_shard", "shard_grad_op", "no_shard",
            "hybrid_shard", "hybrid_shard_grad_op").
        shard_size: for the hybrid strategies: shard within groups of this many ranks (consecutive in
            node-major order, so within a node when it divides the node's ranks) and replicate across the
            ``size // shard_size`` groups (it must divide the size). Default: the ranks per node (shard
            within each node, replicate across nodes).
        shard_comm, replicate_comm: for the hybrid strategies, instead of ``shard_size``: the shard group
            and the replica group of this rank (e.g. from a mesh), which must tile ``comm``.
        units: None (one unit per child of a Sequential), an int N (consecutive Sequential children grouped
            until each group holds at least N elements), or a list whose items are submodules, child
            indices of a Sequential, or lists of those (one unit each). Units must cover every parameter;
            a parameter held by modules of several units (tied weights) belongs to the first and is
            gathered for the others too. List units in execution order so prefetching fetches the unit
            that runs next.
        prefetch: start the next unit's all-gather while the current unit computes.
        backward_prefetch: a ``BackwardPrefetch`` or "pre"/"post" (see settings.py).
        check_finite: after each synchronizing backward, raise FloatingPointError on every rank naming the
            parameters and ranks whose local gradient held NaN or Inf.
        param_dtype: mixed precision (FSDP2's ``MixedPrecisionPolicy``): gather each unit in this dtype
            ("bf16", "fp16", a dtype) and run its forward and backward in it, while the shards (what the
            optimizer updates) stay float32 masters. Activations follow the inputs' dtype.
        reduce_dtype: the dtype gradients accumulate and are reduce-scattered in (default: the shards',
            float32); 16-bit moves half the bytes (a ring of 16-bit messages accumulating in float32).

    At construction every rank takes rank 0's parameter values (a module built inside ``mpidist.nn.deferred()``:
    each rank draws or reads only its shard of each unit, and nothing is broadcast). Build the optimizer on
    ``fsdp.parameters()`` (one flat shard Parameter per unit). Train as usual:
    ``loss = crit(fsdp(x), y); loss.backward(); opt.step()``. Parameters frozen (``requires_grad=False``)
    at construction live in frozen shard Parameters (a unit's frozen part, labelled "<unit> (frozen)", when
    the unit also holds trainable ones) that never get a gradient; freeze alike on every rank, before wrapping.

    As a ``mpidist.parallel.interface.Wrapper`` (what checkpoints, elastic states and clipping read):
    ``mesh`` is the mesh given (a 1-D one under a hybrid strategy: the ("replicate", "shard") mesh FSDP splits it
    into), else ``comm`` as dimension "shard" ("replicate" under no_shard), or that split under a hybrid strategy;
    ``mesh.comm`` is ``comm``. ``placed_parameters()`` names every parameter of the wrapped module with the shard
    Parameter holding it and a ``FlatShard`` saying which of its elements this rank's shard holds.
    """

    def __init__(self, module, comm, strategy="full_shard", units=None, prefetch=True, backward_prefetch="pre",
                 check_finite=False, shard_size=None, shard_comm=None, replicate_comm=None, param_dtype=None,
                 reduce_dtype=None):
        if not isinstance(module, Module):
            raise TypeError(f"FSDP: module must be an mpidist.nn.Module (got {type(module).__name__})")
        if not isinstance(comm, DeviceMesh):
            check_comm("FSDP", comm)
        if not isinstance(prefetch, bool):
            raise TypeError(f"FSDP: prefetch must be a bool (got {prefetch!r})")
        backward_prefetch = BackwardPrefetch.parse(backward_prefetch)
        strategy = ShardingStrategy.parse(strategy)
        given = comm if isinstance(comm, DeviceMesh) else None
        if given is not None:
            comm, strategy, shard_comm, replicate_comm = _groups_of_mesh(given, strategy, shard_size, shard_comm,
                                                                         replicate_comm)
        groups = build_groups(comm, strategy, shard_size, shard_comm, replicate_comm)
        self.module, self.comm = module, comm
        self.mesh = given if given is not None and len(given.names) == 1 + strategy.hybrid else \
            _mesh_of(comm, strategy, groups)
        param_dtype = None if param_dtype is None else as_dtype(param_dtype, "FSDP: param_dtype")
        reduce_dtype = None if reduce_dtype is None else as_dtype(reduce_dtype, "FSDP: reduce_dtype")
        if strategy is ShardingStrategy.NO_SHARD and (param_dtype, reduce_dtype) != (None, None):
            raise ValueError("FSDP: param_dtype and reduce_dtype need a sharding strategy (got strategy='no_shard', "
                             "whose parameters are the shards themselves); use DDP with a communication hook")
        self.settings = FSDPSettings(strategy, prefetch, comm.Get_size(), groups.num_shards, backward_prefetch,
                                     groups.num_replicas, param_dtype, reduce_dtype)
        self.check_finite = check_finite
        self._ctx = _Context(comm, self.settings, groups)
        self.stats = self._ctx.stats
        self._nonfinite = set()  # parameter names whose local (pre-average) gradient held NaN/Inf this pass
        self._syncs = 0
        self._order = itertools.count()  # forward order of sessions
        self._pass_ids = itertools.count(1)
        self._pass = None      # id of the backward pass running now
        self._active = []      # sessions whose backward runs in this pass
        self._forward = None   # the training forward running now
        self._deferring = False  # the backward pass running now defers the weight gradients (backward_input)
        self._weights_for = None  # units that pass reached: the weight pass gathers them again
        self._inflight = []    # training forwards awaiting their backward
        self._reducing = []    # units whose gradient reduction is in flight, in the order they started

        unit_groups = resolve_units(module, units)
        wrapped = [m for _, mods in unit_groups for m in mods if m in _WRAPPED]
        if module in _WRAPPED or wrapped:
            name = type(wrapped[0] if wrapped else module).__name__
            raise ValueError(f"FSDP: module {name} is already wrapped by an FSDP; build a new model for a new wrapper")
        # Before the first broadcast: different models would fail there with MPI's size error, or worse.
        check_same_structure(comm, module.named_parameters(), "FSDP")
        check_same_shards(comm, module.named_parameters(), "FSDP")
        self._trainable = TrainableAtBuild(module.named_parameters(), "FSDP")
        self._units = [Unit(i, label, mods, params, used, self._ctx)
                       for i, (label, mods, params, used) in enumerate(assign_parameters(module, unit_groups))]
        self._param_units = [u for u in self._units if u.params]
        # no_sync mode, the step stamp and the non-finite report, shared with DDP
        self._grad_sync = GradSync(comm, "FSDP", [n for u in self._param_units for n in u.names])
        self._stamp = self._grad_sync.stamp
        for u in self._param_units:
            u.shard_from_rank0()
        # A 16-bit reduction (reduce_dtype, or a 16-bit shard without one) runs the ring on the shard group's private
        # duplicate (mpidist.ring16): made here, where every rank is, so that communicators() names it and
        # mpidist.elastic revokes it after a failure.
        sixteen_bit = any(u.reduces_in_16_bit() for u in self._param_units)
        self._ring_comm = private_comm(groups.shard_comm) if sixteen_bit and groups.shard_comm.Get_size() > 1 \
            else None
        self._neighbours = self._param_neighbours()
        self._checkpoint_spans = self._ancestors_of_units(module)
        self._handles = []
        for u in self._units:
            if u.params or u.used:
                for m in u.modules:
                    self._handles.append(m.register_forward_pre_hook(
                        lambda mod, args, u=u: self._pre_forward(u, mod)))
                    self._handles.append(m.register_forward_hook(
                        lambda mod, args, out, u=u: self._post_forward(u, mod, out)))
            for i, p in enumerate(u.params if not u.frozen else ()):
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, u=u, i=i: self._on_grad_final(u, i, param)))
        # Registered last: the root's pre-hook runs first (prepend), its hook after the units' hooks.
        self._handles.append(module.register_forward_pre_hook(lambda mod, args: self._root_pre_forward(mod),
                                                              prepend=True))
        self._handles.append(module.register_forward_hook(lambda mod, args, out: self._root_post_forward()))
        _WRAPPED.add(module)
        for _, mods in unit_groups:
            _WRAPPED.update(mods)

    # -- construction helpers ---------------------------------------------------------------------------
    def _param_neighbours(self):
        """Return ``{unit index: (previous, next) unit with parameters and modules}`` in unit order (prefetch
        targets; a frozen part has no modules: it is gathered with its unit)."""
        out = {}
        for u in self._units:
            before = [v for v in self._units[: u.index] if v.params and v.modules]
            after = [v for v in self._units[u.index + 1:] if v.params and v.modules]
            out[u.index] = (before[-1] if before else None, after[0] if after else None)
        return out

    def _ancestors_of_units(self, module):
        """Return ``[(path, module)]`` of the modules that contain a unit module (the root included)."""
        paths = {id(m): name for name, m in module.named_modules()}
        by_path = {name: m for name, m in module.named_modules()}
        found = {}
        for u in self._units:
            for m in u.modules:
                parts = paths[id(m)].split(".") if paths[id(m)] else []
                for k in range(len(parts)):
                    path = ".".join(parts[:k])
                    found[path] = by_path[path]
        return sorted(found.items())

    # -- the module interface ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Run the wrapped module (FSDP works through its hooks)."""
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self):
        """Yield the shard Parameters (one flat shard per unit with parameters): give these to the optimizer."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix=""):
        """Yield ``(unit label, shard Parameter)``."""
        for u in self._param_units:
            yield (f"{prefix}.{u.label}" if prefix else u.label), u.shard

    @property
    def shard_comm(self):
        """The ranks this rank's shards are split over (``comm``, a hybrid shard group, or None for NO_SHARD)."""
        return self._ctx.groups.shard_comm

    @property
    def replicate_comm(self):
        """The ranks holding copies of this rank's shards (hybrid replica group, ``comm`` for NO_SHARD, or None)."""
        return self._ctx.groups.replicate_comm

    @property
    def units(self):
        """Return a ``UnitInfo`` per unit, in order (units without parameters included)."""
        return tuple(UnitInfo(u.label, tuple(u.names), u.numel, u.shard_numel,
                              tuple(self._units[i].label for i in u.used)) for u in self._units)

    @property
    def groups(self):
        """This rank's ``ShardGroups``: shard and replica communicators, and which chunk every rank holds."""
        return self._ctx.groups

    def communicators(self):
        """The communicators this FSDP works over besides ``comm`` (hybrid: its shard and replica groups; a 16-bit
        ``reduce_dtype``: the ring's private duplicate of the shard group, ``ring16.private_comm``), e.g.
        for ``mpidist.elastic`` to revoke after a failure: a rank blocked in one of them with live members is
        told of a failure only through them."""
        return tuple(c for c in (self.groups.shard_comm, self.groups.replicate_comm, self._ring_comm)
                     if c is not None and c is not self.comm)

    def placed_parameters(self):
        """Return a ``PlacedParameter`` per parameter of the wrapped module, in its ``named_parameters()`` order.

        Each holds the shard Parameter of the unit owning the parameter (the units' parameters share it) and a
        ``FlatShard``: ``block`` the parameter's own placement (tensor parallelism inside FSDP; None for a
        whole tensor), ``block_shape`` its local shape, and the elements of that block this rank's shard holds
        (``count`` 0 where it holds none: every rank lists every parameter). ``comm`` is the shard group
        (``shard_comm``; None under NO_SHARD, where every rank holds whole units).
        """
        placements = {name: placement_of(p) for name, p in self.module.named_parameters()}
        placed = {}
        for shard in self.shard_layout():
            held = {piece.name: piece for piece in shard.pieces()}
            for span in shard.params:
                piece = held.get(span.name)
                where = (piece.start, piece.count, piece.offset) if piece is not None else (0, 0, 0)
                flat = FlatShard(placements[span.name], span.shape, *where, comm=self.shard_comm)
                placed[span.name] = PlacedParameter(span.name, shard.parameter, flat)
        return tuple(placed[name] for name in placements)

    def named_buffers_global(self):
        """Yield ``(name, buffer)`` of the wrapped module: FSDP leaves buffers whole on every rank."""
        return self.module.named_buffers()

    def grad_norm_comms(self):
        """Return the tensor-parallel communicators of the wrapped parameters' placements (in the module's order),
        then the shard group: the ranks whose gradient pieces are disjoint."""
        own = placement_comms(PlacedParameter(name, p, placement_of(p)) for name, p in self.module.named_parameters())
        return own + ((self.shard_comm,) if self.shard_comm is not None else ())

    def shard_layout(self):
        """Return a ``UnitShard`` per unit with parameters: its flat layout and this rank's shard Parameter."""
        return tuple(u.layout() for u in self._param_units)

    def train(self, mode=True):
        """Set training mode on the wrapped module; return self."""
        self.module.train(mode)
        return self

    def eval(self):
        """Set evaluation mode on the wrapped module; return self."""
        return self.train(False)

    def num_inflight(self):
        """Return how many training forwards have not been reached by a backward yet."""
        return len(self._inflight)

    def reductions_in_flight(self):
        """Return the labels of the units whose gradient reduction has started and not finished, oldest first.

        Finished means added into the shard grad, which FSDP does in order when the next one starts and at
        the end of backward; MPI may have completed the transfer earlier.
        """
        return tuple(u.label for u in self._reducing)

    def zero_grad(self, set_to_none=True):
        """Drop every shard gradient and any gradient accumulated under ``no_sync`` (or zero them in place)."""
        for u in self._param_units:
            if set_to_none:
                u.release_unsharded_grad()
                u.shard.grad = None
                u.grad_state = GradState.NONE
            else:
                for g in {id(g): g for g in (u.shard.grad, u.unsharded_grad) if g is not None}.values():
                    g[...] = 0

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients to global norm ``max_norm`` over the whole model; return the norm before.

        ``Wrapper.clip_grad_norm_`` over the shards' pieces: the ranks of a shard group add up their pieces'
        contributions (padding is left out), so the norm and scale equal those of the unsharded model. Replicas
        hold the same reduced gradients, so the sum runs over the shard group only. Call after backward.
        """
        self._check_at_rest("clip_grad_norm_")
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def remove(self):
        """Detach this FSDP from the module (its hooks, and the mark that it is wrapped), without communicating.

        For wrapping the module again over another communicator, e.g. after ranks were lost
        (``mpidist.elastic``): the module's parameters keep whatever ``data`` they hold now (empty placeholders
        while sharded), so put the full values in before building the new FSDP.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _WRAPPED.discard(self.module)
        for u in self._units:
            for m in u.modules:
                _WRAPPED.discard(m)

    def __repr__(self):
        units = ", ".join(f"{u.label}:{u.numel}" for u in self._units)
        hybrid = (f", shards={self.settings.num_shards} x replicas={self.settings.num_replicas}"
                  if self.settings.strategy.hybrid else "")
        return (f"FSDP(strategy={self.settings.strategy.value}{hybrid}, prefetch={self.settings.prefetch}, "
                f"units=[{units}])")

    # -- state ---------------------------------------------------------------------------------------------
    def _check_at_rest(self, fn):
        busy = [u.label for u in self._param_units if u.holds or u.handle is not None or u.reduction is not None]
        sessions = [u.label for u in self._units if u.session is not None]
        if busy or sessions or self._inflight or self._pass is not None:
            raise RuntimeError(f"FSDP.{fn}: micro-batches are in flight (units gathered: {busy}, training forwards "
                               f"awaiting backward: {len(self._inflight)}); finish their backward first")

    def full_state_dict(self):
        """Gather the full state one tensor at a time to rank 0 and return it there (other ranks get ``{}``).

        Keys and order equal the wrapped module's ``state_dict()``; values are numpy arrays. Rank 0 holds the full
        model plus one tensor in transit; other ranks hold nothing extra. Over ``comm`` only: a tensor-parallel
        model's parameters come back as this rank's slices (``mpidist.full_state_dict(fsdp, world)`` gives the
        unsplit model).
        """
        return _state.full_state_dict(self)

    def load_full_state_dict(self, state_dict):
        """Load rank 0's full ``state_dict`` (other ranks may pass None) and re-shard it unit by unit."""
        self._check_at_rest("load_full_state_dict")
        _state.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self):
        """Return this rank's shards, no communication: ``{unit label: {"shard", "params", "numel", "num_shards", "rank"}}``.

        ``rank`` is the shard index (the rank in the shard group): replicas of a hybrid run save equal entries.
        """
        return _state.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict):
        """Load shards saved by ``sharded_state_dict()`` with the same units, shard group size and shard index."""
        self._check_at_rest("load_sharded_state_dict")
        _state.load_sharded_state_dict(self, state_dict)

    def state_dict(self):
        """Refuse: say which of the two state dicts is meant."""
        raise TypeError("FSDP.state_dict: ambiguous for a sharded model; use full_state_dict() (gathered on rank 0) "
                        "or sharded_state_dict() (this rank's shards)")

    def load_state_dict(self, state_dict, strict=True):
        """Refuse: say which of the two loaders is meant."""
        raise TypeError("FSDP.load_state_dict: ambiguous for a sharded model; use load_full_state_dict() "
                        "or load_sharded_state_dict()")

    @contextlib.contextmanager
    def summon_full_params(self):
        """Gather every unit on every rank for the block (module params show full values; edits are discarded)."""
        self._check_at_rest("summon_full_params")
        held = []
        try:
            for u in self._param_units:
                u.acquire()
                held.append(u)
            yield self.module
        finally:
            for u in held:
                u.release()

    # -- memory --------------------------------------------------------------------------------------------
    def reset_peak(self):
        """Restart peak tracking from what is alive now."""
        self._ctx.transient.reset_peak()

    def memory_stats(self, optimizer=None):
        """Return this rank's bytes, counted from the arrays FSDP owns (and ``optimizer``'s state for its shards).

        Keys: param_shard_bytes, grad_shard_bytes, optimizer_state_bytes, persistent_bytes (their sum),
        gathered_bytes and unsharded_grad_bytes (alive now), peak_gathered_bytes, peak_unsharded_grad_bytes
        (since the last step began or ``reset_peak()``), and peak_bytes = persistent + peak of both together.
        """
        return memory_stats([u.shard for u in self._param_units], self._ctx.transient, optimizer)

    # -- gradient synchronization --------------------------------------------------------------------------
    def no_sync(self):
        """Accumulate full-size gradients locally; the first backward after the block reduce-scatters the sum."""
        return self._grad_sync.no_sync()

    def sync_gradients(self):
        """Reduce every gradient accumulated under ``no_sync`` into the shard grads now (blocking)."""
        self._syncs += 1
        self._stamp.start(self.parameters())
        self._stamp.finish(f"gradient synchronization #{self._syncs}")
        for u in self._param_units:
            if u.grad_state is GradState.ACCUMULATING:
                self._start_reduce(u)
        self._finish_reductions()
        for u in self._param_units:
            if u.grad_state is GradState.REDUCED:
                u.grad_state = GradState.NONE
        if self.check_finite:
            self._raise_if_nonfinite()

    def _raise_if_nonfinite(self):
        """Raise on every rank, naming parameters and ranks, if any rank's local gradient was not finite."""
        local = [n in self._nonfinite for n in self._grad_sync.names]
        self._nonfinite.clear()
        # Each rank saw only its shard's part: the flags are gathered even when this rank's are all clear.
        self._grad_sync.raise_if_nonfinite(local, f"gradient synchronization #{self._syncs}")

    # -- reduction helpers ---------------------------------------------------------------------------------
    def _start_reduce(self, unit):
        """Start ``unit``'s gradient reduction after taking those in flight one stage on (rank-independent order).

        With one collective per reduction (no replicas) that finishes the previous unit's: one reduce-scatter
        is in flight while the next unit's backward computes. With replicas a chunk's allreduce and the next
        unit's reduce-scatter overlap too.
        """
        self._reducing = [u for u in self._reducing if not u.advance_reduce()]
        unit.start_reduce(self._nonfinite if self.check_finite else None)
        self._reducing.append(unit)

    def _finish_reductions(self):
        """Finish every reduction in flight, oldest first."""
        reducing, self._reducing = self._reducing, []
        for u in reducing:
            u.wait_reduce()

    # -- gathering helpers -----------------------------------------------------------------------------------
    def _prefetch(self, unit, step):
        """Start the all-gather of the next unit with parameters (``step`` +1: forward order, -1: backward), and
        of its frozen part."""
        target = self._neighbours[unit.index][0 if step < 0 else 1]
        if target is not None:
            target.start_gather()
            for i in target.used:
                if not self._units[i].modules:  # its frozen part: gathered with it whenever it runs
                    self._units[i].start_gather()

    def _progress(self):
        # MPI libraries without an asynchronous progress thread only advance nonblocking collectives
        # inside MPI calls: testing the pending gathers between layers is what makes prefetch overlap.
        for u in self._param_units:
            if u.handle is not None:
                u.handle.test()
        for u in self._reducing:  # MPI may complete one here; FSDP still finishes it in order (advance_reduce)
            u.reduction.handle.test()

    def _settle(self):
        """Complete stray prefetches and free what nobody holds (rank-independent order)."""
        for u in self._param_units:
            if u.param_state is ParamState.GATHERING:
                u.finish_gather()
            if u.holds == 0:
                u.free()

    def _take(self, session):
        """Acquire the session's unit and the units owning the tied parameters it uses."""
        unit = session.unit
        if unit.params and not session.own:
            unit.acquire()
            session.own = True
        if not session.used:
            session.used = [self._units[i] for i in unit.used]
            for u in session.used:
                u.acquire()

    def _release(self, session, own_only=False):
        if session.own:
            session.own = False
            session.unit.release()
        if not own_only:
            used, session.used = session.used, []
            for u in used:
                u.release()

    # -- forward hooks ---------------------------------------------------------------------------------------
    def _root_pre_forward(self, module):
        for path, m in self._checkpoint_spans:
            if m.activation_checkpointing:
                raise ValueError(f"FSDP: activation checkpointing is set on {path or '<root>'!r}, which contains FSDP "
                                 f"units; its recompute would need every unit gathered at once. Set "
                                 f"activation_checkpointing on the unit modules or on modules inside them")
        training = module.training and is_grad_enabled()
        if not self._inflight and self._pass is None:
            self._ctx.transient.reset_peak()  # a new step begins: the peak covers this forward and backward
        self._stamp.count_forward(training)
        if training:  # waited for before the first all-gather: a mismatched one must never start
            self._stamp.start(self.parameters())
            self._stamp.finish(f"training forward #{self._stamp.forwards}")
            self._forward = _Forward()

    def _root_post_forward(self):
        for u in self._units:  # a unit some of whose modules did not run
            if u.session is not None:
                self._end_forward(u)
        self._settle()
        if self._forward is not None and self._forward.hooked:
            self._inflight.append(self._forward)
        self._forward = None

    def _pre_forward(self, unit, module):
        if unit.session is not None and id(module) not in unit.session.done:
            return None  # another module of the unit's running forward
        if unit.session is not None:
            self._end_forward(unit)  # the module runs again: a new forward of the unit
        session = _Session(unit, next(self._order), self._forward)
        unit.session = session
        self._take(session)
        if self.settings.prefetch:
            self._prefetch(unit, +1)
        return None

    def _post_forward(self, unit, module, out):
        session = unit.session
        if session is None:
            return None
        if is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, s=session: self._on_output_grad(s))
                    session.hooked = True
        session.done.add(id(module))
        if len(session.done) == len(unit.modules):
            self._end_forward(unit)
        self._progress()
        return None

    def _end_forward(self, unit):
        session, unit.session = unit.session, None
        if session.forward is not None and session.hooked:
            session.forward.hooked = True
        keep = self.settings.strategy.keeps_params_for_backward and session.hooked and session.forward is not None
        if keep:
            session.kept = True  # its holds stay until its backward
        else:
            self._release(session)

    # -- backward hooks --------------------------------------------------------------------------------------
    def _begin_backward(self):
        self._trainable.check()
        deferring = weights_deferred()
        sync = self._grad_sync.syncing and not deferring  # input gradients only: nothing to reduce in this pass
        self._stamp.count_backward(sync)
        self._stamp.start(self.parameters())  # waited for before the first all-gather or reduce-scatter
        self._stamp.finish(f"gradient synchronization #{self._syncs + 1}" if sync else
                           f"backward #{self._stamp.backwards} (input gradients; weight gradients deferred)"
                           if deferring else f"backward #{self._stamp.backwards} (under no_sync)")
        if sync:
            self._syncs += 1
        self._pass = next(self._pass_ids)
        self._deferring = deferring
        for u in self._param_units:
            u.final = 0
            u.expected = 0 if u.frozen else len(u.params)
        queue_callback(self._end_backward)
        if deferring:
            self._weights_for = []
            queue_weight_callback(lambda units=self._weights_for: self._begin_weights(units))

    def _begin_weights(self, units):
        """Weight-pass callback of a backward_input pass: gather ``units`` again and install their gradient buffers."""
        if self._pass is None:
            self._begin_backward()
        for unit in units:  # start every gather before waiting for any
            unit.start_gather()
        for unit in units:
            # Ordered before every session: the weight pass's own output hooks (units reached only now) must
            # not finish these; they are released when their gradients are final, or at the pass's end.
            session = _Session(unit, -1, None)
            session.pass_id = self._pass
            self._take(session)
            self._active.append(session)
            if unit.params and not unit.frozen:
                self._install_grads(unit)

    def _install_grads(self, unit):
        if self.settings.backward_prefetch is BackwardPrefetch.POST:
            # POST promises two units of transient memory: the last unit's gradient leaves before this
            # unit's arrives (its reduction stops overlapping compute here).
            self._finish_reductions()
        unit.install_grad_views()

    def _on_output_grad(self, session):
        if self._pass is None:
            self._begin_backward()
        if session.pass_id == self._pass:
            return None
        session.pass_id = self._pass
        if session.forward is not None:
            session.forward.started = True
        # Autograd runs nodes in reverse creation order: every session whose forward ran after this one
        # has finished its backward, so what it holds can go.
        for other in [s for s in self._active if s.order > session.order]:
            self._finish_session(other)
        session.kept = False
        self._take(session)
        self._active.append(session)
        self._progress()
        unit = session.unit
        if self._deferring:
            self._weights_for.append(unit)  # its parameter gradients come in the weight pass
        elif unit.params and not unit.frozen:
            self._install_grads(unit)
        if self.settings.prefetch and self.settings.backward_prefetch is BackwardPrefetch.PRE:
            self._prefetch(unit, -1)
        return None

    def _finish_session(self, session):
        self._release(session)
        if session in self._active:
            self._active.remove(session)

    def _on_grad_final(self, unit, index, param):
        if self._pass is None:  # a backward that reached a parameter but no unit output
            self._begin_backward()
        unit.adopt_grad(param, index)
        unit.final += 1
        if unit.final != unit.expected:
            return
        if self._grad_sync.syncing:
            self._start_reduce(unit)
        # Every node that reads a trainable parameter has run once its gradient is final; a frozen one may
        # still be read, so the unit's frozen part (a used unit) stays gathered until its session finishes.
        for s in [s for s in self._active if s.unit is unit]:
            self._release(s, own_only=True)
        if self.settings.prefetch and self.settings.backward_prefetch is BackwardPrefetch.POST:
            self._prefetch(unit, -1)

    def _end_backward(self):
        deferring, self._deferring, self._weights_for = self._deferring, False, None
        sync = self._grad_sync.syncing and not deferring
        try:
            if sync:
                # Units whose parameters got no gradient in this backward still take part (zeros), in unit
                # order on every rank.
                for u in self._param_units:
                    if u.expected and u.grad_state is not GradState.REDUCED:
                        self._start_reduce(u)
                self._finish_reductions()
            for s in list(self._active):
                self._finish_session(s)
            self._inflight = [f for f in self._inflight if not f.started]
            for u in self._param_units:
                u.final = 0
                if u.grad_state is GradState.REDUCED:
                    u.grad_state = GradState.NONE
            self._settle()
        finally:
            self._pass = None
        if self.check_finite and sync:
            self._raise_if_nonfinite()


def _tensors(out):
    """Yield the Tensors in a module's output (a Tensor, or tuples/lists/dicts of them)."""
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)

