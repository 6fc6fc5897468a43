"""The planner's output: a terminal table of the ranked layouts and the reasons others were dropped; JSON."""
from __future__ import annotations

from collections import Counter
from typing import List

from .estimate import Estimate

__all__ = ["format_table", "to_json"]


def _gib(n):
    return f"{n / 2**30:.2f}"


def _ms(s):
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def format_table(estimates: List[Estimate], top: int = 15, reasons: int = 8) -> str:
    """Return the best ``top`` feasible layouts as a table, then counts of the infeasible ones by reason."""
    feasible = [e for e in estimates if e.feasible]
    head = (f"{'#':>3} {'layout':<42} {'step ms':>9} {'compute':>8} {'tp':>7} {'pp':>7} {'bubble':>7} {'dp':>7} "
            f"{'opt':>6} {'mem GiB':>8} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'bufs':>7} "
            f"{'comm MiB':>9}")
    lines = [head]
    for i, e in enumerate(feasible[:top], 1):
        t, m = e.time, e.memory
        comm = sum(g["bytes"] for g in e.comm.values()) / 2**20
        lines.append(f"{i:>3} {e.layout.name():<42} {_ms(t['step']):>9} {_ms(t['compute']):>8} {_ms(t['tp']):>7} "
                     f"{_ms(t['pp']):>7} {_ms(t['bubble']):>7} {_ms(t['dp']):>7} {_ms(t['optimizer']):>6} "
                     f"{_gib(m['total']):>8} {_gib(m['params']):>7} {_gib(m['grads']):>7} {_gib(m['optimizer']):>7} "
                     f"{_gib(m['activations']):>7} {_gib(m['comm_buffers']):>7} {comm:>9.1f}")
    dropped = Counter(_reason_kind(e.reason) for e in estimates if not e.feasible)
    lines.append(f"{len(feasible)} feasible layouts (times in ms per step, memory per rank); "
                 f"{sum(dropped.values())} infeasible:")
    for reason, n in dropped.most_common(reasons):
        lines.append(f"  {n:>6} x {reason}")
    return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    """Group reasons that differ only in numbers (memory needed) for the summary."""
    if reason.startswith("needs "):
        return "does not fit in memory"
    if reason.startswith("not ranked"):
        return "not ranked: slower than the best layouts whatever their bubble (lower bound)"
    return reason


def to_json(estimates: List[Estimate], top: int = 50) -> dict:
    """Return the plan as JSON-able data: the best ``top`` feasible layouts and every infeasible one's reason."""
    feasible = [e for e in estimates if e.feasible]
    return {"feasible": [e.to_dict() for e in feasible[:top]], "num_feasible": len(feasible),
            "infeasible": [{"name": e.layout.name(), "layout": e.layout.to_dict(), "reason": e.reason}
                           for e in estimates if not e.feasible]}
