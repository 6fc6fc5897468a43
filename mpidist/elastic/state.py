"""The training state kept in memory at each commit, so that survivors roll back instead of restarting.

A commit keeps, on every rank (DDP: every rank holds the full state): parameters (values and ``version``,
which DDP's step check compares), buffers, the optimizer's and the LR schedule's state, the sampler's
position, the given numpy Generators and mpidist's default generator, and a user ``extra`` dict. The last
``keep`` commits are held (two by default): ranks can be one commit apart when a failure strikes, and the
survivors roll back to the older one that all of them hold.

The optimizer's parameters and its state arrays are kept without a copy where the optimizer is ``copy_on_write``
(SGD, Adam, AdamW; a subclass with its own update must declare it) and the arrays are numpy: the commit makes
the live arrays read-only (``optim.hold``) and keeps them, and the next step writes its new values into other
buffers (recycled from the commit dropped, see ``Optimizer.recycle``). Anything else that writes into a parameter in place between commits then fails with
numpy's "read-only" error instead of silently changing a commit. Other optimizers, and CuPy arrays, are copied.

``State(..., roll_forward=True)`` keeps no parameter or optimizer array at all: a commit records the small state
and the parameters' ``version`` counters, and the optimizer updates in place. This relies on DDP's replicas being
equal: after a failure every survivor says whether its parameters are still those of its latest commit (no
``optimizer.step()`` since), the newest such commit wins, and its holder broadcasts it to the others (a survivor
a step ahead carries the others forward; one that had stepped past its commit is brought back to a survivor's
older one). It cannot recover when every survivor had taken ``optimizer.step()`` since its latest commit and
then lost a rank before committing again, i.e. when the step has a collective after ``optimizer.step()`` that
fails: it then says so on every survivor. Commits cost nothing but that small state; put the step's collectives
(a metric's allreduce) before ``optimizer.step()``.
"""

import collections
import copy
import time

import numpy as np

from .. import collectives, optim
from ..nn import random as nn_random
from ..nn.placement import Shard, placement_of
from ..xp import get_array_module

__all__ = ["State", "Replicated"]


class Replicated:
    """What every rank holds whole and equal: LR schedule, sampler position, RNG streams, buffers, user extras.

    The base of the three states (``State``, ``ShardedState``, ``StageState``); ``step`` counts the steps
    taken, and ``stats`` what the in-memory copies cost (commits, seconds, bytes of the latest).
    """

    def __init__(self, sampler=None, rngs=(), extra=None, keep=2):
        if keep < 2:
            raise ValueError(f"{type(self).__name__}: keep must be >= 2 (got {keep}): survivors may need the "
                             f"commit before the last")
        self.sampler = sampler
        self.rngs = list(rngs)
        self.extra = {} if extra is None else extra
        self.keep = keep
        self.step = 0
        self.faults = ()  # MPIDIST_FAULT's faults (Elastic.train sets them): at=save ones fire inside disk saves
        self.stats = {"commits": 0, "commit_s": 0.0, "commit_bytes": 0}
        self._commits = []  # the kept commits, oldest first: dicts with at least "id" and "step"
        self._start_replicated = None  # the small state before the first build (states that start again from it)

    @property
    def committed_id(self):
        """What the survivors agree on (Elastic.guard): the latest commit's id (None before the first)."""
        return self._commits[-1]["id"] if self._commits else None

    @property
    def committed_step(self):
        """The step of the latest commit (None before the first)."""
        return self._commits[-1]["step"] if self._commits else None

    def cannot_start_again(self):
        """Why this state cannot be started again after a failure before its first commit (None: it can)."""
        return (f"{type(self).__name__} cannot start again over fewer ranks: building its wrapper took the model "
                f"apart (into shards or stages), so there is no state to return to")

    def forget_commits(self):
        """Drop every commit (a failure before the first commit completed on every rank: start again)."""
        self._commits.clear()

    def _remember_start(self, buffers):
        """Keep the small state as it is before the first build (mpidist's default generator included, which
        layers built without an rng draw from), for ``_back_to_start``."""
        if self._start_replicated is None and not self._commits:
            self._start_replicated = self._save_replicated(None, buffers)

    def _back_to_start(self, buffers):
        """Start again over the survivors: the small state of before the first build, on every survivor alike
        (ranks that took the first commit and ranks that did not), no commits, step 0."""
        self._load_replicated(self._start_replicated, None, buffers)
        Replicated.forget_commits(self)
        self.step = 0

    def _save_replicated(self, scheduler, buffers):
        return {
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "buffers": [b.copy() for b in buffers],
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "rngs": [copy.deepcopy(g.bit_generator.state) for g in self.rngs],
            "nn_rng": copy.deepcopy(nn_random.get_rng_state()),
            "extra": copy.deepcopy(self.extra),
        }

    def _load_replicated(self, saved, scheduler, buffers):
        for b, value in zip(buffers, saved["buffers"]):
            b[...] = value
        if scheduler is not None:
            scheduler.load_state_dict(saved["scheduler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"])
        for g, state in zip(self.rngs, saved["rngs"]):
            g.bit_generator.state = copy.deepcopy(state)
        nn_random.set_rng_state(copy.deepcopy(saved["nn_rng"]))
        self.extra.clear()
        self.extra.update(copy.deepcopy(saved["extra"]))


def refuse_tensor_parallel(named, owner):
    """Raise NotImplementedError naming the parameters split over a tensor-parallel communicator.

    Recovery rebuilds the wrappers over the survivors from whole parameters; a tensor-parallel slice lost with
    its rank has no copy anywhere, and the layout of the survivors' slices would have to change.
    """
    sharded = [name for name, p in named if isinstance(placement_of(p), Shard)]
    if sharded:
        raise NotImplementedError(f"{owner}: tensor-parallel parameters are not supported in elastic training yet "
                                  f"({len(sharded)} split over a tensor-parallel communicator, e.g. "
                                  f"{', '.join(sharded[:3])}); use DDP, FSDP or a pipeline without tensor parallelism")


class State(Replicated):
    """Everything a DDP step changes, with ``commit()`` and ``rollback(step)`` in memory.

    ``step`` counts the steps taken (the commit id is the ``step`` it was taken at). ``roll_forward``: commits
    keep no arrays; after a failure the survivors continue from the newest commit one of them still holds
    unchanged (see the module's docstring for what that requires; a commit after every step).
    """

    def __init__(self, module, optimizer=None, scheduler=None, sampler=None, rngs=(), extra=None, keep=2,
                 roll_forward=False):
        super().__init__(sampler, rngs, extra, keep)
        if roll_forward and optimizer is None:
            raise ValueError("State(roll_forward=True) needs the optimizer: it keeps no copy of the parameters, so "
                             "the optimizer's step must be the only thing that changes them between commits")
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.roll_forward = bool(roll_forward)
        self._receiving = False  # roll_forward: parameters half overwritten by a broadcast a failure cut short
        named = list(module.named_parameters())
        refuse_tensor_parallel(named, "State")
        self._params = [p for _, p in named]
        self._buffers = [b for _, b in module.named_buffers()]

    committed_id = Replicated.committed_step  # a DDP commit is known by its step

    @property
    def committed_steps(self):
        return [c["step"] for c in self._commits]

    def held_bytes(self):
        """Bytes of the kept commits' parameter and optimizer arrays on this rank."""
        return sum(sum(a.nbytes for a in c["params"] or ()) + sum(v.nbytes for s in (c["optimizer"] or {}).get("state", {}).values()
                                                            for v in s.values() if hasattr(v, "nbytes"))
                   for c in self._commits)

    def start(self, build, comm):
        """Return the first wrapper, ``build(comm)`` (``Elastic.train`` calls this)."""
        return build(comm)

    def cannot_start_again(self):
        return None  # DDP leaves the module whole: building again over the survivors re-broadcasts it

    def forget_commits(self):
        """Drop every commit, back to the first one if this rank took it (it may have gone on into step 0:
        parameters, sampler and generators moved); parameters a commit held move to writable copies."""
        if self._commits:
            self.rollback(self._commits[0]["step"])
        super().forget_commits()
        self._receiving = False
        for p in self._params:
            p.make_writable()

    def restore(self, failure, build, comm):
        """Roll back to the agreed commit (or, ``roll_forward``, take the newest commit a survivor holds
        unchanged) and build the wrapper over the survivors (``Elastic.train``)."""
        if self.roll_forward:
            failure.restored_from = self._take_newest_commit(comm)
        else:
            self.rollback(failure.commit)
        return build(comm)

    def unchanged_since_commit(self):
        """Whether the parameters (and so the optimizer's state) are still those of the latest commit: no
        ``optimizer.step()`` since, nor a broadcast into them cut short."""
        return (bool(self._commits) and not self._receiving
                and all(p.version == v for p, v in zip(self._params, self._commits[-1]["versions"])))

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
        if min(held) == best:  # every survivor holds that commit unchanged (replicas are equal): nothing to send
            self.rollback(best)
            return f"roll_forward: the commit of step {best}, which every survivor held unchanged"
        if comm.Get_rank() == root:
            commit = self._commits[-1]
            layout = _optimizer_layout(self.optimizer)
            layout[0]["param_groups"] = commit["optimizer"]["param_groups"]  # the commit's, not lr set since
            comm.bcast((commit["versions"], commit["replicated"], layout[0]), root=root)
        else:
            versions, replicated, meta = comm.bcast(None, root=root)
            xp = get_array_module(self._params[0].data)
            layout = (meta, [xp.empty(shape, dtype) for shape, dtype in _shapes(meta)])
            # Until every array arrived a failure leaves this rank unusable as a root, unless it already held
            # that commit (equal replicas: the bytes it receives are its own).
            self._receiving = mine != best
        for p in self._params:
            if not p.data.flags.c_contiguous:
                p.data = get_array_module(p.data).ascontiguousarray(p.data)
            collectives.broadcast(p.make_writable(), comm, root=root)
        for array in layout[1]:
            collectives.broadcast(array, comm, root=root)
        if comm.Get_rank() != root:
            self.optimizer.load_state_dict(_optimizer_state(*layout))
            self._commits = [{"step": best, "params": None, "versions": versions,
                              "optimizer": {"param_groups": meta["param_groups"]}, "replicated": replicated}]
            for p, version in zip(self._params, versions):
                p.version = version
            self._receiving = False
        self.rollback(best)  # the small state (sampler, generators, schedule, extras, buffers) of that commit
        return f"roll_forward: the commit of step {best}, sent by survivor {root} (survivors held {held}, -1: stepped past)"

    def _holds(self):
        """Whether commits hold the live arrays (copy-on-write, see the module's docstring) instead of copying."""
        # Without a copy-on-write optimizer something else updates the parameters (in place, say): copy.
        return (getattr(self.optimizer, "copy_on_write", False)
                and all(optim.can_hold(p.data) for p in self._params))

    def commit(self):
        """Keep the state as it is now (after a completed step)."""
        if self._commits and self._commits[-1]["step"] == self.step:
            return
        start = time.perf_counter()
        # The commit about to be dropped lends its arrays (no fresh pages per commit on large models): ranks are
        # at most one commit apart, so nobody can need it once this rank commits again.
        spare = self._commits.pop(0) if len(self._commits) >= self.keep else None
        if self.roll_forward:
            # Nothing kept but the hyperparameters: the survivors take the newest commit one of them holds unchanged.
            params, opt = None, {"param_groups": copy.deepcopy(_param_groups(self.optimizer))}
        elif self._holds():
            # The optimizer's parameters are held; others (frozen, or updated by other code) are copied.
            owned = {id(p) for p in self.optimizer.params}
            params = [optim.hold(p.data) if id(p) in owned else _copy(p.data, spare and spare["params"][i])
                      for i, p in enumerate(self._params)]
            opt = None if self.optimizer is None else _optimizer_copy(self.optimizer, hold=True)
            if spare is not None and self.optimizer is not None:
                self.optimizer.recycle(_arrays(spare), [a for c in self._commits for a in _arrays(c)] + params)
        else:
            params = [_copy(p.data, spare and spare["params"][i]) for i, p in enumerate(self._params)]
            opt = None if self.optimizer is None else _optimizer_copy(self.optimizer, spare and spare["optimizer"])
        snapshot = {
            "step": self.step,
            "params": params,
            "versions": [p.version for p in self._params],
            "optimizer": opt,
            "replicated": self._save_replicated(self.scheduler, self._buffers),
        }
        self._commits.append(snapshot)
        self.stats["commits"] += 1
        self.stats["commit_s"] += time.perf_counter() - start
        self.stats["commit_bytes"] = self.held_bytes() // len(self._commits)

    def rollback(self, step):
        """Restore the commit of ``step`` in place (the optimizer keeps its parameters); drop later commits."""
        where = [i for i, c in enumerate(self._commits) if c["step"] == step]
        if not where:
            raise RuntimeError(f"State.rollback: no commit of step {step} is held (held: {self.committed_steps}); "
                               f"the ranks drifted further apart than keep={self.keep} commits")
        snapshot = self._commits[where[0]]
        if snapshot["params"] is None:  # roll_forward: only the latest commit, while nothing changed since
            if where[0] != len(self._commits) - 1 or not self.unchanged_since_commit():
                raise RuntimeError(f"State.rollback: roll_forward commits keep no copy of the parameters, which "
                                   f"changed since the commit of step {step} (latest: {self.committed_step}); "
                                   f"only the survivors' restore can bring them back")
            for p in self._params:
                p.grad = None
            self.optimizer.zero_grad()
            for group, saved in zip(self.optimizer.param_groups, snapshot["optimizer"]["param_groups"]):
                group.update(copy.deepcopy({k: v for k, v in saved.items() if k != "params"}))  # lr set by hand
            self._load_replicated(snapshot["replicated"], self.scheduler, self._buffers)
            self.step = step
            return
        del self._commits[where[0] + 1:]
        for p, value, version in zip(self._params, snapshot["params"], snapshot["versions"]):
            if optim.is_held(p.data):
                p.data = value.copy()  # held by a commit (copy-on-write): a fresh array, the commit stays as it is
            else:
                p.data[...] = value  # in place: the optimizer's flat views of the parameters stay valid
            p.version = version
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.load_state_dict(snapshot["optimizer"])
            self.optimizer.zero_grad()
        self._load_replicated(snapshot["replicated"], self.scheduler, self._buffers)
        self.step = step


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
    copying its state arrays; ``ShardedState`` uses it too."""
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
    return list(commit["params"]) + [v for s in state.values() for v in s.values() if hasattr(v, "shape")]


def _optimizer_copy(optimizer, spare=None, hold=False):
    """``optimizer.state_dict()``, its arrays copied into ``spare``'s (an earlier such dict) where they fit, or,
    with ``hold``, the live arrays themselves made read-only (copy-on-write)."""
    old = (spare or {}).get("state", {})
    state = {i: {k: ((optim.hold(v) if hold else _copy(v, old.get(i, {}).get(k))) if hasattr(v, "shape") else v)
                 for k, v in s.items()}
             for i, s in optimizer.state.items()}
    return {"state": state, "param_groups": _param_groups(optimizer)}
