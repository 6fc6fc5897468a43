"""Groups: ordered sets of ranks, their set operations and rank translation (``MPI.Group`` on simulated ranks).

A group holds world ranks; ``Get_rank`` answers for the rank that obtained it (groups are local objects
in MPI, so each simulated rank holds its own).
"""

from mpi4py import MPI

from .errors import mpi_error

__all__ = ["SimGroup", "GROUP_EMPTY", "GROUP_NULL"]


class SimGroup:
    """An ordered set of simulated ranks."""

    def __init__(self, world_ranks=(), owner=None, null=False):
        self._world_ranks = list(world_ranks)
        self._owner = owner
        self._null = null

    def __bool__(self):
        return not self._null

    def __eq__(self, other):
        if isinstance(other, SimGroup):
            if self._null or other._null:
                return self._null and other._null
            return self is other or (not self._world_ranks and not other._world_ranks)
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
        return SimGroup(ranks, self._owner)

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
        self._null = True
        self._world_ranks = []

    @classmethod
    def Union(cls, group1, group2):
        a, b = group1._live("Union"), group2._live("Union")
        return group1._new(a + [w for w in b if w not in a])

    @classmethod
    def Intersection(cls, group1, group2):
        a, b = group1._live("Intersection"), set(group2._live("Intersection"))
        return group1._new([w for w in a if w in b])

    @classmethod
    def Difference(cls, group1, group2):
        a, b = group1._live("Difference"), set(group2._live("Difference"))
        return group1._new([w for w in a if w not in b])

    @classmethod
    def Translate_ranks(cls, group1, ranks=None, group2=None):
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

    @classmethod
    def Compare(cls, group1, group2):
        a, b = group1._live("Compare"), group2._live("Compare")
        if a == b:
            return MPI.IDENT
        if sorted(a) == sorted(b):
            return MPI.SIMILAR
        return MPI.UNEQUAL

    def py2f(self):
        return 0 if self._null else id(self) & 0x7FFFFFFF


GROUP_EMPTY = SimGroup()
GROUP_NULL = SimGroup(null=True)
