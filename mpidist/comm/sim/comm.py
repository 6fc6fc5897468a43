"""SimComm: a simulated intracommunicator with mpi4py's methods and MPI's semantics.

Glossary (see engine.py for universe/context/round):
- member: one rank's handle on a context (``SimComm``): its rank, its collective sequence number, its
  name, attributes and info. Freeing it turns the handle null (equal to ``MPI.COMM_NULL``), as in mpi4py.

Sends are eager (buffered at once), except synchronous sends, which complete when a receive matches
them; so a standard ``Send`` never blocks here although a large one may block under real MPI.
"""

import threading
import time

from mpi4py import MPI

from ..agree import describe_ranks
from ..errors import CollectiveMismatchError, SimAbort
from . import spec
from .collectives import Collectives
from .engine import Context, Round, current
from .errors import mpi_error, rc_errhandler
from .group import SimGroup
from .handles import Handles
from .p2p import _TAG_UB, PointToPoint  # p2p's _TAG_UB: Open MPI 4 sets TAG_UB on COMM_WORLD only
from .request import SimRequest

__all__ = ["SimComm", "SimIntercomm", "COMM_NULL"]

# MPI_Comm_get_errhandler hands out a new reference that the caller frees. A copy of the Python handle is not
# one: a program freeing it (as it must) drops the library's own reference, and Open MPI then crashes in the
# next call that uses that handler (MPICH ignores the free of a predefined one). A private duplicate of COMM_SELF
# per error handler lets the library itself give out the references.
_errhandler_holders = {}  # Fortran handle of an error handler -> a private COMM_SELF duplicate carrying it
_errhandler_lock = threading.Lock()


def _new_reference(errhandler):
    """Return a new reference to ``errhandler`` from the MPI library (the caller frees it, as under MPI)."""
    with _errhandler_lock:
        holder = _errhandler_holders.get(errhandler.py2f())
        if holder is None:
            holder = _errhandler_holders[errhandler.py2f()] = MPI.COMM_SELF.Dup()
            holder.Set_errhandler(errhandler)
        return holder.Get_errhandler()



def _describe(name, sig):
    try:
        return _DESCRIBED[name, sig]
    except (KeyError, TypeError):  # TypeError: a signature value that cannot be a key
        pass
    text = f"{name}({', '.join(f'{k}={v}' for k, v in sig)})"
    if len(_DESCRIBED) < 4096:
        try:
            _DESCRIBED[name, sig] = text
        except TypeError:
            pass
    return text


_DESCRIBED = {}  # (call name, signature) -> its description (the same few calls recur)


class SimComm(Handles, PointToPoint, Collectives):
    """Simulated intracommunicator with mpi4py's method names and MPI's semantics."""

    _NULL_HANDLE = MPI.COMM_NULL.handle
    _TOPOLOGY = None  # a subclass's required topology kind: MPI.Cartcomm(comm) of another is a TypeError

    def __new__(cls, ctx=None, rank=0):
        self = object.__new__(cls)
        if isinstance(ctx, SimComm):
            source = ctx._resolve()
            if cls._TOPOLOGY is not None and source._ctx is not None and not cls._TOPOLOGY(source._ctx.topo):
                raise TypeError(f"{cls.__name__}: expecting a communicator of that topology (got {source!r})")
            # mpi4py's Comm(comm): a second handle on the same communicator. Sharing the member state
            # (collective sequence number, name, attributes) keeps collectives through either handle in step.
            self.__dict__ = ctx._resolve().__dict__
        return self

    def __init__(self, ctx=None, rank=0):
        if isinstance(ctx, SimComm):
            return  # a second handle: __new__ shared the state
        if ctx is not None and not isinstance(ctx, Context):
            if isinstance(ctx, MPI.Comm) and ctx == MPI.COMM_NULL:
                ctx = None
            else:
                raise TypeError(f"SimComm: expecting a simulated communicator (got {type(ctx).__name__})")
        self._ctx = ctx
        self._rank = rank
        self._seq = 0
        self._name = None
        self._attrs = {}
        self._info = None
        self._errhandler = None  # None: what mpi4py.rc.errors gives (errors.rc_errhandler)
        self._locks = {}        # mpi4py's per-communicator locks (MPI._comm_lock), by key
        self._commctx = None    # [duplicate, next tag] of MPI._commctx_intra

    # -- identity ---------------------------------------------------------------------------------
    def _live(self, what):
        if self._ctx is None:
            raise mpi_error(MPI.ERR_COMM, f"SimComm.{what}: communicator is MPI.COMM_NULL (freed, or not a member)")
        return self._ctx

    @property
    def _world_rank(self):
        return self._ctx.world_ranks[self._rank]

    @property
    def _universe(self):
        return self._ctx.universe

    def __bool__(self):
        return self._ctx is not None

    def __eq__(self, other):
        if isinstance(other, SimComm):
            a, b = self._resolve(), other._resolve()
            if a._ctx is None or b._ctx is None:
                return a._ctx is None and b._ctx is None
            return a._ctx is b._ctx and a._rank == b._rank
        if isinstance(other, MPI.Comm):
            return self._resolve()._ctx is None and other == MPI.COMM_NULL
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        me = self._resolve()
        return hash((id(me._ctx), me._rank))

    def _resolve(self):
        return self

    def __repr__(self):
        if self._ctx is None:
            return "<SimComm COMM_NULL>"
        return f"<SimComm {self._ctx.name} rank {self._rank} of {self.size}>"

    @property
    def rank(self):
        return self.Get_rank()

    @property
    def size(self):
        return self.Get_size()

    def Get_rank(self):
        """Return this rank's index in the communicator."""
        self._live("Get_rank")
        return self._rank

    def Get_size(self):
        """Return the number of ranks in the communicator."""
        return len(self._live("Get_size").world_ranks)

    def Get_group(self):
        """Return the group of this communicator's ranks."""
        ctx = self._live("Get_group")
        return SimGroup(ctx.world_ranks, self._world_rank, universe=ctx.universe)

    group = property(Get_group)

    def Get_name(self):
        """Return the communicator's name."""
        if self._ctx is None:
            return "MPI_COMM_NULL"
        ctx = self._ctx
        return self._name if self._name is not None else ctx.name

    def Set_name(self, name):
        """Set this rank's name for the communicator."""
        self._live("Set_name")
        self._name = str(name)

    name = property(Get_name, Set_name)

    def Is_intra(self):
        self._live("Is_intra")
        return True

    def Is_inter(self):
        self._live("Is_inter")
        return False

    is_intra = property(Is_intra)
    is_inter = property(Is_inter)

    def Get_topology(self):
        """Return ``MPI.UNDEFINED``, ``MPI.CART``, ``MPI.GRAPH`` or ``MPI.DIST_GRAPH``."""
        ctx = self._live("Get_topology")
        return MPI.UNDEFINED if ctx.topo is None else ctx.topo.kind

    topology = property(Get_topology)

    @property
    def is_topo(self):
        return self.Get_topology() != MPI.UNDEFINED

    # -- info, errhandler, attributes -----------------------------------------------------------------
    def Get_info(self):
        """Return a copy of the hints set on this communicator."""
        self._live("Get_info")
        return MPI.Info.Create() if self._info is None else self._info.Dup()

    def Set_info(self, info):
        """Set hints (kept, not interpreted)."""
        self._live("Set_info")
        self._info = None if info == MPI.INFO_NULL else info.Dup()

    info = property(Get_info, Set_info)

    def Get_errhandler(self):
        """Return a new handle on the error handler (whatever it is, errors raise ``MPI.Exception`` here)."""
        self._live("Get_errhandler")
        return _new_reference(rc_errhandler() if self._errhandler is None else self._errhandler)

    def Set_errhandler(self, errhandler):
        self._live("Set_errhandler")
        if errhandler == MPI.ERRHANDLER_NULL:
            raise mpi_error(MPI.ERR_ERRHANDLER, "SimComm.Set_errhandler: errhandler is MPI.ERRHANDLER_NULL")
        self._errhandler = MPI.Errhandler(errhandler)  # our own handle: the caller may free theirs

    def Call_errhandler(self, errorcode):
        raise mpi_error(errorcode, "SimComm.Call_errhandler")

    @classmethod
    def Create_keyval(cls, copy_fn=None, delete_fn=None, nopython=False):
        """Create an attribute key (the key lives in the MPI library: keys are process-wide, as in MPI)."""
        key = MPI.Comm.Create_keyval(copy_fn, delete_fn, nopython)
        _KEYVALS[key] = (copy_fn, delete_fn)
        return key

    @classmethod
    def Free_keyval(cls, keyval):
        _KEYVALS.pop(keyval, None)
        return MPI.Comm.Free_keyval(keyval)

    def Get_attr(self, keyval):
        """Return the attribute at ``keyval`` (predefined keys answer as under MPI)."""
        self._live("Get_attr")
        _check_keyval("Get_attr", keyval)
        if keyval in _PREDEFINED_KEYS:
            if keyval == MPI.UNIVERSE_SIZE:
                return self._universe.size
            if keyval == MPI.APPNUM:
                return 0
            return MPI.COMM_SELF.Get_attr(keyval)
        return self._attrs.get(keyval)

    def Set_attr(self, keyval, attrval):
        self._live("Set_attr")
        _check_keyval("Set_attr", keyval)
        old = self._attrs.get(keyval, _MISSING)
        if old is not _MISSING:
            self._delete_attr(keyval, old)
        self._attrs[keyval] = attrval

    def Delete_attr(self, keyval):
        self._live("Delete_attr")
        _check_keyval("Delete_attr", keyval)
        if keyval not in self._attrs:
            raise mpi_error(MPI.ERR_KEYVAL, f"SimComm.Delete_attr: no attribute at key {keyval}")
        self._delete_attr(keyval, self._attrs.pop(keyval))

    def _delete_attr(self, keyval, value):
        fns = _KEYVALS.get(keyval)
        if fns and fns[1] is not None:
            fns[1](self, keyval, value)

    def _copy_attrs(self, new):
        for key, value in self._attrs.items():
            fns = _KEYVALS.get(key)
            copy_fn = fns[0] if fns else None
            if copy_fn is None or copy_fn is False:
                continue
            if copy_fn is True:
                new._attrs[key] = value
                continue
            got = copy_fn(self, key, value)
            if got is not NotImplemented:
                new._attrs[key] = got

    # -- mpi4py's internal helpers (mpi4py.util.pkl5 calls them through MPI._comm_lock/_commctx_intra) --------
    def _lock_table(self):
        self._live("_comm_lock_table")
        return self._locks

    def _lock(self, key=None):
        """The lock mpi4py keeps for this communicator and ``key`` (created on first use)."""
        lock = self._lock_table().get(key)
        if lock is None:
            lock = self._locks.setdefault(key, threading.Lock())  # setdefault: one lock even if raced
        return lock

    def _context_intra(self):
        """(private duplicate, fresh tag): collective, as MPI's own is; every rank counts tags the same way."""
        with self._lock("@commctx_intra"):
            if self._commctx is None:
                self._commctx = [self.Dup(), 0]
            dup, tag = self._commctx
            self._commctx[1] = 0 if tag >= _TAG_UB else tag + 1
        return dup, tag

    # -- collective machinery ----------------------------------------------------------------------
    def _start(self, name, sig, payload, work):
        """Post this rank's part of collective ``name``; the last rank to arrive computes every result.

        ``sig`` is a tuple of (field, value) pairs that must be equal on all ranks; ``work`` maps the
        list of payloads by rank to the list of results by rank.
        """
        ctx = self._live(name)
        u = ctx.universe
        rank = self._rank
        with u.cond:
            seq, rnd = self._arrive(ctx, name, sig, payload, work)
        return SimRequest(u, ctx.world_ranks[rank], lambda: rnd.done, lambda: (self._depart(ctx, seq, rnd), None),
                          f"{_describe(name, sig)} #{seq} on {ctx.name}")

    def _arrive(self, ctx, name, sig, payload, work):
        """Enter this rank's part of the next round (the caller holds the universe's lock); return (seq, round)."""
        size = len(ctx.world_ranks)
        seq = self._seq
        self._seq += 1
        rnd = ctx.rounds.get(seq)
        if rnd is None:
            rnd = ctx.rounds[seq] = Round(size)
        rnd.calls[self._rank] = (name, sig, payload)
        rnd.arrived += 1
        if rnd.arrived == size:
            self._finish_round(seq, rnd, work)
            ctx.universe.changed()
        return seq, rnd

    def _depart(self, ctx, seq, rnd):
        """Leave a completed round: the last rank out drops it; raise its error or return this rank's result."""
        rnd.departed += 1
        if rnd.departed == len(ctx.world_ranks):
            ctx.rounds.pop(seq, None)
        if rnd.error is not None:
            if isinstance(rnd.error, BaseException):
                raise rnd.error
            raise CollectiveMismatchError(rnd.error)
        return rnd.results[self._rank]

    def _finish_round(self, seq, rnd, work):
        first = rnd.calls[0]
        if any(c[0] != first[0] or c[1] != first[1] for c in rnd.calls):
            parts = describe_ranks([_describe(name, sig) for name, sig, _ in rnd.calls], joiner=" called ")
            rnd.error = f"collective mismatch on {self._ctx.name} (call #{seq}): {parts}"
        else:
            try:
                rnd.results = work([c[2] for c in rnd.calls])
            except MPI.Exception as exc:  # MPI's own error (truncation...): every rank raises it
                rnd.error = exc
            except Exception as exc:  # a bad buffer on some rank: every rank gets the message
                rnd.error = f"{first[0]} on {self._ctx.name} (call #{seq}) failed: {exc}"
        rnd.done = True

    def _run(self, name, sig, payload, work):
        """Run collective ``name`` to completion and return this rank's result: ``_start(...).wait()``
        without the request object, the path of every blocking collective."""
        ctx = self._live(name)
        u = ctx.universe
        with u.cond:
            seq, rnd = self._arrive(ctx, name, sig, payload, work)
            if not rnd.done:
                u.wait_until(ctx.world_ranks[self._rank], lambda: rnd.done, f"{_describe(name, sig)} #{seq} on {ctx.name}")
            return self._depart(ctx, seq, rnd)

    def _check_root(self, name, root):
        """Return ``root`` as an int (as mpi4py reads it); raise ERR_ROOT unless it is a rank of this communicator."""
        size = self.Get_size()
        root = spec.c_int(root)
        if not 0 <= root < size:
            raise mpi_error(MPI.ERR_ROOT, f"SimComm.{name}: root {root} out of range for communicator of size {size}")
        return root

    # -- communicator management --------------------------------------------------------------------
    def _derive(self, name, color, key, topo=None, sig=(), cls=None):
        parent = self._live(name)

        def work(parts):
            by_color = {}
            for r, (c, k) in enumerate(parts):
                if c != MPI.UNDEFINED:
                    by_color.setdefault(c, []).append((k, r))
            results = [None] * len(parts)
            for c, members in sorted(by_color.items()):
                members.sort()
                ctx = Context(parent.universe, [parent.world_ranks[r] for _, r in members],
                              f"{parent.name}.{name}({c})" if name != "Dup" else f"{parent.name}.Dup", topo)
                for new_rank, (_, r) in enumerate(members):
                    results[r] = (ctx, new_rank)
            return results
        got = self._run(name, sig, (color, key), work)
        if got is None:
            return COMM_NULL_FACTORY()
        if cls is None:
            cls = topo_class(topo) if topo is not None else SimComm
        # as mpi4py's New(cls): a subclass's own __new__/__init__ (pkl5.Comm's takes one comm) are not called
        new = object.__new__(cls)
        SimComm.__init__(new, *got)
        return new

    def Split(self, color=0, key=0):
        """Partition ranks by ``color``, ordered by ``key`` then rank; ``MPI.UNDEFINED`` gives ``MPI.COMM_NULL``."""
        return self._derive("Split", spec.c_int(color), spec.c_int(key))

    def Split_type(self, split_type, key=0, info=None):
        """Split by simulated node (``simulate(ranks_per_node=)``), the one hardware level simulated.

        ``COMM_TYPE_HW_GUIDED``/``RESOURCE_GUIDED`` need the info hint ``mpi_hw_resource_type`` =
        ``mpi_shared_memory`` (else ``COMM_NULL``, as MPI gives for a resource it does not know);
        ``COMM_TYPE_HW_UNGUIDED`` splits only a communicator spanning several nodes (it must give a strictly
        smaller one) and names the level in ``info``; ``MPI.UNDEFINED`` gives ``COMM_NULL``.
        """
        ctx = self._live("Split_type")
        per_node = self._universe.ranks_per_node
        color = self._world_rank // per_node
        hint = None if info is None or info == MPI.INFO_NULL else info
        if split_type == MPI.UNDEFINED:
            color = MPI.UNDEFINED
        elif split_type in (MPI.COMM_TYPE_HW_GUIDED, MPI.COMM_TYPE_RESOURCE_GUIDED):
            if hint is None or hint.Get("mpi_hw_resource_type") != "mpi_shared_memory":
                color = MPI.UNDEFINED
        elif split_type == MPI.COMM_TYPE_HW_UNGUIDED:
            if len({w // per_node for w in ctx.world_ranks}) < 2:
                color = MPI.UNDEFINED
            elif hint is not None:
                hint.Set("mpi_hw_resource_type", "mpi_shared_memory")
        return self._derive("Split_type", color, key)

    def Dup(self, info=None):
        """Return a new communicator with the same ranks and a separate message space."""
        # mpi4py's Dup returns the caller's class (a subclass such as pkl5.Intracomm stays one)
        new = self._derive("Dup", 0, self._rank, topo=self._live("Dup").topo, cls=type(self))
        self._copy_attrs(new)
        new._info = None if info is None or info == MPI.INFO_NULL else info.Dup()
        if info is None and self._info is not None:
            new._info = self._info.Dup()
        return new

    def Dup_with_info(self, info):
        return self.Dup(info)

    def Idup(self, info=None):
        """Return (new communicator, completed request): the Dup is done at once."""
        return self.Dup(info), SimRequest()

    def Idup_with_info(self, info):
        return self.Idup(info)

    def Clone(self):
        return self.Dup()

    def Create(self, group):
        """Communicator of ``group``'s ranks (collective over this communicator); others get COMM_NULL."""
        parent = self._live("Create")
        ranks = group._world_ranks if isinstance(group, SimGroup) else []
        mine = self._world_rank in ranks

        def work(parts):
            members = parts[0]
            ctx = Context(parent.universe, members, f"{parent.name}.Create") if members else None
            return [(ctx, members.index(w)) if ctx is not None and w in members else None
                    for w in parent.world_ranks]
        got = self._run("Create", (), list(ranks), work)
        return SimComm(*got) if (got is not None and mine) else COMM_NULL_FACTORY()

    def Create_group(self, group, tag=0):
        """Communicator of ``group``'s ranks, called by those ranks only."""
        ranks = list(group._world_ranks)
        me = self._world_rank
        if me not in ranks:
            return COMM_NULL_FACTORY()
        ctx = _meet(self._universe, ("Create_group", self._live("Create_group").id, tuple(ranks), tag), ranks, me,
                    f"{self._ctx.name}.Create_group")
        comm = SimComm(ctx, ranks.index(me))
        comm.Barrier()
        return comm

    @classmethod
    def Create_from_group(cls, group, stringtag="org.mpi4py", info=None, errhandler=None):
        """Communicator of ``group``'s ranks, called by those ranks only, matched by ``stringtag``."""
        ranks, me = list(group._live("Create_from_group")), group._owner
        if me not in ranks:
            raise mpi_error(MPI.ERR_GROUP, f"Comm.Create_from_group: the calling rank (world rank {me}) is not "
                                           f"in the group {ranks}")
        ctx = _meet(group._universe, ("Create_from_group", tuple(ranks), str(stringtag)), ranks, me,
                    f"Create_from_group({stringtag})")
        comm = SimComm(ctx, ranks.index(me))
        comm.Barrier()
        return comm

    def Free(self):
        """Free the communicator: this handle becomes ``MPI.COMM_NULL``."""
        self._live("Free")
        for key in list(self._attrs):
            self._delete_attr(key, self._attrs.pop(key))
        if self._commctx is not None:
            self._commctx[0].Free()
            self._commctx = None
        self._ctx = None

    def Disconnect(self):
        self.Barrier()
        self.Free()

    def Compare(self, comm):
        """Return ``MPI.IDENT``, ``CONGRUENT``, ``SIMILAR`` or ``UNEQUAL`` (``MPI.Comm.Compare(a, b)`` works too)."""
        a, b = self._resolve(), comm._resolve()
        if a._ctx is None or b._ctx is None:
            raise mpi_error(MPI.ERR_COMM, f"Comm.Compare: {'the first' if a._ctx is None else 'the second'} "
                                          f"communicator is MPI.COMM_NULL")
        if a._ctx is b._ctx:
            return MPI.IDENT
        if a._ctx.world_ranks == b._ctx.world_ranks:
            return MPI.CONGRUENT
        if sorted(a._ctx.world_ranks) == sorted(b._ctx.world_ranks):
            return MPI.SIMILAR
        return MPI.UNEQUAL

    def Abort(self, errorcode=1):
        """Abort the simulated job: this rank raises and every other rank is released with an error."""
        exc = SimAbort(f"rank {self._rank} of {self._live('Abort').name} called Abort({errorcode})")
        exc.errorcode = errorcode
        raise exc

    # -- topologies ------------------------------------------------------------------------------------
    def Create_cart(self, dims, periods=None, reorder=False):
        from .topo import cart_layout
        return self._create_topo("Create_cart", cart_layout(self.Get_size(), dims, periods))

    def Create_graph(self, index, edges, reorder=False):
        from .topo import graph_layout
        return self._create_topo("Create_graph", graph_layout(self.Get_size(), index, edges))

    def Cart_map(self, dims, periods=None):
        """This rank's rank in a Cartesian layout of ``dims`` (ranks keep their order), or ``MPI.UNDEFINED``."""
        from .topo import cart_layout
        layout = cart_layout(self.Get_size(), dims, periods)
        return self._rank if self._rank < layout.size else MPI.UNDEFINED

    def Graph_map(self, index, edges):
        """This rank's rank in a graph layout (ranks keep their order), or ``MPI.UNDEFINED``."""
        from .topo import graph_layout
        layout = graph_layout(self.Get_size(), index, edges)
        return self._rank if self._rank < layout.size else MPI.UNDEFINED

    def Create_dist_graph_adjacent(self, sources, destinations, sourceweights=None, destweights=None,
                                   info=None, reorder=False):
        from .topo import dist_graph_adjacent
        mine = dist_graph_adjacent(sources, destinations, sourceweights, destweights)
        return self._create_topo("Create_dist_graph_adjacent", None, mine)

    def Create_dist_graph(self, sources, degrees, destinations, weights=None, info=None, reorder=False):
        from .topo import dist_graph_edges
        return self._create_topo("Create_dist_graph", None, dist_graph_edges(sources, degrees, destinations, weights))

    def _create_topo(self, name, layout, part=None):
        from .topo import DistGraph, merge_dist_graph
        parent = self._live(name)
        if part is not None:
            def work(parts):
                layouts = merge_dist_graph(parts)
                ctx = Context(parent.universe, parent.world_ranks, f"{parent.name}.{name}")
                ctx.topo = DistGraph(layouts)
                return [(ctx, r) for r in range(len(parts))]
            got = self._run(name, (), part, work)
            return topo_class(got[0].topo)(*got)
        members = layout.size
        color = 0 if self._rank < members else MPI.UNDEFINED
        return self._derive(name, color, self._rank, topo=layout)

    # -- constants mpi4py users compare against --------------------------------------------------------
    @staticmethod
    def Get_parent():
        """No simulated rank was spawned: a null intercommunicator (MPI's own null handle)."""
        return SimIntercomm(MPI.Comm.Get_parent())

    # -- buffered mode (MPI 4.1 per-communicator buffer; sends here never need it) ------------------------------
    def Attach_buffer(self, buf):
        self._live("Attach_buffer")
        self._bsend_buffer = buf

    def Detach_buffer(self):
        self._live("Detach_buffer")
        buf, self._bsend_buffer = getattr(self, "_bsend_buffer", None), None
        return buf

    def Flush_buffer(self):
        self._live("Flush_buffer")

    def Iflush_buffer(self):
        self._live("Iflush_buffer")
        return SimRequest()

    # -- pickling: only the predefined communicators, as in mpi4py ---------------------------------------------
    def __reduce__(self):
        me = self._resolve()
        if me is COMM_NULL:
            return "COMM_NULL"  # the module's constant
        if me._ctx is None:
            return COMM_NULL_FACTORY, ()
        comms = current()
        for which, comm in enumerate(comms or ()):
            if comm.__dict__ is me.__dict__:
                return _predefined_handle, (which,)
        raise ValueError(f"cannot pickle {me!r}: only MPI.COMM_NULL, COMM_SELF and COMM_WORLD are picklable")


class SimIntercomm(MPI.Intercomm):
    """``MPI.Intercomm`` here: intercommunicators are not simulated, so the only ones are null
    (``MPI.Intercomm()``, ``Get_parent()``), whose calls raise ERR_COMM as MPI's do; ``Create`` takes a
    simulated group."""

    def Create(self, group):
        if self == MPI.COMM_NULL:
            raise mpi_error(MPI.ERR_COMM, "Intercomm.Create: communicator is MPI.COMM_NULL")
        raise NotImplementedError("SimComm.Intercomm.Create: intercommunicators are not simulated")


# What the simulator does not do: these raise NotImplementedError naming the call (docs/simulation.md).
_NOT_SIMULATED = {
    **dict.fromkeys(("Spawn", "Spawn_multiple", "Accept", "Connect", "Join"), "dynamic processes"),
    "Create_intercomm": "intercommunicators",
    **dict.fromkeys(("Ack_failed", "Agree", "Iagree", "Get_failed", "Is_revoked", "Revoke", "Shrink", "Ishrink"),
                    "fault-tolerance (ULFM) calls"),
    **dict.fromkeys(("Psend_init", "Precv_init"), "partitioned communications"),
}


def _refuse(name, what):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"SimComm.{name}: {what} are not simulated")
    refuse.__name__ = refuse.__qualname__ = name
    return refuse


for _name, _what in _NOT_SIMULATED.items():
    setattr(SimComm, _name, _refuse(_name, _what))
SimComm.Create_errhandler = staticmethod(MPI.Comm.Create_errhandler)  # an Errhandler object: MPI's own


_MISSING = object()
# MPI's predefined attribute keys (MPI.HOST is gone from mpi4py 4: only the names this mpi4py has)
_PREDEFINED_KEYS = frozenset(getattr(MPI, k) for k in ("TAG_UB", "IO", "HOST", "WTIME_IS_GLOBAL", "UNIVERSE_SIZE",
                                                        "APPNUM", "LASTUSEDCODE") if hasattr(MPI, k))


def _check_keyval(name, keyval):
    if keyval == MPI.KEYVAL_INVALID:
        raise mpi_error(MPI.ERR_KEYVAL, f"SimComm.{name}: keyval is MPI.KEYVAL_INVALID")

_KEYVALS = {}


def topo_class(topo):
    from .topo import class_for
    return class_for(topo)


def _meet(universe, key, ranks, me, name):
    """The context the ranks of ``ranks`` share for a call only they make (Create_group and
    Create_from_group): the first to arrive creates it, the others find it under ``key``."""
    with universe.cond:
        table = universe.attrs.setdefault("meet", {})
        entry = table.get(key)
        if entry is None or me in entry["taken"]:
            entry = table[key] = {"ctx": Context(universe, ranks, name), "taken": set()}
        entry["taken"].add(me)
        if len(entry["taken"]) == len(ranks):
            table.pop(key, None)
        return entry["ctx"]


def _predefined_handle(which):
    """A new handle on the calling rank's COMM_WORLD (0) or COMM_SELF (1): what an unpickled copy is."""
    return SimComm(current()[which])


def COMM_NULL_FACTORY():
    """A null communicator handle (false, equal to ``MPI.COMM_NULL``)."""
    return SimComm(None, 0)


COMM_NULL = COMM_NULL_FACTORY()
_ = (spec, time)
