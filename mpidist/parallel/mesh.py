"""A process mesh of data-parallel replicas x pipeline stages x tensor-parallel ranks.

Ranks are first put in node-major order (node by node, nodes numbered by their lowest rank, ranks by number
within a node: ``mpidist.comm.nodes``); the rank at position p of that order sits at
``p = (dp_rank * pp + pp_rank) * tp + tp_rank``. Tensor parallelism is innermost, so a tensor-parallel group is
``tp`` consecutive positions, always within one node (where its per-layer collectives are cheapest; a layout
where a node cannot hold whole groups is refused), a pipeline is a block of ``pp * tp`` positions (neighbouring
stages on the same or neighbouring nodes), and each data-parallel group joins one (pipeline, tensor) position
across replicas, i.e. across nodes. Under block placement (mpiexec's default, ``srun -m block``) the position
is the rank; under round-robin placement (``-hosts a,b``, ``srun -m cyclic``) the node order still keeps
tensor-parallel groups inside nodes. With tp = 1 this is the 2-D dp x pp layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpidist.comm import check_comm
from mpidist.comm.nodes import node_major_order, node_of_ranks, ranks_per_node

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
    """Split ``comm`` into tensor-parallel groups (innermost, within a node), pipelines and data-parallel groups.

    ``dp=None`` takes what the world leaves: ``size // (pp * tp)``. Collective over ``comm``. Raises on every
    rank when a node's rank count is not a multiple of ``tp`` (a tensor-parallel group would span nodes).
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
    nodes = node_of_ranks(comm)  # the same list on every rank: any error below is raised on all of them
    per_node = ranks_per_node(nodes)
    if any(count % tp for count in per_node):
        raise ValueError(f"mesh: tp={tp} tensor-parallel ranks do not fit within nodes: every node's rank count "
                         f"must be a multiple of tp so that no tensor-parallel group spans two nodes "
                         f"(ranks per node: {per_node}); pick tp dividing {per_node} or place ranks evenly")
    position = node_major_order(nodes).index(rank)
    rest, tp_rank = divmod(position, tp)
    dp_rank, pp_rank = divmod(rest, pp)
    tp_comm = comm.Split(color=dp_rank * pp + pp_rank, key=tp_rank)
    pp_comm = comm.Split(color=dp_rank * tp + tp_rank, key=pp_rank)
    dp_comm = comm.Split(color=pp_rank * tp + tp_rank, key=dp_rank)
    return Mesh(pp_comm, dp_comm, pp_rank, dp_rank, pp, dp, tp_comm, tp_rank, tp)
