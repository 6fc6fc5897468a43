"""simulate(): run a function on N rank threads that share one simulated universe."""

import ctypes
import os
import threading
import time

from mpi4py import MPI

from ... import config
from ..errors import DeadlockError, RankFailedError
from .comm import SimComm
from .engine import Context, Universe, bind_rank, current

__all__ = ["simulate", "current", "rank_threads"]


def bind_thread(size=1, rank=0):
    """Give the calling (non-rank) thread rank ``rank`` of a fresh world of ``size``, for queries such as
    ``MPI.COMM_WORLD.Get_size()`` made while a module is imported; return the previous binding."""
    previous = current()
    universe = Universe(size)
    bind_rank((SimComm(Context(universe, range(size), "SIM_WORLD"), rank),
               SimComm(Context(universe, [rank], "SIM_SELF"), 0)))
    return previous


def parse_cpus(cpus):
    """Return the set of CPU numbers ``cpus`` names ("0", "0,2", "0-3", or ints), or None for None/"".

    Raise ValueError naming the value when it is malformed or names CPUs this process may not use.
    """
    if cpus is None or cpus == "":
        return None
    if isinstance(cpus, int) and not isinstance(cpus, bool):
        cpus = [cpus]
    try:
        if isinstance(cpus, str):
            chosen = set()
            for part in cpus.split(","):
                first, _, last = part.strip().partition("-")
                chosen.update(range(int(first), int(last or first) + 1))
        else:
            chosen = {int(c) for c in cpus}
    except (TypeError, ValueError):
        raise ValueError(f"simulate: cpus must name CPUs like '0', '0,2' or '0-3' (got {cpus!r})") from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if not chosen or (allowed is not None and not chosen <= allowed):
        raise ValueError(f"simulate: cpus {sorted(chosen)} (from {cpus!r}) must be a non-empty subset of the CPUs "
                         f"this process may use: {sorted(allowed) if allowed is not None else 'unknown'}")
    if allowed is None:
        raise ValueError(f"simulate: cpus={cpus!r}: this platform cannot bind threads to CPUs")
    return chosen


def rank_threads(n, target, *, ranks_per_node=None, timeout=None, seed=None, name="SIM_WORLD", abandon_after=None,
                 cpus=None):
    """Run ``target(rank, world)`` on ``n`` rank threads; return (results, errors, universe).

    ``abandon_after`` (seconds): once a rank failed, a rank thread that has not ended this long after
    (computing, sleeping, reading stdin: nothing a communication call could release) gets ``RankFailedError``
    raised in it; one that still runs as long again is left behind (a daemon thread), as mpiexec kills it.
    ``cpus`` (default ``MPIDIST_SIM_CPUS``; see ``parse_cpus``): bind every rank thread to these CPUs. One CPU
    makes a message's handoff between rank threads a switch on that core instead of waking another core
    (8-byte latency 12-16 us instead of 32-46 us here), at the price of rank threads' numpy work no longer
    running in parallel.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"simulate: n must be a positive int (got {n!r})")
    if timeout is None:
        timeout = config.get("MPIDIST_SIM_TIMEOUT") or None  # 0: no limit
    cpus = parse_cpus(cpus) if cpus is not None else config.get("MPIDIST_SIM_CPUS", parse=parse_cpus)
    universe = Universe(n, timeout, seed=seed, ranks_per_node=ranks_per_node)
    world = Context(universe, range(n), name)
    results = [None] * n
    errors = [None] * n

    def run(rank):
        comm = SimComm(world, rank)
        self_comm = SimComm(Context(universe, [rank], "SIM_SELF"), 0)
        bind_rank((comm, self_comm))
        try:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)  # this thread only (Linux binds threads one by one)
            results[rank] = target(rank, comm)
        except BaseException as exc:  # noqa: BLE001 - any failure must release the other ranks
            errors[rank] = exc
            with universe.cond:
                if universe.failure is None and not isinstance(exc, (RankFailedError, DeadlockError)):
                    universe.failure = (rank, exc)
                universe.changed()
        finally:
            bind_rank(None)
            with universe.cond:
                universe.alive -= 1
                universe.changed()

    threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    if abandon_after is None:
        for t in threads:
            t.join()
    else:
        _join_or_abandon(threads, universe, abandon_after)
    return results, errors, universe


def _join_or_abandon(threads, universe, grace):
    deadline, interrupted = None, False
    while True:
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            return
        alive[0].join(0.05)
        if universe.failure is None and universe.deadlock is None:
            continue
        now = time.monotonic()
        if deadline is None:
            deadline = now + grace
        elif now > deadline and not interrupted:
            for t in alive:  # raised at the thread's next bytecode: ends a compute loop or a sleep
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Stopped))
            deadline, interrupted = now + grace, True
        elif now > deadline:
            return


class _Stopped(RankFailedError):
    """Raised inside a rank thread that kept running after another rank failed."""


def simulate(n, fn, *args, ranks_per_node=None, timeout=None, seed=None, cpus=None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``n`` threads, one per simulated rank; return the results by rank.

    The first rank to raise makes every other rank's pending communication raise ``RankFailedError``;
    ``simulate`` then re-raises that first exception with its rank noted.
    ``ranks_per_node`` groups consecutive ranks into simulated nodes for ``Split_type``.
    ``timeout`` (seconds; default ``MPIDIST_SIM_TIMEOUT`` or none) makes a wait that lasts longer raise
    ``WatchdogTimeout`` describing what every rank is doing.
    ``seed`` picks, among the messages that may legally match a wildcard receive, one at random from a
    generator seeded with it (MPI allows any); the default takes the oldest.
    ``cpus`` binds the rank threads to CPUs (see ``rank_threads``; default ``MPIDIST_SIM_CPUS``).
    """
    results, errors, universe = rank_threads(n, lambda rank, comm: fn(comm, *args, **kwargs),
                                             ranks_per_node=ranks_per_node, timeout=timeout, seed=seed, cpus=cpus)
    if universe.failure is not None:
        rank, exc = universe.failure
    else:
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return results
        rank, exc = failed[0]
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised on simulated rank {rank} of {n})")
    # MPI.Exception keeps its args (the error code): str() and Get_error_class() read them.
    if not isinstance(exc, MPI.Exception) and (not exc.args or f"rank {rank}" not in str(exc.args[0])):
        try:
            exc.args = (f"[simulated rank {rank}] {exc.args[0] if exc.args else ''}",) + tuple(exc.args[1:])
        except (AttributeError, TypeError):
            pass
    raise exc.with_traceback(exc.__traceback__)
