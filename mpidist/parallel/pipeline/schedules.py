"""Pipeline schedules as data: per-rank action lists, a validator, a simulator and a grid printer.

Glossary
- stage: one consecutive slice of the model, numbered 0..p*v-1 in model order. Stage s lives on rank s % p.
- rank: one pipeline process; it holds v stages ("model chunks"), v = 1 except for interleaved schedules.
- micro-batch (mb): one of the m equal slices of a mini-batch; each passes F through every stage, then B back.
- warm-up: the forwards a rank runs before its first backward; cool-down: the backwards left after its last forward.
- bubble: time a rank sits idle waiting on a neighbour; bubble fraction = idle time / makespan, averaged over ranks.
- activations held: (stage, mb) pairs whose forward ran and whose backward has not; see `SimResult`.

Action repr is ``<stage><kind><mb>``: ``1F0`` forward of mb 0 on stage 1, ``2B3`` backward (input-grad backward
when the schedule splits it), ``0W1`` weight-grad backward. Communication actions are named from the stage that
runs them: ``0sF0`` stage 0 sends mb 0's output activation to stage 1, ``1rF0`` stage 1 receives it,
``1sB0`` stage 1 sends mb 0's input gradient to stage 0, ``0rB0`` stage 0 receives it.

Execution model: sends are nonblocking (isend, completed at the end of the step) and receives are blocking.
`insert_comms` puts each receive right before the compute that consumes it and each send right after the compute
that produced it; under this model such a list cannot deadlock unless the compute order itself does, and
`simulate_schedule` checks exactly that.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "Kind", "Action", "Schedule", "SimResult", "ScheduleDeadlockError",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1",
    "insert_comms", "validate", "simulate_schedule", "format_grid",
]


class Kind(str, Enum):
    """What an action does; the value is its code in the compact repr."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "sF"
    RECV_F = "rF"
    SEND_B = "sB"
    RECV_B = "rB"

    @property
    def is_compute(self) -> bool:
        """True for F, B and W; False for sends and receives."""
        return self in (Kind.F, Kind.B, Kind.W)


_ACTION_RE = re.compile(r"^(\d+)(F|B|W|sF|rF|sB|rB)(\d+)$")


@dataclass(frozen=True, repr=False)
class Action:
    """One step of a rank's list: `kind` on model `stage` for micro-batch `mb`."""

    stage: int
    kind: Kind
    mb: int

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise ValueError(f"Action: unknown kind {self.kind!r} (expected one of "
                             f"{[k.value for k in Kind]})") from None
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"Action: stage and mb must be >= 0 (stage={self.stage}, mb={self.mb})")

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Build an action from its compact repr, e.g. ``'1F0'`` or ``'0rB2'``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"Action.parse: cannot parse {text!r} (expected e.g. '1F0', '2B3', '0sF1')")
        return cls(int(match[1]), match[2], int(match[3]))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    __repr__ = __str__


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists for `p` ranks, `m` micro-batches and `v` stages per rank.

    `actions[r]` is rank r's list; entries may be given as Actions or their compact strings ('1F0').
    """

    name: str
    p: int
    m: int
    v: int
    actions: Tuple[Tuple[Action, ...], ...]

    def __post_init__(self):
        _check_sizes(self.name, self.p, self.m, self.v)
        rows = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in self.actions)
        if len(rows) != self.p:
            raise ValueError(f"Schedule {self.name}: expecting {self.p} action lists (one per rank), got {len(rows)}")
        object.__setattr__(self, "actions", rows)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @property
    def split_backward(self) -> bool:
        """True when backward is split into B (input grad) and W (weight grad)."""
        return any(a.kind is Kind.W for row in self.actions for a in row)

    @property
    def has_comms(self) -> bool:
        return any(not a.kind.is_compute for row in self.actions for a in row)

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def replace_actions(self, actions: Sequence[Sequence[Action]], name: Optional[str] = None) -> "Schedule":
        """Return a copy with other action lists (e.g. a hand-edited one)."""
        return Schedule(name or self.name, self.p, self.m, self.v, tuple(tuple(r) for r in actions))


def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"{name}: p, m and v must be >= 1 (p={p}, m={m}, v={v})")


# ---------------------------------------------------------------------------------------------------------------
# Schedule builders (compute actions only; pass the result to `insert_comms` for an executable list).

def gpipe(p: int, m: int) -> Schedule:
    """Build GPipe: every rank runs all forwards, then all backwards."""
    _check_sizes("gpipe", p, m, 1)
    rows = [[Action(r, Kind.F, k) for k in range(m)] + [Action(r, Kind.B, k) for k in range(m)] for r in range(p)]
    return Schedule("gpipe", p, m, 1, rows)


def _one_f_one_b_rows(p: int, m: int) -> List[List[Action]]:
    rows = []
    for r in range(p):
        # Rank r needs p - r - 1 forwards in flight before the first gradient can come back to it.
        warmup = min(p - r - 1, m)
        row = [Action(r, Kind.F, k) for k in range(warmup)]
        for k in range(m - warmup):
            row += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, k)]
        row += [Action(r, Kind.B, k) for k in range(m - warmup, m)]
        rows.append(row)
    return rows


def one_f_one_b(p: int, m: int) -> Schedule:
    """Build 1F1B: warm-up forwards, then one forward / one backward, then cool-down backwards."""
    _check_sizes("1f1b", p, m, 1)
    return Schedule("1f1b", p, m, 1, _one_f_one_b_rows(p, m))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """Build ZB-H1 (Qi et al. 2023): 1F1B order of F and B, with each W deferred to fill the cool-down bubble.

    Rank r runs F and B exactly as 1F1B does, so activations released at B peak at min(p - r, m), as in 1F1B.
    Rank r defers its weight-grad W by r micro-batches: those Ws run in the cool-down, where 1F1B idles. The
    inputs a W needs are then held for up to min(p, m) micro-batches on every rank, which is 1F1B's peak on
    rank 0, so the peak over ranks does not grow (the "same memory as 1F1B" of the paper).
    """
    _check_sizes("zb-h1", p, m, 1)
    rows = []
    for r, row in enumerate(_one_f_one_b_rows(p, m)):
        out, pending, backwards_seen = [], [], 0
        for action in row:
            out.append(action)
            if action.kind is Kind.B:
                pending.append(Action(r, Kind.W, action.mb))
                backwards_seen += 1
                if backwards_seen > r:
                    out.append(pending.pop(0))
        rows.append(out + pending)
    return Schedule("zb-h1", p, m, 1, rows)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Build Megatron-LM interleaved 1F1B with v stages ("model chunks") per rank; stage s is on rank s % p.

    Forwards run in groups of p micro-batches: mbs 0..p-1 through chunk 0, then the same mbs through chunk 1, ...,
    then the next group; backwards follow the same order with chunks reversed. Rank r warms up with
    min((p - r - 1) * 2 + (v - 1) * p, m * v) forwards (Megatron's count), then alternates one forward / one
    backward. With uniform costs the bubble is then (1/v)(p-1)/m of the compute time.

    Fallback when m is not a multiple of p: the last group holds the remaining m % p micro-batches (all m when
    m < p), and Megatron's warm-up can deadlock on such a group (e.g. p=4, m=5, v=3), so every rank runs all its
    forwards before any backward. That order is always correct and its bubble is never above plain 1F1B's
    (p-1)/m, but it holds all m * v chunk activations, as GPipe does.
    """
    _check_sizes("interleaved-1f1b", p, m, v)
    order = []  # (mb, chunk) in forward order, shared by all ranks
    for first in range(0, m, p):
        group = range(first, m) if first + p >= m else range(first, first + p)
        order += [(k, c) for c in range(v) for k in group]
    total = m * v
    rows = []
    for r in range(p):
        forwards = [Action(c * p + r, Kind.F, k) for k, c in order]
        backwards = [Action((v - 1 - c) * p + r, Kind.B, k) for k, c in order]
        warmup = total if m % p else min((p - r - 1) * 2 + (v - 1) * p, total)  # see fallback above
        row = forwards[:warmup]
        for i in range(total - warmup):
            row += [forwards[warmup + i], backwards[i]]
        row += backwards[total - warmup:]
        rows.append(row)
    return Schedule("interleaved-1f1b", p, m, v, rows)


# ---------------------------------------------------------------------------------------------------------------
# Communication

def insert_comms(schedule: Schedule) -> Schedule:
    """Return the schedule with RECV right before each compute that needs a remote input and SEND right after it.

    Transfers between stages on the same rank (only possible when p == 1) need no communication.
    """
    if schedule.has_comms:
        raise ValueError(f"insert_comms: schedule {schedule.name} already has send/recv actions")
    last, rank_of = schedule.num_stages - 1, schedule.rank_of
    rows = []
    for r, row in enumerate(schedule.actions):
        out = []
        for a in row:
            if a.kind is Kind.F and a.stage > 0 and rank_of(a.stage - 1) != r:
                out.append(Action(a.stage, Kind.RECV_F, a.mb))
            if a.kind is Kind.B and a.stage < last and rank_of(a.stage + 1) != r:
                out.append(Action(a.stage, Kind.RECV_B, a.mb))
            out.append(a)
            if a.kind is Kind.F and a.stage < last and rank_of(a.stage + 1) != r:
                out.append(Action(a.stage, Kind.SEND_F, a.mb))
            if a.kind is Kind.B and a.stage > 0 and rank_of(a.stage - 1) != r:
                out.append(Action(a.stage, Kind.SEND_B, a.mb))
        rows.append(out)
    return schedule.replace_actions(rows)


def _message(a: Action) -> Tuple[str, int, int]:
    """Key a send and its matching receive share: (direction, receiving stage, mb)."""
    if a.kind is Kind.SEND_F:
        return ("F", a.stage + 1, a.mb)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage - 1, a.mb)
    return (a.kind.value[1], a.stage, a.mb)


# ---------------------------------------------------------------------------------------------------------------
# Validation

def validate(schedule: Schedule) -> None:
    """Raise ValueError listing every way the schedule is malformed; return None if it is well formed."""
    s, problems = schedule, []
    last, split = s.num_stages - 1, s.split_backward
    compute = Counter()
    for r, row in enumerate(s.actions):
        position = {}
        for i, a in enumerate(row):
            if a.stage > last or a.mb >= s.m:
                problems.append(f"rank {r}: {a} is out of range (stages 0..{last}, mbs 0..{s.m - 1})")
                continue
            if s.rank_of(a.stage) != r:
                problems.append(f"rank {r}: {a} belongs on rank {s.rank_of(a.stage)}")
            if a in position:
                problems.append(f"rank {r}: {a} appears twice (steps {position[a]} and {i})")
            position.setdefault(a, i)
            if a.kind.is_compute:
                compute[a] += 1

        def before(first: Action, then: Action) -> None:
            if first in position and then in position and position[first] > position[then]:
                problems.append(f"rank {r}: {then} at step {position[then]} comes before {first} "
                                f"at step {position[first]}")

        for a in [a for a in row if a.kind.is_compute]:
            if a.kind is Kind.B:
                before(Action(a.stage, Kind.F, a.mb), a)
            if a.kind is Kind.W:
                before(Action(a.stage, Kind.B, a.mb), a)
        for a in [a for a in row if not a.kind.is_compute]:
            # A send follows the compute producing its data; a receive precedes the compute consuming it.
            producer = {Kind.SEND_F: Kind.F, Kind.SEND_B: Kind.B}.get(a.kind)
            if producer is not None:
                before(Action(a.stage, producer, a.mb), a)
            else:
                before(a, Action(a.stage, Kind.F if a.kind is Kind.RECV_F else Kind.B, a.mb))

    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    for stage in range(s.num_stages):
        for mb in range(s.m):
            for kind in kinds:
                n = compute[Action(stage, kind, mb)]
                if n != 1:
                    problems.append(f"{Action(stage, kind, mb)} appears {n} times (expected once)")

    if s.has_comms:
        expected = insert_comms(s.replace_actions([[a for a in row if a.kind.is_compute] for row in s.actions]))
        want = Counter(a for row in expected.actions for a in row if not a.kind.is_compute)
        have = Counter(a for row in s.actions for a in row if not a.kind.is_compute)
        for a in sorted(want - have, key=str):
            problems.append(f"{a} is missing (its peer expects it)")
        for a in sorted(have - want, key=str):
            problems.append(f"{a} has no matching peer action")

    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"schedule {s.name} (p={s.p}, m={s.m}, v={s.v}) is invalid:\n  {shown}{more}")


# ---------------------------------------------------------------------------------------------------------------
# Simulation

@dataclass(frozen=True)
class SimResult:
    """Outcome of `simulate_schedule`.

    timelines[r]: (start, end, action) for every action rank r ran, in order (communications take no rank time).
    busy[r]: compute time of rank r. bubble_fraction: mean over ranks of 1 - busy[r] / makespan.
    peak_activations[r]: most (stage, mb) pairs rank r held at once, counting from F until B (the input-grad
    backward in split schedules). peak_until_w[r]: the same counting until W, i.e. until the last use of the
    stage inputs; equal to peak_activations for unsplit schedules. For v > 1 a pair is one chunk's activations.
    """

    makespan: float
    busy: Tuple[float, ...]
    bubble_fraction: float
    peak_activations: Tuple[int, ...]
    peak_until_w: Tuple[int, ...]
    timelines: Tuple[Tuple[Tuple[float, float, Action], ...], ...] = field(repr=False)

    @property
    def bubble_ratio(self) -> float:
        """Mean idle time over mean busy time: bubble time relative to ideal (bubble-free) compute time."""
        mean_busy = sum(self.busy) / len(self.busy)
        return (self.makespan - mean_busy) / mean_busy


class ScheduleDeadlockError(RuntimeError):
    """No rank can run its next action."""


def simulate_schedule(schedule: Schedule, f_cost: float = 1.0, b_cost: float = 2.0,
                      w_cost: Optional[float] = None, comm_cost: float = 0.0) -> SimResult:
    """Run every rank's list in order, each action starting once its dependencies are done; return timings.

    b_cost is the whole backward of one stage and micro-batch. In split schedules W costs w_cost (default
    b_cost / 2) and B the rest, so f=1, b=2 gives B=1, W=1. Passing w_cost to an unsplit schedule is an error.
    Dependencies: F(s, k) needs F(s-1, k); B(s, k) needs F(s, k) and B(s+1, k); W(s, k) needs B(s, k).
    A receive additionally waits for its send plus comm_cost; sends do not block (see module notes).
    Raises ScheduleDeadlockError naming each rank's stuck action when no rank can proceed.
    """
    s = schedule
    if s.split_backward:
        w_cost = b_cost / 2 if w_cost is None else w_cost
        if not 0 <= w_cost <= b_cost:
            raise ValueError(f"simulate_schedule: w_cost must lie in [0, b_cost] (w_cost={w_cost}, b_cost={b_cost})")
    elif w_cost is not None:
        raise ValueError(f"simulate_schedule: w_cost={w_cost} given but schedule {s.name} has no W actions")
    cost = {Kind.F: f_cost, Kind.B: b_cost - (w_cost or 0.0), Kind.W: w_cost}
    last = s.num_stages - 1

    done: Dict[Action, float] = {}  # compute action -> finish time
    arrived: Dict[Tuple[str, int, int], float] = {}  # message -> time it is available to the receiver
    clock = [0.0] * s.p
    step = [0] * s.p
    timelines: List[List[Tuple[float, float, Action]]] = [[] for _ in range(s.p)]

    def ready_time(a: Action) -> Optional[float]:
        """Time a's dependencies are all satisfied, or None if one has not run yet."""
        if a.kind is Kind.F:
            deps = [Action(a.stage - 1, Kind.F, a.mb)] if a.stage > 0 else []
        elif a.kind is Kind.B:
            deps = [Action(a.stage, Kind.F, a.mb)] + ([Action(a.stage + 1, Kind.B, a.mb)] if a.stage < last else [])
        elif a.kind is Kind.W:
            deps = [Action(a.stage, Kind.B, a.mb)]
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            return arrived.get(_message(a))
        else:
            deps = []
        if any(d not in done for d in deps):
            return None
        return max([done[d] for d in deps], default=0.0)

    remaining = sum(len(row) for row in s.actions)
    while remaining:
        progressed = False
        for r, row in enumerate(s.actions):
            while step[r] < len(row):
                a = row[step[r]]
                ready = ready_time(a)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + cost[a.kind] if a.kind.is_compute else start
                if a.kind.is_compute:
                    done[a] = end
                elif a.kind in (Kind.SEND_F, Kind.SEND_B):
                    arrived[_message(a)] = start + comm_cost
                clock[r] = end
                timelines[r].append((start, end, a))
                step[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} waits at step {step[r]} on {row[step[r]]}"
                              for r, row in enumerate(s.actions) if step[r] < len(row))
            raise ScheduleDeadlockError(f"schedule {s.name} (p={s.p}, m={s.m}, v={s.v}) deadlocks: {stuck}")

    makespan = max(clock)
    busy = tuple(sum(e - b for b, e, a in tl if a.kind.is_compute) for tl in timelines)
    bubble = sum(1 - b / makespan for b in busy) / s.p if makespan > 0 else 0.0
    return SimResult(makespan, busy, bubble,
                     tuple(_peak(row, Kind.B) for row in s.actions),
                     tuple(_peak(row, Kind.W if w_cost is not None else Kind.B) for row in s.actions),
                     tuple(tuple(tl) for tl in timelines))


def _peak(row: Sequence[Action], release: Kind) -> int:
    # Holdings change only at the rank's own actions, so list order (not timing) decides the peak.
    held = peak = 0
    for a in row:
        held += (a.kind is Kind.F) - (a.kind is release)
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------------------------------------------------------
# Printing

def format_grid(schedule: Schedule) -> str:
    """Return a step x rank table of compute actions timed with unit cost for F, B and W; blank cells are idle."""
    sim = simulate_schedule(schedule, 1.0, 2.0 if schedule.split_backward else 1.0,
                            1.0 if schedule.split_backward else None)
    steps = int(round(sim.makespan))
    grid = [[""] * schedule.p for _ in range(steps)]
    for r, tl in enumerate(sim.timelines):
        for start, _, a in tl:
            if a.kind.is_compute:
                grid[int(round(start))][r] = str(a)
    width = max([len(c) for row in grid for c in row] + [len(f"rank{schedule.p - 1}")])
    lines = [f"{'step':>4} " + " ".join(f"{f'rank{r}':<{width}}" for r in range(schedule.p))]
    lines += [f"{t:>4} " + " ".join(f"{c:<{width}}" for c in row) for t, row in enumerate(grid)]
    return "\n".join(line.rstrip() for line in lines)
