"""Node-aware layouts on simulated nodes: tensor parallelism and hybrid-FSDP shard groups stay inside a node.

``simulate(ranks_per_node=k)`` makes block placement (ranks 0..k-1 on the first node). Round-robin placement
(``mpiexec -hosts a,b``, ``srun -m cyclic``: rank r on node r % nodes) comes from ``Cyclic``, a communicator
that answers ``Split_type(COMM_TYPE_SHARED)`` by rank % nodes and passes every other call to the SimComm below.
The reference for "which node" is that placement rule itself, never the code under test; parity runs are
checked against one process trained on the whole batch (tests/test_fsdp.py's harness).
The same checks across real nodes (namespaces, over TCP) are in tests/test_cluster.py.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist.optim import Adam
from mpidist.parallel import mesh
from mpidist.parallel.fsdp import FSDP

from test_fsdp import assert_matches, batches, fsdp_step, make_model, ref_step


class Cyclic:
    """A communicator whose ranks sit on ``nodes`` nodes round-robin (rank r on node r % nodes)."""

    def __init__(self, comm, nodes):
        self._comm, self._nodes = comm, nodes

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split_type(self, split_type, key=0, info=None):
        assert split_type == MPI.COMM_TYPE_SHARED
        return self._comm.Split(color=self._comm.Get_rank() % self._nodes, key=key)


def block_node(rank, per_node):
    return rank // per_node


def members(sub, comm):
    """Return the ranks of ``comm`` in ``sub``, in ``sub``'s order."""
    return sub.allgather(comm.Get_rank())


PLACEMENTS = {  # name: (wrap the SimComm, the node of rank r) for 4 ranks on 2 nodes
    "block": (lambda comm: comm, lambda r: block_node(r, 2)),
    "cyclic": (lambda comm: Cyclic(comm, 2), lambda r: r % 2),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("dims", [dict(tp=2), dict(tp=2, pp=2, dp=1), dict(pp=2), dict(tp=1)])
def test_mesh_keeps_tensor_parallel_in_a_node_and_data_parallel_across(placement, dims):
    wrap, node = PLACEMENTS[placement]

    def run(comm):
        m = mesh(wrap(comm), **dims)
        return members(m.tp_comm, comm), members(m.pp_comm, comm), members(m.dp_comm, comm), (m.dp_rank, m.pp_rank, m.tp_rank)

    out = mpidist.simulate(4, run, ranks_per_node=2)
    tp, pp, dp = dims.get("tp", 1), dims.get("pp", 1), dims.get("dp")
    dp = 4 // (tp * pp) if dp is None else dp
    places = {o[3] for o in out}
    assert len(places) == 4, f"every rank has its own (dp, pp, tp) place: {out}"
    for tp_group, pp_group, dp_group, _ in out:
        assert len(tp_group) == tp and len({node(r) for r in tp_group}) == 1, f"tp group {tp_group} spans nodes"
        assert len(pp_group) == pp and len(dp_group) == dp
        if tp * pp == 2:  # a replica fills one node: every data-parallel group crosses the 2 nodes
            assert len({node(r) for r in dp_group}) == 2, f"dp group {dp_group} stays in one node"


def test_mesh_under_block_placement_is_the_rank_number_layout():
    """Block placement keeps the documented layout w = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    def run(comm):
        m = mesh(comm, tp=2, pp=2, dp=2)
        return comm.Get_rank(), (m.dp_rank * 2 + m.pp_rank) * 2 + m.tp_rank

    for rank, place in mpidist.simulate(8, run, ranks_per_node=4):
        assert rank == place


@pytest.mark.parametrize("per_node, tp", [(3, 2), (2, 4), (1, 2)])
def test_mesh_refuses_tensor_parallel_groups_that_would_span_nodes_on_every_rank(per_node, tp):
    def run(comm):
        with pytest.raises(ValueError, match=r"DeviceMesh: dimension 'tp' \(size %d\) does not fit within nodes.*ranks per "
                                             r"node: \[" % tp) as err:
            mesh(comm, tp=tp)
        return str(err.value)

    out = mpidist.simulate(4, run, ranks_per_node=per_node)
    counts = [min(per_node, 4 - start) for start in range(0, 4, per_node)]
    assert all(f"ranks per node: {counts}" in msg for msg in out), out


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("shard_size", [None, 2])
def test_hybrid_fsdp_shards_within_a_node_and_replicates_across(placement, shard_size):
    wrap, node = PLACEMENTS[placement]

    def run(comm):
        fsdp = FSDP(make_model(), wrap(comm), strategy="hybrid_shard", shard_size=shard_size)
        shard, replicate = fsdp.communicators()
        return members(shard, comm), members(replicate, comm), fsdp.groups.shard_of

    out = mpidist.simulate(4, run, ranks_per_node=2)
    for rank, (shard_group, replica_group, shard_of) in enumerate(out):
        assert len(shard_group) == 2 and {node(r) for r in shard_group} == {node(rank)}, out
        assert len(replica_group) == 2 and len({node(r) for r in replica_group}) == 2, out
        # shard_of is by rank of comm and agrees with each rank's place in its shard group
        assert shard_of[rank] == shard_group.index(rank)


def test_hybrid_fsdp_without_shard_size_on_one_node_shards_over_all_ranks():
    def run(comm):
        fsdp = FSDP(make_model(), comm, strategy="hybrid_shard")
        return fsdp.settings.num_shards, fsdp.settings.num_replicas

    assert mpidist.simulate(4, run) == [(4, 1)] * 4


def test_hybrid_fsdp_without_shard_size_refuses_uneven_nodes_on_every_rank():
    def run(comm):
        with pytest.raises(ValueError, match=r"without shard_size shards within each node, which needs the same "
                                             r"number of ranks on every node \(ranks per node: \[3, 1\]\)"):
            FSDP(make_model(), comm, strategy="hybrid_shard_grad_op")
        return True

    assert mpidist.simulate(4, run, ranks_per_node=3) == [True] * 4


@pytest.mark.parametrize("strategy", ["hybrid_shard", "hybrid_shard_grad_op"])
def test_hybrid_fsdp_by_node_under_round_robin_placement_trains_like_one_process(strategy):
    def run(comm):
        ref = make_model()
        fsdp = FSDP(make_model(), Cyclic(comm, 2), strategy=strategy)
        opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
        for x, y in batches(3):
            fsdp_step(comm, fsdp, opt, x, y)
            ref_step(ref, ref_opt, x, y)
        assert_matches(comm, fsdp, ref)
        return fsdp.settings.num_shards, fsdp.settings.num_replicas

    assert mpidist.simulate(4, run, ranks_per_node=2) == [(2, 2)] * 4


def test_tensor_parallel_mesh_under_round_robin_placement_matches_one_process():
    """A tp=2 layer pair on the node-aware groups of a cyclic world (ranks {0, 2} and {1, 3}) computes exactly."""
    from mpidist.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    import mpidist.nn as nn

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8))
    full1, full2 = nn.Linear(8, 6), nn.Linear(6, 4)
    expected = full2(nn.Tensor(np.maximum(full1(nn.Tensor(x)).data, 0))).data

    def run(comm):
        m = mesh(Cyclic(comm, 2), tp=2)
        col = ColumnParallelLinear(full1, m.tp_comm)
        row = RowParallelLinear(full2, m.tp_comm)
        return row(nn.Tensor(np.maximum(col(nn.Tensor(x)).data, 0))).data

    for got in mpidist.simulate(4, run, ranks_per_node=2):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
