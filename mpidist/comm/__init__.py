"""Communicators: any mpi4py intracommunicator, or the in-process ``SimComm``.

Code above this package never asks which one it holds: both answer the same mpi4py methods. Where it must
know what a communicator is, it asks here (``is_simulated``, ``comm_key``, ``world_ranks``, ``simulated_rank``,
``world_comm``, ``node_comm``) and never imports the simulator.
"""

from .errors import CollectiveMismatchError, CommError, DeadlockError, RankFailedError, SimAbort, WatchdogTimeout
from .sim import SimComm, SimRequest, simulate
from .identity import calls_from_threads_allowed, comm_key, is_simulated, simulated_rank, world_comm, world_ranks
from .nodes import node_comm

__all__ = ["SimComm", "SimRequest", "simulate", "CommError", "CollectiveMismatchError",
           "RankFailedError", "DeadlockError", "SimAbort", "WatchdogTimeout", "is_comm", "check_comm",
           "is_simulated", "calls_from_threads_allowed", "comm_key", "world_ranks", "simulated_rank", "world_comm", "node_comm", "DeviceMesh"]


def is_comm(obj):
    """Return whether ``obj`` can serve as an mpidist communicator (mpi4py intracomm or SimComm)."""
    if isinstance(obj, SimComm):
        return True
    from mpi4py import MPI
    return isinstance(obj, MPI.Intracomm) and obj != MPI.COMM_NULL


def check_comm(fn, comm):
    """Raise a TypeError that says what is wrong unless ``comm`` can serve as an mpidist communicator.

    Called before the first message: an intercommunicator takes the same calls with other meanings
    (a broadcast root names a rank of the *other* group), so using one would hang or mislead. Other
    objects with mpi4py's methods (wrappers that log or count calls) are accepted as they are.
    """
    if type(comm) is SimComm or is_comm(comm):
        return comm
    from mpi4py import MPI
    if isinstance(comm, MPI.Intercomm):
        raise TypeError(f"{fn}: intercommunicators are not supported (got one with a local group of "
                        f"{comm.Get_size()} and a remote group of {comm.Get_remote_size()} ranks); "
                        f"use an intracommunicator, e.g. intercomm.Merge()")
    if isinstance(comm, MPI.Comm):  # COMM_NULL: freed, or this rank is not in it
        raise TypeError(f"{fn}: comm is MPI.COMM_NULL (freed, or this rank is not a member: a Split with "
                        f"color MPI.UNDEFINED gives it)")
    if all(hasattr(comm, name) for name in ("Get_rank", "Get_size", "Allreduce", "Bcast", "Isend", "Mprobe")):
        return comm  # something that answers like an mpi4py intracommunicator (a wrapper, say): trusted
    raise TypeError(f"{fn}: comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD) or a SimComm "
                    f"(got {type(comm).__name__}: {comm!r:.60})")


from .mesh import DeviceMesh  # noqa: E402 - last: the mesh checks its communicators with check_comm above
