"""simulate(): run a function on N rank threads that share one simulated universe."""

import ctypes
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from ... import config
from ..errors import DeadlockError, RankFailedError, WatchdogTimeout
from .comm import SimComm
from .engine import Context, Universe, bind_rank, current

__all__ = ["simulate", "current", "rank_threads", "TimeLimitExceeded", "inherit_thread_local"]


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


class TimeLimitExceeded(WatchdogTimeout):
    """A run lasted longer than its time limit; ``stacks`` and ``waits`` say where each thread was then.

    ``stacks``: (world rank, thread name or None for the rank's own thread) -> the thread's frames (a
    ``traceback.StackSummary``); ``waits``: the same keys -> the communication call it waited in, if any.
    """

    def __init__(self, limit, stacks, waits):
        super().__init__(f"timed out after {limit:g} s")
        self.limit, self.stacks, self.waits = limit, stacks, waits


# Thread-local attributes that a thread started by a rank thread takes over from it (besides the rank's
# communicators): what other modules keep per rank thread, e.g. the program runner's rank for output.
_INHERITED = []
_start = threading.Thread.start
_patch_lock = threading.Lock()
_patched = 0


def inherit_thread_local(local, name):
    """Make threads that a rank thread starts take over its value of ``local.name``."""
    _INHERITED.append((local, name))


def _start_as_rank(thread):
    """``threading.Thread.start`` while simulated ranks run: a thread that a rank thread starts runs as that rank
    (its ``MPI.COMM_WORLD``, its output), as a thread of an MPI process belongs to the process's rank."""
    comms = current()
    if comms is None or not comms[0]:
        return _start(thread)
    universe, rank = comms[0]._universe, comms[0]._world_rank
    values = [(local, name, getattr(local, name, None)) for local, name in _INHERITED]
    run = thread.run

    def run_as_rank():
        bind_rank(comms, helper=thread.name)
        for local, name, value in values:
            setattr(local, name, value)
        try:
            run()
        except (DeadlockError, RankFailedError) as exc:  # released by the simulator: the run's report says why
            with universe.cond:
                universe.helper_errors.append((rank, thread.name, exc))
        finally:
            bind_rank(None)
            for local, name, _ in values:
                setattr(local, name, None)
            with universe.cond:
                universe.helpers -= 1
                universe.changed()
    thread.run = run_as_rank
    with universe.cond:  # counted before it runs: a deadlock check must never miss it
        universe.helpers += 1
        universe.helper_threads.append((rank, thread))
    try:
        _start(thread)
    except BaseException:
        with universe.cond:
            universe.helpers -= 1
            universe.helper_threads.remove((rank, thread))
        raise


def _patch_thread_start(on):
    global _patched
    with _patch_lock:
        _patched += 1 if on else -1
        threading.Thread.start = _start_as_rank if _patched else _start


class _RankThread(threading.Thread):
    """A rank's own thread: a daemon (a run left behind must not keep this process alive), yet while it runs the
    rank's code the threads it starts are not daemons by default, as those a process's main thread starts."""

    def __init__(self, **kwargs):
        super().__init__(daemon=True, **kwargs)
        self.running_rank = False

    @property
    def daemon(self):
        return threading.Thread.daemon.fget(self) and not self.running_rank

    @daemon.setter
    def daemon(self, value):
        threading.Thread.daemon.fset(self, value)


def _join_helpers(universe, rank):
    """Wait for the non-daemon threads ``rank`` started, as a process's exit waits for its threads."""
    while True:
        with universe.cond:
            pending = [t for r, t in universe.helper_threads if r == rank and not t.daemon and t.is_alive()]
        if not pending:
            return
        pending[0].join(0.05)  # in steps: an asynchronous _Stopped can still end this thread


def rank_threads(n, target, *, ranks_per_node=None, timeout=None, seed=None, name="SIM_WORLD", abandon_after=None,
                 cpus=None, time_limit=None):
    """Run ``target(rank, world)`` on ``n`` rank threads; return (results, errors, universe).

    A thread that a rank thread starts runs as that rank (``MPI.COMM_WORLD`` is the rank's); the rank thread
    ends once its non-daemon threads have ended, as a process does.
    ``abandon_after`` (seconds): once a rank failed, a rank thread that has not ended this long after
    (computing, sleeping, reading stdin: nothing a communication call could release) gets ``RankFailedError``
    raised in it; one that still runs as long again is left behind (a daemon thread), as mpiexec kills it.
    ``time_limit`` (seconds, with ``abandon_after``): a run still going after this long fails with
    ``TimeLimitExceeded`` (``universe.failure`` is ``(None, that error)``), every thread stopped as above.
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
            threading.current_thread().running_rank = True
            results[rank] = target(rank, comm)
        except BaseException as exc:  # noqa: BLE001 - any failure must release the other ranks
            errors[rank] = exc
            with universe.cond:
                if universe.failure is None and not isinstance(exc, (RankFailedError, DeadlockError)):
                    universe.failure = (rank, exc)
                universe.changed()
        finally:
            threading.current_thread().running_rank = False
            bind_rank(None)
            with universe.cond:
                universe.alive -= 1
                universe.changed()
        try:
            _join_helpers(universe, rank)
        except _Stopped:
            pass

    threads = [_RankThread(target=run, args=(r,), name=f"sim-rank-{r}") for r in range(n)]
    _patch_thread_start(True)
    try:
        for t in threads:
            _start(t)
        if abandon_after is None:
            for t in threads:
                t.join()
        else:
            _join_or_abandon(threads, universe, abandon_after, time_limit)
    finally:
        _patch_thread_start(False)
    return results, errors, universe


def _join_or_abandon(threads, universe, grace, time_limit=None):
    deadline, interrupted = None, False
    started = time.monotonic()
    while True:
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            return
        alive[0].join(0.05)
        now = time.monotonic()
        if time_limit is not None and now - started > time_limit:
            _time_out(threads, universe, time_limit)
            deadline, time_limit = now, None  # stop every thread at once: the user's limit was the grace
        if universe.failure is None and universe.deadlock is None:
            continue
        if deadline is None:
            deadline = now + grace
        elif now > deadline and not interrupted:
            with universe.cond:
                alive += [t for _, t in universe.helper_threads if t.is_alive()]
            for t in alive:  # raised at the thread's next bytecode: ends a compute loop or a sleep
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(_Stopped))
            deadline, interrupted = now + grace, True
        elif now > deadline:
            return


def _time_out(threads, universe, limit):
    """Fail the run with ``TimeLimitExceeded``, recording where every live thread is (unless it failed already)."""
    frames = sys._current_frames()
    with universe.cond:
        if universe.failure is not None or universe.deadlock is not None:
            return
        # A rank thread that returned and waits for its own threads is not where the time goes: theirs are shown.
        owners = [(rank, None, t) for rank, t in enumerate(threads) if t.running_rank] + \
                 [(rank, t.name, t) for rank, t in universe.helper_threads]
        stacks = {(rank, name): traceback.extract_stack(frames[t.ident]) for rank, name, t in owners
                  if t.is_alive() and t.ident in frames}
        waits = {(rank, None): what for rank, (_, what) in universe.waiting.items()}
        waits.update({(v[2], v[3]): v[1] for v in universe.helper_waiting.values()})
        universe.failure = (None, TimeLimitExceeded(limit, stacks, waits))
        universe.changed()


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
