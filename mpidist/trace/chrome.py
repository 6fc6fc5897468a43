"""Chrome trace-event files: one per rank, and the merged file that Perfetto and chrome://tracing open.

Glossary:
- rank file: ``DIR/rankNNNNN.json``, one rank's events in the JSON object format (``traceEvents``),
  times already on rank 0's clock (microseconds), and ``otherData`` saying who wrote it, its clock
  offset and how many events the ring dropped. Each is a valid trace on its own.
- merged file: ``DIR/trace.json``, every rank's events with times from the earliest event of all
  (``ts`` 0), one process row per rank (``pid`` = rank), three thread rows each (see recorder).
"""

import json
import os
import socket

from ..files import write_text_atomic
from .recorder import ROW_NAMES

__all__ = ["rank_file", "write_rank", "merge", "load", "MERGED", "FORMAT"]

FORMAT = "mpidist-trace-1"
MERGED = "trace.json"


def rank_file(directory, rank):
    return os.path.join(directory, f"rank{rank:05d}.json")


def _metadata_events(rank):
    events = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    for row, name in ROW_NAMES.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": row, "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": row, "args": {"sort_index": row}})
    return events


def chrome_events(recorder, events, offset):
    """Return ``events`` (recorder tuples) as Chrome complete events, times in microseconds on rank 0's clock."""
    rank = recorder.rank
    out = _metadata_events(rank)
    for row, category, name, start, end, args in events:
        event = {"name": name, "cat": category, "ph": "X", "ts": round((start + offset) * 1e6, 3),
                 "dur": round(max(end - start, 0.0) * 1e6, 3), "pid": rank, "tid": row}
        if args:
            event["args"] = args
        out.append(event)
    return out


def write_rank(directory, recorder, offset, round_trip, events=None):
    """Write ``recorder``'s events to its rank file (atomically); return the path."""
    events = list(recorder.events) if events is None else events
    content = {
        "traceEvents": chrome_events(recorder, events, offset),
        "displayTimeUnit": "ms",
        "otherData": {"format": FORMAT, "rank": recorder.rank, "size": recorder.size, "host": socket.gethostname(),
                      "pid": os.getpid(), "clock_offset_s": offset, "clock_round_trip_s": round_trip,
                      "events": len(events), "dropped": recorder.count - len(recorder.events), **recorder.meta},
    }
    os.makedirs(directory, exist_ok=True)
    path = rank_file(directory, recorder.rank)
    write_text_atomic(path, json.dumps(content, separators=(",", ":")))
    return path


def _rank_files(directory):
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if n.startswith("rank") and n.endswith(".json"))


def _read(path):
    try:
        with open(path) as f:
            content = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"mpidist trace: cannot read {path}: {exc}") from None
    if not isinstance(content, dict) or "traceEvents" not in content:
        raise ValueError(f"mpidist trace: {path} is not a Chrome trace (no traceEvents)")
    return content


def merge(directory, output=None):
    """Merge the rank files under ``directory`` into one trace (``DIR/trace.json``); return its path."""
    files = _rank_files(directory)
    if not files:
        raise ValueError(f"mpidist trace: no rank files (rankNNNNN.json) in {directory}")
    contents = [_read(p) for p in files]
    starts = [e["ts"] for c in contents for e in c["traceEvents"] if e.get("ph") == "X"]
    base = min(starts) if starts else 0.0
    events = []
    for c in contents:
        for e in c["traceEvents"]:
            if e.get("ph") == "X":
                e = dict(e, ts=round(e["ts"] - base, 3))
            events.append(e)
    ranks = [c.get("otherData", {}) for c in contents]
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"format": FORMAT, "base_us": base, "ranks": ranks,
                            "clock": "rank 0's time.monotonic in microseconds, minus base_us"}}
    path = output or os.path.join(directory, MERGED)
    write_text_atomic(path, json.dumps(merged, separators=(",", ":")))
    return path


def load(path):
    """Return the merged trace at ``path``: a trace file, or a directory (its trace.json, else its rank files)."""
    if os.path.isdir(path):
        merged = os.path.join(path, MERGED)
        if os.path.exists(merged):
            return _read(merged)
        files = _rank_files(path)
        if not files:
            raise FileNotFoundError(f"mpidist trace: no {MERGED} and no rank files in {path}")
        contents = [_read(p) for p in files]
        return {"traceEvents": [e for c in contents for e in c["traceEvents"]],
                "otherData": {"ranks": [c.get("otherData", {}) for c in contents]}}
    if not os.path.exists(path):
        raise FileNotFoundError(f"mpidist trace: {path} does not exist")
    return _read(path)
