"""Work objects: what every backend operation returns, completed by MPI requests.

Glossary:
- pending: one started MPI operation of a work: something with a blocking ``wait()`` (an mpidist
  ``collectives.Handle``, or ``Requests``, a list of raw mpi4py requests).
- finish: what runs once every pending part is complete (copy a staged buffer back into the tensors,
  divide for AVG); it returns the work's result, the value of its future.
- progress thread: one daemon thread per process that completes the works whose future was asked for.
  DDP asks for the future of each bucket's allreduce as soon as it starts it and only waits for it at the
  end of backward; without a thread of its own nobody would drive MPI until then, so the future would
  never complete (a ``torch.futures.Future`` cannot call back into us when it is waited on). The thread
  waits with the GIL released (inside MPI, or sleeping between tests: see PROGRESS below), so backward
  keeps computing meanwhile.

A work completes exactly once, by whichever thread comes first (a lock per work): the progress thread
for works with a future, the caller's ``wait()`` otherwise.
"""

import datetime
import os
import queue
import threading
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

__all__ = ["Work", "Requests", "completed"]


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

    def wait(self):
        if self.done:
            self.keep = ()
            return
        if self.status is not None:
            self.requests[0].Wait(self.status)
            MPI.Request.Waitall(self.requests[1:])
        else:
            MPI.Request.Waitall(self.requests)
        self.keep = ()


class _Progress:
    """The progress thread (see the glossary): started at the first future, lives as long as the process."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, work):
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="mpidist-torch-progress", daemon=True)
                    self._thread.start()
        self._queue.put(work)

    def _run(self):
        while True:
            work = self._queue.get()
            try:
                work._complete()
            except BaseException:  # noqa: BLE001 - the error travels in the work's future
                pass


def _sleep_until_done(part):
    """Test ``part`` with growing sleeps (10-100 us) in between, instead of spinning inside MPI.

    On an oversubscribed node a spinning wait takes the core that the rank's own backward, or the peer it
    waits for, needs. Measured (MPICH wheel, 2 ranks, 4 MB Iallreduce, otherwise idle machine): MPI wait
    1.4 ms; tests 10 us apart 1.9 ms; 200 us apart 2.8 ms.
    """
    delay = 1e-5
    while not part.test():
        time.sleep(delay)
        delay = min(2 * delay, 1e-4)


_progress = _Progress()
# How works complete (MPIDIST_TORCH_PROGRESS): "thread": futures by the progress thread, waiting inside MPI
# (which spins); "poll": the same, but every wait (progress thread and caller) tests and sleeps 10-100 us
# between tests, leaving the core to computation and to the peers (see _sleep_until_done); "inline":
# get_future() completes the operation at once in the caller (no overlap, no thread). "auto" (the default):
# poll when a node runs more ranks than it has cores, else thread (decided when the default group is made).
PROGRESS_MODES = ("auto", "thread", "poll", "inline")
PROGRESS = os.environ.get("MPIDIST_TORCH_PROGRESS", "auto")
if PROGRESS not in PROGRESS_MODES:
    raise ValueError(f"MPIDIST_TORCH_PROGRESS={PROGRESS!r}: expected one of {', '.join(PROGRESS_MODES)}")


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

    def __init__(self, op, pending, finish, result=None):
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

    def _complete(self):
        """Wait for every pending part and finish, once; record (and raise) an error."""
        with self._lock:
            if not self._done:
                try:
                    for part in self._pending:
                        if PROGRESS == "poll":
                            _sleep_until_done(part)
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

    def _settle(self):
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)

    # -- torch.distributed.Work -------------------------------------------------------------------
    def wait(self, timeout=None):
        """Block until the operation is complete; raise its error if it failed."""
        if not self._done and not _no_limit(timeout):
            limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            deadline = time.monotonic() + limit
            while not self.is_completed():
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
