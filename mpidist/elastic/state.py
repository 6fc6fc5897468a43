"""The training state kept in memory at each commit, one class for every layout, read through the wrapper interface.

``State`` serves a plain module, DDP, FSDP (full or hybrid sharding), tensor parallelism, a Pipeline (tied
weights, dp x pp meshes) and their combinations: it sees a layout only as ``Wrapper.placed_parameters()`` and
``named_buffers_global()``, cut into boxes by ``nn.placement.boxes``.

Words used here:

- *piece*: one box of a tensor of the unsplit model (a parameter or buffer, by its global name) that a rank holds
  as a primary copy: ``(name, offsets, sizes)``. Every build, one allgather of the pieces gives the *catalog*:
  which positions (ranks of the communicator the layout was built over) hold each piece. DDP's replicas, hybrid
  FSDP's replica groups and a pipeline's data-parallel replicas hold equal pieces: each is a *natural holder*.
- *commit*: on every rank, its own local arrays (parameters, their optimizer state, buffers) and the small state
  everyone holds alike (schedule, sampler position, generators, mpidist's default generator, ``extra``). The
  last ``keep`` commits are held (two by default): ranks can be one commit apart when a failure strikes, and the
  survivors go back to the older one that all of them hold.
- *buddies*: with ``replicas=R`` a rank also keeps the *packet* (its own arrays as bytes) of the ``R-1`` positions
  before it (a ring of ``Sendrecv``), where the layout keeps fewer than ``R`` natural copies of some piece.
- *commit id*: ``step * ID_SCALE + ranks lost when the layout was made``: the survivors agree on the smallest,
  the oldest step any of them may need and, for equal steps, the older layout.

A failure: the survivors agree on a commit all of them hold. For every piece the first live holder (a natural
holder, then the buddies) provides it, one allgather gives every survivor every piece (none at all where every
survivor holds every piece itself: DDP), ``build(comm)`` makes the wrapper over the survivors (its own layout),
and each rank loads its new local arrays, optimizer state and buffers from the full tensors, locally. Where a
piece has no live holder the survivors load the latest disk checkpoint (``checkpoint=DIR``, saved every
``checkpoint_every`` steps through ``mpidist.checkpoint``, which reshards) into the new layout and redo the steps
since; without one every survivor raises the same ``RuntimeError`` naming the lost pieces' holders.

``module``: the model the wrapper wraps whole on every rank (DDP, FSDP, a plain module); ``build(comm)`` wraps
it again after a failure, and its parameters get the committed full values first (FSDP takes them apart while
it is built). ``None`` where ``build(comm)`` makes new modules for each layout (pipelines, tensor parallelism).
``optimizer``: an optimizer over the module's own parameters, kept across builds (DDP, plain), or a factory
``optimizer(params)`` called on ``wrapper.parameters()`` after every build (FSDP's shards, new stages);
``scheduler`` alike (an instance, or ``scheduler(optimizer)``). Use ``state.optimizer``/``state.scheduler``.

The optimizer's parameters and its state arrays are kept without a copy where the optimizer is ``copy_on_write``
(SGD, Adam, AdamW; a subclass with its own update must declare it) and the arrays are numpy: the commit makes
the live arrays read-only (``optim.hold``) and keeps them, and the next step writes its new values into other
buffers (recycled from the commit dropped, see ``Optimizer.recycle``). Anything else that writes into a parameter
in place between commits then fails with numpy's "read-only" error instead of silently changing a commit. Other
optimizers, and CuPy arrays, are copied.

``State(..., roll_forward=True)`` keeps no parameter or optimizer array at all: a commit records the small state
and the parameters' ``version`` counters, and the optimizer updates in place. It needs every rank to hold the
whole state (DDP, a plain module): after a failure every survivor says whether its parameters are still those of
its latest commit (no ``optimizer.step()`` since), the newest such commit wins, and its holder broadcasts it to
the others (a survivor a step ahead carries the others forward; one that had stepped past its commit is brought
back to a survivor's older one). It cannot recover when every survivor had taken ``optimizer.step()`` since its
latest commit and then lost a rank before committing again, i.e. when the step has a collective after
``optimizer.step()`` that fails: it then says so on every survivor. Put the step's collectives (a metric's
allreduce) before ``optimizer.step()``.

Before the first commit is known to be held by every rank (a barrier ends that commit) a state with a ``module``
also keeps the module's arrays from before the first build (the wrapper may take them apart), so that a rank lost
before then lets the survivors start again (``forget_commits``).
"""

import collections
import copy
import os
import time

import numpy as np
from mpi4py import MPI

from .. import checkpoint as disk, collectives, optim, standard_json
from ..comm import world_comm
from ..nn import random as nn_random
from ..nn.module import Module
from ..nn.placement import boxes, check_tiling, global_shape
from ..parallel.interface import as_wrapper
from ..xp import copy_into, get_array_module, to_numpy
from .fault import failing_save

__all__ = ["State", "ID_SCALE", "holders_per_packet"]

ID_SCALE = 1 << 20  # commit id = step * ID_SCALE + ranks lost at the layout (fewer than this many ranks)
_TAG = 0x5E1A  # point-to-point tag of the buddy exchange


def holders_per_packet(replicas, size, copies):
    """Return how many ranks hold each packet (1: no buddies) for ``replicas`` asked, ``size`` ranks and
    ``copies``, the fewest natural holders of any piece (hybrid FSDP's replica groups, DDP's ranks)."""
    wanted = min(replicas, size)
    return 1 if copies >= wanted else wanted


def _is_optimizer(obj):
    return isinstance(obj, optim.Optimizer)


def _refuse_sharded_optimizer(optimizer):
    """Raise TypeError for an optimizer whose state is split over a fixed communicator (ZeroRedundancyOptimizer):
    elastic training rebuilds over the survivors, whose shards would not be those it holds."""
    if hasattr(optimizer, "flat_pieces"):
        raise TypeError(f"State: {type(optimizer).__name__} splits its state over the communicator it was built on; "
                        f"elastic training rebuilds over the survivors, which that split does not follow: use the "
                        f"plain optimizer with DDP, or FSDP (whose sharded state elastic reshards)")


class _Layout:
    """One build's layout: this rank's local arrays and pieces, and the catalog of every position's pieces."""

    def __init__(self, wrapper, comm, replicas, lost, context):
        self.params = list(wrapper.parameters())
        index = {id(p): i for i, p in enumerate(self.params)}
        self.buffer_names = []
        self.pieces = []  # this rank's primary pieces: (key, slot, Box); slot ("p", i) or ("b", j)
        self.names = collections.defaultdict(list)  # global name -> [(slot, Box)] of every copy here (a load writes all)
        tensors, problem = {}, None
        try:
            for p in wrapper.placed_parameters():
                slot = ("p", index[id(p.parameter)])
                shape = global_shape(p.placement, p.parameter.data.shape)
                tensors[p.name] = (tuple(shape), str(p.parameter.data.dtype), False)
                for box in boxes(p.placement, p.parameter.data.shape, p.name):
                    self.names[p.name].append((slot, box))
                    if p.primary:
                        self.pieces.append(((p.name, box.offsets, box.sizes), slot, box))
            for j, (name, buf) in enumerate(wrapper.named_buffers_global()):
                self.buffer_names.append(name)
                tensors[name] = (tuple(buf.shape), str(buf.dtype), True)
                for box in boxes(None, buf.shape, name):
                    self.names[name].append((("b", j), box))
                    self.pieces.append(((name, box.offsets, box.sizes), ("b", j), box))
        except (TypeError, ValueError) as exc:  # a placement that does not fit: every rank must hear of it
            problem = f"{type(exc).__name__}: {exc}"
        me = world_comm().Get_rank()
        mine = (problem, me, tensors, [key for key, _, _ in self.pieces])
        everyone = [mine] if comm is None else comm.allgather(mine)
        problems = [f"rank {r}: {p}" for r, (p, *_) in enumerate(everyone) if p]
        if problems:
            raise ValueError(f"{context}: {'; '.join(problems)}")
        self.world = [w for _, w, _, _ in everyone]  # the world rank of each position
        self.position = 0 if comm is None else comm.Get_rank()
        self.tensors = {}
        self.holders = {}  # piece key -> positions holding it
        for position, (_, _, held_tensors, keys) in enumerate(everyone):
            self.tensors.update(held_tensors)
            for key in keys:
                self.holders.setdefault(key, []).append(position)
        for name, (shape, _, _) in self.tensors.items():
            by_position = [[] for _ in everyone]
            for key, positions in self.holders.items():
                if key[0] == name:
                    for i in positions:
                        by_position[i].append(key[1:])
            wrong = check_tiling(name, shape, by_position)
            if wrong is not None:
                raise ValueError(f"{context}: build(comm) must lay the model out over all {len(everyone)} ranks of "
                                 f"comm: {wrong}")
        copies = min((len(h) for h in self.holders.values()), default=len(everyone))
        self.replicas = holders_per_packet(replicas, len(everyone), copies)
        self.lost = lost  # ranks lost when this layout was made (part of the commit id)
        self.whole_everywhere = copies == len(everyone)  # every rank holds every piece (DDP, one rank)


class State:
    """Everything a training step changes, committed in memory and restored over the survivors after a failure.

    ``step`` counts the steps taken; ``stats`` what the commits cost (commits, seconds, bytes of the latest). See
    the module's docstring for ``module``, ``optimizer``, ``scheduler``, ``replicas`` (ranks holding each
    packet, itself included, where the layout keeps fewer natural copies), ``checkpoint``/``checkpoint_every``
    (the disk fallback, saved after every ``checkpoint_every``-th step, collective) and ``roll_forward``.
    """

    def __init__(self, module=None, optimizer=None, scheduler=None, sampler=None, rngs=(), extra=None, *,
                 replicas=1, checkpoint=None, checkpoint_every=None, roll_forward=False, keep=2):
        if keep < 2:
            raise ValueError(f"State: keep must be >= 2 (got {keep}): survivors may need the commit before the last")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"State: module must be an mpidist.nn.Module or None (got {type(module).__name__})")
        if optimizer is not None and not _is_optimizer(optimizer) and not callable(optimizer):
            raise TypeError(f"State: optimizer must be an optimizer over the module's parameters or a factory "
                            f"optimizer(params) (got {type(optimizer).__name__})")
        if _is_optimizer(optimizer):
            _refuse_sharded_optimizer(optimizer)
        if _is_optimizer(optimizer) and module is None:
            raise ValueError("State: an optimizer instance needs the module it steps; without a module (build(comm) "
                             "makes new modules) give a factory, optimizer(params)")
        if scheduler is not None and not callable(scheduler) and not hasattr(scheduler, "state_dict"):
            raise TypeError(f"State: scheduler must be a schedule or a factory scheduler(optimizer) (got "
                            f"{type(scheduler).__name__})")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"State: replicas must be an int >= 1 (got {replicas!r})")
        if (checkpoint is None) != (checkpoint_every is None):
            raise ValueError(f"State: give checkpoint and checkpoint_every together (got checkpoint={checkpoint!r}, "
                             f"checkpoint_every={checkpoint_every!r})")
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1):
            raise ValueError(f"State: checkpoint_every must be an int >= 1 (got {checkpoint_every!r})")
        if roll_forward and not _is_optimizer(optimizer):
            raise ValueError("State(roll_forward=True) needs the optimizer (an instance over the module's parameters): "
                             "it keeps no copy of the parameters, so the optimizer's step must be the only thing that "
                             "changes them between commits")
        self.module = module
        self.sampler = sampler
        self.rngs = list(rngs)
        self.extra = {} if extra is None else extra
        self.replicas, self.keep = replicas, keep
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        self.roll_forward = bool(roll_forward)
        self.step = 0
        self.faults = ()  # MPIDIST_FAULT's faults (Elastic.train sets them): at=save/commit ones fire in here
        self.stats = {"commits": 0, "commit_s": 0.0, "commit_bytes": 0}
        self._factories = (None if _is_optimizer(optimizer) else optimizer,
                           scheduler if scheduler is not None and not hasattr(scheduler, "state_dict") else None)
        self.optimizer = optimizer if _is_optimizer(optimizer) else None
        self.scheduler = scheduler if hasattr(scheduler, "state_dict") else None
        self.wrapper = self.comm = None
        self._layout = None
        self._size = None  # ranks at the first build (ranks lost = this minus the ranks of a layout)
        self._commits = []  # the kept commits, oldest first
        self._receiving = False  # roll_forward: parameters half overwritten by a broadcast a failure cut short
        self._start = None  # (module's arrays by name, small state) before the first build, until all hold a commit
        self._saved_step = -1  # newest step saved to disk: a step restored or replayed is not saved again

    # -- what the survivors agree on ----------------------------------------------------------------------------
    @property
    def committed_id(self):
        """What the survivors agree on (Elastic.guard): the latest commit's id (None before the first)."""
        return self._commits[-1]["id"] if self._commits else None

    @property
    def committed_step(self):
        """The step of the latest commit (None before the first)."""
        return self._commits[-1]["step"] if self._commits else None

    @property
    def committed_steps(self):
        return [c["step"] for c in self._commits]

    def held_bytes(self):
        """Bytes of the kept commits' arrays on this rank (parameters, optimizer state, buddies' packets)."""
        return sum(_nbytes(_arrays(c)) + sum(p.nbytes for _, p in c["buddies"].values()) for c in self._commits)

    def _current_layout(self):
        if self._layout is None:  # before the first build: the module alone on this rank
            if self.module is None:
                raise RuntimeError("State: no layout yet: call start(build, comm) (Elastic.train does) first")
            self._layout = _Layout(as_wrapper(self.module), None, self.replicas, 0, "State")
        return self._layout

    def _id(self, step):
        return step * ID_SCALE + (self._layout.lost if self._layout is not None else 0)

    # -- building -----------------------------------------------------------------------------------------------
    def start(self, build, comm):
        """Return the first wrapper, ``build(comm)``, and make the optimizer and schedule over it where factories."""
        if self._size is None:
            self._size = comm.Get_size()
        if self._start is None and not self._commits:
            values = None if self.module is None else {n: p.data for n, p in self.module.named_parameters()}
            self._start = (values, self._save_small(self._module_buffers()))
            built = self._attach(build, comm)
            if values is not None:  # arrays the wrapper still uses (DDP's) are live: keep copies of those
                live = {id(p.data) for p in self.module.parameters()}
                self._start = ({n: v.copy() if id(v) in live else v for n, v in values.items()}, self._start[1])
            return built
        return self._attach(build, comm)

    def cannot_start_again(self):
        """Why this state cannot be started again after a failure before its first commit (None: it can)."""
        if self.module is not None and self._start is None and self._size is not None:
            return ("State no longer holds the module's starting values (dropped once every rank held the first "
                    "commit)")
        return None

    def forget_commits(self):
        """Back to where training started, to start again over the survivors (a rank lost before the first commit
        completed everywhere): the module's starting values and the small state of before the first build, on
        every survivor alike; no commits, step 0. Parameters a commit held move to writable copies."""
        if self._start is not None:
            values, small = self._start
            for name, p in (self.module.named_parameters() if self.module is not None else ()):
                p.data = values[name].copy()  # a copy: the starting values stay for another start
                p.grad = None
            self._load_small(small, self._module_buffers())
        elif self._commits:  # never built (commits of a plain module): back to the first commit
            self.rollback(self._commits[0]["step"])
        self._commits.clear()
        self._receiving = False
        self.step = 0
        for p in (self.module.parameters() if self.module is not None else ()):
            p.make_writable()
        if self._factories[0] is not None:
            self.optimizer = self.scheduler = None
        self.wrapper = None

    def _module_buffers(self):
        return {} if self.module is None else dict(self.module.named_buffers())

    def _attach(self, build, comm):
        built = build(comm)
        wrapper = as_wrapper(built)
        if self._size is None:
            self._size = comm.Get_size()
        lost = self._size - comm.Get_size()
        layout = _Layout(wrapper, comm, self.replicas, lost, "State")
        if self.roll_forward and not layout.whole_everywhere:
            raise ValueError("State(roll_forward=True): every rank must hold the whole model (DDP, a plain module); "
                             "this layout splits it (FSDP shards, pipeline stages, tensor-parallel slices)")
        make_optimizer, make_scheduler = self._factories
        if make_optimizer is not None:
            self.optimizer = make_optimizer(list(wrapper.parameters()))
            self.scheduler = None if make_scheduler is None else make_scheduler(self.optimizer)
        if self.optimizer is not None:
            _refuse_sharded_optimizer(self.optimizer)
            mine = {id(p) for p in layout.params}
            foreign = [i for i, p in enumerate(self.optimizer.params) if id(p) not in mine]
            if foreign:
                raise ValueError(f"State: the optimizer steps {len(foreign)} parameter(s) the wrapper does not hold "
                                 f"(indices {foreign[:5]}); build it on wrapper.parameters()")
        self.wrapper, self.comm, self._layout = wrapper, comm, layout
        return built

    # -- commit -------------------------------------------------------------------------------------------------
    def _holds(self):
        """Whether commits hold the live arrays (copy-on-write, see the module's docstring) instead of copying."""
        return (self.optimizer is not None and self.optimizer.copy_on_write
                and all(optim.can_hold(p.data) for p in self._current_layout().params))

    def commit(self):
        """Keep the state as it is now (after a completed step); with buddies, exchange packets (collective)."""
        layout = self._current_layout()
        if self._commits and self._commits[-1]["id"] == self._id(self.step):
            return
        start = time.perf_counter()
        # The commit about to be dropped lends its arrays (no fresh pages per commit on large models): ranks are
        # at most one commit apart, so nobody can need it once this rank commits again.
        spare = self._commits.pop(0) if len(self._commits) >= self.keep else None
        if spare is not None and spare["layout"] is not layout:
            spare = None
        params = layout.params
        if self.roll_forward:  # nothing kept but the hyperparameters: see the module's docstring
            values, opt = None, {"param_groups": copy.deepcopy(_param_groups(self.optimizer))}
        elif self._holds():
            owned = {id(p) for p in self.optimizer.params}  # others (frozen, updated by other code) are copied
            values = [optim.hold(p.data) if id(p) in owned else _copy(p.data, spare and spare["params"][i])
                      for i, p in enumerate(params)]
            opt = _optimizer_copy(self.optimizer, hold=True)
            if spare is not None:
                self.optimizer.recycle(_arrays(spare), [a for c in self._commits for a in _arrays(c)] + values)
        else:
            values = [_copy(p.data, spare and spare["params"][i]) for i, p in enumerate(params)]
            opt = None if self.optimizer is None else _optimizer_copy(self.optimizer, spare and spare["optimizer"])
        slot = {id(p): i for i, p in enumerate(params)}
        record = {"id": self._id(self.step), "step": self.step, "layout": layout, "params": values,
                  "versions": [p.version for p in params], "optimizer": opt,
                  "opt_slots": [] if self.optimizer is None else [slot[id(p)] for p in self.optimizer.params],
                  "buffers": [b.copy() for _, b in (self.wrapper or as_wrapper(self.module)).named_buffers_global()],
                  "small": self._save_small(None), "buddies": {}}
        if layout.replicas > 1:
            record["buddies"] = self._exchange(record, spare)
        self._commits.append(record)
        if self._start is not None and self.comm is not None:
            # Completes only once every rank entered it, i.e. took its first commit: from then on no failure can
            # find a survivor without one, and the starting values need not stay alive any longer.
            self.comm.Barrier()
            self._start = None
        self.stats["commits"] += 1
        self.stats["commit_s"] += time.perf_counter() - start
        self.stats["commit_bytes"] = (_nbytes(_arrays(record)) + sum(p.nbytes for _, p in record["buddies"].values()))
        if self.checkpoint is not None and self.step % self.checkpoint_every == 0 and self.step > self._saved_step:
            with failing_save(self.faults, MPI.COMM_WORLD.Get_rank(), self.step):
                disk.save(self.checkpoint, self._disk_state(), self.comm, self.step)
            self._saved_step = self.step

    def _exchange(self, record, spare):
        """Send this rank's packet to its ``replicas - 1`` successors, receive its predecessors' (a ring)."""
        layout, comm = record["layout"], self.comm
        meta, packet = _pack(layout, _own_holding(record))
        position, size = layout.position, len(layout.world)
        buddies = {}
        for d in range(1, layout.replicas):
            if d == 2:  # MPIDIST_FAULT at=commit: after the first exchange, so that some ranks hold this commit
                for fault in self.faults:
                    fault.maybe_fail(MPI.COMM_WORLD.Get_rank(), self.step, at="commit")
            source, dest = (position - d) % size, (position + d) % size
            their_meta = comm.sendrecv((meta, packet.nbytes), dest, _TAG, None, source, _TAG)
            old = spare["buddies"].get(source) if spare is not None else None
            received = old[1] if old is not None and old[1].nbytes == their_meta[1] else np.empty(their_meta[1], np.uint8)
            comm.Sendrecv([packet, MPI.BYTE], dest, _TAG, [received, MPI.BYTE], source, _TAG)
            buddies[source] = (their_meta[0], received)
        return buddies

    # -- restore ------------------------------------------------------------------------------------------------
    def restore(self, failure, build, comm):
        """Restore the agreed commit over ``comm`` (the survivors) and build the wrapper there (``Elastic.train``).

        With ``roll_forward`` the newest commit a survivor holds unchanged instead; where some piece has no live
        holder, the latest disk checkpoint."""
        if self.roll_forward:
            failure.restored_from = self._take_newest_commit(comm)
            self.wrapper = None
            return self._attach(build, comm)
        record = self._record(failure.commit, "State.restore")
        del self._commits[self._commits.index(record) + 1:]
        layout = record["layout"]
        alive = comm.allgather(world_comm().Get_rank())
        rank_of = {w: r for r, w in enumerate(alive)}
        providers, lost = _providers(layout, rank_of)
        if lost:
            return self._restore_from_disk(failure, build, comm, lost)
        if layout.whole_everywhere:  # every survivor holds every piece itself: nothing to send
            full = _assemble(layout, [_provide(record, None, None)])
        else:
            full = _assemble(layout, comm.allgather(_provide(record, providers, comm.Get_rank())))
        built = self._load_full(full, record, build, comm)
        failure.restored_from = _how(layout, rank_of, comm.Get_size())
        self.commit()  # in the new layout at once: a second failure right after finds a commit of it
        return built

    def rollback(self, step):
        """Restore the commit of ``step`` on this rank alone, in place; drop later commits (every piece must be
        this rank's: a plain module, or DDP before its wrapper is built again)."""
        where = [c for c in self._commits if c["step"] == step]
        if not where:
            raise RuntimeError(f"State.rollback: no commit of step {step} is held (held: {self.committed_steps}); "
                               f"the ranks drifted further apart than keep={self.keep} commits")
        record = where[0]
        if record["params"] is None:  # roll_forward: only the latest commit, while nothing changed since
            if record is not self._commits[-1] or not self.unchanged_since_commit():
                raise RuntimeError(f"State.rollback: roll_forward commits keep no copy of the parameters, which "
                                   f"changed since the commit of step {step} (latest: {self.committed_step}); "
                                   f"only the survivors' restore can bring them back")
            for p in record["layout"].params:
                p.grad = None
            self.optimizer.zero_grad()
            for group, saved in zip(self.optimizer.param_groups, record["optimizer"]["param_groups"]):
                group.update(copy.deepcopy({k: v for k, v in saved.items() if k != "params"}))  # lr set by hand
            self._load_small(record["small"], None)
            self._load_buffers(record["buffers"])
            self.step = step
            return
        if not record["layout"].whole_everywhere:
            raise RuntimeError(f"State.rollback: this rank holds only part of the commit of step {step} (a split "
                               f"layout); the survivors' restore (collective) brings it back")
        del self._commits[self._commits.index(record) + 1:]
        layout = record["layout"]
        for p, value, version in zip(layout.params, record["params"], record["versions"]):
            if optim.is_held(p.data):
                p.data = value.copy()  # held by a commit (copy-on-write): a fresh array, the commit stays as it is
            else:
                p.data[...] = value  # in place: the optimizer's flat views of the parameters stay valid
            p.version = version
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.load_state_dict(record["optimizer"])
            self.optimizer.zero_grad()
        self._load_small(record["small"], None)
        self._load_buffers(record["buffers"])
        self.step = step

    def _record(self, commit_id, context):
        where = [c for c in self._commits if c["id"] == commit_id]
        if not where:
            raise RuntimeError(f"{context}: no commit with id {commit_id} is held (held: "
                               f"{[c['id'] for c in self._commits]})")
        return where[0]

    def _load_full(self, full, record, build, comm):
        """Put the full tensors ``full`` (name -> (array, {optimizer key: array}, scalars, version)) into the module,
        build over ``comm``, then load the new layout's local arrays and optimizer state from them."""
        old = self.wrapper
        if old is not None:
            old.remove()
        for name, p in (self.module.named_parameters() if self.module is not None else ()):
            if name in full and p.placement is None and tuple(p.data.shape) != tuple(full[name][0].shape):
                p.data, p.grad = np.array(full[name][0], copy=True), None  # placeholders FSDP left: it shards these
        self._load_small(record["small"], None)
        built = self._attach(build, comm)
        layout = self._layout
        for name, copies in layout.names.items():
            if name not in full:
                continue
            value, _, _, version = full[name]
            for (kind, i), box in copies:
                if kind == "p":
                    param = layout.params[i]
                    copy_into(box.view(param.make_writable()), value[_index(box)])
                    param.version, param.grad = version, None
        for name, buf in self.wrapper.named_buffers_global():
            if name in full:
                copy_into(buf, full[name][0])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_state(full, record))
            self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.load_state_dict(record["small"]["scheduler"])
        self.step = record["step"]
        self._start = None  # every survivor holds a commit from here on
        return built

    def _optimizer_state(self, full, record):
        """The optimizer's state dict for this layout, cut from the full optimizer tensors."""
        layout = self._layout
        index = {id(p): i for i, p in enumerate(self.optimizer.params)}
        state = {}
        for name, copies in layout.names.items():
            if name not in full or not (full[name][1] or full[name][2]):
                continue
            for (kind, i), box in copies:
                if kind != "p" or id(layout.params[i]) not in index:
                    continue
                param = layout.params[i]
                entry = state.setdefault(index[id(param)], dict(full[name][2]))
                for key, value in full[name][1].items():
                    if key not in entry:
                        entry[key] = get_array_module(param.data).zeros(param.data.shape, value.dtype)
                    copy_into(box.view(entry[key]), value[_index(box)])
        # Hyperparameters per group as committed (the groups must be the same: one, usually); indices anew.
        saved = record["optimizer"]["param_groups"]
        fresh = _param_groups(self.optimizer)
        if len(saved) != len(fresh):
            raise RuntimeError(f"State.restore: the optimizer factory made {len(fresh)} parameter groups, the commit "
                               f"has {len(saved)}")
        return {"state": state, "param_groups": [{**old, "params": new["params"]} for old, new in zip(saved, fresh)]}

    # -- roll_forward -------------------------------------------------------------------------------------------
    def unchanged_since_commit(self):
        """Whether the parameters (and so the optimizer's state) are still those of the latest commit: no
        ``optimizer.step()`` since, nor a broadcast into them cut short."""
        return (bool(self._commits) and not self._receiving
                and all(p.version == v for p, v in zip(self._commits[-1]["layout"].params,
                                                        self._commits[-1]["versions"])))

    def _take_newest_commit(self, comm):
        """roll_forward's restore, on every survivor: agree on the newest commit held unchanged; its holder
        broadcasts its parameters, optimizer state and small state; return what happened (for the log)."""
        mine = self._commits[-1]["step"] if self.unchanged_since_commit() else -1
        held = comm.allgather(mine)
        best = max(held)
        if best < 0:
            raise RuntimeError(
                f"State(roll_forward=True) cannot recover: every survivor had taken optimizer.step() after its latest "
                f"commit (steps {comm.allgather(self.committed_step)}) and none committed again before a rank was lost, "
                f"so no one still holds a committed state (a collective after optimizer.step() failed, e.g. a metric's "
                f"allreduce). With roll_forward, issue the step's collectives before optimizer.step(), or use the "
                f"default commits, which keep what they roll back to")
        root = held.index(best)
        params = self._current_layout().params
        if min(held) == best:  # every survivor holds that commit unchanged (replicas are equal): nothing to send
            self.rollback(best)
            return f"roll_forward: the commit of step {best}, which every survivor held unchanged"
        if comm.Get_rank() == root:
            commit = self._commits[-1]
            layout = _optimizer_layout(self.optimizer)
            layout[0]["param_groups"] = commit["optimizer"]["param_groups"]  # the commit's, not lr set since
            comm.bcast((commit["versions"], commit["small"], commit["buffers"], layout[0]), root=root)
        else:
            versions, small, buffers, meta = comm.bcast(None, root=root)
            xp = get_array_module(params[0].data)
            layout = (meta, [xp.empty(shape, dtype) for shape, dtype in _shapes(meta)])
            # Until every array arrived a failure leaves this rank unusable as a root, unless it already held
            # that commit (equal replicas: the bytes it receives are its own).
            self._receiving = mine != best
        for p in params:
            if not p.data.flags.c_contiguous:
                p.data = get_array_module(p.data).ascontiguousarray(p.data)
            collectives.broadcast(p.make_writable(), comm, root=root)
        for array in layout[1]:
            collectives.broadcast(array, comm, root=root)
        if comm.Get_rank() != root:
            self.optimizer.load_state_dict(_optimizer_state(*layout))
            self._commits = [{"id": self._id(best), "step": best, "layout": self._current_layout(), "params": None,
                              "versions": versions, "optimizer": {"param_groups": meta["param_groups"]}, "opt_slots": [],
                              "buffers": buffers, "small": small, "buddies": {}}]
            for p, version in zip(params, versions):
                p.version = version
            self._receiving = False
        self.rollback(best)  # the small state (sampler, generators, schedule, extras, buffers) of that commit
        return f"roll_forward: the commit of step {best}, sent by survivor {root} (survivors held {held}, -1: stepped past)"

    # -- the small state ----------------------------------------------------------------------------------------
    def _save_small(self, buffers):
        small = {
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "rngs": [copy.deepcopy(g.bit_generator.state) for g in self.rngs],
            "nn_rng": copy.deepcopy(nn_random.get_rng_state()),
            "extra": copy.deepcopy(self.extra),
        }
        if buffers is not None:
            small["buffers"] = {name: b.copy() for name, b in buffers.items()}
        return small

    def _load_small(self, small, buffers):
        if self.scheduler is not None and small["scheduler"] is not None:
            self.scheduler.load_state_dict(small["scheduler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(small["sampler"])
        for g, state in zip(self.rngs, small["rngs"]):
            g.bit_generator.state = copy.deepcopy(state)
        nn_random.set_rng_state(copy.deepcopy(small["nn_rng"]))
        self.extra.clear()
        self.extra.update(copy.deepcopy(small["extra"]))
        for name, b in (buffers or {}).items():
            b[...] = small["buffers"][name]

    def _load_buffers(self, values):
        for (name, b), value in zip((self.wrapper or as_wrapper(self.module)).named_buffers_global(), values):
            b[...] = value

    # -- the disk fallback --------------------------------------------------------------------------------------
    def _disk_state(self):
        """The state ``mpidist.checkpoint`` saves and loads: the model, the optimizer, and the small state as JSON.

        The schedule, sampler, generators and extras ride in one JSON entry, encoded by ``mpidist.standard_json``
        (numpy arrays in the extras as raw bytes; tuples come back as lists): a checkpoint holds no pickle, which
        would run code when read. The buffers are saved by name with the model.
        """
        try:
            encoded = standard_json.encode({"step": self.step, **self._save_small(None)}, "State")
        except TypeError as exc:
            raise TypeError(f"{exc}: a disk checkpoint keeps the schedule, sampler, generators and extra as JSON "
                            f"data") from None
        return {"model": self.wrapper, "optim": self.optimizer, "elastic": encoded}

    def _saved_small_state(self, entry, step):
        """Return the small state a checkpoint's ``elastic`` entry holds, decoded and checked."""
        where = f"checkpoint: step {step} in {self.checkpoint}: json['elastic']"
        if isinstance(entry, str):
            raise disk.CheckpointError(f"{where} is a pickled state (written by an older mpidist), which is never "
                                       f"unpickled: unpickling runs code the file chooses; resume from a newer checkpoint")
        try:
            saved = standard_json.decode(entry, "json['elastic']")
        except ValueError as exc:
            raise disk.CheckpointError(f"checkpoint: step {step} in {self.checkpoint}: {exc}") from None
        fields = {"step", "scheduler", "sampler", "rngs", "nn_rng", "extra"}
        if not isinstance(saved, dict) or set(saved) != fields:
            raise disk.CheckpointError(f"{where} must be an object with the fields {sorted(fields)} (got "
                                       f"{sorted(saved) if isinstance(saved, dict) else type(saved).__name__})")
        problems = []
        if isinstance(saved["step"], bool) or not isinstance(saved["step"], int) or saved["step"] < 0:
            problems.append(f"step must be an int >= 0 (got {saved['step']!r:.60})")
        if not isinstance(saved["extra"], dict):
            problems.append(f"extra must be an object (got {type(saved['extra']).__name__})")
        if not isinstance(saved["rngs"], list) or len(saved["rngs"]) != len(self.rngs):
            problems.append(f"rngs must be a list of {len(self.rngs)} generator states (got {saved['rngs']!r:.60})")
        if problems:
            raise disk.CheckpointError(f"{where}: {'; '.join(problems)}")
        return saved

    def _restore_from_disk(self, failure, build, comm, lost):
        """Build over ``comm`` and load the latest disk checkpoint into it (``lost``: the pieces nobody holds)."""
        names = sorted({key[0] for key in lost}) if lost and isinstance(lost[0], tuple) else sorted(lost)
        if self.checkpoint is None:
            raise RuntimeError(_lost_message(lost, self._layout))
        if self.wrapper is not None:
            self.wrapper.remove()
        if self.module is not None and self._layout is not None:  # shapes for the wrapper to take apart
            for name, p in self.module.named_parameters():
                shape, dtype, _ = self._layout.tensors[name]
                if p.placement is None:
                    p.data, p.grad = np.zeros(shape, dtype), None
        built = self._attach(build, comm)
        entries = self._disk_state()
        # A save the failure interrupted left a step directory without a manifest: not a checkpoint, so the load
        # below takes the newest committed one; named in the report so that it is seen to have been passed over.
        incomplete = sorted(set(_step_directories(self.checkpoint)) - set(disk.list_steps(self.checkpoint)))
        step = disk.load(self.checkpoint, entries, comm, log=None)
        if step is None:
            raise RuntimeError(f"State: parameters {names[:6]} had no live holder and {self.checkpoint!r} holds "
                               f"no checkpoint yet")
        saved = self._saved_small_state(entries["elastic"], step)
        try:
            self._load_small(saved, None)
        except (TypeError, ValueError, KeyError) as exc:
            raise disk.CheckpointError(f"checkpoint: step {step} in {self.checkpoint}: json['elastic'] does not "
                                       f"restore ({type(exc).__name__}: {exc})") from None
        self.step = saved["step"]
        self._saved_step = max(self._saved_step, self.step)
        for p in self._layout.params:
            p.grad = None
        self._commits = []
        self._start = None
        failure.restored_from = (f"disk checkpoint of step {self.step} in {self.checkpoint} (no replica of "
                                 f"{len(names)} parameter(s) survived), loaded at {comm.Get_size()} ranks")
        if incomplete:
            failure.restored_from += f"; incomplete save(s) of step(s) {incomplete} passed over"
        self.commit()
        return built


# -- pieces: who holds what, packets, assembling the full tensors -------------------------------------------------
def _own_holding(record):
    """Return ``(pieces, arrays, scalars, versions)`` of this rank's own commit (see ``_pack``)."""
    layout = record["layout"]
    arrays = {(("p", i), None): a for i, a in enumerate(record["params"])}
    arrays.update({(("b", j), None): b for j, b in enumerate(record["buffers"])})
    scalars = {}
    opt = record["optimizer"] or {}
    params = layout.params
    for oi, entry in opt.get("state", {}).items():
        i = record["opt_slots"][oi]
        for key, value in entry.items():
            if hasattr(value, "shape") and value.ndim and tuple(value.shape) == tuple(params[i].data.shape):
                arrays[(("p", i), key)] = value
            else:
                scalars.setdefault(i, {})[key] = value
    versions = dict(enumerate(record["versions"]))
    return [(key, slot, box) for key, slot, box in layout.pieces], arrays, scalars, versions


def _pack(layout, holding):
    """Return ``(meta, packet)``: a holding's arrays as one byte buffer and what is where in it (small, pickled)."""
    pieces, arrays, scalars, versions = holding
    fields, offset = [], 0
    for (slot, key), a in arrays.items():
        a = to_numpy(a)
        # The dtype object, not ``dtype.str``: bfloat16's ``str`` is '<V2', which rebuilds as raw void bytes.
        fields.append((slot, key, tuple(a.shape), a.dtype, offset))
        offset += a.nbytes
    packet = np.empty(offset, np.uint8)
    for (slot, key, shape, dtype, at), a in zip(fields, arrays.values()):
        packet[at:at + to_numpy(a).nbytes] = np.ascontiguousarray(to_numpy(a)).reshape(-1).view(np.uint8)
    return (pieces, fields, scalars, versions), packet


def _unpack(meta, packet):
    """Return the holding a packet and its meta describe (arrays: views of the packet)."""
    pieces, fields, scalars, versions = meta
    arrays = {}
    for slot, key, shape, dtype, at in fields:
        dt = np.dtype(dtype)
        arrays[(slot, key)] = packet[at:at + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
    return pieces, arrays, scalars, versions


def _providers(layout, rank_of):
    """Return ``({piece: (survivor rank, position whose values it sends)}, [pieces without a live holder])``.

    A piece's holders: its natural holders, then the buddies of each (position ``i``'s packet is held by
    ``i+1 .. i+replicas-1``); the first live one provides it."""
    n, providers, lost = len(layout.world), {}, []
    for key in sorted(layout.holders):
        holders = [((i + d) % n, i) for i in layout.holders[key] for d in range(layout.replicas)]
        live = [(rank_of[layout.world[h]], i) for h, i in holders if layout.world[h] in rank_of]
        if live:
            providers[key] = live[0]
        else:
            lost.append(key)
    return providers, lost


def _holding_of(record, position):
    if position == record["layout"].position:
        return _own_holding(record)
    return _unpack(*record["buddies"][position])


def _provide(record, providers, me):
    """Return ``{piece: (values, optimizer arrays, scalars, version)}`` of the pieces this rank provides (all its
    own with ``providers`` None)."""
    out, holdings = {}, {}
    if providers is None:
        wanted = {key: record["layout"].position for key, _, _ in record["layout"].pieces}
    else:
        wanted = {key: source for key, (rank, source) in providers.items() if rank == me}
    for key, source in wanted.items():
        if source not in holdings:
            pieces, arrays, scalars, versions = _holding_of(record, source)
            holdings[source] = ({k: (slot, box) for k, slot, box in pieces}, arrays, scalars, versions)
        by_key, arrays, scalars, versions = holdings[source]
        slot, box = by_key[key]  # views, not copies: read here, or pickled by the allgather
        value = to_numpy(box.view(arrays[(slot, None)]))
        moments = {k: to_numpy(box.view(a)) for (s, k), a in arrays.items() if s == slot and k is not None}
        i = slot[1] if slot[0] == "p" else None
        out[key] = (value, moments, dict(scalars.get(i, {})), versions.get(i, 0))
    return out


def _assemble(layout, parts):
    """Return ``{name: [full array, {optimizer key: full array}, scalars, version]}`` from every provided piece."""
    full = {}
    for part in parts:
        for (name, offsets, sizes), (value, moments, scalars, version) in part.items():
            shape, dtype, _ = layout.tensors[name]
            entry = full.get(name)
            if entry is None and tuple(sizes) == tuple(shape):  # one piece is the whole tensor (DDP): no copy
                full[name] = [value, dict(moments), scalars, version]
                continue
            if entry is None:
                entry = full[name] = [np.empty(shape, dtype), {}, scalars, version]
            where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes)) or ...
            entry[0][where] = value
            for key, moment in moments.items():
                if key not in entry[1]:
                    entry[1][key] = np.zeros(shape, moment.dtype)
                entry[1][key][where] = moment
    return full


def _index(box):
    """The index of ``box`` in its global tensor."""
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes)) or ...


def _groups(layout):
    """Return the distinct holder groups (natural holders of equal pieces), ordered by their first position."""
    return sorted({tuple(h) for h in layout.holders.values()})


def _how(layout, rank_of, size):
    """Return what a restore did, for the log."""
    n = len(layout.world)
    if layout.whole_everywhere:
        return f"in-memory commit held by every survivor, rebuilt {n} -> {size} ranks"
    copies = min(len(h) for h in layout.holders.values())
    gone = sorted(w for w in layout.world if w not in rank_of)
    source = "replicas or buddies" if copies > 1 else "buddies"
    return (f"in-memory commit; pieces of world rank(s) {gone} from their {source}, re-laid out {n} -> {size} ranks"
            + (f" ({len(_groups(layout))} chunks x {copies} replicas before)" if copies > 1 else ""))


def _lost_message(lost, layout):
    """Return the error for pieces nobody alive holds: the first group of positions that held them, named."""
    groups = _groups(layout)
    first = tuple(layout.holders[lost[0]])
    n, world = len(layout.world), layout.world
    what = (f"position {first[0]} (world rank {world[first[0]]})" if len(first) == 1 else
            f"chunk {groups.index(first)} (positions {list(first)}, world ranks {[world[i] for i in first]})")
    holders = [world[(i + d) % n] for i in first for d in range(layout.replicas)]
    names = sorted({key[0] for key in lost})
    return (f"State: the shards of {what} are lost: all {len(holders)} holder(s), world ranks {holders}, failed; use "
            f"more replicas or a disk checkpoint (State(checkpoint=DIR, checkpoint_every=N)); lost: "
            f"{names[:6]}{'...' if len(names) > 6 else ''}")


def _nbytes(arrays):
    return sum(int(a.nbytes) for a in arrays)


def _copy(array, into=None):
    """A copy of ``array``, written into ``into`` when that has the same shape and dtype and is no held array
    (an array a copy-on-write commit held may still be a live parameter)."""
    if (into is not None and getattr(into, "shape", None) == array.shape and into.dtype == array.dtype
            and not optim.is_held(into)):
        into[...] = array
        return into
    return array.copy()


def _param_groups(optimizer):
    """The optimizer's groups as ``state_dict()`` has them (hyperparameters and parameter indices), without
    copying its state arrays."""
    groups, at = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(at, at + n))})
        at += n
    return groups


def _optimizer_layout(optimizer):
    """``(meta, arrays)``: the optimizer's state with each array replaced by ``(shape, dtype)`` (small: sent with
    ``comm.bcast``, between this job's own ranks, never written to a file) and the live arrays themselves in the
    same order (sent as buffers)."""
    state, arrays = {}, []
    for i, s in optimizer.state.items():
        state[i] = {}
        for k, v in s.items():
            if hasattr(v, "shape") and getattr(v, "ndim", 0) > 0:
                arrays.append(get_array_module(v).ascontiguousarray(v))
                v = _ArraySlot(tuple(v.shape), str(v.dtype))
            state[i][k] = v
    return {"state": state, "param_groups": _param_groups(optimizer)}, arrays


class _ArraySlot(collections.namedtuple("_ArraySlot", "shape dtype")):
    """Where ``_optimizer_layout`` took an array out of the optimizer's state (sent apart, as a buffer)."""


def _shapes(meta):
    return [(v.shape, np.dtype(v.dtype)) for s in meta["state"].values() for v in s.values()
            if isinstance(v, _ArraySlot)]


def _optimizer_state(meta, arrays):
    """The state dict of ``_optimizer_layout``'s meta with its arrays put back in order."""
    it = iter(arrays)
    state = {i: {k: next(it) if isinstance(v, _ArraySlot) else v for k, v in s.items()}
             for i, s in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _arrays(commit):
    """The parameter and optimizer arrays of a commit."""
    state = (commit["optimizer"] or {}).get("state", {})
    return list(commit["params"] or ()) + [v for s in state.values() for v in s.values() if hasattr(v, "shape")]


def _optimizer_copy(optimizer, spare=None, hold=False):
    """``optimizer.state_dict()``, its arrays copied into ``spare``'s (an earlier such dict) where they fit, or,
    with ``hold``, the live arrays themselves made read-only (copy-on-write)."""
    old = (spare or {}).get("state", {})
    state = {i: {k: ((optim.hold(v) if hold else _copy(v, old.get(i, {}).get(k))) if hasattr(v, "shape") else v)
                 for k, v in s.items()}
             for i, s in optimizer.state.items()}
    return {"state": state, "param_groups": _param_groups(optimizer)}


def _step_directories(root):
    """Return the steps of every ``step_*`` directory under ``root``, committed (with a manifest) or not."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    return [int(e[5:]) for e in entries
            if e.startswith("step_") and e[5:].isdigit() and os.path.isdir(os.path.join(root, e))]
