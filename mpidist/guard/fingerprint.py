"""Desync checks: ranks compare what they are about to do before a collective moves any data.

Glossary:
- fingerprint: (sequence number, op, dtype, count, shape, root, reduction) of one collective call on one
  communicator; the sequence number counts mpidist collectives per communicator.
- check: ranks MAX-allreduce ``[fp, -fp]`` (one 14-int message); if any field differs, every rank
  gathers all fingerprints and raises ``DesyncError`` naming the ranks and what differs.
- shadow: under MPI a check talks on a private duplicate of the communicator, never on the
  communicator itself, so that it can never be matched with another rank's data call (see below).
- straddle: ranks whose messages lie on both sides of ``check_bytes`` (which is itself a desync: these
  collectives need equal sizes); the ranks above the threshold check, the ranks below do not.
- verdict: the watchdog's finding that a checking rank waits for ranks that went ahead without a check.

When checks run: on every collective in debug mode (``MPIDIST_DEBUG=1``); otherwise on collectives
whose message has at least ``check_bytes`` bytes, where the extra small allreduce costs under 2% of
the collective (measured with benchmarks/guard_cost.py, docs/reliability.md). allgather and alltoall,
whose sizes legitimately differ by rank, exchange their shapes on every call anyway; their fingerprint
rides on that exchange (``compare_stamps``), at every size and at no extra cost.

Why the shadow, and what a straddle does: the decision to check is made from this rank's own size,
the only thing it knows without communicating. In a count mismatch across the threshold (rank 0 passes
1M elements, rank 1 ten) rank 0 checks and rank 1 does not. Were the check on the communicator itself,
rank 0's check would be matched with rank 1's data and both would compute garbage. On the shadow it
waits; rank 1 waits in its data call for rank 0; no rank returns wrong numbers. After ``desync_grace``
seconds rank 0's watchdog asks the members what they are doing; ranks blocked in a collective on the
same communicator without a check can only be waiting for rank 0, so rank 0 raises ``DesyncError``
naming both calls, and the ranks blocked inside MPI (which cannot raise) print the same text on their
stderr. Without a watchdog (no ``init()``), a straddle waits like any other hang; on SimComm, which
compares the calls of every round itself, it raises ``CollectiveMismatchError`` on every rank.
"""

import numpy as np
from mpi4py import MPI

from ..comm.agree import describe_ranks
from ..comm.errors import CommError
from ..wire import DTYPES, REDUCTION_NAMES

__all__ = ["DesyncError", "check", "compare_stamps", "mediate", "describe", "describe_call", "OPS"]

# The calls a fingerprint names: mpidist.collectives', then the torch backend's (mpidist.torch) that differ.
OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "send", "recv",
       "iallreduce", "ibroadcast", "iallgather", "alltoall", "ireduce_scatter",
       "reduce", "reduce_scatter_single", "all_gather_single", "gather", "scatter", "all_to_all_single")
OP_CODES = {op: i for i, op in enumerate(OPS)}
_REDUCTIONS = ("",) + REDUCTION_NAMES  # 0: not a reduction
_RED_CODES = {name: i for i, name in enumerate(_REDUCTIONS)}
FIELDS = ("sequence", "op", "dtype", "count", "shape", "root", "reduction")
_MAX_DIMS = 8  # dims a mismatch report shows

dtype_names = tuple(row.name for row in DTYPES)  # names of the dtype codes (mpidist.wire.DTYPES)
verdicts = {}      # id(record) -> (DesyncError message, ranks it strands), left by the watchdog for the waiting check
stranded = []      # (communicator name, ranks) this rank left blocked inside MPI by raising a verdict
waker = None       # the watchdog's Waker while one runs: it resolves straddles (see the module docstring)
_abandoned = []    # requests of checks given up after a verdict: MPI may still touch their buffers


class DesyncError(CommError):
    """Ranks called different collectives at the same point of the sequence."""


def _shape_code(x, whole):
    shape = getattr(x, "shape", None)
    if not isinstance(shape, tuple):
        return -1
    # hashes of int tuples are the same in every process
    return hash(shape if whole else shape[1:]) & ((1 << 62) - 1)


def fingerprint(seq, op, dtype_code, count, x, root, reduction, whole_shape=True):
    """Return the fingerprint (see glossary) of one call as a list of ints.

    ``whole_shape``: ranks must pass the same shape (else only the trailing dims: allgather, alltoall).
    """
    return [seq, OP_CODES.get(op, -1), dtype_code, count, _shape_code(x, whole_shape), root,
            _RED_CODES.get(reduction, 0)]


def _dims(x):
    shape = getattr(x, "shape", None)
    if not isinstance(shape, tuple):
        return [-1] + [0] * _MAX_DIMS
    return [len(shape)] + [int(d) for d in shape[:_MAX_DIMS]] + [0] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))


def _name(code, names):
    return names[code] if 0 <= code < len(names) else str(code)


def describe(row, show_shape=False):
    """Return '#3 allreduce(dtype=float32, count=6, op=sum)' for a fingerprint row (with its dims, if any)."""
    seq, op, dtype, count, _, root, red = (int(v) for v in row[:7])
    parts = [f"dtype={_name(dtype, dtype_names)}", f"count={count}"]
    if show_shape and len(row) > 7 and row[7] >= 0:
        ndim = int(row[7])
        dims = [int(d) for d in row[8: 8 + min(ndim, _MAX_DIMS)]]
        parts.append(f"shape=({', '.join(map(str, dims))}{',' if ndim == 1 else ''}{', ...' if ndim > _MAX_DIMS else ''})")
    if root >= 0:
        parts.append(f"root={root}")
    if red > 0:
        parts.append(f"op={_REDUCTIONS[red]}")
    return f"#{seq} {_name(op, OPS)}({', '.join(parts)})"


def mismatch_message(name, rows):
    """Return the DesyncError text for the fingerprint rows of every rank (the same text on every rank)."""
    rows = [list(map(int, row)) for row in rows]
    differing = [f for i, f in enumerate(FIELDS) if len({row[i] for row in rows}) > 1]
    if "count" in differing and "shape" in differing:
        differing.remove("shape")  # a different count is a different shape; the count says more
    show_shape = "shape" in differing
    calls = [describe(row, show_shape) for row in rows]
    expected = calls[0]
    # The ranks that differ from rank 0 come first, whoever raises it.
    deviating = describe_ranks([c if c != expected else None for c in calls], joiner=" called ")
    everyone = describe_ranks(calls)
    return (f"collective desync on {name} at call #{rows[0][0]} (differs in {', '.join(differing)}): "
            f"expected {expected} (rank 0), but {deviating}; all ranks: {everyone}")


def check(entry, mine, x, token):
    """Compare fingerprint ``mine`` across ``entry``'s ranks; raise DesyncError on every rank if they differ.

    ``x``: the array (for the shapes a mismatch report shows); ``token``: the call's record, which a
    verdict names (``verdicts[id(token)]``).
    """
    k = len(mine)
    both = np.array(mine + [-v for v in mine], dtype=np.int64)
    _max_allreduce(entry, token, both)
    result = both.tolist()  # a list compares faster than four small numpy operations
    if result[:k] == [-v for v in result[k:]]:
        return
    row = np.array(mine + _dims(x), dtype=np.int64)
    rows = np.empty((entry.size, row.size), dtype=np.int64)
    entry.shadow.Allgather(row, rows)
    raise DesyncError(mismatch_message(entry.name, rows))


def _max_allreduce(entry, token, both):
    shadow = entry.shadow
    wake = waker.request() if waker is not None and isinstance(shadow, MPI.Comm) else None
    if wake is None:
        shadow.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
        return
    # With a watchdog, wait for the check or for the watchdog's wake-up, whichever comes first: a
    # verdict must be able to end the wait (a blocking call could not be left), and MPI's own wait
    # costs what a blocking call costs (a loop of Test calls in Python cost 10-20 us per check).
    request = shadow.Iallreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    while MPI.Request.Waitany([request, wake]) != 0:
        waker.consumed()
        found = verdicts.pop(id(token), None)
        if found is not None:
            verdict, ahead = found
            _abandoned.append((request, both))
            entry.break_(verdict)  # its shadow holds a check that never completes: refuse later calls
            stranded.append((entry.name, ahead))  # they wait for this rank forever (see watchdog's exit hook)
            raise DesyncError(verdict)
        wake = waker.request()


def compare_stamps(name, stamps):
    """Raise DesyncError (on every rank: all see ``stamps``) unless every rank's (sequence, op code) agree.

    ``stamps``: one (sequence, op code) row per rank, from a metadata exchange every rank makes.
    """
    stamps = [tuple(int(v) for v in row) for row in stamps]
    if len(set(stamps)) <= 1:
        return
    calls = [f"#{seq} {_name(op, OPS)}" for seq, op in stamps]
    expected = calls[0]
    deviating = describe_ranks([c if c != expected else None for c in calls], joiner=" called ")
    differing = [f for i, f in enumerate(("sequence", "op")) if len({s[i] for s in stamps}) > 1]
    raise DesyncError(f"collective desync on {name} at call #{stamps[0][0]} (differs in {', '.join(differing)}): "
                      f"expected {expected} (rank 0), but {deviating}")


def _row(s):
    return [s["seq"], OP_CODES.get(s["op"], -1), s["dtype"], s["count"], -1, s["peer"], _RED_CODES.get(s["reduction"], 0)]


def describe_call(summary):
    """Return '#3 allreduce(dtype=float32, count=6, op=sum)' for a record's ``summary`` (see ``record``)."""
    return describe(_row(summary))


def mediate(rank, mine, calls, check_bytes):
    """Return the DesyncError text when ranks went ahead without a check that ``mine`` waits in, else None.

    ``rank``: this rank (in the watchdog's world); ``mine``: the ``summary`` of its waiting check;
    ``calls``: {rank: summaries of that rank's records in flight}. A rank blocked in a collective on the
    same communicator that is not a check can only be waiting for this rank, which never joins it.
    """
    if not mine["checking"]:
        return None
    blocked = {}
    for r, records in sorted(calls.items()):
        for s in records:
            if s["comm"] == mine["comm"] and s["seq"] >= 0 and not s["checking"]:
                blocked[r] = s
                break
    if not blocked:
        return None
    rows = {rank: _row(mine)}
    rows.update({r: _row(s) for r, s in blocked.items()})
    differing = [f for i, f in enumerate(FIELDS) if f != "shape" and len({row[i] for row in rows.values()}) > 1]
    below = "; ".join(f"rank {r} called {describe(rows[r])} ({s['bytes']} B) and went ahead without a check"
                      for r, s in blocked.items())
    return (f"collective desync on {mine['name']} at call #{mine['seq']}"
            f"{' (differs in ' + ', '.join(differing) + ')' if differing else ''}: rank {rank} called "
            f"{describe(rows[rank])} ({mine['bytes']} B, at least the {check_bytes} B from which ranks check) and "
            f"waits in its desync check, but {below}: the ranks passed messages of different sizes")
