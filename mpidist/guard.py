"""Guards on collectives: fingerprints that catch desynchronized ranks, and a watchdog for hangs.

Glossary:
- fingerprint: (sequence number, op, dtype, element count, root, reduction) of one collective call
  on one communicator. The sequence number counts mpidist collectives per communicator.
- desync check: before a collective runs, ranks MAX-allreduce ``[fp, -fp]`` (one 12-int message);
  if any field differs between ranks, every rank gathers all fingerprints and raises
  ``DesyncError`` naming the ranks, the sequence number and expected vs got.
- watchdog: a daemon thread per process. When a collective has been in flight longer than the
  timeout, it asks every rank's watchdog (over a private duplicate of the world communicator) what
  that rank is doing, prints which ranks arrived and which did not, and aborts the job.

The desync check costs one small allreduce per collective (measured in docs/reliability.md), so it
is on in debug mode (``MPIDIST_DEBUG=1`` or ``configure(desync=True)``), off otherwise. The watchdog
costs nothing on the hot path but a dictionary update, and is on by default with a generous
timeout (``MPIDIST_WATCHDOG_TIMEOUT`` seconds, default 900; 0 disables it).
"""

import atexit
import fcntl
import itertools
import os
import stat
import struct
import sys
import termios
import threading
import time
import weakref

import numpy as np

from .comm.errors import CommError
from .partition import REDUCTIONS

__all__ = ["DesyncError", "configure", "settings", "enter", "leave", "Watchdog", "start_watchdog", "stop_watchdog"]

_OPS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "send", "recv",
        "iallreduce", "ibroadcast", "iallgather", "alltoall")
_REDUCTIONS = ("",) + REDUCTIONS  # 0: not a reduction
_FIELDS = ("sequence", "op", "dtype", "count", "root", "reduction")


class DesyncError(CommError):
    """Ranks called different collectives at the same point of the sequence."""


class _Settings:
    def __init__(self):
        self.desync = os.environ.get("MPIDIST_DEBUG", "0") not in ("", "0")
        self.watchdog_timeout = float(os.environ.get("MPIDIST_WATCHDOG_TIMEOUT", "900"))


settings = _Settings()
_sequences = {}      # id(communicator) -> (weak reference to it, number of mpidist collectives started on it)
_in_flight = {}      # token -> (communicator, op, sequence, start time)
_tokens = itertools.count(1)


def configure(desync=None, watchdog_timeout=None):
    """Turn the desync check on/off and set the watchdog timeout (seconds, 0 = off) for this process."""
    if desync is not None:
        settings.desync = bool(desync)
    if watchdog_timeout is not None:
        settings.watchdog_timeout = float(watchdog_timeout)


def _comm_name(comm):
    try:
        return comm.Get_name() or "comm"
    except Exception:  # noqa: BLE001 - a name is only for messages
        return "comm"


def _describe(vec, dtype_names):
    seq, op, dtype, count, root, red = (int(v) for v in vec)
    parts = [f"{_OPS[op] if 0 <= op < len(_OPS) else op}"]
    parts.append(f"dtype={dtype_names[dtype] if 0 <= dtype < len(dtype_names) else dtype}")
    parts.append(f"count={count}")
    if root >= 0:
        parts.append(f"root={root}")
    if red > 0:
        parts.append(f"op={_REDUCTIONS[red]}")
    return f"#{seq} {parts[0]}({', '.join(parts[1:])})"


def tracking():
    """Return whether collectives are being tracked (debug desync checks or a running watchdog)."""
    return settings.desync or _watchdog is not None


def enter(comm, op, dtype_code=-1, count=-1, root=-1, reduction="", dtype_names=(), collective=True):
    """Record the start of ``op`` on ``comm``; check fingerprints in debug mode; return a token.

    Only collectives (``collective=True``) advance the communicator's sequence number and are checked:
    point-to-point calls differ by rank by nature. Plain dict operations under the GIL, no lock: this
    runs on every call while the watchdog is on.
    """
    seq = -1
    if collective:
        # Keyed by object identity, checked through a weak reference: a new communicator that reuses
        # a freed one's id (or MPI handle) must start counting from zero, as it does on every rank.
        ref, started = _sequences.get(id(comm), (None, 0))
        seq = started if ref is not None and ref() is comm else 0
        _sequences[id(comm)] = (ref if seq else weakref.ref(comm), seq + 1)
    token = next(_tokens)
    _in_flight[token] = (comm, op, seq, time.monotonic())
    if collective and settings.desync:
        try:
            _check(comm, np.array([seq, _OPS.index(op), dtype_code, count, root, _REDUCTIONS.index(reduction)],
                                  dtype=np.int64), dtype_names)
        except BaseException:
            _in_flight.pop(token, None)
            raise
    return token


def leave(token):
    """Record that the collective of ``token`` completed."""
    _in_flight.pop(token, None)


def _check(comm, vec, dtype_names):
    from mpi4py import MPI
    both = np.concatenate([vec, -vec])
    comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    if (both[: len(vec)] == -both[len(vec):]).all():
        return
    everyone = np.empty((comm.Get_size(), len(vec)), dtype=np.int64)
    comm.Allgather(vec, everyone)
    reference = everyone[0]
    groups = {}
    for r, row in enumerate(everyone):
        groups.setdefault(_describe(row, dtype_names), []).append(r)
    differing = [f for i, f in enumerate(_FIELDS) if len(set(everyone[:, i].tolist())) > 1]
    parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}" for d, rs in groups.items())
    expected = _describe(reference, dtype_names)
    # The same text on every rank: the ranks that differ from rank 0 come first, whoever raises it.
    deviating = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} called {d}"
                          for d, rs in groups.items() if d != expected)
    raise DesyncError(f"collective desync on {_comm_name(comm)} at call #{int(vec[0])} (differs in {', '.join(differing)}): "
                      f"expected {expected} (rank 0), but {deviating}; all ranks: {parts}")


def in_flight():
    """Return [(communicator name, op, sequence, seconds in flight)] of this process's pending collectives."""
    now = time.monotonic()
    return [(_comm_name(comm), op, seq, now - start) for comm, op, seq, start in list(_in_flight.values())]


# -- watchdog ----------------------------------------------------------------------------------------
_QUERY, _REPLY = 31001, 31002


class Watchdog:
    """Abort the job when an mpidist collective stays in flight longer than ``timeout`` seconds."""

    def __init__(self, world, timeout, poll=0.2, reply_wait=5.0, abort=None, stream=None):
        self.world = world.Dup()  # a private message space: never matches the application's messages
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.timeout, self.poll, self.reply_wait = timeout, poll, reply_wait
        self.abort = abort or (lambda: (wait_until_pipes_drained((1, 2)), world.Abort(1)))
        self.stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpidist-watchdog", daemon=True)
        self.fired = None

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def _status(self):
        pending = in_flight()
        if not pending:
            return "not in an mpidist collective"
        name, op, seq, age = max(pending, key=lambda p: p[3])
        return f"in {op}{'' if seq < 0 else f' #{seq}'} on {name} for {age:.1f} s"

    def _run(self):
        query = np.zeros(1, dtype=np.int64)
        request = self.world.Irecv(query, source=_any_source(), tag=_QUERY)
        while not self._stop.wait(self.poll):
            if request.Test():
                self.world.send(f"rank {self.rank}: {self._status()}", dest=int(query[0]), tag=_REPLY)
                request = self.world.Irecv(query, source=_any_source(), tag=_QUERY)
            # Stagger by rank so that, when several ranks are stuck, one report comes first and aborts.
            stuck = [p for p in in_flight() if p[3] > self.timeout + min(0.3 * self.rank, 5.0)]
            if stuck and self.fired is None:
                self._fire(max(stuck, key=lambda p: p[3]))
        # Leave no receive posted when MPI finalizes (UCX warns about requests never returned).
        request.Cancel()
        request.Wait()
        self.world.Free()

    def _fire(self, pending):
        name, op, seq, age = pending
        self.fired = pending
        me = np.array([self.rank], dtype=np.int64)
        for r in range(self.size):
            if r != self.rank:
                self.world.Isend(me, dest=r, tag=_QUERY)
        replies = {}
        deadline = time.monotonic() + self.reply_wait
        while len(replies) < self.size - 1 and time.monotonic() < deadline:
            req = self.world.irecv(source=_any_source(), tag=_REPLY)
            done, text = req.test()
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
                done, text = req.test()
            if not done:
                break
            replies[int(text.split(":")[0].split()[1])] = text
        if seq < 0:  # point to point: there is no "arrived" for the other ranks, only what each does
            lines = [f"mpidist watchdog: {op} on {name} did not complete within {self.timeout:g} s "
                     f"(rank {self.rank} waited {age:.1f} s)"]
        else:
            arrived = [self.rank] + [r for r, t in replies.items() if f"in {op} #{seq} on {name}" in t]
            lines = [f"mpidist watchdog: {op} #{seq} on {name} did not complete within {self.timeout:g} s "
                     f"(rank {self.rank} waited {age:.1f} s)",
                     f"  ranks that arrived: {sorted(arrived)}",
                     f"  ranks that did not: {sorted(r for r in range(self.size) if r not in arrived)}"]
        lines += [f"  {replies[r]}" for r in sorted(replies)]
        silent = [r for r in range(self.size) if r != self.rank and r not in replies]
        if silent:
            lines.append(f"  no answer from ranks {silent} (busy outside MPI, or dead)")
        lines.append("  aborting the job")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
        self.abort()


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


def _any_source():
    from mpi4py import MPI
    return MPI.ANY_SOURCE


_watchdog = None


def start_watchdog(world, timeout=None, **kwargs):
    """Start this process's watchdog over ``world`` (collective). Returns it, or None when disabled."""
    global _watchdog
    timeout = settings.watchdog_timeout if timeout is None else timeout
    if not timeout or _watchdog is not None:
        return _watchdog
    from mpi4py import MPI
    if isinstance(world, MPI.Comm) and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        # The watchdog thread talks MPI while the main thread may be blocked in MPI.
        sys.stderr.write("mpidist: watchdog disabled: MPI was not initialized with MPI_THREAD_MULTIPLE\n")
        return None
    _watchdog = Watchdog(world, timeout, **kwargs).start()
    atexit.register(stop_watchdog)  # runs before mpi4py's MPI_Finalize (registered earlier, runs later)
    return _watchdog


def stop_watchdog():
    """Stop the watchdog thread, if any."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
