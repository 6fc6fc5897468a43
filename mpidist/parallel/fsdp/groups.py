"""Sharding groups: which ranks split a unit's flat parameter between them, and which hold copies of a chunk.

Glossary:
- shard group: ranks that together hold one copy of every flat parameter, each rank one chunk
  (``shard_comm``): all ranks under FULL_SHARD and SHARD_GRAD_OP, ``shard_size`` consecutive ranks under the
  hybrid strategies, none under NO_SHARD (every rank holds the whole).
- replica group: ranks holding the same chunk in different shard groups (``replicate_comm``); their
  gradients are averaged after each shard group's reduce-scatter. None under FULL_SHARD and SHARD_GRAD_OP,
  all ranks under NO_SHARD.
- shard index: which chunk a rank holds (its rank in ``shard_comm``; 0 under NO_SHARD).

Ranks are first put in node-major order (``mpidist.comm.nodes``: node by node, by rank within a node). With
``shard_size=k`` the rank at position p of that order is shard ``p % k`` of group ``p // k``: a shard group is a
block of k consecutive positions (within one node when k divides the node's rank count, where the all-gathers
and reduce-scatters of every unit are cheap), and a replica group takes one rank per block (across nodes, where
only one allreduce of 1/k of the gradient goes). Without ``shard_size`` or groups, k is the ranks per node:
shard within each node, replicate across nodes. Under block placement the position is the rank.
"""

import numbers
from dataclasses import dataclass
from typing import Any

from ...comm.mesh import DeviceMesh
from ...comm.nodes import node_of_ranks, ranks_per_node

__all__ = ["ShardGroups", "build_groups"]


@dataclass(frozen=True, eq=False)
class ShardGroups:
    """This rank's shard and replica groups, and which chunk every rank of the world communicator holds."""

    shard_comm: Any       # None under NO_SHARD
    replicate_comm: Any   # None when each chunk has one copy
    num_shards: int
    num_replicas: int
    shard_index: int
    replica_index: int
    shard_of: tuple       # the shard index of each rank of the world communicator, by rank

    def holder_of(self, shard_index):
        """Return the lowest rank of the world communicator holding chunk ``shard_index``."""
        return self.shard_of.index(shard_index)


def _check_shard_size(shard_size, size):
    if isinstance(shard_size, bool) or not isinstance(shard_size, numbers.Integral) or shard_size < 1:
        raise ValueError(f"FSDP: shard_size must be an int >= 1 (got {shard_size!r})")
    if size % shard_size:
        raise ValueError(f"FSDP: shard_size={shard_size} does not divide the {size} ranks of comm; hybrid sharding "
                         f"needs equal shard groups: pick a divisor of {size} "
                         f"({[k for k in range(1, size + 1) if size % k == 0]})")
    return int(shard_size)


def build_groups(comm, strategy, shard_size=None, shard_comm=None, replicate_comm=None):
    """Return the ``ShardGroups`` of ``strategy`` over ``comm``; raise naming the sizes on a bad combination."""
    size, rank = comm.Get_size(), comm.Get_rank()
    given = [name for name, value in (("shard_size", shard_size), ("shard_comm", shard_comm),
                                      ("replicate_comm", replicate_comm)) if value is not None]
    if not strategy.hybrid:
        if given:
            raise ValueError(f"FSDP: {', '.join(given)} only apply to the hybrid strategies (strategy="
                             f"{strategy.value!r} uses all {size} ranks); use strategy='hybrid_shard' or "
                             f"'hybrid_shard_grad_op'")
        if strategy.value == "no_shard":
            return ShardGroups(None, comm, 1, size, 0, rank, (0,) * size)
        return ShardGroups(comm, None, size, 1, rank, 0, tuple(range(size)))
    if shard_size is not None and (shard_comm is not None or replicate_comm is not None):
        raise ValueError(f"FSDP: pass either shard_size (got {shard_size!r}) or the pair shard_comm and "
                         f"replicate_comm, not both")
    if shard_comm is None and replicate_comm is None:
        if shard_size is None:
            per_node = ranks_per_node(node_of_ranks(comm))  # the same on every rank: so is the error below
            if len(set(per_node)) > 1:
                raise ValueError(f"FSDP: strategy={strategy.value!r} without shard_size shards within each node, "
                                 f"which needs the same number of ranks on every node (ranks per node: "
                                 f"{per_node}); pass shard_size=k or shard_comm and replicate_comm")
            shard_size = per_node[0]
        k = _check_shard_size(shard_size, size)
        grid = DeviceMesh(comm, {"replicate": size // k, "shard": k})  # shard groups: k consecutive node-major ranks
        shard_comm, replicate_comm = grid["shard"], grid["replicate"]
    elif shard_comm is None or replicate_comm is None:
        raise ValueError(f"FSDP: strategy={strategy.value!r} needs shard_size=k (groups of k ranks of a node "
                         f"shard, the {size} // k groups replicate), or both shard_comm and replicate_comm, or "
                         f"neither (shard within each node, replicate across nodes) (got {', '.join(given)})")
    else:  # the pair must tile comm; a 2-D mesh checks that on every rank
        DeviceMesh.from_groups(comm, {"shard_comm": shard_comm, "replicate_comm": replicate_comm}, context="FSDP")
    shard_of = tuple(comm.allgather(shard_comm.Get_rank()))
    return ShardGroups(shard_comm, replicate_comm, shard_comm.Get_size(), replicate_comm.Get_size(),
                       shard_comm.Get_rank(), replicate_comm.Get_rank(), shard_of)

