"""Flight records: each rank's last calls, written as JSON when a job hangs or dies, and read back as one report.

Glossary:
- flight record: one rank's dump: who (rank, world size, host, pid, job), why (the reason), when, the
  communicators it used (key, name, members, collectives started), its open phases, and its last calls
  (``record.summary`` of each, times as Unix seconds).
- job: an id the ranks agree on at ``init()`` (start time and rank 0's pid); records go to
  ``FLIGHT_DIR/JOB/rankNNNNN.json``, so a new run never mixes with an old one.
- first difference (per communicator): the lowest sequence number at which the member ranks' records
  disagree (a different call, or ranks that never arrived there).

Dumps happen on a watchdog timeout (every rank that answers writes its own), on an abort through
``init()``'s excepthook (``guard.dump_flight_record``), and on SIGUSR2 (``kill -USR2 PID``: that rank only;
it works while the rank is blocked inside MPI, see ``install_signal``).
"""

import json
import os
import signal
import socket
import sys
import threading
import time
import warnings

from .. import config as environment
from ..comm.agree import raise_if_any
from ..files import write_text_atomic
from . import fingerprint, record as _record
from .config import Settings
from .phases import active_phases

__all__ = ["dump", "directory", "check_directory", "install_signal", "load", "analyze", "report", "FORMAT"]

FORMAT = "mpidist-flight-1"
_job = None
_settings = None  # the package's current Settings (set by configure)
_dump_lock = threading.Lock()


def use_settings(settings):
    global _settings
    _settings = settings


def new_job_id():
    """Return a job id that sorts by start time (rank 0 makes it; ``init()`` shares it)."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def set_job(job):
    global _job
    _job = job


def _world():
    """Return (rank, size) in MPI.COMM_WORLD, or (0, 1) when MPI is not running."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return 0, 1


def directory():
    """Return where this process writes its flight record."""
    return os.path.join(_settings.flight_dir, _job or f"pid{os.getpid()}")


def check_directory(world):
    """Check that this job can write flight records (collective over ``world``; at the watchdog's start).

    A directory someone chose (``MPIDIST_FLIGHT_DIR``, ``guard.configure(flight_dir=)``) that some rank cannot
    write to raises ``ConfigError`` on every rank, naming it: records lost at the moment a job hangs or dies
    would hide why. The default (``./mpidist-flight``) only warns: a job in a read-only working directory
    ran before records existed, and still does.
    """
    folder = _settings.flight_dir
    problem = environment.writable_problem(folder)
    if environment.get("MPIDIST_FLIGHT_DIR") == folder:
        source = "MPIDIST_FLIGHT_DIR"
    elif folder != Settings.flight_dir:  # the class attribute holds the field's default
        source = "guard flight_dir"
    else:
        if problem:
            warnings.warn(f"mpidist: flight records cannot be written to {folder!r} ({problem}): a hang or an abort "
                          f"would leave none; set MPIDIST_FLIGHT_DIR to a directory this job can write to",
                          RuntimeWarning, stacklevel=3)
        return
    raise_if_any(world, problem and f"cannot write flight records to {folder!r} ({problem})", source,
                 environment.ConfigError)


def _content(reason):
    rank, size = _world()
    offset = time.time() - time.monotonic()  # monotonic -> Unix seconds
    calls, comms = [], {}
    for rec in _record.snapshot():
        entry = rec[_record.COMM]
        comms.setdefault(entry.key, entry)
        call = _record.summary(rec)
        call["start"] += offset
        call["end"] = None if call["end"] is None else call["end"] + offset
        del call["name"]
        calls.append(call)
    calls.sort(key=lambda c: c["start"])
    return {"format": FORMAT, "rank": rank, "size": size, "job": _job, "host": socket.gethostname(),
            "pid": os.getpid(), "reason": reason, "time": time.time(),
            "phases": [{"name": n, "seconds": a, "limit": lim} for n, a, lim in active_phases(every_thread=True)],
            "communicators": {key: entry.describe() for key, entry in comms.items()},
            "dtypes": list(fingerprint.dtype_names), "calls": calls}


def dump(reason):
    """Write this rank's flight record; return its path (None, with a line on stderr, if that failed).

    Never raises: it runs on the way to an abort.
    """
    try:
        with _dump_lock:
            content = _content(reason)
            folder = directory()
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{content['rank']:05d}.json")
            write_text_atomic(path, json.dumps(content))
            return path
    except Exception as exc:  # noqa: BLE001 - a failed dump must not stop the abort that asked for it
        try:
            sys.stderr.write(f"mpidist: could not write the flight record ({type(exc).__name__}: {exc})\n")
        except Exception:  # noqa: BLE001
            pass
        return None


# -- SIGUSR2 -----------------------------------------------------------------------------------------
_signal_reader = None


def install_signal(signum=signal.SIGUSR2):
    """Make ``signum`` write this rank's flight record, even while the rank is blocked inside MPI.

    Python runs signal handlers only between bytecodes of the main thread, which a blocking MPI call
    never reaches; so the C-level handler's wake-up byte (``signal.set_wakeup_fd``) is read by a small
    thread that writes the dump. Where a wake-up fd is taken already (asyncio), the handler dumps when
    the main thread next runs Python. Returns whether the signal was installed (main thread only).
    """
    global _signal_reader
    if threading.current_thread() is not threading.main_thread() or _signal_reader is not None:
        return _signal_reader is not None
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:  # someone else's wake-up fd: keep it, dump from the handler
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        signal.signal(signum, lambda s, f: dump(f"signal {signal.Signals(s).name}"))
        _signal_reader = False
        return True
    signal.signal(signum, lambda s, f: None)  # the reader thread dumps; without a handler the signal kills

    def read():
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signum in data:
                dump(f"signal {signal.Signals(signum).name}")

    _signal_reader = threading.Thread(target=read, name="mpidist-flight-signal", daemon=True)
    _signal_reader.start()
    return True


# -- reading records back ------------------------------------------------------------------------------
def _rank_files(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("rank") and n.endswith(".json"))


def load(folder):
    """Return (records, note): the flight records of one job under ``folder``, by rank.

    ``folder`` is a job's directory, or a directory of job directories (the newest job is read).
    Raises FileNotFoundError/ValueError naming the path when there is nothing to read.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"mpidist flight: {folder} is not a directory")
    note = ""
    files = _rank_files(folder)
    if not files:
        jobs = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
                      and _rank_files(os.path.join(folder, d)))
        if not jobs:
            raise ValueError(f"mpidist flight: no flight records (rankNNNNN.json) in {folder} or its job directories")
        if len(jobs) > 1:
            note = f"newest of {len(jobs)} jobs in {folder} (older: {', '.join(jobs[:-1][-3:])})"
        folder = os.path.join(folder, jobs[-1])
        files = _rank_files(folder)
    records = []
    for path in files:
        try:
            with open(path) as f:
                content = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"mpidist flight: cannot read {path}: {exc}") from None
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            found = f"format {content.get('format')!r}" if isinstance(content, dict) else f"a JSON {type(content).__name__}"
            raise ValueError(f"mpidist flight: {path} is not a flight record ({found}, expected format {FORMAT!r})")
        records.append(content)
    return records, note


def _call_text(call, dtypes):
    dtype = dtypes[call["dtype"]] if 0 <= call["dtype"] < len(dtypes) else None
    parts = [p for p in (dtype, None if call["count"] < 0 else f"count={call['count']}",
                         f"{call['bytes']} B", None if call["peer"] < 0 else f"root={call['peer']}",
                         f"op={call['reduction']}" if call["reduction"] else None) if p]
    return f"{call['op']}({', '.join(parts)})"


def _signature(call):
    # What every rank must agree on in one collective (bytes may differ: allgather and alltoall).
    return call["op"].lstrip("i"), call["dtype"], call["count"], call["peer"], call["reduction"]


def _state(call, now):
    if call["end"] is None:
        return f"in flight for {now - call['start']:.1f} s" + (" (in its desync check)" if call["checking"] else "")
    return "completed"


def _states(calls, ranks, by_rank):
    """Return 'in flight for 2.0-2.4 s', 'completed', or both with the ranks of each."""
    flying = [m for m in ranks if calls[m]["end"] is None]
    ages = [by_rank[m]["time"] - calls[m]["start"] for m in flying]
    span = "" if not ages else f"{min(ages):.1f} s" if max(ages) - min(ages) < 0.05 else f"{min(ages):.1f}-{max(ages):.1f} s"
    checking = " (in the desync check)" if any(calls[m]["checking"] for m in flying) else ""
    if len(flying) == len(ranks):
        return f"in flight for {span}{checking}"
    if not flying:
        return "completed"
    return f"in flight for {span}{checking} on ranks {flying}, completed on the others"


def analyze(records):
    """Return the report's lines: per communicator, the first sequence number where ranks differ."""
    records = sorted(records, key=lambda r: r["rank"])
    size = max(r["size"] for r in records)
    by_rank = {r["rank"]: r for r in records}
    lines = [f"flight records of {len(records)} of {size} ranks (job {records[0].get('job')})"]
    for r in records:
        phases = "".join(f"; in phase {p['name']} for {p['seconds']:.1f} s" for p in r["phases"])
        lines.append(f"  rank {r['rank']} ({r['host']} pid {r['pid']}): {r['reason']}{phases}")
    missing = [r for r in range(size) if r not in by_rank]
    if missing:
        lines.append(f"  no record from ranks {missing} (dead, or never asked)")
    comms = {}
    for r in records:
        for key, comm in r["communicators"].items():
            comms.setdefault(key, comm)
    for key in sorted(comms, key=lambda k: (-len(comms[k]["members"] or ()), k)):
        lines += _compare(key, comms[key], by_rank)
    p2p = [(r["rank"], c) for r in records for c in r["calls"] if c["seq"] < 0 and c["end"] is None]
    for rank, call in p2p:
        peer = "any rank" if call["peer"] < 0 else f"rank {call['peer']}"
        lines.append(f"rank {rank}: {call['op']} {'to' if call['op'] == 'send' else 'from'} {peer} on "
                     f"{comms[call['comm']]['name']} in flight for {by_rank[rank]['time'] - call['start']:.1f} s")
    return lines


def _compare(key, comm, by_rank):
    members = comm["members"] if comm["members"] is not None else sorted(by_rank)
    present = [m for m in members if m in by_rank]
    absent = [m for m in members if m not in by_rank]
    name = comm["name"] if comm["name"].startswith("comm ") else f"comm {comm['name']}"
    label = f"{name} ({key}, ranks {_record.span(members)})"
    calls, last = {}, {}
    for m in present:
        calls[m] = {c["seq"]: c for c in by_rank[m]["calls"] if c["comm"] == key and c["seq"] >= 0}
        used = by_rank[m]["communicators"].get(key)
        last[m] = used["calls"] - 1 if used else -1  # the last collective it started here
    known = [min(c) for c in calls.values() if c]
    if not known:
        return [f"{label}: no collective calls in the records"]
    low, high = max(known), max(last.values())
    dtypes = by_rank[present[0]].get("dtypes", [])
    for seq in range(low, high + 1):
        never = [m for m in present if last[m] < seq]
        here = {m: calls[m][seq] for m in present if seq in calls[m]}
        kinds = {}
        for m, call in here.items():
            kinds.setdefault(_signature(call), []).append(m)
        if not never and len(kinds) <= 1:
            continue
        out = [f"{label}: first difference at #{seq}"]
        for ranks in kinds.values():
            out.append(f"  ranks {ranks}: {_call_text(here[ranks[0]], dtypes)}, {_states(here, ranks, by_rank)}")
        for m in never:
            before = calls[m].get(last[m])
            was = (f"; its last call here: #{last[m]} {before['op']}, {_state(before, by_rank[m]['time'])}" if before
                   else "" if last[m] >= 0 else "; it never called a collective on this communicator")
            out.append(f"  rank {m} never arrived{was}")
        if absent:
            out.append(f"  no record from ranks {absent}")
        return out
    call = here.get(present[0]) if here else None
    flying = [m for m in present if high in calls[m] and calls[m][high]["end"] is None]
    tail = "" if call is None else f"; last #{high} {_call_text(call, dtypes)}" + (
        f", in flight on ranks {flying}" if flying else ", completed on every rank")
    return [f"{label}: ranks {present} agree on #{low}..#{high}{tail}"
            + (f" (no record from ranks {absent})" if absent else "")]


def report(folder):
    """Return the text ``python -m mpidist flight DIR`` prints."""
    records, note = load(folder)
    lines = analyze(records)
    if note:
        lines.insert(1, f"  ({note})")
    return "\n".join(lines)
