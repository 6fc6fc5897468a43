"""A device mesh: the ranks of a communicator arranged in a grid with named dimensions, one communicator each.

Glossary:
- dimension: a named axis of the grid with a size, outermost first, innermost last, e.g. ("dp", "pp", "tp").
- position: a rank's place in node-major order (``mpidist.comm.nodes``: node by node, nodes numbered by their
  lowest rank, ranks by number within a node). Under block placement (mpiexec's default, ``srun -m block``) the
  position is the rank; under round-robin placement the order still keeps inner dimensions inside nodes.
- coordinate: a rank's index along every dimension, from its position in row-major order (last dimension
  fastest): for sizes (n0, n1, n2), position = (c0 * n1 + c1) * n2 + c2.
- dimension communicator (``mesh[name]``): the ranks whose coordinates differ only along that dimension, ordered
  by it. Dimension k's ranks are n_k positions at a stride of n_{k+1} * ... (1 for the innermost), inside one
  block of n_k * n_{k+1} * ... consecutive positions; such blocks stay within nodes exactly when every node's
  rank count is a multiple of the block length (a node boundary inside a block cuts one of its groups), which
  is what ``within_node`` checks.

A mesh frees what it split off (``free()``, collective, once) and never the communicators it was given.
"""
from __future__ import annotations

import math
import numbers

from . import check_comm
from .agree import check_same, raise_if_any
from .nodes import node_major_order, node_of_ranks, ranks_per_node

__all__ = ["DeviceMesh", "mesh"]


def _ravel(coordinate, shape):
    index = 0
    for c, n in zip(coordinate, shape):
        index = index * n + c
    return index


def _unravel(index, shape):
    coordinate = []
    for n in reversed(shape):
        index, c = divmod(index, n)
        coordinate.append(c)
    return tuple(reversed(coordinate))


def _listed(dims):
    """Return "a=2, b=3, a*b=6" for [("a", 2), ("b", 3)] ("a=2" for one dimension)."""
    dims = list(dims)
    product = f", {'*'.join(a for a, _ in dims)}={math.prod(n for _, n in dims)}" if len(dims) > 1 else ""
    return ", ".join(f"{a}={n}" for a, n in dims) + product


def _dims_problem(dims, within_node, size):
    """Return (names, sizes with -1 resolved, problem or None) for ``dims`` over ``size`` ranks."""
    if not hasattr(dims, "items"):
        return (), (), f"dims must map each dimension's name to its size, outermost first (got {dims!r:.80})"
    names, shape = tuple(dims), list(dims.values())
    bad_names = [name for name in names if not isinstance(name, str) or not name]
    if not names or bad_names:
        return names, (), f"dimension names must be non-empty strings (got {list(names)})"
    for name, n in zip(names, shape):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or (n < 1 and n != -1):
            return names, (), f"{name} must be an int >= 1, or -1 for what the others leave (got {n!r})"
    if shape.count(-1) > 1:
        listed = ", ".join(f"{a}={n}" for a, n in zip(names, shape))
        return names, (), f"at most one dimension may be -1 (got {listed})"
    if -1 in shape:
        k = shape.index(-1)
        others = [(a, n) for a, n in zip(names, shape) if n != -1]
        rest = math.prod(n for _, n in others)
        if size % rest:
            return names, (), (f"the number of ranks ({size}) is not divisible by {' * '.join(a for a, _ in others)} "
                               f"({_listed(others)})")
        shape[k] = size // rest
    if math.prod(shape) != size:
        return names, (), (f"{' * '.join(names)} must equal the number of ranks ({_listed(zip(names, shape))}, "
                           f"ranks={size})")
    unknown = [name for name in within_node if name not in names]
    if unknown:
        return names, (), f"within_node names no dimension of the mesh {unknown} (dimensions: {list(names)})"
    return names, tuple(int(n) for n in shape), None


def _node_problem(names, shape, within_node, per_node):
    """Return why a dimension of ``within_node`` would span two nodes, or None."""
    for name in within_node:
        k = names.index(name)
        block = math.prod(shape[k:])
        if shape[k] > 1 and any(count % block for count in per_node):
            inner = "" if k == len(names) - 1 else f" ({'*'.join(names[k:])}={block}: {name} and the dimensions inside)"
            return (f"dimension {name!r} (size {shape[k]}) does not fit within nodes: every node's rank count must be "
                    f"a multiple of {block}{inner} so that no {name!r} group spans two nodes (ranks per node: "
                    f"{per_node}); pick sizes whose product divides every node's count, or place ranks evenly")
    return None


class DeviceMesh:
    """This rank's place in a grid of ``comm``'s ranks with named dimensions, and one communicator per dimension.

    ``DeviceMesh(comm, {"dp": 2, "pp": 2, "tp": 2})`` splits ``comm`` (collective): dimensions outermost first,
    one size may be -1 (what the others leave). Ranks are ordered node-major, then row-major with the last
    dimension innermost, so inner dimensions are consecutive ranks of one node where they fit; a dimension
    named in ``within_node`` that would span two nodes raises on every rank. ``mesh["tp"]`` is that dimension's
    communicator; ``dp_comm``, ``pp_comm``, ``tp_comm``, ``dp``, ``pp``, ``tp``, ``dp_rank``, ``pp_rank``,
    ``tp_rank`` read the dimensions named so.
    """

    __slots__ = ("_comm", "_names", "_shape", "_coordinate", "_comms", "_owned", "_submeshes", "_parent", "_freed")

    def __init__(self, comm, dims, *, within_node=()):
        check_comm("DeviceMesh", comm)
        within_node = (within_node,) if isinstance(within_node, str) else tuple(within_node)
        size = comm.Get_size()
        names, shape, problem = _dims_problem(dims, within_node, size)
        raise_if_any(comm, problem, "DeviceMesh")
        check_same(comm, [(name, n) for name, n in zip(names, shape)] + [("within_node", within_node)],
                   "DeviceMesh", what="dimension")
        nodes = node_of_ranks(comm)  # the same list on every rank: a refusal below is raised on all of them
        per_node = ranks_per_node(nodes)
        problem = _node_problem(names, shape, within_node, per_node)
        if problem:
            raise ValueError(f"DeviceMesh: {problem}")
        coordinate = _unravel(node_major_order(nodes).index(comm.Get_rank()), shape)
        comms = []
        for k in range(len(shape)):
            others = coordinate[:k] + coordinate[k + 1:]
            comms.append(comm.Split(color=_ravel(others, shape[:k] + shape[k + 1:]), key=coordinate[k]))
        self._setup(comm, names, shape, coordinate, comms, owned=comms)

    def _setup(self, comm, names, shape, coordinate, comms, owned, parent=None):
        self._comm, self._names, self._shape, self._coordinate = comm, tuple(names), tuple(shape), tuple(coordinate)
        self._comms, self._owned = tuple(comms), list(owned)
        self._submeshes, self._parent, self._freed = {}, parent, False

    @classmethod
    def _new(cls, *args, **kwargs):
        obj = cls.__new__(cls)
        obj._setup(*args, **kwargs)
        return obj

    @classmethod
    def from_comm(cls, comm, name="world"):
        """Return the 1-D mesh whose one dimension, ``name``, is ``comm`` itself (no communication)."""
        check_comm("DeviceMesh.from_comm", comm)
        return cls._new(comm, (name,), (comm.Get_size(),), (comm.Get_rank(),), (comm,), owned=())

    @classmethod
    def from_groups(cls, comm, groups, *, context="DeviceMesh.from_groups"):
        """Return the mesh of already-split communicators ``groups`` ({name: comm}, outermost first).

        Collective over ``comm``; raises on every rank unless the groups tile ``comm``: their sizes multiply to
        its size, no two ranks share a coordinate (ranks in the groups), and the ranks of each group share every
        other coordinate. Errors begin with ``context``. ``free()`` leaves the given communicators alone.
        """
        check_comm(context, comm)
        if not hasattr(groups, "items") or not groups:
            raise TypeError(f"{context}: groups must map each dimension's name to its communicator, "
                            f"outermost first (got {groups!r:.80})")
        for name, group in groups.items():
            check_comm(f"{context} {name}", group)
        names = tuple(groups)
        shape = tuple(group.Get_size() for group in groups.values())
        size = comm.Get_size()
        problem = None
        if math.prod(shape) != size:
            problem = (f"{' x '.join(f'{name} ({n} ranks)' for name, n in zip(names, shape))} = {math.prod(shape)} "
                       f"ranks, but comm has {size}: the groups must tile comm")
        raise_if_any(comm, problem, context)
        coordinate = tuple(group.Get_rank() for group in groups.values())
        places = comm.allgather(coordinate)
        twice = sorted({p for p in places if places.count(p) > 1})
        raise_if_any(comm, f"ranks share a place ({', '.join(names)}) {twice}: each group must split comm along "
                           f"its own dimension" if twice else None, context)
        problem = None
        for k, (name, group) in enumerate(groups.items()):
            others = group.allgather(coordinate[:k] + coordinate[k + 1:])
            if problem is None and len(set(others)) > 1:
                along = ", ".join(names[:k] + names[k + 1:])
                problem = (f"group {name!r} joins ranks at different places along ({along}) {sorted(set(others))}"
                           f": its ranks must differ only along {name!r}")
        raise_if_any(comm, problem, context)
        return cls._new(comm, names, shape, coordinate, tuple(groups.values()), owned=())

    @classmethod
    def from_dimensions(cls, groups, comm=None):
        """Return the mesh of dimension communicators ``groups`` ({name: comm}, outermost first), unchecked.

        No communication: ``comm`` is the communicator the groups tile where the caller knows they do (else use
        ``from_groups``, which checks), or None where no one communicator holds them all (a pipeline's and its
        data-parallel groups given apart); ``from_dimensions({})`` is this process alone (no dimension, size 1).
        ``free()`` leaves the given communicators alone.
        """
        if not hasattr(groups, "items"):
            raise TypeError(f"DeviceMesh.from_dimensions: groups must map each dimension's name to its "
                            f"communicator, outermost first (got {groups!r:.80})")
        for name, group in groups.items():
            check_comm(f"DeviceMesh.from_dimensions {name}", group)
        if comm is not None:
            check_comm("DeviceMesh.from_dimensions", comm)
        return cls._new(comm, tuple(groups), tuple(g.Get_size() for g in groups.values()),
                        tuple(g.Get_rank() for g in groups.values()), tuple(groups.values()), owned=())

    # -- what a mesh is ------------------------------------------------------------------------------------

    @property
    def comm(self):
        """The communicator holding every rank of the mesh (None for a mesh ``from_dimensions`` without one)."""
        self._check_live("comm")
        return self._comm

    @property
    def names(self):
        """The dimensions' names, outermost first."""
        return self._names

    @property
    def shape(self):
        """The dimensions' sizes, outermost first."""
        return self._shape

    @property
    def coordinate(self):
        """This rank's index along every dimension, outermost first."""
        return self._coordinate

    def size(self, name=None) -> int:
        """Return the size of dimension ``name``, or the number of ranks of the mesh."""
        return math.prod(self._shape) if name is None else self._shape[self._index(name)]

    def rank(self, name=None) -> int:
        """Return this rank's coordinate along dimension ``name``, or its row-major position in the mesh."""
        return _ravel(self._coordinate, self._shape) if name is None else self._coordinate[self._index(name)]

    def __getitem__(self, name):
        """Return the communicator of dimension ``name``."""
        k = self._index(name)
        self._check_live(f"[{name!r}]")
        return self._comms[k]

    def __repr__(self):
        dims = ", ".join(f"{name}={n}" for name, n in zip(self._names, self._shape))
        return f"DeviceMesh({dims}; coordinate {self._coordinate}{'; freed' if self._freed else ''})"

    def _index(self, name):
        if name not in self._names:
            raise KeyError(f"DeviceMesh: no dimension {name!r} (dimensions: {list(self._names)})")
        return self._names.index(name)

    def _check_live(self, what):
        if self._freed:
            raise RuntimeError(f"DeviceMesh.{what}: the mesh ({', '.join(self._names)}) was freed; build a new one")

    # -- sub-meshes and freeing ----------------------------------------------------------------------------

    def submesh(self, *names):
        """Return the mesh of dimensions ``names`` (in this mesh's order) over the ranks sharing the other coordinates.

        Collective over ``comm`` the first time a set of two or more names is asked for (one Split); the result is
        kept, shares this mesh's dimension communicators, and is freed with this mesh.
        """
        self._check_live("submesh")
        unknown = [name for name in names if name not in self._names]
        order = [self._names.index(name) for name in names if name in self._names]
        if not names or unknown or order != sorted(set(order)):
            raise ValueError(f"DeviceMesh.submesh: give distinct dimensions in the mesh's order "
                             f"{list(self._names)} (got {list(names)})")
        if tuple(names) == self._names:
            return self
        if names not in self._submeshes:
            shape = tuple(self._shape[k] for k in order)
            coordinate = tuple(self._coordinate[k] for k in order)
            comms = tuple(self._comms[k] for k in order)
            if len(order) == 1:
                comm = comms[0]
            elif self._comm is None:
                raise ValueError(f"DeviceMesh.submesh: the mesh ({', '.join(self._names)}) has no communicator "
                                 f"holding all its ranks to split {list(names)} from; build it with one")
            else:
                rest = [k for k in range(len(self._shape)) if k not in order]
                color = _ravel([self._coordinate[k] for k in rest], [self._shape[k] for k in rest])
                comm = self._comm.Split(color=color, key=_ravel(coordinate, shape))
                self._owned.append(comm)
            self._submeshes[names] = DeviceMesh._new(comm, names, shape, coordinate, comms, owned=(), parent=self)
        return self._submeshes[names]

    def free(self) -> None:
        """Free every communicator this mesh split off (collective over ``comm``); later use raises."""
        if self._parent is not None:
            raise RuntimeError(f"DeviceMesh.free: the mesh ({', '.join(self._names)}) is a submesh of "
                               f"({', '.join(self._parent._names)}); free that mesh, which frees this one too")
        self._check_live("free")
        for comm in self._owned:
            comm.Free()
        self._owned = []
        self._freed = True
        for sub in self._submeshes.values():
            sub._freed = True

    # -- the data x pipeline x tensor names --------------------------------------------------------------

    def _named(self, name, what):
        try:
            return what(name)
        except KeyError:
            raise AttributeError(f"DeviceMesh: no dimension {name!r} (dimensions: {list(self._names)})") from None

    dp_comm = property(lambda self: self._named("dp", self.__getitem__), doc="The communicator of dimension 'dp'.")
    pp_comm = property(lambda self: self._named("pp", self.__getitem__), doc="The communicator of dimension 'pp'.")
    tp_comm = property(lambda self: self._named("tp", self.__getitem__), doc="The communicator of dimension 'tp'.")
    dp = property(lambda self: self._named("dp", self.size), doc="The size of dimension 'dp'.")
    pp = property(lambda self: self._named("pp", self.size), doc="The size of dimension 'pp'.")
    tp = property(lambda self: self._named("tp", self.size), doc="The size of dimension 'tp'.")
    dp_rank = property(lambda self: self._named("dp", self.rank), doc="This rank's coordinate along 'dp'.")
    pp_rank = property(lambda self: self._named("pp", self.rank), doc="This rank's coordinate along 'pp'.")
    tp_rank = property(lambda self: self._named("tp", self.rank), doc="This rank's coordinate along 'tp'.")


def mesh(comm, dp: int = None, pp: int = 1, tp: int = 1) -> DeviceMesh:
    """Split ``comm`` into a ("dp", "pp", "tp") DeviceMesh, tensor parallelism innermost and within nodes.

    ``dp=None`` takes what the world leaves: ``size // (pp * tp)``. Collective over ``comm``. Under block placement
    world rank w = (dp_rank * pp + pp_rank) * tp + tp_rank. Raises on every rank when a node's rank count is not a
    multiple of ``tp`` (a tensor-parallel group would span nodes).
    """
    for name, value in (("pp", pp), ("tp", tp)) + ((("dp", dp),) if dp is not None else ()):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"mesh: {name} must be an int >= 1 (got {value!r})")
    return DeviceMesh(comm, {"dp": -1 if dp is None else dp, "pp": pp, "tp": tp}, within_node=("tp",))
