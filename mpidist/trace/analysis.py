"""Reading a merged trace back: where each rank's time went, as numbers and as a timeline picture.

Glossary (per rank, over the time from its first to its last event):
- compute: time inside a compute event (module forward/backward, optimizer step, pipeline F/B/W, a user
  span of category "compute") and not inside a blocking communication call (FSDP's gather in a forward)
  nor inside a wait() for a nonblocking one (its ``wait_us`` onwards).
- communication: time during which some call was in progress: a blocking call, or a nonblocking one
  from its start until it completed.
- exposed communication: communication time that is not compute time, i.e. the rank waited for it.
- overlap: the rest of the communication time (hidden behind compute), as a share of communication.
- bubble (pipeline steps): mean over ranks of 1 - (the rank's F/B/W time in the step) / makespan, the
  makespan running from the step's first F/B/W start to its last end on any rank; next to the
  schedule's own prediction with uniform stage costs (e.g. (p-1)/(m+p-1) for GPipe and 1F1B).
"""

import statistics

__all__ = ["analyze", "report", "plot", "union", "length", "subtract"]

COMPUTE_CATEGORIES = frozenset({"forward", "backward", "optimizer", "pipeline", "compute"})


def union(intervals):
    """Return the union of (start, end) intervals as sorted, disjoint intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1] = end
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals):
    return sum(b - a for a, b in intervals)


def subtract(intervals, removed):
    """Return disjoint ``intervals`` minus disjoint ``removed`` (both sorted)."""
    out, j = [], 0
    for start, end in intervals:
        while j < len(removed) and removed[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(removed) and removed[k][0] < end:
            if removed[k][0] > cursor:
                out.append((cursor, removed[k][0]))
            cursor = max(cursor, removed[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _complete(trace):
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def analyze(trace):
    """Return a dict of the report's numbers (seconds) from a merged trace (``chrome.load``)."""
    events = _complete(trace)
    ranks = sorted({e["pid"] for e in events})
    per_rank = {}
    for rank in ranks:
        mine = [e for e in events if e["pid"] == rank]
        compute, blocking, flying = [], [], []
        for e in mine:
            start, end = e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6
            if e.get("cat") == "comm":
                args = e.get("args") or {}
                if "posted_us" in args:
                    flying.append((start, end))
                    blocking.append((start, start + args["posted_us"] * 1e-6))
                    if "wait_us" in args:  # the caller blocked in wait() until it completed
                        blocking.append((start + args["wait_us"] * 1e-6, end))
                else:
                    blocking.append((start, end))
            elif e.get("cat") in COMPUTE_CATEGORIES:
                compute.append((start, end))
        busy = subtract(union(compute), union(blocking))
        comm = union(blocking + flying)
        exposed = subtract(comm, busy)
        first = min(e["ts"] for e in mine) * 1e-6
        last = max(e["ts"] + e["dur"] for e in mine) * 1e-6
        per_rank[rank] = {"span": last - first, "compute": length(busy), "communication": length(comm),
                          "exposed": length(exposed),
                          "overlap": 1 - length(exposed) / length(comm) if length(comm) > 0 else None}
    meta = {m.get("rank"): m for m in trace.get("otherData", {}).get("ranks", []) if isinstance(m, dict)}
    for rank, numbers in per_rank.items():
        numbers["dropped"] = meta.get(rank, {}).get("dropped", 0)
    comms = sorted((e for e in events if e.get("cat") == "comm"), key=lambda e: -e["dur"])
    return {"ranks": per_rank, "pipeline": _bubbles(events), "slowest": comms}


def _bubbles(events):
    """Return [{pipeline, step, schedule, p, m, v, ranks, measured, formula}] of each traced pipeline step.

    The makespan of a step runs from its first action's start to its last action's end over all ranks (the
    schedule's own makespan): time a rank spent waiting before its first action (in a barrier, or for the
    previous step of other ranks) is not the schedule's bubble. Steps are told apart by the pipeline's number
    (the order the ranks first traced it) and its step count.
    """
    def key(e):
        return e["args"].get("pipeline", 0), e["args"]["step"]
    steps = {}
    for e in events:
        if e.get("cat") == "pipeline step":
            steps.setdefault(key(e), e["args"])
    busy, first, last = {}, {}, {}
    for e in events:
        if e.get("cat") == "pipeline":
            step, end = key(e), e["ts"] + e["dur"]
            busy[(step, e["pid"])] = busy.get((step, e["pid"]), 0.0) + e["dur"]
            first[step] = min(first.get(step, e["ts"]), e["ts"])
            last[step] = max(last.get(step, end), end)
    out = []
    for step, args in sorted(steps.items()):
        makespan = last.get(step, 0.0) - first.get(step, 0.0)
        if makespan <= 0:
            continue
        p = args["p"]
        ranks = sorted(r for s, r in busy if s == step)
        # A rank of the pipeline missing from the trace counts as idle for the whole step.
        times = [busy[(step, r)] for r in ranks] + [0.0] * max(p - len(ranks), 0)
        out.append({"pipeline": step[0], "step": step[1], "schedule": args["schedule"], "p": p, "m": args["m"],
                    "v": args["v"], "ranks": len(ranks), "measured": sum(1 - t / makespan for t in times) / len(times),
                    "formula": args["bubble_formula"]})
    return out


def _ms(seconds):
    return f"{seconds * 1e3:.3f} ms"


def _bytes(n):
    if n < 0:
        return "(size known on arrival)"  # a receive into a buffer it allocates
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def report(trace, top=5):
    """Return the text of ``mpidist trace summary``."""
    numbers = analyze(trace)
    lines = [f"{len(numbers['ranks'])} ranks; per rank (seconds from its first to its last event):",
             f"{'rank':>5} {'span':>12} {'compute':>12} {'comm':>12} {'exposed':>12} {'overlap':>8} {'dropped':>8}"]
    for rank, n in numbers["ranks"].items():
        overlap = "-" if n["overlap"] is None else f"{100 * n['overlap']:.1f}%"
        lines.append(f"{rank:>5} {_ms(n['span']):>12} {_ms(n['compute']):>12} {_ms(n['communication']):>12} "
                     f"{_ms(n['exposed']):>12} {overlap:>8} {n['dropped']:>8}")
    computes = {r: n["compute"] for r, n in numbers["ranks"].items()}
    if len(computes) > 1 and statistics.median(computes.values()) > 0:
        slow, fast = max(computes, key=computes.get), min(computes, key=computes.get)
        median = statistics.median(computes.values())
        lines.append(f"slowest rank by compute: {slow} ({computes[slow] / median:.2f}x the median, "
                     f"{computes[slow] / max(computes[fast], 1e-12):.2f}x rank {fast}, the fastest)")
    by_pipeline = {}
    for b in numbers["pipeline"]:
        by_pipeline.setdefault(b["pipeline"], []).append(b)
    for bubbles in by_pipeline.values():
        # The first step warms up (allocations, connections): the median is over the others when there are any.
        measured = [b["measured"] for b in (bubbles[1:] if len(bubbles) > 1 else bubbles)]
        b = bubbles[-1]
        lines.append(f"pipeline {b['schedule']} p={b['p']} m={b['m']}" + (f" v={b['v']}" if b["v"] > 1 else "")
                     + f": bubble {statistics.median(measured):.3f} measured (median of {len(measured)} steps), "
                     f"{b['formula']:.3f} by the schedule's formula")
    if numbers["slowest"]:
        lines.append(f"slowest communication calls (of {len(numbers['slowest'])}):")
        for e in numbers["slowest"][:top]:
            args = e.get("args") or {}
            kind = "nonblocking, start to completion" if "posted_us" in args else "blocking"
            lines.append(f"  rank {e['pid']}: {e['name']} {_bytes(args.get('bytes', 0))} on {args.get('comm')} "
                         f"{_ms(e['dur'] * 1e-6)} ({kind}) at {_ms(e['ts'] * 1e-6)}")
    return "\n".join(lines)


_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "weight grad (W)": "#da8bc3", "optimizer": "#55a868",
           "compute": "#937860", "comm": "#c44e52"}
_PIPELINE_COLORS = {"F": "forward", "B": "backward", "W": "weight grad (W)"}  # actions drawn as their phase


def plot(trace, path):
    """Draw ranks x time, colored by phase, to ``path`` (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("mpidist trace summary --plot needs matplotlib (pip install mpidist[examples])") from None
    events = _complete(trace)
    ranks = sorted({e["pid"] for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.9 * len(ranks)))
    for i, rank in enumerate(ranks):
        for e in events:
            category = e.get("cat")
            if category == "pipeline":
                category = _PIPELINE_COLORS.get((e.get("args") or {}).get("kind"))
            if e["pid"] != rank or category not in _COLORS:
                continue
            depth = (e.get("args") or {}).get("depth", 0)
            if depth and e.get("cat") in ("forward", "backward"):
                continue  # outermost calls only: nested ones would paint over them
            row = i + (0.45 if category == "comm" else 0.0)
            ax.broken_barh([(e["ts"] * 1e-3, max(e["dur"] * 1e-3, 1e-3))], (row, 0.4), color=_COLORS[category])
    ax.set_yticks([i + 0.42 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(_COLORS),
              fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
