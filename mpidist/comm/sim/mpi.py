"""``MPI``: a namespace that mirrors ``mpi4py.MPI`` for code running on simulated ranks.

Constants, datatypes, ops, ``Status``, ``Info`` and exceptions are the real module's. ``COMM_WORLD`` and
``COMM_SELF`` resolve, on each call, to the calling rank thread's communicators, so a class attribute
``COMM = MPI.COMM_WORLD`` bound once at import serves every rank. The class-level calls
(``Request.Waitall``, ``Comm.Compare``, ``Message.probe``, ``Group.Union``...) are the simulator's, which
take simulated objects. Dynamic processes, MPI-IO, one-sided windows and intercommunicators are not
simulated: their classes stay mpi4py's and refuse a simulated communicator.
"""

import sys
import time
import types

from mpi4py import MPI as _MPI

from . import topo
from .comm import COMM_NULL, SimComm
from .errors import mpi_error
from .group import GROUP_EMPTY, GROUP_NULL, SimGroup
from .request import MESSAGE_NO_PROC, MESSAGE_NULL, REQUEST_NULL, SimMessage, SimPrequest, SimRequest
from .runner import current

__all__ = ["MPI", "ThreadComm"]


class ThreadComm(SimComm):
    """``COMM_WORLD``/``COMM_SELF`` of whichever simulated rank thread uses it."""

    def __init__(self, which):
        object.__setattr__(self, "_which", which)

    def _target(self):
        comms = current()
        if comms is None:
            raise RuntimeError(f"MPI.{('COMM_WORLD', 'COMM_SELF')[object.__getattribute__(self, '_which')]}: "
                               f"used outside a simulated rank (run the code under simulate() or 'mpidist sim')")
        return comms[object.__getattribute__(self, "_which")]

    def __getattribute__(self, name):
        if name in ("_target", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        if name in ("Free", "Disconnect"):
            which = ("COMM_WORLD", "COMM_SELF")[object.__getattribute__(self, "_which")]

            def refuse(*args, **kwargs):
                raise mpi_error(_MPI.ERR_COMM, f"MPI.{which}.{name}: a predefined communicator cannot be freed")
            return refuse
        return getattr(object.__getattribute__(self, "_target")(), name)

    def __setattr__(self, name, value):
        setattr(self._target(), name, value)

    def __repr__(self):
        comms = current()
        which = ("COMM_WORLD", "COMM_SELF")[object.__getattribute__(self, "_which")]
        return f"<MPI.{which} (simulated){'' if comms is None else ': ' + repr(comms[object.__getattribute__(self, '_which')])}>"


def _init(*args, **kwargs):
    return None


_attached = {}


def _attach_buffer(buf):
    """Record the buffered-mode buffer of the calling rank (sends here never need it)."""
    _attached[_rank_key()] = buf


def _detach_buffer():
    return _attached.pop(_rank_key(), None)


def _rank_key():
    comms = current()
    return None if comms is None else id(comms[0]._ctx.universe), comms and comms[0]._world_rank


def _build():
    ns = types.ModuleType("mpidist.comm.sim.MPI", __doc__)
    for name in dir(_MPI):
        if not name.startswith("__"):
            setattr(ns, name, getattr(_MPI, name))
    topo._init()
    ns.__dict__.update({
        "COMM_WORLD": ThreadComm(0), "COMM_SELF": ThreadComm(1), "COMM_NULL": COMM_NULL,
        "Comm": SimComm, "Intracomm": SimComm, "Topocomm": topo.SimTopocomm, "Cartcomm": topo.SimCartcomm,
        "Graphcomm": topo.SimGraphcomm, "Distgraphcomm": topo.SimDistgraphcomm,
        "Request": SimRequest, "Prequest": SimPrequest, "REQUEST_NULL": REQUEST_NULL,
        "Message": SimMessage, "MESSAGE_NULL": MESSAGE_NULL, "MESSAGE_NO_PROC": MESSAGE_NO_PROC,
        "Group": SimGroup, "GROUP_EMPTY": GROUP_EMPTY, "GROUP_NULL": GROUP_NULL,
        "Attach_buffer": _attach_buffer, "Detach_buffer": _detach_buffer, "Flush_buffer": _init,
        "Iflush_buffer": lambda: REQUEST_NULL,
        "Init": _init, "Init_thread": lambda *a, **k: _MPI.THREAD_MULTIPLE, "Finalize": _init,
        "Is_initialized": lambda: True, "Is_finalized": lambda: False,
        "Wtime": time.perf_counter, "Wtick": lambda: time.get_clock_info("perf_counter").resolution,
    })
    return ns


MPI = _build()
sys.modules.setdefault("mpidist.comm.sim.MPI", MPI)
