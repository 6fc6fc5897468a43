"""Matching engine: the state one simulated run shares, collective rounds, and point-to-point matching.

Glossary:
- universe: everything one ``simulate`` call shares: the lock, the failure flag, the deadlock bookkeeping
  and the match-order generator. Every communicator derived from the world lives in the same universe.
- context: the shared state of one communicator (its members, collective rounds, mailboxes).
- round: one collective call, matched across ranks by its per-communicator sequence number.
  The last rank to arrive checks that every rank called the same thing and computes all results.
- envelope: (source, tag, payload, kind) of a message in a mailbox; payload is packed bytes (buffer
  messages) or pickled bytes (object messages).

Point-to-point messages match posted receives in posting order and are non-overtaking per sender.
Among the messages that may legally match a wildcard receive (the oldest matching one of each sender),
the default takes the oldest (FIFO); with a seed the universe picks one at random, as MPI allows.
"""

import itertools
import random
import threading
import time

from mpi4py import MPI

from ..agree import name_ranks
from ..errors import DeadlockError, RankFailedError, WatchdogTimeout

__all__ = ["Universe", "Context", "Round", "ANY_SOURCE", "ANY_TAG", "current", "bind_rank"]

ANY_SOURCE, ANY_TAG = MPI.ANY_SOURCE, MPI.ANY_TAG

_local = threading.local()


def current():
    """The calling rank thread's (world, self) communicators, or None outside a simulated rank."""
    return getattr(_local, "comms", None)


def bind_rank(comms, helper=None):
    """Make ``comms`` (world, self) the calling thread's communicators (None: unbind).

    ``helper``: the thread's name when it is not the rank's own thread but one the rank started (its waits are
    counted apart from the rank's, and a failure of its own rank releases them too).
    """
    _local.comms = comms
    _local.helper = helper


def helper_name():
    """The calling thread's name if a rank thread started it (it runs as that rank), else None."""
    return getattr(_local, "helper", None)


class _Waiter:
    """A blocked rank's wakeup: a lock held while the rank sleeps, released once by ``Universe.changed``."""

    __slots__ = ("gate", "armed")

    def __init__(self):
        self.gate = threading.Lock()
        self.gate.acquire()
        self.armed = False  # whether the rank sleeps on ``gate`` (so that one release wakes it)


class Universe:
    """State shared by every simulated rank of one ``simulate`` run.

    ``cond`` is the universe lock (re-entrant). A rank that must wait sleeps on a lock of its own, which
    ``changed`` releases: one handoff per wakeup (a ``threading.Condition`` costs a fresh lock per wait
    and makes the woken rank contend for the condition's lock again), the floor of a Python thread switch.
    """

    def __init__(self, size, timeout=None, seed=None, ranks_per_node=None):
        self.cond = threading.RLock()
        self.size = size
        self.timeout = timeout       # watchdog: seconds one wait may last (None: forever)
        self.alive = size
        self.failure = None          # (world rank, exception) of the first rank that failed
        self.epoch = 0               # bumped on every state change, for deadlock detection
        self.waiting = {}            # world rank -> (epoch it last found its wait unsatisfied, description)
        self.helpers = 0             # live threads that rank threads started (each runs as its rank: see runner)
        self.helper_waiting = {}     # such a thread's id -> (epoch, description, world rank, name), as ``waiting``
        self.helper_threads = []     # (world rank, thread) of every thread rank threads started
        self.helper_errors = []      # (world rank, thread name, error) of such threads the simulator released
        self.deadlock = None
        self.seed = seed
        self.rng = random.Random(seed) if seed is not None else None
        self.ranks_per_node = ranks_per_node or size
        self.attrs = {}              # universe-wide state other modules keep (keyvals, published names)
        self._sleepers = []          # (lock held) the _Waiter of every thread asleep in wait_until

    def changed(self):
        """(lock held) Record a state change and wake every sleeping rank to re-check its wait."""
        self.epoch += 1
        if self._sleepers:
            for waiter in self._sleepers:
                waiter.armed = False
                waiter.gate.release()
            self._sleepers.clear()

    def wait_until(self, world_rank, ready, what):
        """Block (lock held) until ``ready()``; raise if another rank failed, all ranks are stuck, or the watchdog fires."""
        if ready():
            return
        started = time.monotonic() if self.timeout is not None else None
        seconds = 5.0 if self.timeout is None else min(5.0, self.timeout / 4)
        waiting = self.waiting
        helper = getattr(_local, "helper", None)  # the thread's name if a rank thread of this universe started it
        if helper is not None and _local.comms[0]._ctx.universe is not self:
            helper = None
        mine, key = (waiting, world_rank) if helper is None else (self.helper_waiting, threading.get_ident())
        waiter = getattr(_local, "waiter", None)  # per thread: a rank's helper threads may wait too
        if waiter is None:
            waiter = _local.waiter = _Waiter()
        try:
            while True:
                if started is not None and time.monotonic() - started > self.timeout:
                    busy = [r for r in range(self.size) if r not in waiting and r != world_rank]
                    lines = "; ".join(f"rank {r} waits in {waiting[r][1]}" for r in sorted(waiting))
                    raise WatchdogTimeout(f"watchdog: rank {world_rank} waited more than {self.timeout:g} s in {what}; "
                                          f"{lines}{'; ' if lines else ''}ranks not in a communication call: {busy}")
                if self.failure is not None and (self.failure[0] != world_rank or helper is not None):
                    r, exc = self.failure  # r None: the run itself failed (its time limit)
                    cause = str(exc) if r is None else f"simulated rank {r} failed ({type(exc).__name__}: {exc})"
                    raise RankFailedError(f"{cause}; rank {world_rank} was released from {what}")
                if self.deadlock is not None:
                    raise DeadlockError(self.deadlock)
                epoch = self.epoch
                mine[key] = (epoch, what) if helper is None else (epoch, what, world_rank, helper)
                # else some thread is not waiting: no deadlock (the common case)
                if len(waiting) >= self.alive and len(self.helper_waiting) >= self.helpers:
                    stuck = [r for r, (e, _) in waiting.items() if e == epoch]
                    helpers = sorted(v[2:] + (v[1],) for v in self.helper_waiting.values() if v[0] == epoch)
                    if len(stuck) == self.alive and len(helpers) == self.helpers:
                        lines = "; ".join([f"rank {r} waits in {waiting[r][1]}" for r in sorted(stuck)] +
                                          [f"rank {r} (its thread {name}) waits in {w}" for r, name, w in helpers])
                        # The ranks not waiting have ended (a failure would have released the waits first).
                        ended = [r for r in range(self.size) if r not in waiting]
                        ended = f" and {name_ranks(ended)} returned without joining them" if ended else ""
                        self.deadlock = f"deadlock: every live simulated rank is blocked{ended}: {lines}"
                        self.changed()
                        raise DeadlockError(self.deadlock)
                # Sleep until ``changed`` releases the gate or ``seconds`` pass, the universe lock released.
                waiter.armed = True
                self._sleepers.append(waiter)
                saved = self.cond._release_save()
                try:
                    woken = waiter.gate.acquire(True, seconds)
                finally:
                    self.cond._acquire_restore(saved)
                if not woken:
                    if waiter.armed:  # timed out before anyone woke it
                        waiter.armed = False
                        self._sleepers.remove(waiter)
                    else:  # woken between the timeout and taking the lock back: consume that release
                        waiter.gate.acquire()
                if ready():
                    return
        finally:
            mine.pop(key, None)


class Round:
    """One collective call on one communicator, filled in as ranks arrive."""

    __slots__ = ("calls", "arrived", "departed", "done", "error", "results")

    def __init__(self, size):
        self.calls = [None] * size
        self.arrived = 0
        self.departed = 0
        self.done = False
        self.error = None
        self.results = [None] * size


class Context:
    """Shared state of one communicator: members, collective rounds and point-to-point queues."""

    _ids = itertools.count()

    def __init__(self, universe, world_ranks, name, topo=None):
        self.universe = universe
        self.world_ranks = list(world_ranks)
        self.name = name
        self.id = next(self._ids)
        self.rounds = {}
        self.unexpected = [[] for _ in self.world_ranks]   # per destination: envelopes nobody has asked for yet
        self.posted = [[] for _ in self.world_ranks]       # per destination: receives waiting for a message
        self.topo = topo                                   # Cartesian/graph layout, or None

    def take(self, dest, source, tag, remove=True):
        """Return (lock held) the envelope a receive (source, tag) at ``dest`` matches now, or None."""
        queue = self.unexpected[dest]
        if not queue:
            return None
        rng = self.universe.rng
        if rng is None or (source != ANY_SOURCE and tag != ANY_TAG):
            for i, env in enumerate(queue):
                if (source == ANY_SOURCE or env[0] == source) and (tag == ANY_TAG or env[1] == tag):
                    return queue.pop(i) if remove else env
            return None
        # Any sender's oldest matching message may match (non-overtaking holds per sender only).
        firsts, seen = [], set()
        for i, env in enumerate(queue):
            if env[0] not in seen and (source == ANY_SOURCE or env[0] == source) and (tag == ANY_TAG or env[1] == tag):
                seen.add(env[0])
                firsts.append(i)
        if not firsts:
            return None
        i = firsts[rng.randrange(len(firsts))] if len(firsts) > 1 else firsts[0]
        return queue.pop(i) if remove else queue[i]

    def deliver(self, dest, env):
        """Hand (lock held) an envelope to the oldest matching posted receive at ``dest``, else queue it."""
        posted = self.posted[dest]
        for i, recv in enumerate(posted):
            if (recv.source == ANY_SOURCE or recv.source == env[0]) and (recv.tag == ANY_TAG or recv.tag == env[1]):
                del posted[i]
                recv.envelope = env
                if len(env) > 4 and env[4] is not None:
                    env[4][0] = True  # a synchronous send completes once a posted receive has matched it
                return
        self.unexpected[dest].append(env)
