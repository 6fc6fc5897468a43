"""Groups: ordered sets of ranks, their set operations and rank translation (``MPI.Group`` on simulated ranks).

A group holds world ranks; ``Get_rank`` answers for the rank that obtained it (groups are local objects
in MPI, so each simulated rank holds its own).
"""

from mpi4py import MPI

from .errors import mpi_error
from .handles import Handles

__all__ = ["SimGroup", "GROUP_EMPTY", "GROUP_NULL"]


class SimGroup(Handles):
    """An ordered set of simulated ranks."""

    _NULL_HANDLE = MPI.GROUP_NULL.handle

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        if args and isinstance(args[0], SimGroup) and not args[0]._constant:
            self.__dict__ = args[0].__dict__  # MPI.Group(group): a second handle on the same group
        return self

    def __init__(self, world_ranks=None, owner=None, null=False, universe=None, constant=False):
        """``SimGroup()`` is a null group, as ``MPI.Group()`` is; ``SimGroup(group)`` a second handle."""
        if isinstance(world_ranks, SimGroup):
            if world_ranks._constant:  # a copy of GROUP_EMPTY/GROUP_NULL is a handle of its own
                self.__dict__ = dict(world_ranks.__dict__, _constant=False)
            return
        if isinstance(world_ranks, MPI.Group):
            if world_ranks not in (MPI.GROUP_NULL, MPI.GROUP_EMPTY):
                raise TypeError(f"MPI.Group: expecting a simulated group (got {world_ranks!r})")
            null, world_ranks = world_ranks == MPI.GROUP_NULL, []
        self._world_ranks = [] if world_ranks is None else list(world_ranks)
        self._owner = owner
        self._null = null or world_ranks is None
        self._universe = universe  # of the communicator it came from (Create_from_group meets there)
        self._constant = constant  # GROUP_EMPTY and GROUP_NULL themselves never change

    def __reduce__(self):
        if self._constant:
            return "GROUP_NULL" if self._null else "GROUP_EMPTY"  # the module's own constant
        if self._null or not self._world_ranks:
            return SimGroup, (None if self._null else [],)
        raise ValueError(f"cannot pickle {self!r}: only MPI.GROUP_NULL and GROUP_EMPTY are picklable")

    def __bool__(self):
        return not self._null

    def __eq__(self, other):
        if isinstance(other, SimGroup):
            if self._null or other._null:
                return self._null and other._null
            return self.__dict__ is other.__dict__ or (not self._world_ranks and not other._world_ranks)
        if isinstance(other, MPI.Group):
            if self._null:
                return other == MPI.GROUP_NULL
            return not self._world_ranks and other == MPI.GROUP_EMPTY
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = object.__hash__

    def __repr__(self):
        return "<SimGroup NULL>" if self._null else f"<SimGroup {self._world_ranks}>"

    def _live(self, what):
        if self._null:
            raise mpi_error(MPI.ERR_GROUP, f"Group.{what}: group is MPI.GROUP_NULL")
        return self._world_ranks

    def _new(self, ranks):
        return SimGroup(ranks, self._owner, universe=self._universe)

    def Get_size(self):
        return len(self._live("Get_size"))

    def Get_rank(self):
        ranks = self._live("Get_rank")
        return ranks.index(self._owner) if self._owner in ranks else MPI.UNDEFINED

    size = property(Get_size)
    rank = property(Get_rank)

    def _check(self, what, ranks):
        n = self.Get_size()
        for r in ranks:
            if not 0 <= r < n:
                raise mpi_error(MPI.ERR_RANK, f"Group.{what}: rank {r} out of range for a group of size {n}")

    def Incl(self, ranks):
        ranks = [int(r) for r in ranks]
        self._check("Incl", ranks)
        if len(set(ranks)) != len(ranks):
            raise mpi_error(MPI.ERR_RANK, f"Group.Incl: ranks {ranks} repeat")
        return self._new([self._world_ranks[r] for r in ranks])

    def Excl(self, ranks):
        ranks = [int(r) for r in ranks]
        self._check("Excl", ranks)
        drop = set(ranks)
        return self._new([w for i, w in enumerate(self._world_ranks) if i not in drop])

    @staticmethod
    def _expand(ranges):
        out = []
        for first, last, stride in ranges:
            if stride == 0:
                raise mpi_error(MPI.ERR_ARG, "Group: range stride 0")
            out.extend(range(first, last + (1 if stride > 0 else -1), stride))
        return out

    def Range_incl(self, ranks):
        return self.Incl(self._expand(ranks))

    def Range_excl(self, ranks):
        return self.Excl(self._expand(ranks))

    def Dup(self):
        return self._new(self._live("Dup"))

    def Free(self):
        if self._constant:
            raise mpi_error(MPI.ERR_GROUP, "Group.Free: a predefined group cannot be freed")
        self._null = True
        self._world_ranks = []

    def Union(self, group):
        """Ranks of this group, then those of ``group`` not in it (``MPI.Group.Union(a, b)`` works too)."""
        group1, group2 = self, group
        a, b = group1._live("Union"), group2._live("Union")
        return group1._new(a + [w for w in b if w not in a])

    def Intersection(self, group):
        group1, group2 = self, group
        a, b = group1._live("Intersection"), set(group2._live("Intersection"))
        return group1._new([w for w in a if w in b])

    def Difference(self, group):
        group1, group2 = self, group
        a, b = group1._live("Difference"), set(group2._live("Difference"))
        return group1._new([w for w in a if w not in b])

    Intersect = Intersection  # MPI 4.1's name

    def Translate_ranks(self, ranks=None, group=None):
        """This group's ``ranks`` as ranks of ``group`` (world ranks if None; ``MPI.UNDEFINED`` if absent)."""
        group1, group2 = self, group
        a = group1._live("Translate_ranks")
        if ranks is None:
            ranks = range(len(a))
        out = []
        for r in ranks:
            if r == MPI.PROC_NULL:
                out.append(MPI.PROC_NULL)
                continue
            group1._check("Translate_ranks", [r])
            if group2 is None:
                out.append(a[r])
                continue
            b = group2._live("Translate_ranks")
            out.append(b.index(a[r]) if a[r] in b else MPI.UNDEFINED)
        return out

    def Compare(self, group):
        a, b = self._live("Compare"), group._live("Compare")
        if a == b:
            return MPI.IDENT
        if sorted(a) == sorted(b):
            return MPI.SIMILAR
        return MPI.UNEQUAL



GROUP_EMPTY = SimGroup([], constant=True)
GROUP_NULL = SimGroup(None, constant=True)
