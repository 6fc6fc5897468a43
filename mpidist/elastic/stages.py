"""Pipeline and dp x pp mesh state that survives the loss of ranks: a lost stage comes back from a data-parallel
replica when one survives, otherwise from the latest disk checkpoint, at a new layout, without restarting.

Words used here:

- *name*: a parameter's global name, the same whatever the layout: ``Pipeline.placed_parameters()`` names it
  as the unsplit model does (``"blocks.3.attn.qkv.weight"``, ``"3.weight"``), as ``mpidist.checkpoint`` does. A commit keeps this
  rank's parameters and their optimizer arrays by name, locally (no communication).
- *holders*: the world ranks that held each name when the layout was made (one ``allgather`` of names per
  layout). In a dp x pp mesh every stage has ``dp`` holders; with ``dp = 1`` one.
- *commit id*: ``step * ID_SCALE + ranks lost when the layout was made``, as for ``ShardedState``.

A failure: the survivors agree on a commit all of them hold. If every name still has a live holder (the lost
stage has a replica), the lowest live holder of each name sends its committed values (one ``allgather`` of
objects), every survivor then holds the whole committed model and optimizer state, ``build(comm)`` makes the
pipeline for the survivors (its own layout, e.g. dp=2 x pp=2 on 4 ranks, dp=1 x pp=3 on 3), and each rank
loads its new stage by name. If some name has no live holder (a pipeline without replicas), the survivors
load the latest disk checkpoint (``checkpoint=DIR``, written every ``checkpoint_every`` steps through
``mpidist.checkpoint``, which reshards) into the pipeline built over the survivors and go on from its step;
without one, every survivor raises the same ``RuntimeError`` naming the lost parameters. ``failure.restored_from``
says which happened.

Tensor-parallel parameters (placements) are refused (``refuse_tensor_parallel``): a lost slice has no copy.
"""

import os
import time

from mpi4py import MPI

from .. import checkpoint as disk, standard_json
from .fault import failing_save
from ..comm import world_ranks
from .sharded import ID_SCALE, _param_groups
from .state import Replicated, refuse_tensor_parallel

__all__ = ["StageState"]


class StageState(Replicated):
    """The state of pipeline (and dp x pp mesh) training kept in memory by parameter name.

    ``build(comm)`` (given to ``Elastic.train``) must return a ``Pipeline`` over all ranks of ``comm`` whose
    stages are new modules (their values are loaded here). ``optimizer(params)`` and ``scheduler(optimizer)``
    are factories, made again over the new stages after a failure; use ``state.optimizer`` and
    ``state.scheduler`` in the step. ``checkpoint``: a directory for the disk fallback, saved every
    ``checkpoint_every`` steps (collective), used only when a lost stage has no surviving replica.
    """

    def __init__(self, optimizer, scheduler=None, sampler=None, rngs=(), extra=None, checkpoint=None,
                 checkpoint_every=None, keep=2):
        super().__init__(sampler, rngs, extra, keep)
        if not callable(optimizer) or (scheduler is not None and not callable(scheduler)):
            raise TypeError(f"StageState: optimizer and scheduler must be factories, optimizer(params) and "
                            f"scheduler(optimizer) (got {type(optimizer).__name__}, {type(scheduler).__name__})")
        if (checkpoint is None) != (checkpoint_every is None):
            raise ValueError(f"StageState: give checkpoint and checkpoint_every together (got checkpoint="
                             f"{checkpoint!r}, checkpoint_every={checkpoint_every!r})")
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1):
            raise ValueError(f"StageState: checkpoint_every must be an int >= 1 (got {checkpoint_every!r})")
        self._make_optimizer, self._make_scheduler = optimizer, scheduler
        self.checkpoint, self.checkpoint_every = checkpoint, checkpoint_every
        self.optimizer = self.scheduler = self.wrapper = self.comm = None
        self._named = {}     # name -> this rank's Parameter
        self._holders = {}   # name -> world ranks holding it in this layout
        self._world = None
        self._saved_step = -1  # newest step saved to disk: a step restored or replayed is not saved again

    def held_bytes(self):
        """Bytes of the kept commits' parameter and optimizer arrays on this rank."""
        return sum(v.nbytes for c in self._commits for entry in c["values"].values()
                   for v in (entry[0], *entry[1].values()))

    # -- building -------------------------------------------------------------------------------------------
    def start(self, build, comm):
        """Build the pipeline over ``comm`` and make the optimizer and schedule over its stages."""
        self._remember_start([])  # building again from it makes the same stages on every survivor
        return self._attach(build, comm)

    def cannot_start_again(self):
        return None  # build(comm) makes new stages from the start each time: build them again over the survivors

    def forget_commits(self):
        """Back to where training started (a rank lost before the first commit completed everywhere): the small
        state (sampler, generators, extras) returns to what it was before the first build, on every survivor
        alike; the stages are built anew."""
        self._back_to_start([])  # buffers: the new stages' own
        self.wrapper = self.optimizer = self.scheduler = None

    def _attach(self, build, comm):
        wrapper = build(comm)
        if wrapper.comm.Get_size() * (1 if wrapper.dp_comm is None else wrapper.dp_comm.Get_size()) != comm.Get_size():
            raise ValueError(f"StageState: build(comm) must use all {comm.Get_size()} ranks (pipeline of "
                             f"{wrapper.comm.Get_size()} x {1 if wrapper.dp_comm is None else wrapper.dp_comm.Get_size()} replicas)")
        self.wrapper, self.comm = wrapper, comm
        self._world = world_ranks(comm)
        self._named = {}
        for placed in wrapper.placed_parameters():  # a further copy of a tied weight under the tied weight's name
            self._named[placed.name] = placed.parameter
        refuse_tensor_parallel(list(self._named.items()), "StageState")
        self._buffers = [b for _, b in wrapper.named_buffers_global()]
        everyone = comm.allgather(sorted(self._named))
        self._holders = {}
        for world_rank, names in zip(self._world, everyone):
            for name in names:
                self._holders.setdefault(name, []).append(world_rank)
        self.optimizer = self._make_optimizer(list(wrapper.parameters()))
        self.scheduler = None if self._make_scheduler is None else self._make_scheduler(self.optimizer)
        return wrapper

    def _names_of_optimizer(self):
        by_id = {id(p): name for name, p in self._named.items()}
        return [by_id[id(p)] for p in self.optimizer.params]

    # -- commit ---------------------------------------------------------------------------------------------
    def commit(self):
        """Copy this rank's stage parameters and optimizer state by name (local); save to disk when due."""
        step_id = self.step * ID_SCALE + (MPI.COMM_WORLD.Get_size() - len(self._world))
        if self._commits and self._commits[-1]["id"] == step_id:
            return
        start = time.perf_counter()
        values = {}
        for i, name in enumerate(self._names_of_optimizer()):
            state = self.optimizer.state.get(i, {})
            values[name] = (self._named[name].data.copy(),
                            {k: v.copy() for k, v in state.items() if hasattr(v, "shape")},
                            {k: v for k, v in state.items() if not hasattr(v, "shape")})
        self._commits.append({"id": step_id, "step": self.step, "holders": self._holders, "values": values,
                              "param_groups": _param_groups(self.optimizer),
                              "replicated": self._save_replicated(self.scheduler, self._buffers)})
        del self._commits[:-self.keep]
        self.stats["commits"] += 1
        self.stats["commit_s"] += time.perf_counter() - start
        self.stats["commit_bytes"] = self.held_bytes() // len(self._commits)
        if self.checkpoint is not None and self.step % self.checkpoint_every == 0 and self.step > self._saved_step:
            with failing_save(self.faults, MPI.COMM_WORLD.Get_rank(), self.step):
                disk.save(self.checkpoint, self._disk_state(), self.comm, self.step)
            self._saved_step = self.step

    def _disk_state(self):
        """The state ``mpidist.checkpoint`` saves and loads: the stages, the optimizer, and the small state as JSON.

        The schedule, sampler, generators and extras ride in one JSON entry, encoded by ``mpidist.standard_json``
        (numpy arrays in the extras as raw bytes; tuples come back as lists): a checkpoint holds no pickle, which
        would run code when read. The buffers are the stages' own, saved by name with the model.
        """
        small = self._save_replicated(self.scheduler, [])
        del small["buffers"]
        try:
            encoded = standard_json.encode({"step": self.step, **small}, "StageState")
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
        return {**saved, "buffers": []}

    # -- restore --------------------------------------------------------------------------------------------
    def restore(self, failure, build, comm):
        """Restore the agreed commit over ``comm`` from replicas, or the latest disk checkpoint if a stage is gone."""
        where = [c for c in self._commits if c["id"] == failure.commit]
        if not where:
            raise RuntimeError(f"StageState.restore: no commit with id {failure.commit} is held (held: "
                               f"{[c['id'] for c in self._commits]})")
        record = where[0]
        del self._commits[self._commits.index(record) + 1:]
        alive = world_ranks(comm)
        rank_of = {w: r for r, w in enumerate(alive)}
        lost = sorted(name for name, holders in record["holders"].items() if not any(w in rank_of for w in holders))
        if lost:
            return self._restore_from_disk(failure, build, comm, lost)
        provider = {name: min(rank_of[w] for w in holders if w in rank_of) for name, holders in record["holders"].items()}
        me = comm.Get_rank()
        full = {}
        for part in comm.allgather({name: v for name, v in record["values"].items() if provider[name] == me}):
            full.update(part)
        self._load_replicated(record["replicated"], None, [])
        wrapper = self._attach(build, comm)
        for name, p in self._named.items():
            p.data[...] = full[name][0]
            p.grad = None
        state = {}
        for i, name in enumerate(self._names_of_optimizer()):
            arrays, scalars = full[name][1], full[name][2]
            if arrays or scalars:
                state[i] = {**scalars, **{k: v.copy() for k, v in arrays.items()}}
        # Hyperparameters per group as committed (the groups must be the same: one, usually); indices anew.
        saved, fresh = record["param_groups"], _param_groups(self.optimizer)
        if len(saved) != len(fresh):
            raise RuntimeError(f"StageState.restore: the optimizer factory made {len(fresh)} parameter groups, the "
                               f"commit has {len(saved)}")
        groups = [{**old, "params": new["params"]} for old, new in zip(saved, fresh)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        self._load_replicated(record["replicated"], self.scheduler, self._buffers)
        self.step = record["step"]
        replicas = sorted({w for holders in record["holders"].values() for w in holders if w in rank_of})
        failure.restored_from = (f"in-memory commit; lost stages from their data-parallel replicas, re-split over "
                                 f"{comm.Get_size()} ranks (world {replicas})")
        self.commit()
        return wrapper

    def _restore_from_disk(self, failure, build, comm, lost):
        if self.checkpoint is None:
            raise RuntimeError(f"StageState: parameters {lost[:6]}{'...' if len(lost) > 6 else ''} had no live holder "
                               f"(no data-parallel replica survived) and no disk checkpoint was configured "
                               f"(StageState(checkpoint=DIR, checkpoint_every=N))")
        wrapper = self._attach(build, comm)
        entries = self._disk_state()
        # A save the failure interrupted left a step directory without a manifest: not a checkpoint, so the load
        # below takes the newest committed one; named in the report so that it is seen to have been passed over.
        incomplete = sorted(set(_step_directories(self.checkpoint)) - set(disk.list_steps(self.checkpoint)))
        step = disk.load(self.checkpoint, entries, comm, log=None)
        if step is None:
            raise RuntimeError(f"StageState: parameters {lost[:6]} had no live holder and {self.checkpoint!r} holds "
                               f"no checkpoint yet")
        saved = self._saved_small_state(entries["elastic"], step)
        try:
            self._load_replicated(saved, self.scheduler, self._buffers)
        except (TypeError, ValueError, KeyError) as exc:
            raise disk.CheckpointError(f"checkpoint: step {step} in {self.checkpoint}: json['elastic'] does not "
                                       f"restore ({type(exc).__name__}: {exc})") from None
        self.step = saved["step"]
        self._saved_step = max(self._saved_step, self.step)
        for p in self._named.values():
            p.grad = None
        self._commits = []
        failure.restored_from = (f"disk checkpoint of step {self.step} in {self.checkpoint} (no replica of "
                                 f"{len(lost)} parameter(s) survived), loaded at {comm.Get_size()} ranks")
        if incomplete:
            failure.restored_from += f"; incomplete save(s) of step(s) {incomplete} passed over"
        self.commit()
        return wrapper


def _step_directories(root):
    """Return the steps of every ``step_*`` directory under ``root``, committed (with a manifest) or not."""
    try:
        entries = os.listdir(root)
    except OSError:
        return []
    return [int(e[5:]) for e in entries
            if e.startswith("step_") and e[5:].isdigit() and os.path.isdir(os.path.join(root, e))]
