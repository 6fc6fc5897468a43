"""Run a pipeline schedule: one training step's forwards and backwards over all micro-batches.

Glossary (see schedules.py for stage, rank, micro-batch, bubble)
- pipeline comm: the communicator whose ranks are the pipeline positions 0..p-1; model stage s runs on rank s % p.
- chunk: one of the v stage modules a rank holds (v > 1 only for interleaved schedules); chunk c is stage c*p + r.
- boundary tensor: a stage's output activation (travelling forward) or its input gradient (travelling back).
- B/W split: in zero-bubble schedules B produces the input gradient (sent upstream at once) and W produces the
  weight gradients. A module may implement the split itself (`backward_input(dy, mb)` -> dx and
  `backward_weight(mb)`); for any other module B runs the whole `backward` with every parameter-gradient
  accumulation captured, and W adds the captured gradients into `param.grad` (firing its grad-ready hooks).
  That keeps ZB-H1's order and gradients exact but makes W nearly free, so only modules with the split
  protocol see ZB-H1's shorter bubble.

Communication follows the model of schedules.py: sends are nonblocking (handles kept until they complete or
the step ends), receives are blocking. Each message's tag encodes (kind, receiving stage, micro-batch), so a
message can only match the receive it was meant for.
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
from mpidist.guard import DesyncError
from mpidist.partition import split_sizes
from mpidist.nn.module import Sequential
from mpidist.nn.utils import clip_grad_norm_
from mpidist.xp import asarray_like, is_device_array

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


@dataclass(frozen=True)
class StepStats:
    """What this rank did during the last `Pipeline.step`.

    compute_s: time in F, B and W (module forward/backward, loss, weight-gradient accumulation).
    idle_s: time blocked in receives and in waiting for sends to complete (the bubble, plus transfer time).
    wall_s: the whole step, including the start-of-step input check and, with dp_comm, the gradient sync.
    peak_activations: most micro-batches with saved activations at once, summed over this rank's chunks
    (`stage.num_inflight()`, sampled after every compute action).
    peak_pending_w: most backwards whose W had not run yet (0 for schedules without a B/W split).
    """

    compute_s: float
    idle_s: float
    wall_s: float
    peak_activations: int
    peak_pending_w: int


class Pipeline:
    """Pipeline-parallel training step over the ranks of `comm`, following a schedule.

    stage: this rank's module, or the list of its v chunks (stages r, r + p, ...) for "interleaved".
    num_microbatches: m; a batch of any size >= m is split along axis 0 into m parts differing by at most one.
    schedule: "gpipe", "1f1b", "interleaved", "zb_h1", or a `Schedule` (with or without send/recv actions).
    loss_fn: a `mpidist.nn.Loss`; required on the rank holding the last stage.
    dp_comm: data-parallel communicator (same pipeline position in every replica, see `mpidist.parallel.mesh`);
    each chunk is wrapped in DDP and its gradients are averaged over replicas after the schedule.
    """

    def __init__(self, stage, comm, num_microbatches: int, schedule: Union[str, Schedule] = "1f1b",
                 loss_fn=None, dp_comm=None):
        self.comm = check_comm("Pipeline", comm)
        if dp_comm is not None:
            check_comm("Pipeline (dp_comm)", dp_comm)
        self.rank, self.p = comm.Get_rank(), comm.Get_size()
        self.stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
        self.loss_fn = loss_fn
        self.m = num_microbatches
        error = self._check_arguments(schedule)
        # Agree before anything else: a rank that raised alone would leave the others blocked in a receive.
        raise_if_any(comm, error, "Pipeline")
        # Ranks with different settings would exchange messages meant for other micro-batches or stages.
        check_same(comm, self._settings(schedule, dp_comm), "Pipeline: ranks were built with different settings",
                   what="setting")
        self.schedule = self._resolve(schedule)
        self.v = self.schedule.v
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
        self._step_number = 0  # steps started; every boundary message is stamped (step, micro-batch)

    # -- construction ------------------------------------------------------------------------------------------

    def _check_arguments(self, schedule) -> Optional[str]:
        """Return this rank's first problem with the constructor arguments as a message, or None."""
        m, v, p = self.m, len(self.stages), self.p
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

    def _settings(self, schedule, dp_comm):
        """What every pipeline rank must agree on: schedule, micro-batches, stages, data-parallel replicas."""
        if isinstance(schedule, Schedule):
            actions = hashlib.blake2b(repr(schedule.actions).encode(), digest_size=6).hexdigest()
            schedule = f"Schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, v={schedule.v}, actions {actions})"
        return [("schedule", schedule), ("num_microbatches", self.m), ("stage modules per rank", len(self.stages)),
                ("data-parallel replicas", 1 if dp_comm is None else dp_comm.Get_size())]

    def _resolve(self, schedule) -> Schedule:
        p, m, v = self.p, self.m, len(self.stages)
        if not isinstance(schedule, Schedule):
            return insert_comms(SCHEDULES[schedule](p, m, v))
        if not schedule.has_comms:
            schedule = insert_comms(schedule)
        validate(schedule)
        simulate_schedule(schedule)  # raises DeadlockError instead of hanging the ranks
        return schedule

    # -- the step ----------------------------------------------------------------------------------------------

    def step(self, inputs=None, targets=None, broadcast_loss: bool = False) -> Optional[float]:
        """Run forward and backward of every micro-batch; return the batch-mean loss on the last stage.

        Gradients accumulate into `param.grad` (zero them and step the optimizer yourself). `inputs` is read on
        rank 0 and `targets` on the rank of the last stage; other ranks may pass anything. With dp_comm the loss
        is the mean over replicas and the gradients are averaged over replicas. With broadcast_loss every rank
        returns the loss.
        """
        t_start = time.perf_counter()
        x_mbs, y_mbs, error = self._split_batch(inputs, targets)
        raise_if_any(self.comm, error, "Pipeline.step")
        self._step_number += 1
        self._compute = self._idle = 0.0
        self._peak = self._peak_w = 0
        self._sends: List[collectives.Handle] = []
        self._inbox: Dict[Tuple[str, int, int], object] = {}  # (kind, stage, mb) -> tensor consumed by that stage
        self._pending_w: Dict[Tuple[int, int], list] = {}  # (stage, mb) -> captured (param, grad) pairs
        self._x_mbs, self._y_mbs = x_mbs, y_mbs
        self._loss = 0.0
        n_total = sum(len(y) for y in y_mbs) if y_mbs is not None else 0
        self._loss_scales = ([1.0] * self.m if getattr(self.loss_fn, "reduction", "mean") == "sum"
                             else [len(y) / n_total for y in y_mbs]) if y_mbs is not None else None

        with self._no_sync():
            for action in self.actions:
                self._run(action)
                self._sends = [h for h in self._sends if not h.test()]
        t0 = time.perf_counter()
        for handle in self._sends:
            handle.wait()
        self._idle += time.perf_counter() - t0
        self._sends, self._inbox, self._x_mbs, self._y_mbs = [], {}, None, None
        if self._ddp is not None:
            for ddp in self._ddp:
                ddp.sync_gradients()

        holds_loss = self.rank == self.schedule.rank_of(self.last_stage)
        loss = self._loss if holds_loss else None
        if holds_loss and self.dp_comm is not None:
            # dp_comm joins the last stages of all replicas, so only they take part.
            loss = float(collectives.allreduce(np.array([loss]), self.dp_comm, op="mean")[0])
        if broadcast_loss:
            buf = np.array([loss if holds_loss else 0.0])
            loss = float(collectives.broadcast(buf, self.comm, root=self.schedule.rank_of(self.last_stage))[0])
        self.stats = StepStats(self._compute, self._idle, time.perf_counter() - t_start, self._peak, self._peak_w)
        return loss

    def _split_batch(self, inputs, targets):
        """Return (input micro-batches or None, target micro-batches or None, this rank's error or None)."""
        x_mbs = y_mbs = None
        if self.rank == 0:
            if inputs is None:
                return None, None, "Pipeline.step: rank 0 runs the first stage and needs inputs (got None)"
            if len(inputs) < self.m:
                return None, None, (f"Pipeline.step: batch of {len(inputs)} is smaller than the number of "
                                    f"micro-batches ({self.m})")
            x_mbs = _split(inputs, self.m)
        if self.rank == self.schedule.rank_of(self.last_stage):
            if targets is None:
                return None, None, (f"Pipeline.step: rank {self.rank} runs the last stage and needs targets "
                                    f"(got None)")
            if len(targets) < self.m:
                return None, None, (f"Pipeline.step: batch of {len(targets)} targets is smaller than the "
                                    f"number of micro-batches ({self.m})")
            if self.rank == 0 and len(targets) != len(inputs):
                return None, None, (f"Pipeline.step: inputs and targets differ in batch size "
                                    f"({len(inputs)} vs {len(targets)})")
            y_mbs = _split(targets, self.m)
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
            {Kind.F: self._forward, Kind.B: self._backward, Kind.W: self._weight}[kind](s, k)
            self._compute += time.perf_counter() - t0
            self._peak = max(self._peak, sum(st.num_inflight() for st in self.stages))
            self._peak_w = max(self._peak_w, len(self._pending_w))

    def _forward(self, s: int, k: int) -> None:
        x = self._x_mbs[k] if s == 0 else self._inbox.pop(("F", s, k))
        y = self._module(s).forward(x, mb=k)
        if s == self.last_stage:
            self._loss += float(self.loss_fn(y, self._y_mbs[k], mb=k)) * self._loss_scales[k]
        else:
            self._inbox[("F", s + 1, k)] = y  # sent by SEND_F, or consumed here when stage s+1 is local

    def _backward(self, s: int, k: int) -> None:
        if s == self.last_stage:
            dy = self.loss_fn.backward(mb=k, scale=self._loss_scales[k])
        else:
            dy = self._inbox.pop(("B", s, k))
        raw = self.stages[s // self.p]
        if not self.schedule.split_backward:
            dx = self._module(s).backward(dy, mb=k)
        elif hasattr(raw, "backward_input"):
            dx = raw.backward_input(dy, mb=k)
            self._pending_w[(s, k)] = None
        else:
            captured = []
            with _capture_param_grads(raw, captured):
                dx = self._module(s).backward(dy, mb=k)
            self._pending_w[(s, k)] = captured
        if s > 0:
            self._inbox[("B", s - 1, k)] = dx

    def _weight(self, s: int, k: int) -> None:
        captured = self._pending_w.pop((s, k))
        if captured is None:
            self.stages[s // self.p].backward_weight(mb=k)
        else:
            for param, grad in captured:
                param.accumulate_grad(grad)

    def parameters(self):
        """Yield the parameters of every stage module on this rank (what its optimizer steps)."""
        for stage in self.stages:
            yield from stage.parameters()

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False) -> float:
        """Clip the gradients of the whole pipelined model to global norm ``max_norm``; return the norm before.

        Collective over the pipeline's ranks: each holds other stages, so they add up their
        contributions. Replicas of a mesh hold the same averaged gradients and get the same result.
        """
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.comm, error_if_nonfinite)

    # Global index of the first layer of each chunk on this rank (see checkpoint_modules); found once.
    _layer_offsets: Optional[List[int]] = None

    def checkpoint_modules(self) -> List[Tuple[str, object]]:
        """Return ("<i>.", layer) for this rank's layers, numbered as in the unsplit model (collective the first time).

        The unsplit model is the stages in stage order, each `Sequential` stage contributing its children and any
        other stage module counting as one layer; layer i is named "i.". So the names are those of
        `nn.Sequential(*all_layers)`, the same however the layers are split into stages (a checkpoint saved with
        2 stages loads with 3, or into the plain model). Counting the earlier stages' layers takes one allgather
        over the pipeline comm, on the first call only: call it on every rank (`mpidist.checkpoint` does).
        """
        if self._layer_offsets is None:
            counts = self.comm.allgather([len(_layers(module)) for module in self.stages])
            per_stage = [counts[self.schedule.rank_of(s)][s // self.p] for s in range(self.num_stages)]
            self._layer_offsets = [sum(per_stage[:c * self.p + self.rank]) for c in range(len(self.stages))]
        return [(f"{first + i}.", layer) for first, module in zip(self._layer_offsets, self.stages)
                for i, layer in enumerate(_layers(module))]

    # -- helpers -----------------------------------------------------------------------------------------------

    def _module(self, s: int):
        """Return the module that runs stage s (its DDP wrapper when data-parallel)."""
        chunk = s // self.p
        return self._ddp[chunk] if self._ddp is not None else self.stages[chunk]

    def _no_sync(self):
        stack = contextlib.ExitStack()
        for ddp in self._ddp or ():
            stack.enter_context(ddp.no_sync())
        return stack

    def _recv(self, stage: int, tag: int, mb: int):
        t0 = time.perf_counter()
        try:
            x = collectives.recv(self.schedule.rank_of(stage), self.comm, tag=tag, stamp=(self._step_number, mb))
        except DesyncError as exc:
            raise DesyncError(f"Pipeline.step {self._step_number}: rank {self.rank} expected micro-batch {mb} of this "
                              f"step from rank {self.schedule.rank_of(stage)} (stage {stage}), but the ranks are at "
                              f"different steps (a rank skipped or repeated step(), or continued after an error "
                              f"inside one): {exc}") from None
        self._idle += time.perf_counter() - t0
        return self._to_stage_device(x)

    def _send(self, x, stage: int, tag: int, mb: int) -> None:
        self._sends.append(collectives.isend(x, self.schedule.rank_of(stage), self.comm, tag=tag,
                                             stamp=(self._step_number, mb)))

    def _to_stage_device(self, x):
        """Move a received host array to where this rank's parameters live (a no-op for numpy stages)."""
        for stage in self.stages:
            for param in stage.parameters():
                return asarray_like(x, param.data) if is_device_array(param.data) else x
        return x


def _layers(module) -> list:
    """Return the layers a stage module contributes to the unsplit model: a Sequential's children, else itself."""
    return list(module) if isinstance(module, Sequential) else [module]


def _tag(direction: int, stage: int, mb: int, num_stages: int) -> int:
    """Tag of the boundary tensor travelling to `stage` for micro-batch `mb` (direction 0: forward, 1: backward)."""
    return 2 * (mb * num_stages + stage) + direction


def _split(batch, m: int) -> List:
    bounds = np.cumsum([0] + split_sizes(len(batch), m))
    return [batch[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])]


@contextlib.contextmanager
def _capture_param_grads(module, captured: list):
    """Collect (param, grad) from every `accumulate_grad` call under `module` instead of applying it."""
    params = list(module.parameters())
    saved = [p.__dict__.get("accumulate_grad") for p in params]
    for p in params:
        p.accumulate_grad = lambda g, p=p: captured.append((p, g))
    try:
        yield captured
    finally:
        for p, original in zip(params, saved):
            if original is None:
                del p.accumulate_grad
            else:
                p.accumulate_grad = original
