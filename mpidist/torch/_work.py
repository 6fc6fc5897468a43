"""Work objects: what every backend operation returns, completed by MPI requests.

Glossary:
- pending: one started MPI operation of a work: something with a blocking ``wait()`` and a
  ``wait_or(signal)`` (an mpidist ``collectives.Handle``, or ``Requests``, a list of raw mpi4py requests).
- finish: what runs once every pending part is complete (copy a staged buffer back into the tensors,
  divide for AVG); it returns the work's result, the value of its future.
- progress thread: one daemon thread per process that completes the works whose future was asked for.
  DDP asks for the future of each bucket's allreduce as soon as it starts it and only waits for it at the
  end of backward; without a thread of its own nobody would drive MPI until then, so the future would
  never complete (a ``torch.futures.Future`` cannot call back into us when it is waited on). The thread
  waits with the GIL released (inside MPI, or sleeping between tests: see PROGRESS below), so backward
  keeps computing meanwhile.

- abort signal: one per process group (``Abort``). ``abort()`` fires it: every pending work of the group
  fails with ``AbortedError`` and its future gets the error at once; waits that test between sleeps
  (poll, ``wait(timeout)``) return at once. In ``thread`` mode a wait is a plain MPI_Wait, which nothing
  MPI offers can wake (MPI_Cancel is not defined for collectives; MPICH has no MPIX_Comm_revoke): abort
  settles the futures at once and hands the progress thread's queue to a new thread, so other groups'
  futures keep completing, but the old thread stays inside MPI until the operation completes, and
  MPI_Finalize at exit may then crash. With ``MPIDIST_TORCH_ABORTABLE=1`` the progress thread waits in
  ``MPI_Waitany`` beside a generalized request of its own that abort completes, so it returns and ends
  (costs ~20% of a DDP step at 2 ranks, see ABORTABLE). The caller's own ``wait()`` stays a plain
  MPI_Wait either way (a Waitany there made a 1 MiB allreduce up to twice as slow, 2.5-2.8 -> 5.4-7.9 ms);
  ``wait(timeout)`` tests between sleeps and is released.

A work completes exactly once, by whichever thread comes first (a lock per work): the progress thread
for works with a future, the caller's ``wait()`` otherwise.
"""

import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import config

__all__ = ["Work", "Requests", "completed", "Abort", "AbortedError"]

# Buffers and requests of operations that were abandoned while MPI may still use them (dropped without a
# wait, or still pending when their group was aborted): freeing the memory could let a late peer's data
# land in reused memory, so they live as long as the process.
_abandoned = []


class Requests:
    """Pending raw mpi4py requests (the operations mpidist.collectives has no nonblocking form of)."""

    __slots__ = ("requests", "keep", "status", "done")

    def __init__(self, requests, keep=(), status=None):
        self.requests = requests
        self.keep = keep        # buffers MPI reads or writes until the requests complete
        self.status = status    # filled by the first request (a receive from any source)
        self.done = False       # completed by test(): a later Wait on the freed request would blank the status

    def test(self):
        if self.done:
            return True
        if self.status is not None and not self.requests[0].Test(self.status):
            return False
        self.done = MPI.Request.Testall(self.requests)
        return self.done

    def __del__(self):
        if not self.done and self.keep and any(r != MPI.REQUEST_NULL for r in self.requests):
            _abandoned.append((self.requests, self.keep))

    def wait_or(self, signal):
        """Wait until these requests or MPI request ``signal`` complete; return whether these did (then as ``wait``)."""
        if not self.done and all(isinstance(r, MPI.Request) for r in self.requests) and not self.test():
            every = list(self.requests) + [signal]
            while any(r != MPI.REQUEST_NULL for r in self.requests):
                if MPI.Request.Waitany(every, self.status) == len(self.requests):
                    return False
            self.done = True  # a Wait on the freed request would blank the status
        self.wait()
        return True

    def wait(self):
        if self.done:
            self.keep = ()
            return
        if self.status is not None:
            self.requests[0].Wait(self.status)
            MPI.Request.Waitall(self.requests[1:])
        else:
            MPI.Request.Waitall(self.requests)
        self.done = True
        self.keep = ()


class AbortedError(RuntimeError):
    """An operation of a process group that was aborted (``ProcessGroup.abort()``)."""


class Abort:
    """A process group's abort signal (see the glossary): fired once, by ``fire``; waits check it."""

    def __init__(self, name):
        self.name = name
        self.reason = None            # set when fired: the message every later wait raises

    def check(self):
        if self.reason is not None:
            raise AbortedError(self.reason)

    def fire(self, reason):
        """Fire the signal; return False if it had fired before."""
        if self.reason is not None:
            return False
        self.reason = reason
        _progress.release(self)
        return True


class _Progress:
    """The progress thread (see the glossary): started at the first future, lives as long as the process."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()
        self._current = None  # the work the thread is completing now
        self._signal = None   # the thread's generalized request, completed by release (thread mode)

    def submit(self, work):
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, args=(self._queue,), name="mpidist-torch-progress",
                                                    daemon=True)
                    self._thread.start()
        self._queue.put(work)

    def release(self, abort):
        """A group was aborted: if the thread is blocked on one of its works, give the queue to a new thread."""
        with self._lock:
            current = self._current
            if self._thread is None or current is None or current._abort is not abort:
                return False
            old, self._queue, self._thread, self._current = self._queue, queue.SimpleQueue(), None, None
            signal, self._signal = self._signal, None
            while True:
                try:
                    self._queue.put(old.get_nowait())
                except queue.Empty:
                    break
        if not self._queue.empty():
            self.submit(_Idle())
        if signal is not None:
            signal[1] = True
            signal[0].Complete()  # wakes the old thread's Waitany (see _wait_any); it then ends
        return True

    def _run(self, mine):
        holder = self._signal = [MPI.Grequest.Start(), False]  # the thread's signal, and whether completed
        signal = holder[0]
        while mine is self._queue:  # a replaced thread (see release) ends once its wait returns
            work = mine.get()
            self._current = work
            try:
                work._complete(signal if ABORTABLE else None)
            except BaseException:  # noqa: BLE001 - the error travels in the work's future
                pass
            finally:
                if mine is self._queue:
                    self._current = None
        if not holder[1]:  # not completed by release: complete it to free it
            signal.Complete()
        signal.Wait()
        if not mine.empty():  # raced with release: hand over what came in late
            while not mine.empty():
                self.submit(mine.get_nowait())


class _Idle:
    """A no-op queue entry that starts a progress thread for works handed over by ``release``."""

    _abort = None

    def _complete(self, signal=None):
        pass


def _wait_any(part, signal, abort):
    """Wait inside MPI for ``part`` or until ``signal`` (the progress thread's) completes: then raise."""
    if not part.wait_or(signal):
        abort.check() if abort is not None else None
        raise AbortedError("mpidist: the progress thread was released from its wait")


def _sleep_until_done(part, abort=None):
    """Test ``part`` with growing sleeps (10-100 us) in between, instead of spinning inside MPI.

    On an oversubscribed node a spinning wait takes the core that the rank's own backward, or the peer it
    waits for, needs. Measured (MPICH wheel, 2 ranks, 4 MB Iallreduce, otherwise idle machine): MPI wait
    1.4 ms; tests 10 us apart 1.9 ms; 200 us apart 2.8 ms.
    """
    delay = 1e-5
    while not part.test():
        if abort is not None:
            abort.check()
        time.sleep(delay)
        delay = min(2 * delay, 1e-4)


_progress = _Progress()
# How works complete (MPIDIST_TORCH_PROGRESS): "thread": futures by the progress thread, waiting inside MPI
# (which spins); "poll": the same, but every wait (progress thread and caller) tests and sleeps 10-100 us
# between tests, leaving the core to computation and to the peers (see _sleep_until_done); "inline":
# get_future() completes the operation at once in the caller (no overlap, no thread). "auto" (the default):
# poll when a node runs more ranks than it has cores, else thread (decided when the default group is made).
PROGRESS_MODES = config.TORCH_PROGRESS_MODES
# MPIDIST_TORCH_ABORTABLE=1: in thread mode the progress thread waits in MPI_Waitany beside its own
# generalized request, so that abort() also ends a wait inside MPI (see the glossary). Off by default:
# it made a DDP step of the benchmark's MLP about 20% slower at 2 ranks (43-60 ms -> 55-73 ms wall,
# 30-35 -> 39-54 ms CPU, three interleaved runs each, load average 6).
ABORTABLE = bool(config.get("MPIDIST_TORCH_ABORTABLE"))
PROGRESS = config.get("MPIDIST_TORCH_PROGRESS") or "auto"


def decide_progress(ranks_on_node, cores):
    """Resolve "auto": spinning waits only pay when every rank has a core of its own. Return the mode."""
    global PROGRESS
    if PROGRESS == "auto":
        PROGRESS = "poll" if ranks_on_node > cores else "thread"
    return PROGRESS


def _no_limit(timeout):
    if timeout is None:
        return True
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return timeout <= 0 or timeout >= 1e9


class Work(dist._Work):
    """The handle of one backend operation: ``wait()`` blocks until done, ``get_future()`` for callbacks."""

    def __init__(self, op, pending, finish, result=None, group=None):
        super().__init__()
        self.op = op
        self._pending = pending      # list of pending parts (see the glossary)
        self._finish = finish        # None: the result is ``result`` as given
        self._result = result
        self._error = None
        self._done = False
        self._lock = threading.Lock()
        self._future = None
        self._source = -1            # a receive from any source: the rank it came from
        self._abort = None           # the group's abort signal (see the glossary)
        if group is not None and pending:
            self._abort = group._abort
            group._pending.add(self)

    def _complete(self, signal=None):
        """Wait for every pending part and finish, once; record (and raise) an error.

        ``signal``: the progress thread's generalized request; with it (thread mode) the wait inside MPI
        is a Waitany that abort can end (see the glossary); the caller's waits are a plain MPI_Wait.
        """
        with self._lock:
            if not self._done:
                try:
                    for part in self._pending:
                        if PROGRESS == "poll":
                            _sleep_until_done(part, self._abort)
                            part.wait()
                        elif signal is not None:
                            _wait_any(part, signal, self._abort)
                        else:
                            part.wait()
                    if self._finish is not None:
                        self._result = self._finish()
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._pending, self._finish, self._done = (), None, True
                    if self._future is not None:
                        self._settle()
        if self._error is not None:
            raise self._error

    def _abandon(self):
        """The group was aborted: fail this work unless it completed; cancel its receives, keep its buffers."""
        if self._done:
            return
        error = AbortedError(self._abort.reason if self._abort is not None and self._abort.reason
                             else f"mpidist {self.op}: process group aborted")
        if not self._lock.acquire(blocking=False):
            # A thread is completing it: testing between sleeps (poll), it raises by itself within 100 us;
            # blocked inside MPI (thread), it stays (see the glossary), so its future gets the error now.
            if self._future is not None:
                self._settle(error)
            return
        try:
            if self._done:
                return
            for part in self._pending:
                if isinstance(part, Requests) and not part.done:
                    if part.status is not None:  # a receive: cancelling is allowed and frees the match
                        for r in part.requests:
                            try:
                                r.Cancel()
                            except MPI.Exception:
                                pass
                    _abandoned.append((part.requests, part.keep))
                    part.done, part.keep = True, ()
            self._error = error
            self._pending, self._finish, self._done = (), None, True
            if self._future is not None:
                self._settle()
        finally:
            self._lock.release()

    def _settle(self, error=None):
        # Abort may settle a future while the thread blocked on its work settles it later: the second loses.
        if self._future.done():
            return
        try:
            if error is not None or self._error is not None:
                self._future.set_exception(error if error is not None else self._error)
            else:
                self._future.set_result(self._result)
        except RuntimeError:
            if not self._future.done():
                raise

    # -- torch.distributed.Work -------------------------------------------------------------------
    def wait(self, timeout=None):
        """Block until the operation is complete; raise its error if it failed."""
        if not self._done and not _no_limit(timeout):
            limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            deadline = time.monotonic() + limit
            while not self.is_completed():
                if self._abort is not None and self._abort.reason is not None:
                    # abort may have found the lock held by is_completed's test (and left the work to the
                    # thread holding it): this thread is the one, so it fails the work itself; if another
                    # thread holds the lock (blocked inside MPI), this wait ends with the abort's error
                    self._abandon()
                    if not self._done:
                        raise AbortedError(self._abort.reason)
                    continue
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mpidist {self.op}: not complete after {limit:g} s (timeout)")
                time.sleep(0.0005)
        self._complete()
        return True

    def is_completed(self):
        if self._done or self._future is not None:
            return self._done  # with a future, the progress thread completes it
        if not self._lock.acquire(blocking=False):
            return False
        try:
            ready = all(part.test() for part in self._pending)
        except BaseException:  # noqa: BLE001 - _complete records and raises it
            ready = True
        finally:
            self._lock.release()
        if ready:
            try:
                self._complete()
            except BaseException:  # noqa: BLE001 - recorded; wait() raises it
                pass
        return self._done

    def is_success(self):
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result if isinstance(self._result, list) else [self._result]

    def get_future(self):
        """Return a ``torch.futures.Future`` completed with the result (the progress thread completes it)."""
        if PROGRESS == "inline" and not self._done:
            try:
                self._complete()
            except BaseException:  # noqa: BLE001 - travels in the future
                pass
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    self._settle()
                else:
                    _progress.submit(self)
        return self._future

    def _source_rank(self):
        self.wait()
        return self._source

    def source_rank(self):
        return self._source_rank()


def completed(op, result):
    """Return a work that is already complete with ``result`` (blocking paths: device tensors, empty input)."""
    return Work(op, (), None, result)
