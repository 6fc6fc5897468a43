"""Per-rank timelines: where each rank's time goes, as one Chrome trace of every rank.

``trace.start(DIR, comm)`` on every rank (or ``MPIDIST_TRACE=DIR`` in the environment) records, per rank,
module forward and backward calls (down to ``depth`` calls deep), optimizer steps, every collective and
point-to-point call (op, communicator, bytes, peer; start, the moment a nonblocking call returned, end),
pipeline actions (F/B/W with stage and micro-batch) and any ``trace.span``. ``trace.stop()`` (or the
end of the process) measures each rank's clock offset to rank 0, writes ``DIR/rankNNNNN.json`` per rank
and merges them into ``DIR/trace.json`` (Perfetto, chrome://tracing). ``python -m mpidist trace summary DIR``
reads it back: compute, communication, exposed communication, overlap, pipeline bubble, slowest calls.

Memory is bounded: each rank keeps its last ``limit`` events (a ring); the files say how many were dropped.
Off (the default), nothing is registered: the only cost left is the pipeline executor's one flag check.
Measured cost on: docs/performance.md (benchmarks/trace_cost.py).
"""

import atexit
import os
import threading

from mpi4py import MPI

from mpidist import config
from mpidist.comm import check_comm, is_simulated, world_comm

from . import analysis, chrome, clock, recorder as _recorder
from .chrome import load, merge
from .recorder import COMM, COMPUTE, IN_FLIGHT, span

__all__ = ["start", "stop", "span", "enabled", "load", "merge", "summary", "COMPUTE", "COMM", "IN_FLIGHT"]

_sessions = threading.local()  # the calling rank's (directory, comm, rank) between start and stop
_process_session = None        # the same, for a stop called from another thread than start (MPI)


def enabled():
    """Return whether this process is recording."""
    return _recorder.on


def _check(name, value, low):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"trace.start: {name} must be an int >= {low} (got {value!r})")


def start(directory, comm=None, depth=1, limit=1 << 20, **meta):
    """Start recording this rank's timeline into ``directory``; collective over ``comm`` (default: the world).

    ``depth``: time modules down to this many calls deep (0: only the outermost, e.g. the model).
    ``limit``: events kept per rank (the last ones; older ones are counted as dropped).
    ``meta``: JSON-able values written into this rank's file (``otherData``).
    """
    global _process_session
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"trace.start: directory must be a path (got {type(directory).__name__})")
    _check("depth", depth, 0)
    _check("limit", limit, 1)
    if comm is None:
        comm = world_comm()
    check_comm("trace.start", comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    _recorder.install(depth, limit, rank)
    recorder = _recorder.recorder_for(rank, size)
    recorder.meta.update(meta, depth=depth, limit=limit)
    _recorder.bind(recorder)
    session = (os.fspath(directory), comm, rank)
    _sessions.value = session
    if not is_simulated(comm):
        _process_session = session
    comm.Barrier()  # every rank's recorder exists before any rank can stop (the last to stop switches off)


def stop():
    """Stop recording; write this rank's file, and on rank 0 the merged one. Collective over start's ``comm``.

    Returns the merged file's path on rank 0, None elsewhere.
    """
    global _process_session
    session = getattr(_sessions, "value", None) or _process_session
    if session is None:
        raise RuntimeError("trace.stop: tracing was not started on this rank (call trace.start first)")
    _sessions.value = None
    if session is _process_session:
        _process_session = None
    directory, comm, rank = session
    recorder = _recorder.take(rank)
    events = list(recorder.events) if recorder is not None else []
    # Simulated ranks are threads sharing this process's clock: offset 0 by construction.
    offset, round_trip = (0.0, 0.0) if is_simulated(comm) else clock.measure_offset(comm)
    if recorder is not None:
        chrome.write_rank(directory, recorder, offset, round_trip, events)
    comm.Barrier()
    path = chrome.merge(directory) if rank == 0 else None
    comm.Barrier()  # the merged file exists on return
    return path


def summary(path, top=5):
    """Return the report ``python -m mpidist trace summary PATH`` prints."""
    return analysis.report(load(path), top)


# -- MPIDIST_TRACE=DIR: record the whole process, written at its end --------------------------------------
def _at_exit(directory):
    recorders = _recorder.take_all()
    world = MPI.COMM_WORLD if MPI.Is_initialized() and not MPI.Is_finalized() else None
    if world is not None and world.Get_size() > 1:
        offset, round_trip = clock.measure_offset(world)
        for r in recorders:
            chrome.write_rank(directory, r, offset, round_trip)
        world.Barrier()
        if world.Get_rank() == 0:
            print(f"mpidist: trace in {chrome.merge(directory)} (python -m mpidist trace summary {directory})")
        return
    if recorders:  # one process: itself, or simulated ranks sharing its clock
        for r in recorders:
            chrome.write_rank(directory, r, 0.0, 0.0)
        print(f"mpidist: trace in {chrome.merge(directory)} (python -m mpidist trace summary {directory})")


def _from_environment(env=os.environ):
    directory = config.get("MPIDIST_TRACE", env)
    if not directory:
        return
    depth, limit = config.get("MPIDIST_TRACE_DEPTH", env), config.get("MPIDIST_TRACE_LIMIT", env)
    problem = config.writable_problem(directory)  # now, not in an exit handler whose error leaves status 0
    if problem:
        raise config.ConfigError(f"MPIDIST_TRACE: cannot write the trace to {directory!r} ({problem}); "
                                 f"point it to a directory this job can write to")
    _recorder.install(1 if depth is None else depth, 1 << 20 if limit is None else limit)
    atexit.register(_at_exit, directory)


_from_environment()
