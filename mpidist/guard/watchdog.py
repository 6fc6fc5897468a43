"""The watchdog: time limits per phase, reports of who arrived and who did not, and straddle verdicts.

Glossary:
- limit: how long a collective (or receive) may stay in flight: ``collective_timeout``, or inside a
  phase that phase's limit. A phase is itself watched: one that lasts longer than its limit (a
  checkpoint write stuck on a file system, with no collective in flight) is reported too.
- phase: a named stretch of the program with its own limit (``guard.phases``).
- query: one watchdog asks others what they are doing (optionally after writing their flight record,
  or printing a verdict); each answers with a one-line status and the records it has in flight.
- verdict: see ``fingerprint``. The watchdog that finds one hands it to its waiting check (which
  raises ``DesyncError``) after the ranks that went ahead have printed it.
- departure: a rank whose program ends normally (an early ``return``, one batch fewer, ``sys.exit``)
  tells every other watchdog, at exit, how many collectives it started on each communicator
  (``record.started``). A rank in flight in a collective that a departed member never started
  (its sequence number is not below that count) can never complete it: its watchdog reports it within
  about a second instead of at the collective timeout, and aborts the job. Point-to-point calls are
  left to the timeout: a message the departed rank sent before it left may still complete them.

The watchdog is a daemon thread per process (it needs MPI_THREAD_MULTIPLE), talking over a private
duplicate of the world communicator, polling every 0.2 s: nothing on the collectives' hot path.
"""

import atexit
import fcntl
import os
import stat
import struct
import sys
import termios
import threading
import time

import numpy as np
from mpi4py import MPI

from ..comm import is_simulated
from . import fingerprint, flight, record as _record
from .phases import active_phases, innermost_limit

__all__ = ["Watchdog", "start_watchdog", "stop_watchdog", "running", "status_line", "wait_until_pipes_drained"]

_QUERY, _REPLY, _WAKE, _LEFT = 31001, 31002, 31003, 31004
# Seconds an exiting rank waits, at most, for the other ranks' departure notices before MPI_Finalize: at a
# normal end every rank then receives every notice (MPI wants no message left unreceived at Finalize). It costs
# nothing when ranks end together, nor when they end apart: Finalize itself waits for every rank (seen with MPICH
# and Open MPI).
_DEPARTURE_LINGER = 2.0
_settings = None  # the package's current Settings (set by configure)


def use_settings(settings):
    global _settings
    _settings = settings


def status_line(rank):
    """Return what this rank is doing, in one line ('rank 2: in allreduce #3 on MPI_COMM_WORLD for 2.1 s')."""
    now = time.monotonic()
    pending = _record.in_flight()
    phases = active_phases(every_thread=True)
    where = f" (in phase {phases[-1][0]} for {phases[-1][1]:.1f} s)" if phases else ""
    if not pending:
        return f"rank {rank}: not in an mpidist collective{where}"
    r = pending[0]
    seq = r[_record.SEQ]
    check = " (desync check)" if r[_record.STATE] == _record.CHECKING else ""
    return (f"rank {rank}: in {r[_record.OP]}{'' if seq < 0 else f' #{seq}'}{check} on {r[_record.COMM].name} "
            f"for {now - r[_record.START]:.1f} s{where}")


# -- the watchdog thread -------------------------------------------------------------------------------
class Waker:
    """A receive the main thread's desync checks wait on beside their collective; a verdict completes it.

    One receive stays posted (from the main thread) until a wake-up arrives; other threads' checks wait
    without it (a blocking call: their straddles end at the collective timeout).
    """

    def __init__(self, world):
        self.world, self.rank = world, world.Get_rank()
        self._buffer = np.zeros(1, dtype=np.int64)
        self._request = None
        self._main = threading.main_thread().ident

    def request(self):
        """Return the pending wake-up receive (posting it), or None off the main thread."""
        if threading.get_ident() != self._main:
            return None
        if self._request is None:
            self._request = self.world.Irecv(self._buffer, source=self.rank, tag=_WAKE)
        return self._request

    def consumed(self):
        """Forget the receive that just completed (the next wait posts a new one)."""
        self._request = None

    def wake(self):
        """Complete the main thread's pending wait (from the watchdog thread)."""
        self.world.Send(np.zeros(1, dtype=np.int64), dest=self.rank, tag=_WAKE)  # to itself: eager

    def close(self):
        """Withdraw the pending receive (main thread, before the watchdog's communicator is freed)."""
        request, self._request = self._request, None
        if request is not None:
            request.Cancel()
            request.Wait()


class Watchdog:
    """Abort the job when a call or phase stays in flight longer than its limit; resolve straddles."""

    def __init__(self, world, timeout=None, poll=0.2, reply_wait=5.0, abort=None, stream=None):
        self.world = world.Dup()  # a private message space: never matches the application's messages
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.timeout = timeout  # the collective limit; None: the settings' (which configure may change)
        self.poll, self.reply_wait = poll, reply_wait
        self.abort = abort or (lambda: (wait_until_pipes_drained((1, 2)), world.Abort(1)))
        self.stream = stream or sys.stderr
        # Communicator members are world ranks (MPI.COMM_WORLD); this watchdog talks over ``world``'s ranks.
        mine, everyone = self.world.Get_group(), MPI.COMM_WORLD.Get_group()
        ranks = MPI.Group.Translate_ranks(everyone, list(range(everyone.Get_size())), mine)
        self._to_local = {w: int(r) for w, r in enumerate(ranks) if r != MPI.UNDEFINED}
        mine.Free()
        everyone.Free()
        # The host of every rank, so that a report can name a node whose ranks all went silent (a node down,
        # or its link): ranks alone do not say which machine to look at.
        self.hosts = self.world.allgather(MPI.Get_processor_name())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpidist-watchdog", daemon=True)
        self._round = 0
        self._checked = {}  # id(record) -> when the last query about its straddle was made
        self._requests = []  # (reason, done event) of flight dumps this process asked every rank for
        self.waker = Waker(self.world)
        self.fired = None
        self.departed = {}  # rank -> (when this watchdog heard it, {communicator key: [calls, last op]})
        self._leaving = threading.Event()    # this rank announced its departure
        self._all_left = threading.Event()   # ... and has heard every other rank's

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def limit(self):
        """Return the limit of a call in flight now (seconds; 0: none)."""
        limit = innermost_limit()
        if limit is not None:
            return limit
        return _settings.collective_timeout if self.timeout is None else self.timeout

    # -- answering others -------------------------------------------------------------------------
    def _summary(self):
        return {"text": status_line(self.rank), "calls": [_record.summary(r) for r in _record.in_flight()]}

    def _serve(self):
        """Answer queued queries (never blocks)."""
        while self.world.iprobe(source=MPI.ANY_SOURCE, tag=_QUERY):
            asker, round_id, dump_reason, verdict = self.world.recv(source=MPI.ANY_SOURCE, tag=_QUERY)
            if verdict:
                prefix = f"[rank {self.rank}] mpidist: "
                self.stream.write(f"{prefix}DesyncError: {verdict}\n{prefix}this rank is blocked inside MPI and cannot "
                                  f"raise it; rank {asker} raises it, and the job is aborted when that error ends rank "
                                  f"{asker} (caught or not; or at the collective timeout)\n")
                self.stream.flush()
                wait_until_pipes_drained((2,))  # the abort that follows must not swallow it
            if dump_reason:
                flight.dump(dump_reason)
            self.world.send((round_id, self.rank, self._summary()), dest=asker, tag=_REPLY)

    def _ask(self, ranks, dump_reason=None, wait=None, verdict=None):
        """Query ``ranks`` (who first write their flight record / print ``verdict``, when given);
        return {rank: summary} of those that answered within ``wait`` seconds."""
        self._round += 1
        for r in ranks:
            self.world.send((self.rank, self._round, dump_reason, verdict), dest=r, tag=_QUERY)  # small: eager
        replies = {}
        deadline = time.monotonic() + (self.reply_wait if wait is None else wait)
        while len(replies) < len(ranks) and time.monotonic() < deadline:
            self._serve()  # a rank asking this one at the same time waits for an answer too
            if self.world.iprobe(source=MPI.ANY_SOURCE, tag=_REPLY):
                round_id, r, summary = self.world.recv(source=MPI.ANY_SOURCE, tag=_REPLY)
                if round_id == self._round:
                    replies[r] = summary
            else:
                time.sleep(0.002)
        return replies

    def request_dump(self, reason, wait):
        """Ask every rank (from another thread) to write its flight record; wait up to ``wait`` seconds."""
        done = threading.Event()
        self._requests.append((reason, done))
        return done.wait(wait)

    # -- the loop ------------------------------------------------------------------------------------
    def _run(self):
        try:
            while not self._stop.wait(0.01 if self._leaving.is_set() else self.poll):
                self._serve()
                self._hear_departures()
                if self._leaving.is_set() and len(self.departed) == self.size - 1:
                    self._all_left.set()
                while self._requests:
                    reason, done = self._requests.pop(0)
                    self._ask(self._others(), reason, wait=min(self.reply_wait, 3.0))
                    done.set()
                if self.fired is None:
                    self._watch()
        finally:
            self.world.Free()

    def _others(self):
        """Return the other ranks that can still answer (all but this one and those that left)."""
        return [r for r in range(self.size) if r != self.rank and r not in self.departed]

    # -- departures ----------------------------------------------------------------------------------
    def announce_departure(self, linger=_DEPARTURE_LINGER):
        """Tell every other rank's watchdog that this rank leaves the job, with its collective counts.

        Called at a normal exit (``atexit``, main thread). Then waits until every other rank's notice came
        (they all end), or ``linger`` seconds; the thread goes on answering queries meanwhile.
        """
        notice = (self.rank, _record.started())
        # Also to ranks that left before: they wait for this notice before their MPI_Finalize.
        requests = [self.world.isend(notice, dest=r, tag=_LEFT) for r in range(self.size) if r != self.rank]
        self._leaving.set()
        deadline = time.monotonic() + linger
        while requests and not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.001)
        self._all_left.wait(max(0.0, deadline - time.monotonic()))

    def _hear_departures(self):
        while self.world.iprobe(source=MPI.ANY_SOURCE, tag=_LEFT):
            rank, counts = self.world.recv(source=MPI.ANY_SOURCE, tag=_LEFT)
            self.departed[rank] = (time.monotonic(), counts)

    def _left_behind(self, pending, now, stagger):
        """Return (record, rank) of a collective in flight here that ``rank``, which left, never started."""
        for rec in pending:
            entry, seq = rec[_record.COMM], rec[_record.SEQ]
            if seq < 0 or entry.members is None:
                continue
            for member in entry.members:
                rank = self._to_local.get(member)
                if rank is None or rank not in self.departed:
                    continue
                heard, counts = self.departed[rank]
                if seq >= counts.get(entry.key, (0, None))[0] and now - max(heard, rec[_record.START]) > stagger:
                    return rec, rank
        return None

    def _fire_left(self, rec, rank):
        self.fired = rec
        entry, seq = rec[_record.COMM], rec[_record.SEQ]
        label = f"{rec[_record.OP]} #{seq} on {entry.name}"
        headline = (f"mpidist watchdog: rank {rank} left the job (its program ended) while rank {self.rank} waits in "
                    f"{label}, which rank {rank} never joins ({self._departure_text(rank, entry.key)})")
        self._report(headline, rec, advice=False)

    def _departure_note(self, rank, rec):
        """Return '; its last collective there was #2 allreduce' when ``rank`` is a member of ``rec``'s communicator."""
        entry = None if rec is None else rec[_record.COMM]
        if entry is None or entry.members is None or not any(self._to_local.get(m) == rank for m in entry.members):
            return ""
        return f"; {self._departure_text(rank, entry.key)}"

    def _departure_text(self, rank, key):
        calls, op = self.departed[rank][1].get(key, (0, None))
        if not calls:
            return "it left without a collective call on this communicator"
        return f"its last collective there was #{calls - 1}{'' if op is None else ' ' + op}"

    # -- the watch -----------------------------------------------------------------------------------
    def _watch(self):
        now = time.monotonic()
        pending = _record.in_flight()
        self._resolve_straddles(pending, now)
        limit = self.limit()
        stagger = min(0.3 * self.rank, 5.0)  # when several ranks are stuck, one report comes first
        if self.departed:
            found = self._left_behind(pending, now, stagger)
            if found:
                self._fire_left(*found)
                return
        if limit:
            stuck = [r for r in pending if now - r[_record.START] > limit + stagger]
            if stuck:
                self._fire(stuck[0], limit)
                return
        for name, age, phase_limit in active_phases(every_thread=True):
            if phase_limit and age > phase_limit + stagger:
                self._fire((name, age), phase_limit)
                return

    def _resolve_straddles(self, pending, now):
        grace = _settings.desync_grace
        waiting = [r for r in pending if r[_record.STATE] == _record.CHECKING and now - r[_record.START] > grace]
        self._checked = {k: t for k, t in self._checked.items() if any(id(r) == k for r in waiting)}
        for rec in waiting:
            entry = rec[_record.COMM]
            if entry.members is None or now - self._checked.get(id(rec), 0.0) < grace:
                continue
            self._checked[id(rec)] = now
            members = [self._to_local[m] for m in entry.members if m in self._to_local]
            members = [m for m in members if m != self.rank and m not in self.departed]
            replies = self._ask(members, wait=min(self.reply_wait, 2.0))
            mine = _record.summary(rec)
            verdict = fingerprint.mediate(self.rank, mine, {r: s["calls"] for r, s in replies.items()},
                                          _settings.check_bytes)
            if verdict is None or rec[_record.END] is not None:
                continue
            # The ranks that went ahead print it first (they cannot raise); then this rank's check raises it.
            ahead = [r for r, s in replies.items() if any(c["comm"] == mine["comm"] and not c["checking"] for c in s["calls"])]
            self._ask(ahead, verdict=verdict, wait=min(self.reply_wait, 3.0))
            fingerprint.verdicts[id(rec)] = (verdict, ahead)
            self.waker.wake()

    def _fire(self, what, limit):
        self.fired = what
        if isinstance(what, tuple):  # a phase
            name, age = what
            headline = (f"mpidist watchdog: phase {name} did not complete within {limit:g} s "
                        f"(rank {self.rank} has been in it {age:.1f} s)")
            self._report(headline, None)
            return
        seq = what[_record.SEQ]
        age = time.monotonic() - what[_record.START]
        label = f"{what[_record.OP]}{'' if seq < 0 else f' #{seq}'} on {what[_record.COMM].name}"
        headline = f"mpidist watchdog: {label} did not complete within {limit:g} s (rank {self.rank} waited {age:.1f} s)"
        self._report(headline, what)

    def _report(self, headline, rec, advice=True):
        """Write every rank's flight record, print the report on ``rec`` (a record, or None) and abort."""
        reason = headline.replace("mpidist watchdog: ", "watchdog: ")
        path = flight.dump(reason)
        others = self._others()
        replies = self._ask(others, dump_reason=reason)
        lines = [headline]
        if rec is not None and rec[_record.SEQ] >= 0:
            lines += self._arrivals(rec, replies)
        lines += [f"  {replies[r]['text']}" for r in sorted(replies)]
        lines += [f"  rank {r}: left the job (its program ended){self._departure_note(r, rec)}" for r in sorted(self.departed)]
        silent = [r for r in others if r not in replies]
        if silent:
            lines.append(f"  no answer from ranks {silent} (busy outside MPI, or dead){self._on_hosts(silent)}")
            lines += self._unreachable_nodes(silent)
        if advice:
            lines.append("  if this wait is legitimate, raise the limit: mpidist.init(collective_timeout=...) or "
                         "MPIDIST_COLLECTIVE_TIMEOUT, or wrap the slow part in guard.phase(name, timeout)")
        if path:
            directory = os.path.dirname(path)
            lines.append(f"  flight records: {directory}/rank*.json (python -m mpidist flight {directory})")
        lines.append("  aborting the job")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
        self.abort()

    def _on_hosts(self, ranks):
        """Return ' (on node2)' or ' (on node1: 0; node2: 1,3)': the hosts of ``ranks`` when the job spans several."""
        if len(set(self.hosts)) < 2:
            return ""
        by_host = {}
        for r in ranks:
            by_host.setdefault(self.hosts[r], []).append(r)
        if len(by_host) == 1:
            return f" (on {next(iter(by_host))})"
        return " (on " + "; ".join(f"{h}: {','.join(map(str, rs))}" for h, rs in by_host.items()) + ")"

    def _unreachable_nodes(self, silent):
        """Return a line for each other host none of whose ranks answered: that node, or its link, is down."""
        quiet = set(silent) | set(self.departed)
        return [f"  node {host} unreachable: none of its ranks {ranks} answered (the node or its network link is down)"
                for host in dict.fromkeys(self.hosts) if host != self.hosts[self.rank]
                for ranks in [[r for r, h in enumerate(self.hosts) if h == host]]
                if all(r in quiet for r in ranks) and any(r in silent for r in ranks)]

    def _arrivals(self, rec, replies):
        """Return the report's lines on who is in collective ``rec`` (members of its communicator only).

        When every member is there, the lines say so and compare their calls: ranks that passed
        different arguments (a count below ``check_bytes``) hang inside MPI without any missing rank.
        """
        entry, seq = rec[_record.COMM], rec[_record.SEQ]
        members = (sorted(self._to_local[m] for m in entry.members if m in self._to_local)
                   if entry.members is not None else list(range(self.size)))
        calls = {self.rank: _record.summary(rec)}
        for r, reply in replies.items():
            found = [c for c in reply["calls"] if c["comm"] == entry.key and c["seq"] == seq]
            if found:
                calls[r] = found[0]
        arrived = sorted(r for r in calls if r in members)
        missing = [r for r in members if r not in calls]
        lines = [f"  ranks that arrived: {arrived}"]
        if missing:
            return lines + [f"  ranks that did not: {missing}{self._on_hosts(missing)}"]
        groups = {}
        for r in arrived:
            groups.setdefault(fingerprint.describe_call(calls[r]), []).append(r)
        if len(groups) > 1:
            called = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {call}"
                               for call, rs in groups.items())
            return lines + [f"  ranks that did not: none, every member is in #{seq} but the calls differ (a desync: "
                            f"checked only from MPIDIST_CHECK_BYTES, or always with MPIDIST_DEBUG=1): {called}"]
        return lines + [f"  ranks that did not: none, every member is in {next(iter(groups))} with the same arguments: "
                        f"the wait is inside MPI (a slow or failed network or node, or a stopped process)"]


def wait_until_pipes_drained(fds, timeout=2.0):
    """Wait until whoever reads these pipes (the launcher's stdio forwarder) has read everything written.

    MPI_Abort makes the launcher kill every process, its own stdio forwarder included; bytes still sitting
    in the pipe at that moment are lost, and with them the traceback that says why the job died (seen with
    the MPICH wheel's Hydra about once in 50 runs). Files and terminals need no wait; the timeout bounds
    the wait if nobody reads.
    """
    deadline = time.monotonic() + timeout
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
                if unread == 0:
                    break
                time.sleep(0.005)
        except OSError:
            continue  # closed or not queryable: nothing we can wait for


_watchdog = None


def running():
    """Return this process's watchdog, or None."""
    return _watchdog


def start_watchdog(world, timeout=None, **kwargs):
    """Start this process's watchdog over ``world`` (collective). Returns it, or None when it cannot run.

    ``timeout``: the collective limit (default: the settings'). Also checks the flight directory
    (``flight.check_directory``), agrees on a job id for flight records, installs the SIGUSR2 flight dump,
    and has a normal exit of this process tell the other ranks' watchdogs (see the glossary: departure).
    """
    global _watchdog
    if _watchdog is not None:
        return _watchdog
    if not is_simulated(world) and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        # The watchdog thread talks MPI while the main thread may be blocked in MPI.
        sys.stderr.write("mpidist: watchdog disabled: MPI was not initialized with MPI_THREAD_MULTIPLE\n")
        return None
    flight.check_directory(world)
    flight.set_job(world.bcast(flight.new_job_id() if world.Get_rank() == 0 else None, root=0))
    flight.install_signal()
    _watchdog = Watchdog(world, timeout, **kwargs).start()
    fingerprint.waker = _watchdog.waker
    atexit.register(stop_watchdog)  # runs before mpi4py's MPI_Finalize (registered earlier, runs later)
    atexit.register(_announce_departure)  # before stop_watchdog: the notices travel on its communicator
    atexit.register(_abort_if_stranded)  # and this before both
    return _watchdog


def _announce_departure():
    """At a normal exit, tell the other ranks' watchdogs that this rank left (see the glossary)."""
    if _watchdog is not None and not MPI.Is_finalized():
        try:
            _watchdog.announce_departure()
        except Exception as exc:  # noqa: BLE001 - an exit must go on; the others still have their timeout
            sys.stderr.write(f"mpidist: could not tell the other ranks that this one leaves ({type(exc).__name__}: {exc})\n")


def _abort_if_stranded():
    """At exit, abort the job if a caught straddle DesyncError left other ranks blocked inside MPI.

    Those ranks wait in a collective this rank never joins and cannot leave it: MPI_Finalize would wait
    for them until their own watchdog's collective timeout (300 s by default), and then blame this rank.
    """
    if not fingerprint.stranded:
        return
    rank = MPI.COMM_WORLD.Get_rank()
    for name, ranks in fingerprint.stranded:
        sys.stderr.write(f"[rank {rank}] mpidist: this rank caught a DesyncError on {name} that left rank(s) "
                         f"{sorted(ranks)} blocked inside MPI, in a collective it never joins; MPI_Finalize would wait "
                         f"for them, so the job is aborted at exit\n")
    sys.stderr.flush()
    if _watchdog is not None:
        _watchdog.abort()
    else:
        wait_until_pipes_drained((1, 2))
        MPI.COMM_WORLD.Abort(1)


def stop_watchdog():
    """Stop the watchdog thread, if any."""
    global _watchdog
    if _watchdog is not None:
        fingerprint.waker = None
        if threading.current_thread() is threading.main_thread():
            _watchdog.waker.close()
        _watchdog.stop()
        _watchdog = None
