"""Which node each rank of a communicator runs on, as MPI sees it (``Split_type(COMM_TYPE_SHARED)``)."""

import contextlib


def node_of_ranks(comm):
    """Return the node index of every rank of ``comm``, by rank; collective over ``comm``.

    A node is a group of ranks that share memory (``COMM_TYPE_SHARED``: a host under mpiexec or srun, a
    ``simulate(ranks_per_node=)`` block under SimComm). Nodes are numbered by their lowest rank, so under block
    placement node indices grow with the rank and under round-robin placement rank ``r`` is on node ``r % nodes``.
    """
    rank = comm.Get_rank()
    with node_comm(comm) as local:
        first = min(local.allgather(rank))
    firsts = comm.allgather(first)
    index = {f: i for i, f in enumerate(sorted(set(firsts)))}
    return [index[f] for f in firsts]


def node_major_order(nodes):
    """Return the ranks ordered node by node (nodes in index order), by rank within a node."""
    return sorted(range(len(nodes)), key=lambda r: (nodes[r], r))


def ranks_per_node(nodes):
    """Return the number of ranks on each node, by node index."""
    return [nodes.count(n) for n in range(max(nodes) + 1)]


@contextlib.contextmanager
def node_comm(comm):
    """Yield the communicator of this rank's node (``COMM_TYPE_SHARED``, ranks in ``comm``'s order); freed on exit.

    Collective over ``comm``. Under SimComm a node is a ``simulate(ranks_per_node=)`` block.
    """
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        yield local
    finally:
        local.Free()
