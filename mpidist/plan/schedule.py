"""A layout's pipeline schedule for the planner: the actions its Pipeline runs, timed fast and exactly.

Glossary:
- program: a schedule's compute actions (F, B, W) compiled once per (schedule, p, m, v) into integer arrays:
  per action its rank's previous action, its dependency on its own rank (B on its F, W on its B) and on a
  neighbouring stage (F on the stage before, B on the stage after), grouped into waves (actions whose
  dependencies all lie in earlier waves) so that one wave is timed by a few numpy operations.
- in flight: the most micro-batches (chunks of them under interleaving) whose activations a rank holds at once,
  counted until their last use (W in split schedules): ``SimResult.peak_until_w``.

Why it is exact: ``simulate_schedule`` starts an action at the largest of its rank's clock, its dependencies'
ends and, for a dependency on another rank, that end plus the message's cost (a send starts when its producer
ends; its receive waits for it), and ends it its cost later. A program computes the same maxima (exact in
floating point, whatever their order) and the same sums in the same order, so makespans and busy times are
EQUAL to the simulation's, not close (tests/test_plan_search.py compares them over a grid of schedules, sizes
and costs). In-flight counts depend only on each rank's order of actions: closed forms of the builders' orders.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from mpidist.parallel.pipeline import schedules as _schedules

from .layouts import Layout

__all__ = ["build_schedule", "in_flight", "time_schedule", "pipeline"]

_BUILDERS = {"gpipe": lambda p, m, v: _schedules.gpipe(p, m), "1f1b": lambda p, m, v: _schedules.one_f_one_b(p, m),
             "interleaved": _schedules.interleaved_1f1b, "zb_h1": lambda p, m, v: _schedules.zero_bubble_h1(p, m)}
_F, _B, _W = 0, 1, 2


def build_schedule(layout: Layout):
    """Return the ``Schedule`` the layout's Pipeline runs (with its send/receive actions)."""
    return _schedules.insert_comms(_BUILDERS[layout.schedule](layout.pp, layout.num_micro, layout.chunks))


def in_flight(schedule: str, p: int, m: int, v: int = 1) -> Tuple[int, ...]:
    """Return each rank's most micro-batches in flight (``peak_until_w`` of the schedule's simulation).

    From the builders' orders: GPipe holds all m; 1F1B's rank r warms up with min(p - r - 1, m) forwards, then
    alternates, so it holds min(p - r, m); ZB-H1 releases at W, which rank r defers by r micro-batches: min(p, m)
    on every rank; interleaved holds its warm-up plus one (all m * v chunks when m % p, its all-forwards fallback).
    """
    if schedule == "gpipe":
        return (m,) * p
    if schedule == "1f1b":
        return tuple(min(p - r, m) for r in range(p))
    if schedule == "zb_h1":
        return (min(p, m),) * p
    if schedule == "interleaved":
        total = m * v
        if m % p:
            return (total,) * p
        return tuple(min((p - r - 1) * 2 + (v - 1) * p + 1, total) for r in range(p))
    raise ValueError(f"in_flight: unknown schedule {schedule!r} (expected one of {', '.join(_BUILDERS)})")


@dataclass(frozen=True)
class _Program:
    """A schedule's compute actions as arrays (see the module notes); action i of rank r is index r * per_rank + i."""

    p: int
    per_rank: int
    # per wave: (actions, kinds, previous action on the rank, dependency on the same stage, dependency on the
    # neighbouring stage, 1.0 where that neighbour is on another rank (a message) else 0.0); a missing
    # dependency points at a slot holding 0.0 (a rank's clock starts at 0) or -inf (no neighbour)
    waves: Tuple[Tuple[np.ndarray, ...], ...]


@functools.lru_cache(maxsize=512)   # a 3072-rank search of a 96-layer model times ~280 schedules (~30 MB)
def _program(schedule: str, p: int, m: int, v: int) -> _Program:
    """Compile the builder's schedule (see ``_Program``)."""
    built = _BUILDERS[schedule](p, m, v)
    rows = [[(a.stage, a.kind.value, a.mb) for a in row] for row in built.actions]
    per_rank = len(rows[0])
    n = p * per_rank
    if any(len(row) != per_rank for row in rows):
        raise ValueError(f"schedule {schedule} (p={p}, m={m}, v={v}): ranks run different numbers of actions")
    zero, never = n, n + 1
    index = {a: r * per_rank + i for r, row in enumerate(rows) for i, a in enumerate(row)}
    last = built.num_stages - 1
    kind, same, other = [0] * n, [zero] * n, [never] * n
    for r, row in enumerate(rows):
        for i, (stage, k, mb) in enumerate(row):
            # F(s) follows F(s - 1); B(s) its F(s) and B(s + 1); W(s) its B(s) (``simulate_schedule``'s rules)
            j = r * per_rank + i
            if k == "F":
                kind[j] = _F
                if stage > 0:
                    other[j] = index[(stage - 1, "F", mb)]
            elif k == "B":
                kind[j], same[j] = _B, index[(stage, "F", mb)]
                if stage < last:
                    other[j] = index[(stage + 1, "B", mb)]
            else:
                kind[j], same[j] = _W, index[(stage, "B", mb)]
    wave = _waves(rows, per_rank, same, other)
    prev = np.arange(-1, n - 1)
    prev[::per_rank] = zero
    kind, same, other = np.array(kind), np.array(same), np.array(other)
    crosses = np.where((other < n) & (other // per_rank != np.arange(n) // per_rank), 1.0, 0.0)
    ids = np.argsort(wave, kind="stable")
    bounds = np.searchsorted(wave[ids], np.arange(wave.max() + 2))
    waves = tuple((j, kind[j], prev[j], same[j], other[j], crosses[j])
                  for j in (ids[bounds[w]:bounds[w + 1]] for w in range(len(bounds) - 1)))
    return _Program(p, per_rank, waves)


def _waves(rows, per_rank, same, other) -> np.ndarray:
    """Return each action's wave, sweeping the ranks as the simulation does (an action runs once its rank's
    previous one and its dependencies have); raise ``ScheduleDeadlockError`` as it does when none can run."""
    n = len(rows) * per_rank
    wave = [-1] * n + [-1, -1]   # the two missing-dependency slots: wave -1, done
    done = [False] * n + [True, True]
    step = [0] * len(rows)
    remaining = n
    while remaining:
        progressed = False
        for r in range(len(rows)):
            j, stop = r * per_rank + step[r], (r + 1) * per_rank
            before = wave[j - 1] if step[r] else -1
            while j < stop and done[same[j]] and done[other[j]]:
                before = wave[j] = 1 + max(before, wave[same[j]], wave[other[j]])
                done[j] = True
                j += 1
            if j != r * per_rank + step[r]:
                remaining -= j - r * per_rank - step[r]
                step[r] = j - r * per_rank
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} waits at step {step[r]} on {rows[r][step[r]]}"
                              for r in range(len(rows)) if step[r] < per_rank)
            raise _schedules.ScheduleDeadlockError(f"schedule deadlocks: {stuck}")
    return np.array(wave[:n])


def time_schedule(schedule: str, p: int, m: int, v: int, f: float, b: float, w: Optional[float],
                  comm) -> Tuple[np.ndarray, np.ndarray]:
    """Return (makespan, busiest rank's compute time) of the schedule, one of each per message cost in ``comm``.

    Costs as ``simulate_schedule`` takes them: ``b`` the whole backward, ``w`` its weight-gradient part in split
    schedules (None otherwise), ``comm`` a message's time between stages (a float or a sequence of them)."""
    if schedule == "zb_h1":
        w = b / 2 if w is None else w
        if not 0 <= w <= b:
            raise ValueError(f"time_schedule: w must lie in [0, b] (w={w}, b={b})")
    elif w is not None:
        raise ValueError(f"time_schedule: w={w} given but schedule {schedule} has no W actions")
    prog = _program(schedule, p, m, v)
    comm = np.atleast_1d(np.asarray(comm, np.float64))[:, None]
    n = p * prog.per_rank
    costs = np.array([f, b - (w or 0.0), w or 0.0], np.float64)
    start = np.zeros((len(comm), n + 2))
    end = np.zeros((len(comm), n + 2))
    end[:, n + 1] = -np.inf
    for j, kind, prev, same, other, crosses in prog.waves:
        s = np.maximum(np.maximum(end[:, prev], end[:, same]), end[:, other] + comm * crosses)
        start[:, j] = s
        end[:, j] = s + costs[kind]
    spans = (end[:, :n] - start[:, :n]).reshape(len(comm), p, prog.per_rank)
    busy = np.cumsum(spans, axis=2)[:, :, -1]   # in each rank's order, as the simulation sums them
    finish = end[:, prog.per_rank - 1:n:prog.per_rank]
    return finish.max(axis=1), busy.max(axis=1)


def pipeline(layout: Layout, f: float, b: float, w: Optional[float], comm) -> dict:
    """Return the schedule's makespan, busiest rank's busy time (floats, or arrays with one per message cost
    when ``comm`` is a sequence) and each rank's in-flight count.

    Past its fill, a schedule repeats itself every p micro-batches (each group of p adds the same time and the
    same holdings), so for m > 4p it is timed at m1 = 2p + m % p and m2 = m1 + p micro-batches (same remainder:
    the same branch of the interleaved builder) and extended linearly to m. tests/test_plan.py checks the
    extension against the full simulation.
    """
    p, m, v = layout.pp, layout.num_micro, layout.chunks
    peak = in_flight(layout.schedule, p, m, v)
    if m <= 4 * p:
        makespan, busy = time_schedule(layout.schedule, p, m, v, f, b, w, comm)
    else:
        m1 = 2 * p + m % p
        span1, busy1 = time_schedule(layout.schedule, p, m1, v, f, b, w, comm)
        span2, busy2 = time_schedule(layout.schedule, p, m1 + p, v, f, b, w, comm)
        groups = (m - m1) // p
        makespan, busy = span1 + groups * (span2 - span1), busy1 + groups * (busy2 - busy1)
    if np.ndim(comm) == 0:
        makespan, busy = float(makespan[0]), float(busy[0])
    return {"makespan": makespan, "busy": busy, "peak": peak}
