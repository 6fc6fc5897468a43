"""DeviceMesh (mpidist.comm.mesh): named dimensions over any communicator, against grids computed by hand.

Each expected group below is written out from the documented layout (node-major positions, row-major, last
dimension innermost), never derived from the code under test. Round-robin placement (rank r on node r % nodes,
as ``mpiexec -hosts a,b`` places ranks) is a communicator split from a block-placed world with its ranks
renumbered so (the simulator's nodes answer its ``Split_type(COMM_TYPE_SHARED)`` as they would under mpiexec).
"""

import re

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import DeviceMesh
from mpidist.collectives import allreduce


def members(sub, comm):
    """Return the ranks of ``comm`` in ``sub``, in ``sub``'s order."""
    return sub.allgather(comm.Get_rank())


def raised_on_every_rank(n, build, **simulate_kw):
    """Run ``build(comm)`` on ``n`` simulated ranks; return each rank's ValueError message."""
    def run(comm):
        with pytest.raises(ValueError) as err:
            build(comm)
        return str(err.value)
    return mpidist.simulate(n, run, **simulate_kw)


FOUR_D = ("dp_replicate", "dp_shard", "pp", "tp")
GRIDS = {  # sizes: (the group of every rank along each dimension of FOUR_D, each rank's coordinate), 8 ranks
    (2, 2, 1, 2): ({"dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
                    "dp_shard": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
                    "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
                    "tp": [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]},
                   [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1),
                    (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)]),
    (1, 2, 2, 2): ({"dp_replicate": [[0], [1], [2], [3], [4], [5], [6], [7]],
                    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7], [0, 4], [1, 5], [2, 6], [3, 7]],
                    "pp": [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]],
                    "tp": [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]},
                   [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
                    (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 1, 0), (0, 1, 1, 1)]),
}


@pytest.mark.parametrize("sizes", sorted(GRIDS))
def test_four_named_dimensions_split_eight_ranks_as_the_documented_grid(sizes):
    groups, coordinates = GRIDS[sizes]

    def run(comm):
        m = DeviceMesh(comm, dict(zip(FOUR_D, sizes)))
        assert (m.names, m.shape, m.comm, m.size()) == (FOUR_D, sizes, comm, 8)
        for name in FOUR_D:  # a dimension's communicator is ordered by the coordinate along it
            assert m[name].Get_rank() == m.rank(name) and m[name].Get_size() == m.size(name)
        got = {name: members(m[name], comm) for name in FOUR_D}, m.coordinate, m.rank()
        m.free()
        return got

    for rank, (got_groups, coordinate, position) in enumerate(mpidist.simulate(8, run)):
        assert got_groups == {name: groups[name][rank] for name in FOUR_D}
        assert coordinate == coordinates[rank] and position == rank  # one node: the position is the rank


def test_submesh_joins_the_ranks_sharing_the_other_coordinates():
    def run(comm):
        m = DeviceMesh(comm, {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "tp": 2})
        dp = m.submesh("dp_replicate", "dp_shard")
        assert m.submesh("dp_replicate", "dp_shard") is dp and m.submesh(*FOUR_D) is m
        assert (dp.names, dp.shape, dp.coordinate) == (("dp_replicate", "dp_shard"), (2, 2), m.coordinate[:2])
        assert dp["dp_shard"] is m["dp_shard"] and dp["dp_replicate"] is m["dp_replicate"]
        assert dp.comm.Get_rank() == dp.rank() == 2 * m.rank("dp_replicate") + m.rank("dp_shard")
        tp = m.submesh("tp")
        assert tp.comm is m["tp"] and tp.shape == (2,)
        for names in [("tp", "dp_shard"), ("dp",), (), ("tp", "tp")]:
            with pytest.raises(ValueError, match=re.escape(f"DeviceMesh.submesh: give distinct dimensions in the "
                                                           f"mesh's order {list(FOUR_D)} (got {list(names)})")):
                m.submesh(*names)
        with pytest.raises(RuntimeError, match=r"is a submesh of .*; free that mesh, which frees this one too"):
            dp.free()
        got = members(dp.comm, comm), members(m.submesh("pp", "tp").comm, comm)
        m.free()
        with pytest.raises(RuntimeError, match=r"DeviceMesh\.\['dp_shard'\]: the mesh \(dp_replicate, dp_shard\) "
                                               r"was freed"):
            dp["dp_shard"]
        return got

    data = [[0, 2, 4, 6], [1, 3, 5, 7]]  # ranks sharing (pp, tp), ordered by (dp_replicate, dp_shard)
    pp_tp = [[0, 1], [2, 3], [4, 5], [6, 7]]
    for rank, (dp_group, pp_tp_group) in enumerate(mpidist.simulate(8, run)):
        assert dp_group == data[rank % 2] and pp_tp_group == pp_tp[rank // 2]


@pytest.mark.world_sizes(2, 4)
def test_minus_one_takes_what_the_other_dimensions_leave(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    m = DeviceMesh(comm, {"dp": -1, "tp": 2})
    assert (m.shape, m.dp, m.tp, m.dp_rank, m.tp_rank) == ((n // 2, 2), n // 2, 2, rank // 2, rank % 2)
    # the tp group is two consecutive ranks, the dp group one tp position across them
    assert allreduce(np.array([rank]), m.tp_comm)[0] == 2 * (rank // 2) * 2 + 1
    assert allreduce(np.array([rank]), m.dp_comm)[0] == sum(range(rank % 2, n, 2))
    with pytest.raises(AttributeError, match=r"DeviceMesh: no dimension 'pp' \(dimensions: \['dp', 'tp'\]\)"):
        m.pp_comm
    with pytest.raises(KeyError, match=r"no dimension 'pp'"):
        m["pp"]
    with pytest.raises(AttributeError):
        m.tp = 4
    m.free()


@pytest.mark.world_sizes(4)
def test_free_frees_what_the_mesh_split_once_and_later_use_raises(comm):
    m = DeviceMesh(comm, {"a": 2, "b": 2})
    split = [m["a"], m["b"], m.submesh("a", "b")]
    assert split[2] is m  # all dimensions: the mesh itself, nothing split
    m.free()
    assert all(c == MPI.COMM_NULL for c in split[:2])
    assert comm.allreduce(1) == 4  # the communicator it was built from is not the mesh's to free
    for use in (m.free, lambda: m["a"], lambda: m.submesh("a"), lambda: m.comm):
        with pytest.raises(RuntimeError, match=r"the mesh \(a, b\) was freed; build a new one"):
            use()
    assert (m.shape, m.coordinate) == ((2, 2), divmod(comm.Get_rank(), 2))  # plain facts stay readable


@pytest.mark.parametrize("dims, message", [
    ({"a": 3, "b": 2}, "a * b must equal the number of ranks (a=3, b=2, a*b=6, ranks=4)"),
    ({"a": 3}, "a must equal the number of ranks (a=3, ranks=4)"),
    ({"a": -1, "b": 3}, "the number of ranks (4) is not divisible by b (b=3)"),
    ({"a": -1, "b": -1}, "at most one dimension may be -1 (got a=-1, b=-1)"),
    ({"a": 0, "b": 4}, "a must be an int >= 1, or -1 for what the others leave (got 0)"),
    ({"a": 2.0, "b": 2}, "a must be an int >= 1, or -1 for what the others leave (got 2.0)"),
    ({"": 4}, "dimension names must be non-empty strings (got [''])"),
    ([("a", 4)], "dims must map each dimension's name to its size, outermost first (got [('a', 4)])"),
])
def test_bad_sizes_raise_on_every_rank_naming_the_values(dims, message):
    assert raised_on_every_rank(4, lambda comm: DeviceMesh(comm, dims)) == [f"DeviceMesh: ranks 0,1,2,3: {message}"] * 4


def test_a_bad_size_on_one_rank_or_ranks_that_disagree_raise_on_every_rank():
    got = raised_on_every_rank(4, lambda comm: DeviceMesh(comm, {"dp": 0 if comm.Get_rank() == 1 else 4}))
    assert got == ["DeviceMesh: rank 1: dp must be an int >= 1, or -1 for what the others leave (got 0)"] * 4
    got = raised_on_every_rank(4, lambda comm: DeviceMesh(comm, {"dp": 2, "tp": 2} if comm.Get_rank() < 3
                                                          else {"tp": 2, "dp": 2}))
    assert got == ["DeviceMesh: ranks disagree at dimension 0: ranks 0,1,2: ('dp', 2); rank 3: ('tp', 2)"] * 4
    got = raised_on_every_rank(4, lambda comm: DeviceMesh(comm, {"dp": 4}, within_node=("tp",)))
    assert got == ["DeviceMesh: ranks 0,1,2,3: within_node names no dimension of the mesh ['tp'] "
                   "(dimensions: ['dp'])"] * 4


def test_round_robin_placement_keeps_inner_dimensions_inside_nodes():
    """Ranks on nodes r % 2: node-major order is 0,2,4,6 | 1,3,5,7, and the grid follows that order."""
    def run(world):
        r = world.Get_rank()  # on node r // 4; rank s = (r % 4) * 2 + r // 4 of comm is on node s % 2
        comm = world.Split(color=0, key=(r % 4) * 2 + r // 4)
        m = DeviceMesh(comm, {"dp": 2, "pp": 2, "tp": 2}, within_node="tp")
        got = members(m.tp_comm, comm), members(m.pp_comm, comm), members(m.dp_comm, comm), m.coordinate
        return comm.Get_rank(), got

    tp = {0: [0, 2], 2: [0, 2], 4: [4, 6], 6: [4, 6], 1: [1, 3], 3: [1, 3], 5: [5, 7], 7: [5, 7]}
    pp = {0: [0, 4], 4: [0, 4], 2: [2, 6], 6: [2, 6], 1: [1, 5], 5: [1, 5], 3: [3, 7], 7: [3, 7]}
    dp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3], 4: [4, 5], 5: [4, 5], 6: [6, 7], 7: [6, 7]}
    position = [0, 4, 1, 5, 2, 6, 3, 7]  # of rank r in the node-major order
    for rank, got in sorted(mpidist.simulate(8, run, ranks_per_node=4)):
        p = position[rank]
        assert got == (tp[rank], pp[rank], dp[rank], (p // 4, p // 2 % 2, p % 2))


@pytest.mark.parametrize("per_node, within, fits", [(4, "pp", True), (2, "pp", False), (2, "tp", True),
                                                    (3, "tp", False), (3, "dp", True)])
def test_within_node_refuses_dimensions_that_would_span_nodes_on_every_rank(per_node, within, fits):
    """Block placement: nodes of ``per_node`` consecutive ranks; a dimension's groups stay in a node exactly when
    every node holds whole blocks of it and the dimensions inside it (pp: 4 ranks, tp: 2, dp of size 1: any)."""
    dims = {"dp": 1, "pp": 2, "tp": 2} if within == "dp" else {"dp": 2, "pp": 2, "tp": 2}
    n = 4 if within == "dp" else 8
    counts = [min(per_node, n - start) for start in range(0, n, per_node)]
    if not fits:
        block = {"pp": "4 (pp*tp=4: pp and the dimensions inside)", "tp": "2"}[within]
        expected = (f"DeviceMesh: dimension {within!r} (size 2) does not fit within nodes: every node's rank count "
                    f"must be a multiple of {block} so that no {within!r} group spans two nodes (ranks per node: "
                    f"{counts}); pick sizes whose product divides every node's count, or place ranks evenly")
        got = raised_on_every_rank(n, lambda comm: DeviceMesh(comm, dims, within_node=(within,)),
                                   ranks_per_node=per_node)
        assert got == [expected] * n
        return

    def run(comm):
        m = DeviceMesh(comm, dims, within_node=(within,))
        return members(m[within], comm)

    for rank, group in enumerate(mpidist.simulate(n, run, ranks_per_node=per_node)):
        assert rank in group and len({r // per_node for r in group}) == 1, (rank, group)


@pytest.mark.world_sizes(4)
def test_from_groups_takes_strided_groups_that_tile_the_communicator(comm):
    rank = comm.Get_rank()
    pairs = comm.Split(color=rank // 2, key=rank)    # {0, 1}, {2, 3}
    strided = comm.Split(color=rank % 2, key=rank)   # {0, 2}, {1, 3}
    m = DeviceMesh.from_groups(comm, {"x": pairs, "y": strided})
    assert (m.names, m.shape, m.coordinate) == (("x", "y"), (2, 2), (rank % 2, rank // 2))
    assert m["x"] is pairs and m.rank() == (rank % 2) * 2 + rank // 2
    m.free()  # the groups were given: still usable
    assert pairs.allreduce(rank) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    with pytest.raises(ValueError, match=re.escape("DeviceMesh.from_groups: ranks 0,1,2,3: x (4 ranks) x y (4 ranks) "
                                                   "= 16 ranks, but comm has 4: the groups must tile comm")):
        DeviceMesh.from_groups(comm, {"x": comm, "y": comm})
    with pytest.raises(ValueError, match=re.escape("ranks share a place (x, y) [(0, 0), (1, 1)]: each group must "
                                                   "split comm along its own dimension")):
        DeviceMesh.from_groups(comm, {"x": pairs, "y": pairs})
    # Places all distinct, but the group {0, 2} of y holds x coordinates 0 and 1: rank 3 is first in {3, 1}.
    backwards = comm.Split(color=rank % 2, key=rank if rank % 2 == 0 else -rank)
    with pytest.raises(ValueError, match=re.escape("DeviceMesh.from_groups: ranks 0,1,2,3: group 'x' joins ranks at "
                                                   "different places along (y) [(0,), (1,)]: its ranks must differ "
                                                   "only along 'x'")):
        DeviceMesh.from_groups(comm, {"y": backwards, "x": pairs})
    for c in (pairs, strided, backwards):
        c.Free()


@pytest.mark.world_sizes(1, 2)
def test_from_comm_is_the_one_dimensional_mesh_of_the_communicator_itself(comm):
    m = DeviceMesh.from_comm(comm, "dp")
    assert (m.names, m.shape, m.coordinate, m.dp, m.dp_rank) == (("dp",), (comm.Get_size(),), (comm.Get_rank(),),
                                                                  comm.Get_size(), comm.Get_rank())
    assert m.dp_comm is comm and m.comm is comm
    m.free()
    assert comm.allreduce(1) == comm.Get_size()


def test_mesh_is_the_dp_pp_tp_device_mesh_with_tp_kept_in_a_node():
    def run(comm):
        m = mpidist.mesh(comm, pp=2, tp=2)
        return type(m), m.names, m.shape, members(m.tp_comm, comm)

    for rank, (kind, names, shape, tp) in enumerate(mpidist.simulate(8, run, ranks_per_node=4)):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert (kind, names, shape, tp) == (DeviceMesh, ("dp", "pp", "tp"), (2, 2, 2), pair)
    got = raised_on_every_rank(8, lambda comm: mpidist.mesh(comm, tp=4), ranks_per_node=3)
    assert all(msg.startswith("DeviceMesh: dimension 'tp' (size 4) does not fit within nodes") for msg in got), got
