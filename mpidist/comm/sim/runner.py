"""simulate(): run a function on N rank threads that share one simulated universe."""

import os
import threading

from mpi4py import MPI

from ..errors import DeadlockError, RankFailedError
from .comm import SimComm
from .engine import Context, Universe

__all__ = ["simulate", "current", "rank_threads"]

_local = threading.local()


def current():
    """The calling rank thread's (world, self) communicators, or None outside a simulated rank."""
    return getattr(_local, "comms", None)


def bind_thread(size=1, rank=0):
    """Give the calling (non-rank) thread rank ``rank`` of a fresh world of ``size``, for queries such as
    ``MPI.COMM_WORLD.Get_size()`` made while a module is imported; return the previous binding."""
    previous = current()
    universe = Universe(size)
    _local.comms = (SimComm(Context(universe, range(size), "SIM_WORLD"), rank),
                    SimComm(Context(universe, [rank], "SIM_SELF"), 0))
    return previous


def rank_threads(n, target, *, ranks_per_node=None, timeout=None, seed=None, name="SIM_WORLD"):
    """Run ``target(rank, world)`` on ``n`` rank threads; return (results, errors, universe)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"simulate: n must be a positive int (got {n!r})")
    if timeout is None and os.environ.get("MPIDIST_SIM_TIMEOUT"):
        timeout = float(os.environ["MPIDIST_SIM_TIMEOUT"])
    universe = Universe(n, timeout, seed=seed, ranks_per_node=ranks_per_node)
    world = Context(universe, range(n), name)
    results = [None] * n
    errors = [None] * n

    def run(rank):
        comm = SimComm(world, rank)
        self_comm = SimComm(Context(universe, [rank], "SIM_SELF"), 0)
        _local.comms = (comm, self_comm)
        try:
            results[rank] = target(rank, comm)
        except BaseException as exc:  # noqa: BLE001 - any failure must release the other ranks
            errors[rank] = exc
            with universe.cond:
                if universe.failure is None and not isinstance(exc, (RankFailedError, DeadlockError)):
                    universe.failure = (rank, exc)
                universe.changed()
        finally:
            _local.comms = None
            with universe.cond:
                universe.alive -= 1
                universe.changed()

    threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors, universe


def simulate(n, fn, *args, ranks_per_node=None, timeout=None, seed=None, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``n`` threads, one per simulated rank; return the results by rank.

    The first rank to raise makes every other rank's pending communication raise ``RankFailedError``;
    ``simulate`` then re-raises that first exception with its rank noted.
    ``ranks_per_node`` groups consecutive ranks into simulated nodes for ``Split_type``.
    ``timeout`` (seconds; default ``MPIDIST_SIM_TIMEOUT`` or none) makes a wait that lasts longer raise
    ``WatchdogTimeout`` describing what every rank is doing.
    ``seed`` picks, among the messages that may legally match a wildcard receive, one at random from a
    generator seeded with it (MPI allows any); the default takes the oldest.
    """
    results, errors, universe = rank_threads(n, lambda rank, comm: fn(comm, *args, **kwargs),
                                             ranks_per_node=ranks_per_node, timeout=timeout, seed=seed)
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
