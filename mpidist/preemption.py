"""Preemption: turn SIGTERM/SIGUSR1/SIGINT into a checkpoint at a step boundary that every rank agrees on.

A signal can reach one rank (Slurm's ``--signal=B:USR1@120`` goes to the batch shell, which forwards
it) or all of them, at different moments (mpiexec forwards a Ctrl-C to every rank). The handler only
sets a flag; at each step boundary the ranks MAX-allreduce their flags, so they all stop after the same
step, save, and exit with ``PREEMPTED_EXIT`` — the status the Slurm templates turn into a requeue.

Ctrl-C (SIGINT) is a stop like the others, announced once per job (by rank 0); a second SIGINT on a
rank ends it at once. That second one must work while the rank is blocked inside MPI, where Python
runs no signal handler, so the first one hands SIGINT back to the operating system's default action
(terminate), and the launcher then ends the other ranks.
"""

import os
import signal
import sys
import threading

import numpy as np

from . import collectives
from .comm import check_comm

__all__ = ["PREEMPTED_EXIT", "Preemption"]

PREEMPTED_EXIT = 99  # the Slurm templates requeue the job when srun/mpiexec exits with this status


class Preemption:
    """Watch for preemption signals; ``should_stop()`` at a step boundary tells every rank the same answer.

    Use as a context manager (restores the previous handlers) or call ``install()``/``uninstall()``.
    ``request()`` sets the flag by hand (tests, or a wall-clock budget).
    """

    def __init__(self, comm, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.comm = check_comm("Preemption", comm)
        self.signals = tuple(signals)
        self.requested = False
        self.received = None
        self._previous = {}
        self._announce = comm.Get_rank() == 0  # one line per job: mpiexec delivers a Ctrl-C to every rank

    def _handler(self, signum, frame):
        first = not self.requested
        self.requested = True
        self.received = self.received or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C terminates, even inside MPI
        if first and self._announce:
            again = "; Ctrl-C again aborts at once without saving" if signum == signal.SIGINT else ""
            # os.write, not print: a handler that prints while the main thread is printing raises
            # "reentrant call" inside the buffered writer.
            os.write(2, f"mpidist: {signal.Signals(signum).name} received: stopping after the current step on every "
                        f"rank to save a checkpoint (exit {PREEMPTED_EXIT}){again}\n".encode())

    def install(self):
        """Install the signal handlers (only possible from the main thread; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self  # Python delivers signals to the main thread only; and install once
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self):
        """Restore the handlers that were there before."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def request(self):
        """Ask for a stop at the next step boundary, as a signal would."""
        self.requested = True

    def should_stop(self):
        """Return whether any rank was asked to stop (collective: call it on every rank at the same step)."""
        flag = np.array([1 if self.requested else 0], dtype=np.int32)
        collectives.allreduce(flag, self.comm, op="max")
        return bool(flag[0])

    @staticmethod
    def exit():
        """Leave with ``PREEMPTED_EXIT`` so the batch script requeues the job."""
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(PREEMPTED_EXIT)
