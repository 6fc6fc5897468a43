"""The simulated communicator: mpi4py's intracommunicator surface, one thread per rank, in one process.

Modules, one per concept: ``engine`` (universe, rounds, matching), ``spec`` (message specs and datatypes),
``ops`` (reductions), ``p2p`` and ``collectives`` (the calls), ``request`` (requests, messages, status),
``group`` and ``topo`` (groups, Cartesian/graph communicators), ``comm`` (``SimComm``), ``runner``
(``simulate``), ``mpi`` (the ``MPI`` namespace for unmodified mpi4py code), ``program`` (``mpidist sim``),
``plugin`` (pytest).
"""

from . import topo as _topo
from .comm import SimComm
from .request import SimMessage, SimPrequest, SimRequest
from .runner import simulate

_topo._init()

__all__ = ["SimComm", "SimMessage", "SimPrequest", "SimRequest", "simulate", "MPI"]


def __getattr__(name):
    if name == "MPI":  # built on first use: it copies mpi4py.MPI's names
        from .mpi import MPI
        return MPI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
