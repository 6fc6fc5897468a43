"""The planner's fast search gives EXACTLY what the exhaustive one gives: the compiled schedule timing against
the event simulation, the in-flight closed forms against the schedules' own orders, and ``plan`` against the
search as it was before (every layout estimated in full with the event simulation; the lower bound from every
call)."""
import importlib

import numpy as np
import pytest

from mpidist.parallel.pipeline import schedules
from mpidist.plan import Estimate, ModelShape, Profile, load_profile, plan, to_json
from mpidist.plan.layouts import enumerate_layouts
from mpidist.plan.model import stage_layers
from mpidist.plan.schedule import in_flight, time_schedule
from mpidist.plan.volumes import calls_per_rank

est_module = importlib.import_module("mpidist.plan.estimate")

BUILDERS = {"gpipe": lambda p, m, v: schedules.gpipe(p, m), "1f1b": lambda p, m, v: schedules.one_f_one_b(p, m),
            "interleaved": schedules.interleaved_1f1b, "zb_h1": lambda p, m, v: schedules.zero_bubble_h1(p, m)}


def simulated(name, p, m, v, f, b, w, comm):
    return schedules.simulate_schedule(schedules.insert_comms(BUILDERS[name](p, m, v)), f, b, w, comm_cost=comm)


GRID = [(name, p, m, v) for name in ("gpipe", "1f1b", "zb_h1") for p in (2, 3, 4) for m in (1, 2, 3, 5, 8)
        for v in (1,)] + [("interleaved", p, m, v) for p in (2, 3, 4) for m in (1, 3, 4, 6, 8) for v in (2, 3)]


@pytest.mark.parametrize("f,b,w,message", [(1.0, 2.0, 1.0, 0.0), (0.1, 0.3, 0.11, 0.07), (1e-3, 2.7e-3, 0.0, 3.3e-4)])
def test_compiled_schedules_time_exactly_as_the_event_simulation(f, b, w, message):
    """Makespan and busiest rank's busy time EQUAL ``simulate_schedule``'s (same float operations), with and
    without message costs at once; in-flight counts EQUAL its ``peak_until_w``."""
    for name, p, m, v in GRID:
        w_ = w if name == "zb_h1" else None
        try:
            timed, untimed = simulated(name, p, m, v, f, b, w_, message), simulated(name, p, m, v, f, b, w_, 0.0)
        except schedules.ScheduleDeadlockError:   # the builders never deadlock; keep the grid honest if one does
            continue
        span, busy = time_schedule(name, p, m, v, f, b, w_, [message, 0.0])
        assert (span[0], busy[0]) == (timed.makespan, max(timed.busy)), (name, p, m, v)
        assert (span[1], busy[1]) == (untimed.makespan, max(untimed.busy)), (name, p, m, v)
        assert in_flight(name, p, m, v) == timed.peak_until_w, (name, p, m, v)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 19, 1), ("gpipe", 3, 14, 1), ("zb_h1", 5, 23, 1),
                                        ("interleaved", 2, 12, 2), ("interleaved", 3, 14, 2),
                                        ("interleaved", 4, 24, 3), ("1f1b", 1, 3, 1)])
def test_in_flight_closed_forms_hold_past_the_steady_state(name, p, m, v):
    assert in_flight(name, p, m, v) == simulated(name, p, m, v, 1.0, 2.0, None, 0.0).peak_until_w


def test_bad_costs_and_schedules_are_refused():
    with pytest.raises(ValueError, match=r"time_schedule: w must lie in \[0, b\] \(w=3.0, b=2.0\)"):
        time_schedule("zb_h1", 2, 2, 1, 1.0, 2.0, 3.0, 0.0)
    with pytest.raises(ValueError, match="time_schedule: w=1.0 given but schedule 1f1b has no W actions"):
        time_schedule("1f1b", 2, 2, 1, 1.0, 2.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="in_flight: unknown schedule 'nope'"):
        in_flight("nope", 2, 2)


# -- the search as it was: every candidate estimated in full, the event simulation, the bound from every call --
def slow_pipeline(layout, f, b, w, comm):
    """The planner's pipeline timing before the fast search: the event simulation (extended past m > 4p)."""
    p, m, v = layout.pp, layout.num_micro, layout.chunks
    comms = list(np.atleast_1d(comm))
    if m <= 4 * p:
        runs = [simulated(layout.schedule, p, m, v, f, b, w, c) for c in comms]
        spans, busies, peak = [r.makespan for r in runs], [max(r.busy) for r in runs], runs[0].peak_until_w
    else:
        m1, groups = 2 * p + m % p, (m - 2 * p - m % p) // p
        spans, busies = [], []
        for c in comms:
            r1, r2 = simulated(layout.schedule, p, m1, v, f, b, w, c), simulated(layout.schedule, p, m1 + p, v, f, b, w, c)
            spans.append(r1.makespan + groups * (r2.makespan - r1.makespan))
            busies.append(max(r1.busy) + groups * (max(r2.busy) - max(r1.busy)))
        peak = tuple(k1 + groups * (k2 - k1) for k1, k2 in zip(r1.peak_until_w, r2.peak_until_w))
    if np.ndim(comm) == 0:
        return {"makespan": spans[0], "busy": busies[0], "peak": peak}
    return {"makespan": np.array(spans), "busy": np.array(busies), "peak": peak}


def slow_peaks(layout):
    if layout.pp == 1:
        return None
    return slow_pipeline(layout, 1.0, 2.0, 1.0 if layout.schedule == "zb_h1" else None, 0.0)["peak"]


def slow_lower_bound(shape, layout, profile, ranks_per_node):
    pp, v = layout.pp, layout.chunks
    stages = stage_layers(shape, pp * v)
    best, seen = 0.0, set()
    for position in range(pp):
        mine = [s for s in range(pp * v) if s % pp == position]
        kind = tuple((sum(x.startswith("blocks.") for x in stages[s]), "embed" in stages[s], "head" in stages[s])
                     for s in mine)
        if kind in seen:
            continue
        seen.add(kind)
        layers = [layer for s in mine for layer in stages[s]]
        f, b = est_module._compute_seconds(shape, layout, layers, profile, ranks_per_node)
        tp_s = est_module._calls_seconds(calls_per_rank(shape, layout, position), profile, layout, ranks_per_node,
                                         {"tp"})
        best = max(best, layout.num_micro * (f + b) + tp_s)
    return best


def exhaustive_plan(shape, global_batch, ranks, ranks_per_node, profile, keep=50, precision=None, **choices):
    """``plan`` before the fast search: every candidate under the bound gets the full estimate."""
    ranks_per_node = min(ranks_per_node, ranks)
    out, candidates = [], []
    for layout, why in enumerate_layouts(ranks, global_batch, ranks_per_node, shape.layers,
                                         (shape.heads, shape.num_kv_heads), **choices):
        layout = est_module._with_precision(layout, precision or {})
        why = why or est_module.estimate_structure(shape, layout, ranks_per_node)
        if why:
            out.append(Estimate(layout, reason=why))
        else:
            candidates.append((slow_lower_bound(shape, layout, profile, ranks_per_node), layout))
    candidates.sort(key=lambda c: c[0])
    steps = []
    for bound, layout in candidates:
        if len(steps) >= keep and bound > steps[keep - 1]:
            out.append(Estimate(layout, reason=f"not ranked: its step is at least {bound:.4g} s, slower than the "
                                               f"{keep} best layouts"))
            continue
        est = est_module.estimate(shape, layout, profile, ranks_per_node)
        out.append(est)
        if est.feasible:
            steps = sorted(steps + [est.time["step"]])
    feasible = sorted((e for e in out if e.feasible), key=lambda e: (e.time["step"], e.memory["total"]))
    return feasible + [e for e in out if not e.feasible]


def with_memory(name, gib):
    return Profile.from_dict(dict(load_profile(name).to_dict(), memory_bytes=gib * 2**30))


CASES = {   # id: (shape, global batch, ranks, ranks per node, (profile, GiB per rank), keep, precision, choices)
    "4 ranks, every kind": (ModelShape(layers=4, hidden=32, heads=4, vocab=32, seq=8), 16, 4, 4,
                            ("local", 0.00061), 10, None, {}),
    "8 ranks on 2 nodes, bfloat16 policy, fp16 hook": (
        ModelShape(layers=4, hidden=64, heads=4, vocab=64, seq=16, dtype="float16"), 16, 8, 4,
        ("a100-80gb-ib", 0.00103), 8, {"param_dtype": "bfloat16", "comm_hook": "fp16"},
        {"schedules": ("1f1b", "interleaved", "zb_h1"), "max_micro_batch": 2}),
    "6 ranks, m > 4p": (ModelShape(layers=6, hidden=32, heads=2, vocab=32, seq=8, tie_weights=False), 48, 6, 2,
                        ("h100-ib", 0.00052), 3, None,
                        {"shardings": ("ddp",), "recompute": ("full",), "max_micro_batch": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_plan_equals_the_exhaustive_search(monkeypatch, case):
    """The ranked layouts, their times, memory, calls and warnings, and every dropped layout's reason (the
    ``--json`` content) EQUAL the exhaustive search's; every kind of outcome occurs."""
    shape, batch, ranks, per_node, profile, keep, precision, choices = CASES[case]
    profile = with_memory(*profile)
    fast = to_json(plan(shape, batch, ranks, per_node, profile, keep=keep, precision=precision, **choices), 10**9)
    monkeypatch.setattr(est_module, "_pipeline", slow_pipeline)
    monkeypatch.setattr(est_module, "_peaks", slow_peaks)
    slow = to_json(exhaustive_plan(shape, batch, ranks, per_node, profile, keep=keep, precision=precision,
                                   **choices), 10**9)
    assert fast == slow
    reasons = [e["reason"] for e in fast["infeasible"]]
    assert fast["num_feasible"] > 0 and any(e["layout"]["pp"] > 1 for e in fast["feasible"])
    assert any(r.startswith("not ranked") for r in reasons) and any(r.startswith("needs ") for r in reasons)


def test_layouts_that_do_not_fit_get_their_memory_not_a_step_time():
    shape = ModelShape(layers=4, hidden=256, heads=4, vocab=256, seq=32)
    dropped = [e for e in plan(shape, 8, 4, 4, with_memory("local", 0.001)) if e.reason.startswith("needs ")]
    assert dropped
    for e in dropped:
        full = est_module.estimate(shape, e.layout, with_memory("local", 0.001), 4)
        assert e.reason == full.reason and e.memory["total"] == full.memory["total"] and e.time == {}


@pytest.mark.parametrize("case", list(CASES))
def test_pruned_search_keeps_the_best_layouts_of_the_full_search_and_its_bound_is_a_lower_bound(case):
    """Branch and bound is only sound when ``lower_bound`` never exceeds a layout's estimated step: checked on every
    feasible candidate; and the ``keep`` best of the pruned search are those of a search that prunes nothing."""
    shape, batch, ranks, per_node, profile, keep, precision, choices = CASES[case]
    profile = with_memory(*profile)
    per_node = min(per_node, ranks)
    full = [e for e in plan(shape, batch, ranks, per_node, profile, keep=10**9, precision=precision, **choices)
            if e.feasible]
    assert len(full) > keep
    for e in full:
        assert est_module.lower_bound(shape, e.layout, profile, per_node) <= e.time["step"] * (1 + 1e-12), e.layout
    pruned = plan(shape, batch, ranks, per_node, profile, keep=keep, precision=precision, **choices)
    assert [(e.layout, e.time["step"]) for e in pruned[:keep]] == [(e.layout, e.time["step"]) for e in full[:keep]]
