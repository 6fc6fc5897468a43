"""Guards on collectives: desync checks, per-phase time limits with a watchdog, and a flight recorder.

- ``fingerprint``: ranks compare (sequence, op, dtype, count, shape, root, reduction) before a collective
  moves data: every collective in debug mode (``MPIDIST_DEBUG=1``), always on messages of at least
  ``check_bytes``; a mismatch raises ``DesyncError`` on every rank naming the ranks and what differs.
- ``watchdog`` and ``phases``: a call in flight longer than its limit (``collective_timeout``, or its
  phase's, e.g. ``checkpoint``) is reported with the ranks that did and did not arrive, and the job aborted;
  so is, within about a second, a collective that a rank which left the job (its program ended) never joins.
- ``record`` and ``flight``: every call is recorded in a per-process ring (the flight recorder), dumped
  as JSON per rank on a watchdog timeout, an abort or SIGUSR2; ``python -m mpidist flight DIR`` reads
  the dumps back and names, per communicator, the first call where ranks differ.

Costs (benchmarks/guard_cost.py) are in docs/reliability.md.
"""

import dataclasses
import sys
import time

from . import config, fingerprint, flight, phases as _phases, record, watchdog
from .fingerprint import DesyncError
from .flight import report as flight_report
from .phases import phase
from .config import Settings
from .watchdog import Watchdog, start_watchdog, stop_watchdog, wait_until_pipes_drained

__all__ = ["DesyncError", "Settings", "settings", "configure", "phase", "dump_flight_record", "flight_report",
           "in_flight", "name_dtypes", "Watchdog", "start_watchdog", "stop_watchdog", "wait_until_pipes_drained"]

settings = None


def _use(new):
    global settings
    settings = new
    record.apply(new)
    for module in (flight, _phases, watchdog):
        module.use_settings(new)


_use(config.from_environment())


def configure(**changes):
    """Change this process's guard settings (fields of ``Settings``; unknown names are refused).

    ``watchdog_timeout`` is accepted as the former name of ``collective_timeout``.
    """
    if "watchdog_timeout" in changes:
        changes["collective_timeout"] = changes.pop("watchdog_timeout")
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"guard.configure: unexpected argument {unknown[0]!r} (expected some of {', '.join(sorted(known))})")
    _use(dataclasses.replace(settings, **{k: v for k, v in changes.items() if v is not None}))
    return settings


def name_dtypes(names):
    """Tell the guard the dtype names of the codes collectives use (reports name dtypes, not codes)."""
    fingerprint.dtype_names = tuple(names)


def dump_flight_record(reason, wait=3.0):
    """Write this rank's flight record and ask every other rank (through the watchdog) to write theirs.

    For the abort path: waits at most ``wait`` seconds for the others, never raises, and prints one line
    saying where the records are. Returns this rank's path (None if it could not be written).
    """
    path = flight.dump(reason)
    dog = watchdog.running()
    if dog is not None:
        try:
            dog.request_dump(reason, wait)
        except Exception:  # noqa: BLE001 - it runs on the way to an abort, which must happen anyway
            pass
    if path:
        folder = flight.directory()
        try:
            sys.stderr.write(f"mpidist: flight records in {folder} (python -m mpidist flight {folder})\n")
        except Exception:  # noqa: BLE001
            pass
    return path


def in_flight(comm=None):
    """Return [(communicator name, op, sequence, seconds in flight)] of this process's calls in flight.

    With ``comm``: only those on ``comm`` (simulated ranks share one process, and so these records).
    """
    now = time.monotonic()
    return [(r[record.COMM].name, r[record.OP], r[record.SEQ], now - r[record.START]) for r in record.in_flight(comm)]
