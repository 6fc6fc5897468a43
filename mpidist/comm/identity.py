"""What a communicator is: simulated or MPI, a key that names it on every rank, and its ranks in the world.

Code above ``mpidist.comm`` asks these questions here and never imports the simulator or reads its internals:
a SimComm's ranks are threads of this process, an MPI communicator's ranks are processes.
"""

import itertools
import threading

from mpi4py import MPI

from .sim import SimComm
from .sim.runner import current as _current

__all__ = ["is_simulated", "calls_from_threads_allowed", "comm_key", "world_ranks", "simulated_rank", "world_comm"]


def is_simulated(comm):
    """Return whether ``comm`` is a SimComm (its ranks are threads of this process)."""
    return isinstance(comm, SimComm)


def calls_from_threads_allowed(comm):
    """Return whether two threads of this process may call into ``comm`` at the same time.

    A SimComm's calls are thread-safe; MPI's are only under MPI_THREAD_MULTIPLE (mpi4py asks for it, but an
    application that called ``MPI.Init_thread`` itself, or an MPI built without it, may have less).
    """
    return is_simulated(comm) or MPI.Query_thread() >= MPI.THREAD_MULTIPLE


_ordinals = itertools.count()  # this process's next key number for an MPI communicator
_ordinal_lock = threading.Lock()
_keyval = None                 # the MPI attribute that caches a communicator's key (not copied by Dup)


def _cached_keyval():
    global _keyval
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval()
    return _keyval


def comm_key(comm):
    """Return a key for ``comm`` equal on every rank and unique while it lives.

    A SimComm's key is its shared state's number: local. MPI gives communicators no identity that ranks
    can compare, so an MPI communicator's first ``comm_key`` is collective over it (one small allreduce):
    its ranks agree on a number above any key number each of them handed out before; the key is cached
    on the communicator (an attribute ``Dup`` does not copy), so later calls are local. Two communicators
    alive at once never share a key: with the same members, the one keyed second gets a higher number.
    A key is a tuple whose last item is that number (short labels may show only it).
    """
    global _ordinals
    if is_simulated(comm):
        return ("sim", comm._ctx.id) if comm else ("sim", None)
    keyval = _cached_keyval()
    key = comm.Get_attr(keyval)
    if key is None:
        with _ordinal_lock:
            mine = next(_ordinals)
        number = comm.allreduce(mine, op=MPI.MAX)
        with _ordinal_lock:  # every rank's later keys lie above this one
            _ordinals = itertools.count(max(number + 1, next(_ordinals)))
        key = ("mpi", world_ranks(comm), number)
        comm.Set_attr(keyval, key)
    return key


def world_ranks(comm):
    """Return ``MPI.COMM_WORLD``'s rank of each rank of ``comm``, in its rank order (None if simulated).

    None too for an object that only answers like a communicator (a wrapper that logs calls, say): asking its
    group would be a call of its own, and what it wraps is unknown.
    """
    if not isinstance(comm, MPI.Comm):
        return None  # simulated ranks have no process of their own in the world
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def simulated_rank():
    """Return the simulated world rank this thread runs, or None outside a simulation."""
    comms = _current()
    return None if comms is None else comms[0].Get_rank()


def world_comm():
    """Return this thread's world: its simulated world inside a simulation, else ``MPI.COMM_WORLD``."""
    comms = _current()
    return MPI.COMM_WORLD if comms is None else comms[0]
