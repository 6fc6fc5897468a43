"""The planner's output: a terminal table of the ranked layouts and the reasons others were dropped; JSON."""
from __future__ import annotations

from collections import Counter
from typing import List

from .estimate import Estimate

__all__ = ["format_table", "to_json", "plot", "TIME_PARTS", "MEMORY_PARTS"]

TIME_PARTS = ("compute", "tp", "pp", "bubble", "dp", "optimizer")      # they add up to the step
MEMORY_PARTS = ("params", "grads", "optimizer", "optimizer_work", "activations", "transient", "comm_buffers")   # they add up to the total
_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")


def _gib(n):
    return f"{n / 2**30:.2f}"


def _ms(s):
    return f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def format_table(estimates: List[Estimate], top: int = 15, reasons: int = 8) -> str:
    """Return the best ``top`` feasible layouts as a table, then counts of the infeasible ones by reason."""
    feasible = [e for e in estimates if e.feasible]
    head = (f"{'#':>3} {'layout':<42} {'step ms':>9} {'compute':>8} {'tp':>7} {'pp':>7} {'bubble':>7} {'dp':>7} "
            f"{'opt':>6} {'mem GiB':>8} {'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'trans':>7} {'bufs':>7} "
            f"{'comm MiB':>9}")
    lines = [head]
    for i, e in enumerate(feasible[:top], 1):
        t, m = e.time, e.memory
        comm = sum(g["bytes"] for g in e.comm.values()) / 2**20
        lines.append(f"{i:>3} {e.layout.name():<42} {_ms(t['step']):>9} {_ms(t['compute']):>8} {_ms(t['tp']):>7} "
                     f"{_ms(t['pp']):>7} {_ms(t['bubble']):>7} {_ms(t['dp']):>7} {_ms(t['optimizer']):>6} "
                     f"{_gib(m['total']):>8} {_gib(m['params']):>7} {_gib(m['grads']):>7} {_gib(m['optimizer']):>7} "
                     f"{_gib(m['activations']):>7} {_gib(m['transient']):>7} {_gib(m['comm_buffers']):>7} {comm:>9.1f}")
    dropped = Counter(_reason_kind(e.reason) for e in estimates if not e.feasible)
    lines.append(f"{len(feasible)} feasible layouts (times in ms per step, memory per rank); "
                 f"{sum(dropped.values())} infeasible:")
    for reason, n in dropped.most_common(reasons):
        lines.append(f"  {n:>6} x {reason}")
    warned = Counter(w for e in feasible[:top] for w in e.warnings)
    if warned:
        lines.append("WARNING: out of the profile's validated range (layouts shown above; extrapolated, not measured):")
        lines += [f"  {n:>6} x {w}" for w, n in warned.most_common()]
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


def plot(estimates: List[Estimate], path: str, top: int = 10, memory_bytes: float = None) -> str:
    """Draw the best ``top`` feasible layouts to ``path``: step time and per-rank memory, stacked by component.

    With matplotlib (any format it writes, by the file's extension); without it, an SVG written here (``path``
    must then end in ``.svg``). ``memory_bytes``: the rank's memory, drawn as a line. Returns ``path``."""
    feasible = [e for e in estimates if e.feasible][:top]
    if not feasible:
        raise ValueError("plan --plot: no feasible layout to draw")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not path.endswith(".svg"):
            raise ValueError(f"plan --plot: without matplotlib only SVG is written (got {path!r})") from None
        return _plot_svg(feasible, path, memory_bytes)
    names = [e.layout.name() for e in feasible]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.42 * len(names)), sharey=True)
    for ax, parts, get, scale, unit in ((ax_t, TIME_PARTS, lambda e: e.time, 1e3, "ms per step"),
                                        (ax_m, MEMORY_PARTS, lambda e: e.memory, 2.0**-30, "GiB per rank")):
        left = [0.0] * len(names)
        for part, color in zip(parts, _COLORS):
            widths = [get(e)[part] * scale for e in feasible]
            ax.barh(range(len(names)), widths, left=left, color=color, label=part)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel(unit)
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(parts), fontsize="small", frameon=False)
    if memory_bytes:
        ax_m.axvline(memory_bytes * 2.0**-30, color="black", linestyle="--", linewidth=1)
    ax_t.set_yticks(range(len(names)), names, fontsize="small")
    ax_t.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_svg(feasible: List[Estimate], path: str, memory_bytes: float = None) -> str:
    """The SVG fallback of ``plot``: one row per layout, two stacked bars (time, memory) scaled to the largest."""
    from xml.sax.saxutils import escape
    label_w, bar_w, row_h, top_h = 330, 330, 22, 40
    width, height = label_w + 2 * (bar_w + 30), top_h + row_h * len(feasible) + 30
    panels = ((TIME_PARTS, lambda e: e.time, "time"), (MEMORY_PARTS, lambda e: e.memory, "memory"))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">']
    for k, (parts, get, title) in enumerate(panels):
        x0 = label_w + k * (bar_w + 30)
        full = max(sum(get(e)[p] for p in parts) for e in feasible)
        if k == 1 and memory_bytes:
            full = max(full, memory_bytes)
        scale = _ms(full) + " ms per step" if k == 0 else _gib(full) + " GiB per rank"
        out.append(f'<text x="{x0}" y="14">{title} (full width: {scale})</text>')
        for j, (part, color) in enumerate(zip(parts, _COLORS)):
            out.append(f'<rect x="{x0 + 80 * j}" y="20" width="10" height="10" fill="{color}"/>'
                       f'<text x="{x0 + 80 * j + 13}" y="29">{part}</text>')
        for i, e in enumerate(feasible):
            x, y = float(x0), top_h + i * row_h
            for part, color in zip(parts, _COLORS):
                w = get(e)[part] / full * bar_w
                out.append(f'<rect class="{title}-{part}" x="{x:.2f}" y="{y}" width="{w:.2f}" '
                           f'height="{row_h - 6}" fill="{color}"/>')
                x += w
        if k == 1 and memory_bytes:
            xm = x0 + memory_bytes / full * bar_w
            out.append(f'<line x1="{xm:.2f}" y1="{top_h - 4}" x2="{xm:.2f}" y2="{height - 20}" stroke="black" '
                       f'stroke-dasharray="4"/>')
    for i, e in enumerate(feasible):
        out.append(f'<text x="4" y="{top_h + i * row_h + 12}">{escape(e.layout.name())}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path
