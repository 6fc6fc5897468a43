"""A process mesh of data-parallel replicas x pipeline stages x tensor-parallel ranks.

World rank w sits at ``w = (dp_rank * pp + pp_rank) * tp + tp_rank``: tensor parallelism is innermost, so a
tensor-parallel group is ``tp`` consecutive ranks (one node, where its per-layer collectives are cheapest), a
pipeline is a block of ``pp * tp`` consecutive ranks (neighbouring stages on neighbouring nodes), and each
data-parallel group joins one (pipeline, tensor) position across replicas. With tp = 1 this is the 2-D
dp x pp layout, pipeline position w % pp of replica w // pp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpidist.comm import check_comm

__all__ = ["Mesh", "mesh"]


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a dp x pp x tp mesh and the communicators it talks on."""

    pp_comm: Any  # the pp ranks of this replica at this tensor position, ordered by pipeline position
    dp_comm: Any  # the dp ranks at this (pipeline, tensor) position, ordered by replica
    pp_rank: int
    dp_rank: int
    pp: int
    dp: int
    tp_comm: Any = None  # the tp ranks of this (replica, stage), ordered by tensor position
    tp_rank: int = 0
    tp: int = 1

    def __getitem__(self, name):
        """``mesh["dp"]``, ``mesh["tp"]``, ``mesh["pp"]``: the communicator of that dimension."""
        comms = {"dp": self.dp_comm, "tp": self.tp_comm, "pp": self.pp_comm}
        if name not in comms:
            raise KeyError(f"Mesh: no dimension {name!r} (expected one of {sorted(comms)})")
        return comms[name]

    def free(self) -> None:
        """Free the communicators (collective over the world the mesh was built from)."""
        self.pp_comm.Free()
        self.dp_comm.Free()
        if self.tp_comm is not None:
            self.tp_comm.Free()


def mesh(comm, dp: int = None, pp: int = 1, tp: int = 1) -> Mesh:
    """Split ``comm`` into tensor-parallel groups (innermost), pipelines and data-parallel groups.

    ``dp=None`` takes what the world leaves: ``size // (pp * tp)``. Collective over ``comm``.
    """
    check_comm("mesh", comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    for name, value in (("pp", pp), ("tp", tp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mesh: {name} must be an int >= 1 (got {value!r})")
    if dp is None:
        if size % (pp * tp):
            raise ValueError(f"mesh: the number of ranks ({size}) is not divisible by pp * tp (pp={pp}, tp={tp}, "
                             f"pp*tp={pp * tp})")
        dp = size // (pp * tp)
    if dp * pp * tp != size:
        raise ValueError(f"mesh: dp * pp * tp must equal the number of ranks (dp={dp}, pp={pp}, tp={tp}, "
                         f"dp*pp*tp={dp * pp * tp}, ranks={size})")
    rest, tp_rank = divmod(rank, tp)
    dp_rank, pp_rank = divmod(rest, pp)
    tp_comm = comm.Split(color=dp_rank * pp + pp_rank, key=tp_rank)
    pp_comm = comm.Split(color=dp_rank * tp + tp_rank, key=pp_rank)
    dp_comm = comm.Split(color=pp_rank * tp + tp_rank, key=dp_rank)
    return Mesh(pp_comm, dp_comm, pp_rank, dp_rank, pp, dp, tp_comm, tp_rank, tp)
