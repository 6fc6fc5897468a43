"""Communicators: any mpi4py intracommunicator, or the in-process ``SimComm``.

Code above this package never asks which one it holds: both answer the same mpi4py methods.
"""

from .errors import CollectiveMismatchError, CommError, DeadlockError, RankFailedError, SimAbort, WatchdogTimeout
from .sim import SimComm, SimRequest, simulate

__all__ = ["SimComm", "SimRequest", "simulate", "CommError", "CollectiveMismatchError",
           "RankFailedError", "DeadlockError", "SimAbort", "WatchdogTimeout", "is_comm"]


def is_comm(obj):
    """Return whether ``obj`` can serve as an mpidist communicator (mpi4py intracomm or SimComm)."""
    if isinstance(obj, SimComm):
        return True
    from mpi4py import MPI
    return isinstance(obj, MPI.Intracomm) and obj != MPI.COMM_NULL
