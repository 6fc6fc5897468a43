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
from .comm import COMM_NULL, SimComm, SimIntercomm
from .engine import helper_name
from .errors import mpi_error, rc_errhandler
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
        if name in ("_target", "__class__", "__dict__", "__module__", "__reduce__", "__reduce_ex__"):
            return object.__getattribute__(self, name)
        if name in ("Free", "Disconnect"):
            which = ("COMM_WORLD", "COMM_SELF")[object.__getattribute__(self, "_which")]

            def refuse(*args, **kwargs):
                raise mpi_error(_MPI.ERR_COMM, f"MPI.{which}.{name}: a predefined communicator cannot be freed")
            return refuse
        return getattr(object.__getattribute__(self, "_target")(), name)

    def __setattr__(self, name, value):
        setattr(self._target(), name, value)

    def __reduce__(self):
        return ("COMM_WORLD", "COMM_SELF")[object.__getattribute__(self, "_which")]  # this module's own name

    def __repr__(self):
        comms = current()
        which = ("COMM_WORLD", "COMM_SELF")[object.__getattribute__(self, "_which")]
        return f"<MPI.{which} (simulated){'' if comms is None else ': ' + repr(comms[object.__getattribute__(self, '_which')])}>"


def _not_simulated(name, what):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"MPI.{name}: {what} are not simulated")
    refuse.__name__ = name
    return refuse


class Win(_MPI.Win):
    """One-sided windows are not simulated: creating one raises NotImplementedError (WIN_NULL stays MPI's)."""

    Create, Allocate, Allocate_shared, Create_dynamic = (
        classmethod(lambda cls, *args, _name=name, **kwargs: _not_simulated(f"Win.{_name}", "one-sided windows")())
        for name in ("Create", "Allocate", "Allocate_shared", "Create_dynamic"))


class _WinNull:
    """``MPI.WIN_NULL`` here: windows are not simulated, so every call on it raises NotImplementedError
    (what mpi4py gives where the MPI library has no one-sided support)."""

    def __bool__(self):
        return False

    def __eq__(self, other):
        return other is self or (isinstance(other, _MPI.Win) and other == _MPI.WIN_NULL)

    __hash__ = object.__hash__

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        refuse = _not_simulated(f"Win.{name}", "one-sided windows")
        if name not in _RMA_CALLS:
            return refuse

        def rma(origin, target_rank=None, target=None, *args, **kwargs):
            _check_rma_specs(name, origin, target)  # mpi4py reads the specs before it calls MPI
            return refuse()
        return rma


_RMA_CALLS = ("Put", "Get", "Accumulate", "Rput", "Rget", "Raccumulate")


def _check_rma_specs(name, origin, target):
    """Raise ValueError for an origin or target spec mpi4py's one-sided calls refuse to read."""
    from .spec import _items
    if isinstance(origin, (list, tuple)):
        _items(origin)  # 2 to 4 items
    if target is None or isinstance(target, int):
        return
    if isinstance(target, (list, tuple)):
        if len(target) > 3:
            raise ValueError(f"Win.{name}: target: expecting 3 items at most, got {len(target)}")
        return
    raise ValueError(f"Win.{name}: target: expecting integral or list/tuple, got {type(target).__name__}")


class File(_MPI.File):
    """MPI-IO is not simulated: opening a file raises NotImplementedError (FILE_NULL stays MPI's)."""

    Open = classmethod(lambda cls, *args, **kwargs: _not_simulated("File.Open", "MPI-IO files")())


def _init(*args, **kwargs):
    return None


def _lifecycle():
    """The calling rank's [initialized, finalized] (MPI_Init/MPI_Finalize), or None outside a simulated rank.

    A rank starts initialized unless ``mpi4py.rc.initialize`` is false when first asked (a program sets it
    before its ``from mpi4py import MPI``, as under mpiexec, and then calls ``MPI.Init``).
    """
    comms = current()
    if comms is None:
        return None
    universe, rank = comms[0]._ctx.universe, comms[0]._world_rank
    with universe.cond:
        table = universe.attrs.setdefault("mpi.lifecycle", {})
        if rank not in table:
            import mpi4py
            table[rank] = [bool(getattr(getattr(mpi4py, "rc", None), "initialize", True)), False]
        return table[rank]


def _initialize(name):
    state = _lifecycle()
    if state is not None:
        if state[0]:
            done = "finalized" if state[1] else "initialized"
            raise mpi_error(_MPI.ERR_OTHER, f"MPI.{name}: MPI is already {done} on this rank (mpi4py initializes it "
                                            f"at import unless mpi4py.rc.initialize is False)")
        state[0] = True
    return _MPI.THREAD_MULTIPLE


def _finalize():
    state = _lifecycle()
    if state is not None:
        if not state[0] or state[1]:
            problem = "already finalized" if state[1] else "not initialized"
            raise mpi_error(_MPI.ERR_OTHER, f"MPI.Finalize: MPI is {problem} on this rank")
        state[1] = True


def _is_initialized():
    state = _lifecycle()
    return _MPI.Is_initialized() if state is None else state[0]


def _is_finalized():
    state = _lifecycle()
    return _MPI.Is_finalized() if state is None else state[1]


def _is_thread_main():
    """A rank's own thread is its main thread; a thread it started is not."""
    return _MPI.Is_thread_main() if current() is None else helper_name() is None


class Session(_MPI.Session):
    """Sessions are the MPI library's, with two differences for a simulated rank: the process sets
    ``mpi://WORLD`` and ``mpi://SELF`` are its simulated world and self (size, groups), and the error handler
    is the one ``mpi4py.rc.errors`` names when ``Init`` is called (mpi4py applied its own at import)."""

    @classmethod
    def Init(cls, info=_MPI.INFO_NULL, errhandler=None):
        import mpi4py
        session = super().Init(info, errhandler)
        if getattr(getattr(mpi4py, "rc", None), "errors", "exception") != "default":
            session.Set_errhandler(rc_errhandler())
        else:
            session.Set_errhandler(_MPI.ERRORS_ARE_FATAL if errhandler is None else errhandler)
        return session

    def Get_pset_info(self, pset_name):
        comm = _pset_comm(pset_name)
        if comm is None:
            return super().Get_pset_info(pset_name)
        # Not asked of the library: a simulation runs as a singleton, where Open MPI 5 fails the query of
        # mpi://WORLD (an error its fatal handler turns into an abort), and the answer is the simulated world's.
        info = _MPI.Info.Create()
        info.Set("mpi_size", str(comm.Get_size()))
        return info

    def Create_group(self, pset_name):
        comm = _pset_comm(pset_name)
        return super().Create_group(pset_name) if comm is None else comm.Get_group()


def _pset_comm(pset_name):
    comms = current()
    which = {"mpi://WORLD": 0, "mpi://SELF": 1}.get(pset_name)
    return None if comms is None or which is None else comms[which]


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
        "Win": Win, "WIN_NULL": _WinNull(), "File": File, "Intercomm": SimIntercomm,
        "Request": SimRequest, "Prequest": SimPrequest, "REQUEST_NULL": REQUEST_NULL,
        "Message": SimMessage, "MESSAGE_NULL": MESSAGE_NULL, "MESSAGE_NO_PROC": MESSAGE_NO_PROC,
        "Group": SimGroup, "GROUP_EMPTY": GROUP_EMPTY, "GROUP_NULL": GROUP_NULL,
        "Attach_buffer": _attach_buffer, "Detach_buffer": _detach_buffer, "Flush_buffer": _init,
        "Iflush_buffer": lambda: REQUEST_NULL,
        "_comm_lock": lambda comm, key=None: comm._resolve()._lock(key),
        "_comm_lock_table": lambda comm: comm._resolve()._lock_table(),
        "_commctx_intra": lambda comm: comm._resolve()._context_intra(),
        "_commctx_inter": _not_simulated("_commctx_inter", "intercommunicators"),
        "Init": lambda: _initialize("Init"), "Init_thread": lambda *a, **k: _initialize("Init_thread"),
        "Finalize": _finalize, "Is_initialized": _is_initialized, "Is_finalized": _is_finalized,
        "Is_thread_main": _is_thread_main,
        "Session": Session,
        "Wtime": time.perf_counter, "Wtick": lambda: time.get_clock_info("perf_counter").resolution,
    })
    return ns


MPI = _build()
COMM_WORLD, COMM_SELF = MPI.COMM_WORLD, MPI.COMM_SELF  # what a pickled MPI.COMM_WORLD/COMM_SELF names
sys.modules.setdefault("mpidist.comm.sim.MPI", MPI)
