"""A 2-D process mesh: data-parallel replicas x pipeline stages.

World rank w sits at pipeline position w % pp of replica w // pp, so each pipeline is a block of consecutive
ranks (neighbouring stages usually share a node) and each data-parallel group joins one position across replicas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpidist.comm import check_comm

__all__ = ["Mesh", "mesh"]


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a dp x pp mesh and the two communicators it talks on."""

    pp_comm: Any  # the pp ranks of this replica, ordered by pipeline position
    dp_comm: Any  # the dp ranks at this pipeline position, ordered by replica
    pp_rank: int
    dp_rank: int
    pp: int
    dp: int

    def free(self) -> None:
        """Free both communicators (collective over the world the mesh was built from)."""
        self.pp_comm.Free()
        self.dp_comm.Free()


def mesh(comm, dp: int = 2, pp: int = 2) -> Mesh:
    """Split `comm` into pipeline groups of pp consecutive ranks and data-parallel groups across them."""
    check_comm("mesh", comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    for name, value in (("dp", dp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mesh: {name} must be an int >= 1 (got {value!r})")
    if dp * pp != size:
        raise ValueError(f"mesh: dp * pp must equal the number of ranks (dp={dp}, pp={pp}, dp*pp={dp * pp}, "
                         f"ranks={size})")
    dp_rank, pp_rank = divmod(rank, pp)
    pp_comm = comm.Split(color=dp_rank, key=pp_rank)
    dp_comm = comm.Split(color=pp_rank, key=dp_rank)
    return Mesh(pp_comm, dp_comm, pp_rank, dp_rank, pp, dp)
