"""The guard's hot path: every mpidist collective and point-to-point call is numbered and recorded here.

Glossary:
- record: one call, a list indexed by the constants below: the communicator's sequence number (-1 for
  point-to-point), op, the communicator's entry, bytes, peer (root of a rooted collective, dest/source
  of point-to-point, -1 otherwise), start and end (``time.monotonic``; end is None while in flight),
  dtype code, element count, reduction, and state (RUNNING, or CHECKING while in a desync check).
  A record is also the token ``enter`` returns and ``leave`` takes.
- entry: what this process knows of one communicator: its key, name, size, members, the number of
  collectives started on it, and its shadow (the private duplicate desync checks talk on).
- key: a communicator's name that is the same on every member rank: its members' world ranks, its
  name (``Get_name``) if it has one, and how many communicators alike this rank used before
  ("0-3:MPI_COMM_WORLD#0", "0,2#1"). MPI gives communicators no identity that ranks can compare,
  and names are often empty; two unnamed duplicates are told apart by the order of first use.
- ring: the flight recorder, the last ``flight_size`` records of this process.
- held: records of nonblocking calls whose handle is still waited for; kept even after the ring moves on.

Recording is on by default: a call costs two clock reads, one list and a deque append (measured in
docs/reliability.md). Nothing here takes a lock: appends and pops are atomic under the GIL, and readers
(the watchdog, a dump) copy the ring first.
"""

import collections
import time
import weakref

from mpi4py import MPI

from mpidist.comm import comm_key, is_simulated, world_ranks

from . import fingerprint

__all__ = ["enter", "enter_p2p", "leave", "hold", "in_flight", "sequence", "entry_of", "snapshot", "summary", "started",
           "Entry"]

SEQ, OP, COMM, BYTES, PEER, START, END, DTYPE, COUNT, REDUCTION, STATE = range(11)
RUNNING, CHECKING = 0, 1

_clock = time.monotonic
enabled = True            # False only in benchmarks that measure what recording costs
_debug = False            # settings.desync
_check_bytes = 1 << 62    # settings.check_bytes, "never" when 0
_ring = collections.deque(maxlen=2000)
_held = {}                # id(record) -> record
_entries = {}             # id(communicator) -> Entry (checked against a weak reference: ids are reused)
_last = (None, None)      # (communicator, entry) of the last call: most calls use the one before's
_ordinals = collections.Counter()
# mpidist.trace's hooks while it records (None otherwise): ``on_hold(record)`` when a nonblocking call
# returns its handle, ``on_wait(record)`` when the caller starts waiting for it, ``on_leave(record)`` when a
# call completes. One global check on the hot path.
on_hold = None
on_wait = None
on_leave = None


def apply(settings):
    """Take the hot path's values from ``settings`` (a ``guard.settings.Settings``)."""
    global _debug, _check_bytes, _ring
    _debug = settings.desync
    _check_bytes = settings.check_bytes or 1 << 62
    if _ring.maxlen != settings.flight_size:
        _ring = collections.deque(_ring, maxlen=settings.flight_size)


def span(ranks):
    """Return "0-3" for consecutive ranks, "0,2,5" otherwise."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class Entry:
    """What this process knows of one communicator (see the glossary)."""

    __slots__ = ("ref", "owner", "seq", "size", "rank", "name", "members", "key", "shadow", "broken", "__weakref__")

    def __init__(self, comm):
        self.owner = weakref.ref(comm, self._gone)
        self.ref = self.owner
        self.seq = 0
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        # None under SimComm (every simulated rank lives in this process; names identify its communicators)
        # and for objects that only answer like a communicator
        self.members = world_ranks(comm)
        try:
            label = comm.Get_name()
        except Exception:  # noqa: BLE001 - a name only labels reports
            label = ""
        basis = (self.members, label, self.rank)
        ordinal = _ordinals[basis]
        _ordinals[basis] += 1
        if is_simulated(comm):
            # One process holds every rank, so a per-process ordinal depends on which ranks used which
            # communicators before; comm_key is the same on every rank and unique (and local there).
            self.key = f"{label}#{comm_key(comm)[-1]}"
        elif self.members is None:  # an object that answers like a communicator: its members are unknown
            self.key = f"{label}#{ordinal}"
        else:
            self.key = f"{span(self.members)}{':' + label if label else ''}#{ordinal}"
        self.name = label or f"comm {self.key}"
        # Checks talk on a private duplicate under MPI (see fingerprint); made at the first collective.
        # The simulator compares every call of a round itself, so a check there uses the communicator.
        self.shadow = comm if self.members is None or self.size == 1 else None
        self.broken = None

    def _gone(self, _ref):
        shadow, self.shadow = self.shadow, None
        if shadow is None:
            return
        try:
            if self.members is not None and not MPI.Is_finalized():  # an MPI communicator (or our Dup of one)
                shadow.Free()
        except Exception:  # noqa: BLE001 - MPI refused, or interpreter exit already cleared this module's globals
            pass

    def break_(self, reason):
        """Refuse every later call on this communicator (a check on its shadow can never complete)."""
        global _last
        self.broken = reason
        self.ref = _nothing  # the next call takes the slow path, which raises
        _last = (None, None)

    def describe(self):
        """Return the JSON-able description flight records carry."""
        return {"name": self.name, "size": self.size, "rank": self.rank, "members": self.members, "calls": self.seq}


def _register(comm):
    old = _entries.get(id(comm))
    if old is not None and old.broken is not None and old.owner() is comm:
        raise fingerprint.DesyncError(f"{old.name} cannot be used after a collective desync: {old.broken}")
    entry = Entry(comm)
    _entries[id(comm)] = entry
    return entry


def entry_of(comm):
    """Return ``comm``'s entry (registering it)."""
    entry = _entries.get(id(comm))
    return entry if entry is not None and entry.ref() is comm else _register(comm)


def _lookup(comm):
    """Return ``comm``'s entry (registering it) and remember it as the last one used."""
    global _last
    entry = _entries.get(id(comm))
    if entry is None or entry.ref() is not comm:
        entry = _register(comm)
    _last = (comm, entry)
    return entry


def enter(comm, op, x, nbytes, dtype_code, count, peer, reduction, sized=True):
    """Record the start of collective ``op`` on ``comm``; check its fingerprint when due; return the record.

    ``x`` is the array (None for a bad one: the validation that follows names it), ``nbytes`` its size.
    ``sized``: every rank passes the same number of bytes (allreduce, broadcast, reduce_scatter,
    allgather into ``out``), so the size may decide whether to check. Collectives whose sizes differ by
    rank (allgather, alltoall) carry their fingerprint in their own metadata exchange instead.
    """
    last = _last
    entry = last[1] if comm is last[0] else _lookup(comm)  # the same communicator as last time: no dict lookup
    seq = entry.seq
    entry.seq = seq + 1
    checking = (_debug or (sized and nbytes >= _check_bytes)) and entry.size > 1
    record = [seq, op, entry, nbytes, peer, _clock(), None, dtype_code, count, reduction, checking]
    _ring.append(record)
    if checking or entry.shadow is None:
        try:
            if entry.shadow is None:
                # The first collective on comm, on every rank alike (whatever each one's size):
                # the one point where a duplicate can be made without being matched by a data call.
                entry.shadow = comm.Dup()
            if checking:
                fingerprint.check(entry, fingerprint.fingerprint(seq, op, dtype_code, count, x, peer, reduction, sized),
                                  x, record)
                record[STATE] = RUNNING
        except BaseException:
            record[END] = _clock()
            raise
    return record


def enter_p2p(comm, op, nbytes, peer):
    """Record the start of point-to-point ``op`` (send or recv) on ``comm``; return the record."""
    last = _last
    entry = last[1] if comm is last[0] else _lookup(comm)  # the same communicator as last time: no dict lookup
    record = [-1, op, entry, nbytes, peer, _clock(), None, -1, -1, "", RUNNING]
    _ring.append(record)
    return record


def leave(record):
    """Record that the call of ``record`` completed (or failed)."""
    record[END] = _clock()
    if _held:
        _held.pop(id(record), None)
    if on_leave is not None:
        on_leave(record)


def hold(record):
    """Keep ``record`` in flight until ``leave``, however many calls follow (a handle waits for it)."""
    _held[id(record)] = record
    if on_hold is not None:
        on_hold(record)


def snapshot():
    """Return this process's records, oldest first, and those of held handles that the ring dropped."""
    records = list(_ring)  # one C-level copy: atomic under the GIL
    seen = {id(r) for r in records}
    return records + [r for r in list(_held.values()) if id(r) not in seen]


def in_flight(comm=None):
    """Return the records not yet complete (of ``comm`` only, when given), oldest first."""
    records = [r for r in snapshot() if r[END] is None]
    if comm is not None:
        records = [r for r in records if r[COMM].owner() is comm]
    return sorted(records, key=lambda r: r[START])


def sequence(comm):
    """Return the sequence number of the collective in progress on ``comm`` (-1 when none was recorded)."""
    entry = _entries.get(id(comm))
    return entry.seq - 1 if entry is not None and entry.ref() is comm else -1


def started():
    """Return {communicator key: [collectives started, op of the last one or None]} of this process.

    What a rank that leaves the job tells the others (``watchdog``): a collective whose sequence number
    is below its count there was joined before it left; any later one never will be. The op comes from
    the ring (None when the ring no longer holds that communicator's last call).
    """
    counts = {entry.key: [entry.seq, None] for entry in list(_entries.values()) if entry.seq > 0}
    for rec in reversed(snapshot()):
        found = counts.get(rec[COMM].key)
        if found is not None and found[1] is None and rec[SEQ] == found[0] - 1:
            found[1] = rec[OP]
    return counts


def _nothing():
    return None


def summary(record):
    """Return the JSON-able description of ``record`` that flight records and the watchdog's replies carry."""
    entry = record[COMM]
    return {"comm": entry.key, "name": entry.name, "op": record[OP], "seq": record[SEQ], "bytes": record[BYTES],
            "peer": record[PEER], "dtype": record[DTYPE], "count": record[COUNT], "reduction": record[REDUCTION],
            "checking": record[STATE] == CHECKING, "start": record[START], "end": record[END]}
