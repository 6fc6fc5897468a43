"""Run a pipeline schedule: one training step's forwards and backwards over all micro-batches.

Glossary (see schedules.py for stage, rank, micro-batch, bubble)
- pipeline comm: the communicator whose ranks are the pipeline positions 0..p-1; model stage s runs on rank s % p.
- chunk: one of the v stage modules a rank holds (v > 1 only for interleaved schedules); chunk c is stage c*p + r.
- boundary message: what crosses a stage boundary for one micro-batch: forward, the tuple of a stage's outputs
  (activations; integer arrays such as token ids included); backward, one gradient (or None) per output.
- stage inputs: the leaves a stage's forward starts from. A received floating-point activation that needed a
  gradient upstream becomes ``nn.Tensor(array, requires_grad=True)``; anything else (the first stage's batch,
  integer arrays) a plain Tensor. The inputs' ``.grad`` after backward is what travels upstream.
- saved micro-batch: (stage inputs, stage outputs) kept from F until B; the outputs hold the autograd graph.
- B/W split (zero-bubble schedules): B is ``nn.backward_input`` (the inputs' gradients now, sent upstream at once),
  W is ``DeferredWeightGrads.run()`` (the parameter gradients, later). Generic over modules: any stage built from
  autograd ops splits, and W does the real weight-gradient work (the matmuls of ``dW = dy^T x``).

Communication follows the model of schedules.py: sends are nonblocking (handles kept until they complete or
the step ends), receives are blocking. A boundary message travels as a small manifest (one code per entry:
array needing a gradient, array, or None) followed by each array as its own message, all on one tag that
encodes (direction, receiving stage, micro-batch) and all stamped (step, micro-batch): messages on one tag
between two ranks do not overtake each other, and a message can only match the receive it was meant for.
Arrays travel separately (not packed into one buffer) so that device arrays keep the GPU paths of collectives.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from mpidist import collectives
from mpidist.comm import check_comm
from mpidist.comm.agree import check_same, raise_if_any
from mpidist.comm.mesh import DeviceMesh
from mpidist.guard import DesyncError
from mpidist.nn.autograd import Tensor, backward, backward_input, no_grad
from mpidist.nn.deferred import materialize
from mpidist.nn.module import Module, Sequential
from mpidist.nn.placement import placement_of
from mpidist.partition import split_sizes
from mpidist.trace import recorder as _trace
from mpidist.xp import asarray_like, is_device_array

from ..interface import PlacedParameter, Wrapper, dimensions, placement_comms, refuse_mesh
from .tied import TiedParameters
from .schedules import (Action, Kind, Schedule, gpipe, insert_comms, interleaved_1f1b, one_f_one_b,
                        simulate_schedule, validate, zero_bubble_h1)

__all__ = ["Pipeline", "StepStats", "SCHEDULES"]

# Schedule names accepted by Pipeline; "interleaved" takes v from the number of stage modules.
SCHEDULES: Dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved_1f1b,
    "zb_h1": lambda p, m, v: zero_bubble_h1(p, m),
}

# MPI guarantees tags up to 32767 on every implementation; staying below it keeps tags portable.
_MAX_TAG = 32767


def _groups_of_mesh(mesh, dp_comm):
    """Return (pipeline comm, data-parallel comm or None) of ``mesh``; raise on every rank if it does not fit."""
    names, problem = mesh.names, None
    if len(names) != 1 and ("pp" not in names or set(names) - {"dp", "pp", "tp"}):
        problem = (f"a mesh must have one dimension (the pipeline) or a dimension 'pp' and besides it only 'dp' "
                   f"(replicas) and 'tp' (tensor parallel inside stages) (got {dimensions(mesh)})")
    elif "dp" in names and dp_comm is not None:
        problem = f"the mesh ({dimensions(mesh)}) gives the data-parallel ranks: pass no dp_comm with it"
    refuse_mesh(mesh, problem, "Pipeline")
    if len(names) == 1:
        return mesh[names[0]], dp_comm
    return mesh["pp"], (mesh["dp"] if "dp" in names and mesh.size("dp") > 1 else None)


@dataclass(frozen=True)
class StepStats:
    """What this rank did during the last `Pipeline.step`.

    compute_s: time in F, B and W (module forward/backward, loss, weight-gradient accumulation).
    idle_s: time blocked in receives and in waiting for sends to complete (the bubble, plus transfer time).
    wall_s: the whole step, including the start-of-step input check and, with dp_comm, the gradient sync.
    peak_activations: most saved micro-batches at once (F done, B not yet), summed over this rank's chunks,
    sampled after every compute action.
    peak_pending_w: most backwards whose W had not run yet (0 for schedules without a B/W split); each keeps the
    graph pieces that lead to parameters (and the tensors they saved) until its W.
    """

    compute_s: float
    idle_s: float
    wall_s: float
    peak_activations: int
    peak_pending_w: int


class Pipeline(Wrapper):
    """Pipeline-parallel training step over the ranks of `comm`, following a schedule.

    comm: the pipeline communicator, or a ``DeviceMesh``: 1-D (its one dimension is the pipeline), or with a
    dimension "pp" (the pipeline), optionally "dp" (data-parallel replicas: as ``dp_comm``, not given too) and
    "tp" (tensor parallelism inside the stages, read from their placements), e.g. ``mpidist.mesh(comm, dp, pp,
    tp)``. Other dimensions raise on every rank naming them.

    stage: this rank's module, or the list of its v chunks (stages r, r + p, ...) for "interleaved". A stage is
    called as ``stage(*inputs)`` and returns a Tensor or a tuple of Tensors, which the next stage receives as
    its positional arguments (the first stage gets the batch: an array or a tuple of arrays).
    num_microbatches: m; a batch of any size >= m is split along axis 0 into m parts differing by at most one.
    schedule: "gpipe", "1f1b", "interleaved", "zb_h1", or a `Schedule` (with or without send/recv actions).
    loss_fn: called as ``loss_fn(last stage's output, targets)`` and returning a scalar Tensor (a
    `mpidist.nn.Loss`, or any function); required on the rank holding the last stage.
    dp_comm: data-parallel communicator (same pipeline position in every replica, see ``mpidist.mesh``);
    each chunk is wrapped in DDP and its gradients are averaged over replicas after the schedule.
    tied_parameters: this rank's copies of weights that several stages hold (a GPT's token embedding on the
    first stage and its tied head on the last): a list of Parameters (one shared weight) or a dict
    ``name -> list`` (several), with the same names on every rank and an empty list where a rank holds no copy.
    Built collectively; after each step every copy's gradient is the sum over all copies, so equal copies stay
    equal, and ``clip_grad_norm_`` counts the shared weight once.

    Sizes, in the schedules' notation: ``num_ranks`` (p, the pipeline comm's size), ``num_microbatches`` (m),
    ``chunks_per_rank`` (v, stage modules per rank), ``num_stages`` (p * v).

    As a ``Wrapper`` (``mpidist.parallel.interface``), ``placed_parameters()`` names this rank's parameters as the
    unsplit model does, worked out once at construction:
    - a ``Sequential`` stage built with ``names`` (``GPT.pipeline_stages``: "embed", "blocks.3", "head") names
      child i's parameters ``f"{names[i]}.{name}"``;
    - otherwise the unsplit model is taken to be ``Sequential(*all layers)``, stage after stage (a Sequential
      stage's children are layers, any other stage module one layer): layer i's parameters are ``f"{i}.{name}"``,
      the same however the layers are cut (a checkpoint saved with 2 stages loads with 3, or into that model).
    A tied weight's copies all take the name of the copy earliest in the unsplit model (the stage first, then
    the position in it: a GPT's embedding weight); the other copies are ``primary=False``. ``mesh`` is the mesh
    given, else ``comm`` as dimension "pp", or with ``dp_comm`` the dimensions ("dp", "pp") with ``mesh.comm`` None
    (the layout spans two communicators, none of which holds it all).
    """

    def __init__(self, stage, comm, num_microbatches: int, schedule: Union[str, Schedule] = "1f1b",
                 loss_fn=None, dp_comm=None, tied_parameters=None):
        given = comm if isinstance(comm, DeviceMesh) else None
        if given is not None:
            comm, dp_comm = _groups_of_mesh(given, dp_comm)
        self.comm = check_comm("Pipeline", comm)
        if dp_comm is not None:
            check_comm("Pipeline (dp_comm)", dp_comm)
        self.rank, self.num_ranks = comm.Get_rank(), comm.Get_size()
        self.stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        # Agree before anything else: a rank that raised alone would leave the others blocked in a receive.
        raise_if_any(comm, self._check_stages(), "Pipeline", TypeError)
        raise_if_any(comm, self._check_arguments(schedule), "Pipeline")
        # Ranks with different settings would exchange messages meant for other micro-batches or stages.
        tied = self._tied_groups(tied_parameters)
        check_same(comm, self._settings(schedule, dp_comm) + [("tied parameters", sorted(tied))],
                   "Pipeline: ranks were built with different settings", what="setting")
        self.tied = [TiedParameters(comm, params, name) for name, params in sorted(tied.items())]
        for module in self.stages:  # deferred (mpidist.nn.deferred): each stage draws its own layers, no more
            materialize(module)
        if given is not None and (len(given.names) > 1 or dp_comm is None):
            self.mesh = given
        else:  # a communicator (or 1-D mesh) and a dp_comm: no one communicator holds both
            self.mesh = (DeviceMesh.from_comm(comm, "pp") if dp_comm is None
                         else DeviceMesh.from_dimensions({"dp": dp_comm, "pp": comm}))
        self._placed, self._buffer_layers = self._place_parameters()
        self._syncing = True  # False inside no_sync()
        self.schedule = self._resolve(schedule)
        self.chunks_per_rank = self.schedule.v
        self.num_stages = self.schedule.num_stages
        self.last_stage = self.num_stages - 1
        self.actions: Tuple[Action, ...] = self.schedule.actions[self.rank]
        self.dp_comm = dp_comm
        self._ddp = None
        if dp_comm is not None:
            try:
                from mpidist.parallel.ddp import DDP
            except ImportError as exc:
                raise ImportError(f"Pipeline: dp_comm needs mpidist.parallel.ddp.DDP, which failed to import "
                                  f"({exc})") from exc
            self._ddp = [DDP(s, dp_comm) for s in self.stages]
        self.stats: Optional[StepStats] = None
        self._bubble_formula: Optional[float] = None  # computed when a traced step first needs it
        self._step_number = 0  # steps started; every boundary message is stamped (step, micro-batch)

    # -- construction ------------------------------------------------------------------------------------------

    def _check_stages(self) -> Optional[str]:
        """Return this rank's first stage module that is not a module (called, with parameters()), or None."""
        for i, module in enumerate(self.stages):
            if not callable(module) or not callable(getattr(module, "parameters", None)):
                which = f"stage module {i}" if len(self.stages) > 1 else "stage"
                return (f"Pipeline: {which} must be a module, called as stage(*inputs) and with parameters() (got "
                        f"{type(module).__name__})")
        return None

    def _check_arguments(self, schedule) -> Optional[str]:
        """Return this rank's first problem with the constructor arguments as a message, or None."""
        m, v, p = self.num_microbatches, len(self.stages), self.num_ranks
        if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 1:
            return f"Pipeline: num_microbatches must be an int >= 1 (got {m!r})"
        if isinstance(schedule, Schedule):
            if (schedule.p, schedule.m, schedule.v) != (p, m, v):
                return (f"Pipeline: schedule {schedule.name} is for p={schedule.p}, m={schedule.m}, v={schedule.v} "
                        f"but this pipeline has p={p} ranks, m={m} micro-batches and v={v} stage modules")
        elif not isinstance(schedule, str) or schedule not in SCHEDULES:
            return f"Pipeline: unknown schedule {schedule!r} (expected one of {sorted(SCHEDULES)} or a Schedule)"
        elif schedule == "interleaved" and v < 2:
            return (f"Pipeline: schedule 'interleaved' needs a list of v >= 2 stage modules on each rank "
                    f"(stages r, r + p, ...; got {v})")
        elif schedule != "interleaved" and v != 1:
            return (f"Pipeline: schedule {schedule!r} runs one stage module per rank (got {v}); "
                    f"use schedule='interleaved' for several")
        if 2 * m * p * v > _MAX_TAG:
            return (f"Pipeline: {m} micro-batches x {p * v} stages need tags up to {2 * m * p * v}, above the "
                    f"portable MPI limit {_MAX_TAG}; use fewer micro-batches")
        if self.rank == (p * v - 1) % p and self.loss_fn is None:
            return f"Pipeline: rank {self.rank} holds the last stage ({p * v - 1}) and needs loss_fn (got None)"
        return None

    def _place_parameters(self):
        """Return (this rank's PlacedParameters in the unsplit model's order, [(prefix, layer)] for buffers).

        Collective over the pipeline comm (one allgather): earlier stages' layer counts number unnamed layers,
        and every rank learns where each tied weight's copies are, so all agree on the primary copy.
        """
        counts = self.comm.allgather([len(_layers(module)) for module in self.stages])
        p = self.num_ranks
        per_stage = [counts[s % p][s // p] for s in range(p * len(self.stages))]
        entries, layers = [], []  # entries: (stage, name, parameter, placement, primary)
        for chunk, module in enumerate(self.stages):
            stage = chunk * p + self.rank
            first = sum(per_stage[:stage])
            names = module.names if isinstance(module, Sequential) else None
            prefixes = ([f"{n}." for n in names] if names is not None
                        else [f"{first + i}." for i in range(len(_layers(module)))])
            seen = set()
            for prefix, layer in zip(prefixes, _layers(module)):
                layers.append((prefix, layer))
                for name, param, placement, primary in _layer_parameters(layer):
                    if id(param) not in seen:
                        seen.add(id(param))
                        entries.append((stage, prefix + name, param, placement, primary))
        position = {id(e[2]): (e[0], i) for i, e in enumerate(entries)}
        missing = [f"{group.name!r}" for group in self.tied for q in group.params if id(q) not in position]
        raise_if_any(self.comm, f"Pipeline: tied parameter {missing[0]} has a copy on rank {self.rank} that no stage "
                                f"module of that rank holds" if missing else None, "Pipeline")
        # Each tied weight: (stage, index, name) of every copy on every rank; the smallest is the primary.
        copies = self.comm.allgather([[(*position[id(q)], entries[position[id(q)][1]][1]) for q in group.params]
                                      for group in self.tied])
        renamed = {}  # id(copy) -> the primary's name, for this rank's non-primary copies
        for g, group in enumerate(self.tied):
            primary = min((c for rank_copies in copies for c in rank_copies[g]), default=None)
            for q in group.params:
                stage, index = position[id(q)]
                if (stage, index, entries[index][1]) != primary:
                    renamed[id(q)] = primary[2]
        placed = tuple(PlacedParameter(renamed.get(id(param), name), param, placement, stage,
                                       primary and id(param) not in renamed)
                       for stage, name, param, placement, primary in entries)
        return placed, layers

    @staticmethod
    def _tied_groups(tied_parameters) -> Dict[str, list]:
        if tied_parameters is None:
            return {}
        if isinstance(tied_parameters, dict):
            return {str(k): list(v) for k, v in tied_parameters.items()}
        return {"tied": list(tied_parameters)}

    def _settings(self, schedule, dp_comm):
        """What every pipeline rank must agree on: schedule, micro-batches, stages, data-parallel replicas."""
        if isinstance(schedule, Schedule):
            actions = hashlib.blake2b(repr(schedule.actions).encode(), digest_size=6).hexdigest()
            schedule = f"Schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, v={schedule.v}, actions {actions})"
        return [("schedule", schedule), ("num_microbatches", self.num_microbatches),
                ("stage modules per rank", len(self.stages)),
                ("data-parallel replicas", 1 if dp_comm is None else dp_comm.Get_size())]

    def _resolve(self, schedule) -> Schedule:
        p, m, v = self.num_ranks, self.num_microbatches, len(self.stages)
        if not isinstance(schedule, Schedule):
            return insert_comms(SCHEDULES[schedule](p, m, v))
        if not schedule.has_comms:
            schedule = insert_comms(schedule)
        validate(schedule)
        simulate_schedule(schedule)  # raises ScheduleDeadlockError instead of hanging the ranks
        return schedule

    # -- the step ----------------------------------------------------------------------------------------------

    def step(self, inputs=None, targets=None, broadcast_loss: bool = False) -> Optional[float]:
        """Run forward and backward of every micro-batch; return the batch-mean loss on the last stage.

        Gradients accumulate into `param.grad` (zero them and step the optimizer yourself). `inputs` (an array,
        or a tuple of arrays of one batch size, passed to the first stage as its arguments) is read on rank 0
        and `targets` (an array or a tuple of arrays) on the rank of the last stage; other ranks may pass
        anything. With dp_comm the loss is the mean over replicas and the gradients are averaged over
        replicas. With broadcast_loss every rank returns the loss.
        """
        return self._execute(self.actions, inputs, targets, broadcast_loss, "Pipeline.step", training=True)

    def evaluate(self, inputs=None, targets=None, broadcast_loss: bool = False) -> Optional[float]:
        """Run the forwards only, without autograd, and return the batch-mean loss as `step` does.

        For validation: no gradient is touched and no activation is kept. Every rank runs its stages' forwards
        in stage order, micro-batch by micro-batch; the modules run in whatever mode they are in (call
        ``eval()`` on the stage modules to switch off dropout). Collective like `step`, and counted in the same
        step sequence (its messages are stamped, so a rank that evaluates while another trains fails clearly).
        """
        if self._forward_actions is None:
            p, m, v = self.num_ranks, self.num_microbatches, self.chunks_per_rank
            rows = [[Action(s, Kind.F, k) for s in range(r, self.num_stages, p) for k in range(m)]
                    for r in range(p)]
            forward_only = insert_comms(Schedule(f"{self.schedule.name} forward-only", p, m, v,
                                                 rows))
            self._forward_actions = forward_only.actions[self.rank]
        with no_grad():
            return self._execute(self._forward_actions, inputs, targets, broadcast_loss, "Pipeline.evaluate",
                                 training=False)

    _forward_actions: Optional[Tuple[Action, ...]] = None

    def _execute(self, actions, inputs, targets, broadcast_loss, name, training):
        t_start = time.perf_counter()
        traced_from = time.monotonic() if _trace.on else None
        x_mbs, y_mbs, error = self._split_batch(inputs, targets, name)
        raise_if_any(self.comm, error, name)
        self._step_number += 1
        self._compute = self._idle = 0.0
        self._peak = self._peak_w = 0
        self._sends: List[collectives.Handle] = []
        # (kind, stage, mb) -> boundary message consumed by that stage: F, the activations it takes (with
        # whether each needs a gradient); B, the gradients of its outputs.
        self._inbox: Dict[Tuple[str, int, int], _Message] = {}
        self._saved: Dict[Tuple[int, int], Tuple[tuple, tuple]] = {}  # (stage, mb) -> (inputs, outputs), F to B
        self._pending_w: Dict[Tuple[int, int], object] = {}  # (stage, mb) -> DeferredWeightGrads, B to W
        self._x_mbs, self._y_mbs = x_mbs, y_mbs
        self._loss = 0.0
        if y_mbs is not None:
            n_total = sum(_batch_len(y) for y in y_mbs)
            # Micro-batch losses are means over their own samples: weighting each by its share of the batch
            # makes the summed gradients those of the full-batch mean (also for uneven splits).
            self._loss_scales = ([1.0] * self.num_microbatches if getattr(self.loss_fn, "reduction", "mean") == "sum"
                                 else [_batch_len(y) / n_total for y in y_mbs])

        self._training = training
        with self._no_sync():
            for action in actions:
                self._run(action)
                self._sends = [h for h in self._sends if not h.test()]
        t0 = time.perf_counter()
        for handle in self._sends:
            handle.wait()
        self._idle += time.perf_counter() - t0
        self._sends, self._inbox, self._saved, self._x_mbs, self._y_mbs = [], {}, {}, None, None
        if training and self._syncing:
            self.sync_gradients()

        holds_loss = self.rank == self.schedule.rank_of(self.last_stage)
        loss = self._loss if holds_loss else None
        if holds_loss and self.dp_comm is not None:
            # dp_comm joins the last stages of all replicas, so only they take part.
            loss = float(collectives.allreduce(np.array([loss]), self.dp_comm, op="mean")[0])
        if broadcast_loss:
            buf = np.array([loss if holds_loss else 0.0])
            loss = float(collectives.broadcast(buf, self.comm, root=self.schedule.rank_of(self.last_stage))[0])
        if not training:
            return loss
        self.stats = StepStats(self._compute, self._idle, time.perf_counter() - t_start, self._peak, self._peak_w)
        if traced_from is not None and _trace.on:
            self._trace_step(traced_from)
        return loss

    def _trace_step(self, began):
        """Record this step for ``mpidist trace summary``: its span, and the bubble its schedule predicts."""
        if self._bubble_formula is None:
            # Uniform costs, F = 1 and B + W = 2 per stage (halved per chunk when interleaved): the formulas'
            # setting, e.g. (p-1)/(m+p-1) for GPipe and 1F1B.
            v = self.chunks_per_rank
            self._bubble_formula = simulate_schedule(self.schedule, 1.0 / v, 2.0 / v).bubble_fraction
        _trace.add(_trace.COMPUTE, "pipeline step", f"{self.schedule.name} step {self._step_number}", began,
                   time.monotonic(), {"step": self._step_number, "pipeline": _trace.pipeline_number(self),
                                      "schedule": self.schedule.name, "p": self.num_ranks,
                                      "m": self.num_microbatches, "v": self.chunks_per_rank,
                                      "bubble_formula": self._bubble_formula})

    def _split_batch(self, inputs, targets, name="Pipeline.step"):
        """Return (input micro-batches or None, target micro-batches or None, this rank's error or None)."""
        x_mbs = y_mbs = None
        n_inputs = None
        if self.rank == 0:
            if inputs is None:
                return None, None, f"{name}: rank 0 runs the first stage and needs inputs (got None)"
            n_inputs, error = _check_batch("inputs", inputs)
            if error is not None:
                return None, None, error
            if n_inputs < self.num_microbatches:
                return None, None, (f"{name}: batch of {n_inputs} is smaller than the number of "
                                    f"micro-batches ({self.num_microbatches})")
            x_mbs = _split(inputs, self.num_microbatches)
        if self.rank == self.schedule.rank_of(self.last_stage):
            if targets is None:
                return None, None, (f"{name}: rank {self.rank} runs the last stage and needs targets "
                                    f"(got None)")
            n_targets, error = _check_batch("targets", targets)
            if error is not None:
                return None, None, error
            if n_targets < self.num_microbatches:
                return None, None, (f"{name}: batch of {n_targets} targets is smaller than the "
                                    f"number of micro-batches ({self.num_microbatches})")
            if n_inputs is not None and n_targets != n_inputs:
                return None, None, (f"{name}: inputs and targets differ in batch size "
                                    f"({n_inputs} vs {n_targets})")
            y_mbs = _split(targets, self.num_microbatches)
        return x_mbs, y_mbs, None

    def _run(self, a: Action) -> None:
        kind, s, k = a.kind, a.stage, a.mb
        if kind is Kind.RECV_F:
            self._inbox[("F", s, k)] = self._recv(s - 1, _tag(0, s, k, self.num_stages), k)
        elif kind is Kind.RECV_B:
            self._inbox[("B", s, k)] = self._recv(s + 1, _tag(1, s, k, self.num_stages), k)
        elif kind is Kind.SEND_F:
            self._send(self._inbox.pop(("F", s + 1, k)), s + 1, _tag(0, s + 1, k, self.num_stages), k)
        elif kind is Kind.SEND_B:
            self._send(self._inbox.pop(("B", s - 1, k)), s - 1, _tag(1, s - 1, k, self.num_stages), k)
        else:
            t0 = time.perf_counter()
            traced_from = time.monotonic() if _trace.on else None
            {Kind.F: self._forward, Kind.B: self._backward, Kind.W: self._weight}[kind](s, k)
            self._compute += time.perf_counter() - t0
            if traced_from is not None and _trace.on:
                _trace.add(_trace.COMPUTE, "pipeline", str(a), traced_from, time.monotonic(),
                           {"kind": kind.value, "stage": s, "microbatch": k, "step": self._step_number,
                            "pipeline": _trace.pipeline_number(self)})
            self._peak = max(self._peak, len(self._saved))
            self._peak_w = max(self._peak_w, len(self._pending_w))

    def _forward(self, s: int, k: int) -> None:
        if s == 0:
            batch = self._x_mbs[k]
            inputs = tuple(Tensor(a) for a in (batch if isinstance(batch, tuple) else (batch,)))
        else:
            message = self._inbox.pop(("F", s, k))
            # Fresh leaves: the previous stage's graph ends at its outputs; this stage's backward stops here
            # and hands the leaves' gradients upstream.
            inputs = tuple(Tensor(a, requires_grad=needs) for a, needs in zip(message.arrays, message.needs_grad))
        out = self._module(s)(*inputs)
        outputs = _as_outputs(s, out)
        if s == self.last_stage:
            loss = self.loss_fn(out, self._y_mbs[k])
            if not isinstance(loss, Tensor) or loss.size != 1 or (self._training and not loss.requires_grad):
                got = (f"shape {loss.shape}, requires_grad={loss.requires_grad}" if isinstance(loss, Tensor)
                       else type(loss).__name__)
                raise TypeError(f"Pipeline: loss_fn must return a scalar Tensor that requires grad (got {got})")
            self._loss += float(loss) * self._loss_scales[k]
            outputs = (loss,)
        else:
            # Sent by SEND_F, or consumed here when stage s+1 is local.
            self._inbox[("F", s + 1, k)] = _Message(tuple(t.data for t in outputs),
                                                    tuple(t.requires_grad for t in outputs))
        if self._training:
            self._saved[(s, k)] = (inputs, outputs)

    def _backward(self, s: int, k: int) -> None:
        inputs, outputs = self._saved.pop((s, k))
        if s == self.last_stage:
            grads = (self._loss_scales[k],)
        else:
            grads = self._inbox.pop(("B", s, k)).arrays
            if len(grads) != len(outputs):
                raise ValueError(f"Pipeline: stage {s} returned {len(outputs)} outputs for micro-batch {k} but "
                                 f"stage {s + 1} sent back {len(grads)} gradients")
        # Outputs that need no gradient (integer arrays passed on) or got none (unused downstream) end here.
        seeded = [(t, g) for t, g in zip(outputs, grads) if g is not None and t.requires_grad]
        leaves = [t for t in inputs if t.requires_grad]
        input_grads = [None] * len(leaves)
        if not self.schedule.split_backward:
            if seeded:
                backward([t for t, _ in seeded], [g for _, g in seeded])
                input_grads = [t.grad for t in leaves]
        else:
            deferred = None
            if seeded:
                input_grads, deferred = backward_input([t for t, _ in seeded], [g for _, g in seeded], leaves)
            self._pending_w[(s, k)] = deferred
        if s > 0:
            by_leaf = dict(zip(map(id, leaves), input_grads))
            self._inbox[("B", s - 1, k)] = _Message(tuple(by_leaf.get(id(t)) for t in inputs))

    def _weight(self, s: int, k: int) -> None:
        deferred = self._pending_w.pop((s, k))
        if deferred is not None:
            deferred.run()

    # -- the Wrapper interface ------------------------------------------------------------------------------------

    def placed_parameters(self):
        """Return this rank's parameters under the unsplit model's names, with their stage and placement."""
        return self._placed

    def named_buffers_global(self):
        """Yield (unsplit name, array) for the buffers of this rank's layers (named as their parameters)."""
        for prefix, layer in self._buffer_layers:
            if isinstance(layer, Wrapper):
                named = layer.named_buffers_global()
            elif isinstance(layer, Module):
                named = layer.named_buffers()
            else:
                named = ()
            for name, array in named:
                yield prefix + name, array

    def communicators(self):
        """Return dp_comm (when given) and the communicators of the tied weights' holders this rank is one of."""
        own = tuple(c for group in self.tied for c in group.communicators())
        return own if self.dp_comm is None else (self.dp_comm, *own)

    def grad_norm_comms(self):
        """Return the placements' communicators (tensor parallel), then the pipeline comm: stages are disjoint."""
        return (*placement_comms(self._placed), self.comm)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally over the steps in the block: no data-parallel average, no tied-weight sum.

        The first ``step`` after the block (or ``sync_gradients()``) reduces the accumulated sums."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def sync_gradients(self):
        """Average gradients over dp_comm, then sum each tied weight's copies (collective; ``step`` calls it)."""
        for ddp in self._ddp or ():
            ddp.sync_gradients()
        for group in self.tied:  # after the replicas' average: sum of averages = average of sums
            group.allreduce_grads()

    def remove(self):
        """Remove the gradient hooks of the DDPs wrapping the stages (with dp_comm), without communicating."""
        for ddp in self._ddp or ():
            ddp.remove()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _module(self, s: int):
        """Return the module that runs stage s (its DDP wrapper when data-parallel)."""
        chunk = s // self.num_ranks
        return self._ddp[chunk] if self._ddp is not None else self.stages[chunk]

    def _no_sync(self):
        stack = contextlib.ExitStack()
        for ddp in self._ddp or ():
            stack.enter_context(ddp.no_sync())
        return stack

    def _recv(self, stage: int, tag: int, mb: int) -> "_Message":
        t0 = time.perf_counter()
        source = self.schedule.rank_of(stage)
        try:
            manifest = self._recv_array(source, tag, mb)
            arrays = tuple(None if code == _NONE else self._to_stage_device(
                self._recv_array(source, tag, mb)) for code in manifest.tolist())
        except DesyncError as exc:
            raise DesyncError(f"Pipeline.step {self._step_number}: rank {self.rank} expected micro-batch {mb} of this "
                              f"step from rank {source} (stage {stage}), but the ranks are at "
                              f"different steps (a rank skipped or repeated step(), or continued after an error "
                              f"inside one): {exc}") from None
        self._idle += time.perf_counter() - t0
        return _Message(arrays, tuple(code == _NEEDS_GRAD for code in manifest.tolist()))

    def _recv_array(self, source: int, tag: int, mb: int):
        return collectives.recv(source, self.comm, tag=tag, stamp=(self._step_number, mb))

    def _send(self, message: "_Message", stage: int, tag: int, mb: int) -> None:
        dest, stamp = self.schedule.rank_of(stage), (self._step_number, mb)
        manifest = np.array([_NONE if a is None else (_NEEDS_GRAD if needs else _ARRAY)
                             for a, needs in zip(message.arrays, message.needs_grad)], dtype=np.int64)
        for array in (manifest, *(a for a in message.arrays if a is not None)):  # bfloat16 as its bits (wire)
            self._sends.append(collectives.isend(array, dest, self.comm, tag=tag, stamp=stamp))

    def _to_stage_device(self, x):
        """Move a received host array to where this rank's parameters live (a no-op for numpy stages)."""
        for stage in self.stages:
            for param in stage.parameters():
                return asarray_like(x, param.data) if is_device_array(param.data) else x
        return x


# Manifest codes of a boundary message's entries.
_NONE, _NEEDS_GRAD, _ARRAY = 0, 1, 2


@dataclass(frozen=True)
class _Message:
    """One boundary message: its arrays (None where a gradient is absent) and, forward, which need a gradient."""

    arrays: tuple
    needs_grad: tuple = ()

    def __post_init__(self):
        if not self.needs_grad:
            object.__setattr__(self, "needs_grad", (False,) * len(self.arrays))


def _as_outputs(s: int, out) -> tuple:
    """Return a stage's output as a tuple of Tensors (arrays are wrapped; they need no gradient)."""
    items = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not items:
        raise TypeError(f"Pipeline: stage {s} returned an empty {type(out).__name__}; return a Tensor or a "
                        f"tuple of Tensors")
    outputs = []
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            if not (hasattr(t, "__array_interface__") or hasattr(t, "__cuda_array_interface__")):
                raise TypeError(f"Pipeline: stage {s} output {i} is a {type(t).__name__}; a stage returns a "
                                f"Tensor, an array or a tuple of them")
            t = Tensor(t)
        outputs.append(t)
    return tuple(outputs)


def _layers(module) -> list:
    """Return the layers a stage module contributes to the unsplit model: a Sequential's children, else itself."""
    return list(module) if isinstance(module, Sequential) else [module]


def _layer_parameters(layer):
    """Yield (name in the layer, Parameter, placement, primary) for a Module, a Wrapper or another stage object."""
    if isinstance(layer, Wrapper):
        for placed in layer.placed_parameters():
            yield placed.name, placed.parameter, placed.placement, placed.primary
    elif isinstance(layer, Module):
        for name, param in layer.named_parameters():
            yield name, param, placement_of(param), True
    else:  # an object with parameters() only (a stage contract's minimum): numbered
        for j, param in enumerate(layer.parameters()):
            yield str(j), param, placement_of(param), True


def _tag(direction: int, stage: int, mb: int, num_stages: int) -> int:
    """Tag of the boundary tensor travelling to `stage` for micro-batch `mb` (direction 0: forward, 1: backward)."""
    return 2 * (mb * num_stages + stage) + direction


def _batch_len(batch) -> int:
    return len(batch[0]) if isinstance(batch, tuple) else len(batch)


def _check_batch(name: str, batch):
    """Return (batch size, None) or (None, error) for an array or a tuple of arrays of one batch size."""
    items = batch if isinstance(batch, tuple) else (batch,)
    if not items:
        return None, f"Pipeline.step: {name} is an empty tuple"
    sizes = [len(a) for a in items]
    if len(set(sizes)) > 1:
        return None, f"Pipeline.step: the {name} arrays differ in batch size (axis 0 lengths: {sizes})"
    return sizes[0], None


def _split(batch, m: int) -> List:
    """Split an array (or each array of a tuple) along axis 0 into m parts differing by at most one."""
    items = batch if isinstance(batch, tuple) else (batch,)
    bounds = np.cumsum([0] + split_sizes(len(items[0]), m))
    parts = [tuple(a[int(lo):int(hi)] for a in items) for lo, hi in zip(bounds[:-1], bounds[1:])]
    return parts if isinstance(batch, tuple) else [p[0] for p in parts]
