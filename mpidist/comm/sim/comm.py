"""SimComm: a simulated intracommunicator with mpi4py's methods and MPI's semantics.

Glossary (see engine.py for universe/context/round):
- member: one rank's handle on a context (``SimComm``): its rank, its collective sequence number, its
  name, attributes and info. Freeing it turns the handle null (equal to ``MPI.COMM_NULL``), as in mpi4py.

Sends are eager (buffered at once), except synchronous sends, which complete when a receive matches
them; so a standard ``Send`` never blocks here although a large one may block under real MPI.
"""

import time

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatchError, SimAbort
from . import spec
from .collectives import Collectives
from .engine import Context
from .errors import mpi_error
from .group import SimGroup
from .p2p import PointToPoint
from .request import SimRequest

__all__ = ["SimComm", "COMM_NULL"]



def _describe(name, sig):
    fields = ", ".join(f"{k}={v}" for k, v in sig)
    return f"{name}({fields})"


class SimComm(PointToPoint, Collectives):
    """Simulated intracommunicator with mpi4py's method names and MPI's semantics."""

    def __init__(self, ctx=None, rank=0):
        self._ctx = ctx
        self._rank = rank
        self._seq = 0
        self._name = None
        self._attrs = {}
        self._info = None
        self._errhandler = MPI.ERRORS_ARE_FATAL

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

    @property
    def handle(self):
        return 0 if self._ctx is None else self._ctx.id + 1000

    def py2f(self):
        return self.handle

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
        return SimGroup(ctx.world_ranks, self._world_rank)

    group = property(Get_group)

    def Get_name(self):
        """Return the communicator's name."""
        ctx = self._live("Get_name")
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
        self._live("Get_errhandler")
        return self._errhandler

    def Set_errhandler(self, errhandler):
        self._live("Set_errhandler")
        self._errhandler = errhandler

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
        if keyval in (MPI.TAG_UB, MPI.IO, MPI.HOST, MPI.WTIME_IS_GLOBAL, MPI.UNIVERSE_SIZE, MPI.APPNUM,
                      MPI.LASTUSEDCODE):
            if keyval == MPI.UNIVERSE_SIZE:
                return self._universe.size
            if keyval == MPI.APPNUM:
                return 0
            return MPI.COMM_SELF.Get_attr(keyval)
        return self._attrs.get(keyval)

    def Set_attr(self, keyval, attrval):
        self._live("Set_attr")
        old = self._attrs.get(keyval, _MISSING)
        if old is not _MISSING:
            self._delete_attr(keyval, old)
        self._attrs[keyval] = attrval

    def Delete_attr(self, keyval):
        self._live("Delete_attr")
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

    # -- collective machinery ----------------------------------------------------------------------
    def _start(self, name, sig, payload, work):
        """Post this rank's part of collective ``name``; the last rank to arrive computes every result.

        ``sig`` is a tuple of (field, value) pairs that must be equal on all ranks; ``work`` maps the
        list of payloads by rank to the list of results by rank.
        """
        ctx = self._live(name)
        u = ctx.universe
        rank = self._rank
        size = len(ctx.world_ranks)
        with u.cond:
            seq = self._seq
            self._seq += 1
            rnd = ctx.rounds.get(seq)
            if rnd is None:
                rnd = ctx.rounds[seq] = _Round(size)
            rnd.calls[rank] = (name, sig, payload)
            rnd.arrived += 1
            if rnd.arrived == size:
                self._finish_round(seq, rnd, work)
                u.changed()

        def finish():
            rnd.departed += 1
            if rnd.departed == size:
                ctx.rounds.pop(seq, None)
            if rnd.error is not None:
                if isinstance(rnd.error, BaseException):
                    raise rnd.error
                raise CollectiveMismatchError(rnd.error)
            return rnd.results[rank], None

        return SimRequest(u, ctx.world_ranks[rank], lambda: rnd.done, finish,
                          f"{_describe(name, sig)} #{seq} on {ctx.name}")

    def _finish_round(self, seq, rnd, work):
        first = rnd.calls[0]
        if any(c[0] != first[0] or c[1] != first[1] for c in rnd.calls):
            groups = {}
            for r, (name, sig, _) in enumerate(rnd.calls):
                groups.setdefault(_describe(name, sig), []).append(r)
            parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} called {d}" for d, rs in groups.items())
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
        return self._start(name, sig, payload, work).wait()

    def _check_root(self, name, root):
        size = self.Get_size()
        if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
            raise mpi_error(MPI.ERR_ROOT, f"SimComm.{name}: root {root} out of range for communicator of size {size}")

    # -- communicator management --------------------------------------------------------------------
    def _derive(self, name, color, key, topo=None, sig=()):
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
        return (topo_class(topo) if topo is not None else type(self)._derived_class())(*got)

    @classmethod
    def _derived_class(cls):
        return SimComm

    def Split(self, color=0, key=0):
        """Partition ranks by ``color``, ordered by ``key`` then rank; ``MPI.UNDEFINED`` gives ``MPI.COMM_NULL``."""
        return self._derive("Split", color, key)

    def Split_type(self, split_type, key=0, info=None):
        """Split by simulated node (``simulate(ranks_per_node=)``) for every type but ``MPI.UNDEFINED``."""
        if split_type == MPI.UNDEFINED:
            return self._derive("Split_type", MPI.UNDEFINED, key)
        node = self._world_rank // self._universe.ranks_per_node
        return self._derive("Split_type", node, key)

    def Dup(self, info=None):
        """Return a new communicator with the same ranks and a separate message space."""
        new = self._derive("Dup", 0, self._rank, topo=self._ctx.topo if self._ctx is not None else None)
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

    def Clone(self):
        return self.Dup()

    def Create(self, group):
        """Communicator of ``group``'s ranks (collective over this communicator); others get COMM_NULL."""
        ranks = group._world_ranks if isinstance(group, SimGroup) else []
        mine = self._world_rank in ranks
        parent = self._live("Create")

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
        u = self._universe
        key = ("Create_group", self._live("Create_group").id, tuple(ranks), tag)
        with u.cond:
            table = u.attrs.setdefault("create_group", {})
            entry = table.get(key)
            if entry is None or me in entry["taken"]:
                entry = table[key] = {"ctx": Context(u, ranks, f"{self._ctx.name}.Create_group"), "taken": set()}
            entry["taken"].add(me)
            ctx = entry["ctx"]
            if len(entry["taken"]) == len(ranks):
                table.pop(key, None)
        comm = SimComm(ctx, ranks.index(me))
        comm.Barrier()
        return comm

    def Free(self):
        """Free the communicator: this handle becomes ``MPI.COMM_NULL``."""
        self._live("Free")
        for key in list(self._attrs):
            self._delete_attr(key, self._attrs.pop(key))
        self._ctx = None

    def Disconnect(self):
        self.Barrier()
        self.Free()

    @staticmethod
    def Compare(comm1, comm2):
        """Return ``MPI.IDENT``, ``CONGRUENT``, ``SIMILAR`` or ``UNEQUAL``."""
        a, b = comm1._resolve(), comm2._resolve()
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
    def Get_parent(self):
        return COMM_NULL_FACTORY()


class _Round:
    __slots__ = ("calls", "arrived", "departed", "done", "error", "results")

    def __init__(self, size):
        self.calls = [None] * size
        self.arrived = 0
        self.departed = 0
        self.done = False
        self.error = None
        self.results = [None] * size


_MISSING = object()
_KEYVALS = {}


def topo_class(topo):
    from .topo import class_for
    return class_for(topo)


def COMM_NULL_FACTORY():
    """A null communicator handle (false, equal to ``MPI.COMM_NULL``)."""
    return SimComm(None, 0)


COMM_NULL = COMM_NULL_FACTORY()
_ = (spec, time)
