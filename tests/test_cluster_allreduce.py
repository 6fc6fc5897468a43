"""The hierarchical allreduce (mpidist.collectives_hier) against numpy on every rank's inputs.

Simulated nodes (``simulate(ranks_per_node=)``: block placement, even and uneven) and round-robin placement
(test_cluster_layout's ``Cyclic``); under mpiexec the ``comm`` fixture's ranks, and in ``make test-cluster`` the
same file again with 2 ranks on each of 2 network-namespace nodes (tests/test_cluster.py). Inputs are small
integers in every dtype, so every order of summation gives the same exact value: the reference is numpy's
reduction of all ranks' inputs, computed on each rank from the shared seed.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist.collectives_hier import HierarchicalAllreduce

from test_cluster_layout import Cyclic

ALGORITHMS = ("flat", "hierarchical", "auto")
CASES = [("float64", "sum"), ("float64", "mean"), ("float32", "prod"), ("float16", "sum"), ("float16", "mean"),
         ("float64", "max"), ("float32", "min"), ("int32", "sum"), ("int64", "max"), ("bool", "sum"),
         ("complex128", "sum")]


def inputs(size, dtype, op, shape=(3, 5), seed=7):
    """Return every rank's input (small integers; NaNs for min/max), the same on every rank."""
    rng = np.random.default_rng(seed)
    low, high = (-2, 3) if op == "prod" else (-8, 9)
    values = rng.integers(low, high, size=(size,) + shape)
    if dtype == "bool":
        return values > 0
    arrays = values.astype(dtype)
    if op in ("max", "min") and np.dtype(dtype).kind == "f" and arrays[0].size:
        arrays[(1 % size,) + (0,) * len(shape)] = np.nan  # propagates, whichever rank holds it
    return arrays


def reference(arrays, dtype, op):
    """numpy's reduction of all ranks' inputs, rounded once to ``dtype``."""
    if dtype == "bool":
        return arrays.any(axis=0) if op in ("sum", "max") else arrays.all(axis=0)
    wide = arrays.astype(np.float32) if dtype == "float16" else arrays
    if op == "mean":
        total = wide.sum(axis=0) / wide.dtype.type(len(arrays))
    else:
        total = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](wide, axis=0)
    return total.astype(dtype)


def check(comm, allreduce, dtype, op):
    """Reduce this rank's input with ``allreduce``; return (equal to numpy, equal to every other rank's bits)."""
    arrays = inputs(comm.Get_size(), dtype, op)
    x = arrays[comm.Get_rank()].copy()
    out = allreduce(x, op)
    assert out is x
    want = reference(arrays, dtype, op)
    same = np.array_equal(x, want, equal_nan=x.dtype.kind in "fc")
    everyone = comm.allgather(x.tobytes())
    return same, all(b == everyone[0] for b in everyone)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("size, per_node", [(4, 2), (6, 3), (5, 2), (4, 1), (3, 3)])
def test_hierarchical_allreduce_matches_numpy_on_simulated_nodes(algorithm, size, per_node):
    def run(comm):
        with HierarchicalAllreduce(comm, algorithm=algorithm) as allreduce:
            return [check(comm, allreduce, dtype, op) for dtype, op in CASES]

    for rank, results in enumerate(mpidist.simulate(size, run, ranks_per_node=per_node)):
        assert results == [(True, True)] * len(CASES), (rank, [c for c, r in zip(CASES, results) if r != (True, True)])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hierarchical_allreduce_matches_numpy_with_round_robin_nodes(algorithm):
    def run(comm):
        nodes = Cyclic(comm, 2)  # rank r on node r % 2
        with HierarchicalAllreduce(nodes, algorithm=algorithm) as allreduce:
            results = [check(comm, allreduce, dtype, op) for dtype, op in CASES]
            return results, allreduce.node_comm.allgather(comm.Get_rank()), allreduce.local_rank

    for rank, (results, node_members, local_rank) in enumerate(mpidist.simulate(4, run)):
        assert results == [(True, True)] * len(CASES), rank
        assert node_members == [r for r in range(4) if r % 2 == rank % 2]  # the placement rule
        assert local_rank == rank // 2


def test_only_node_leaders_talk_across_nodes():
    """Node groups follow the placement rule; the leader group holds local rank 0 of each node, in node order."""
    def run(comm):
        with HierarchicalAllreduce(comm, algorithm="hierarchical") as allreduce:
            leaders = (allreduce.leader_comm.allgather(comm.Get_rank()) if allreduce.local_rank == 0
                       else allreduce.leader_comm == MPI.COMM_NULL)
            return allreduce.node_comm.allgather(comm.Get_rank()), leaders, allreduce.nodes

    out = mpidist.simulate(5, run, ranks_per_node=2)
    for rank, (node_members, leaders, nodes) in enumerate(out):
        assert node_members == [r for r in range(5) if r // 2 == rank // 2]
        assert leaders == ([0, 2, 4] if rank % 2 == 0 else True)
        assert nodes == 3


def test_auto_takes_one_algorithm_on_every_rank_and_flat_where_nothing_is_gained():
    def run(comm, per_node):
        with HierarchicalAllreduce(comm) as allreduce:
            x = np.ones(1 << 12)
            allreduce(x)
            return allreduce.algorithm_for(x.nbytes), x[0]

    for per_node in (2, 1, 4):
        out = mpidist.simulate(4, run, per_node, ranks_per_node=per_node)
        assert {a for a, _ in out} <= {"flat", "hierarchical"} and len({a for a, _ in out}) == 1, out
        assert all(total == 4.0 for _, total in out)
        if per_node in (1, 4):  # one rank per node, or one node: the three steps only add work
            assert out[0][0] == "flat"


def test_bad_input_raises_on_every_rank():
    def run(comm):
        allreduce = HierarchicalAllreduce(comm, algorithm="auto")
        read_only = np.ones(3)
        read_only.flags.writeable = False
        errors = []
        for call in (lambda: HierarchicalAllreduce(comm, algorithm="ring"),
                     lambda: allreduce(np.ones(3), op="median"),
                     lambda: allreduce([1.0, 2.0]),
                     lambda: allreduce(np.ones(3, dtype="datetime64[s]")),
                     lambda: allreduce(read_only),
                     lambda: allreduce(np.ones(3, dtype=np.int32), op="mean")):
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        allreduce.free()
        return errors

    for errors in mpidist.simulate(4, run, ranks_per_node=2):
        assert None not in errors, errors
        assert errors[0].startswith("HierarchicalAllreduce: ") and "algorithm must be one of" in errors[0]
        assert "'ring'" in errors[0]
        assert "median" in errors[1]
        assert "numpy array" in errors[2] and "list" in errors[2]
        assert "datetime64" in errors[3]
        assert "writ" in errors[4], errors[4]
        assert "mean" in errors[5] and "int32" in errors[5]


def test_hierarchical_allreduce_matches_numpy_under_mpi(comm):
    """On the comm fixture's ranks (SimComm 1..4; real MPI under mpiexec: one node, or two in make test-cluster)."""
    for algorithm in ALGORITHMS:
        with HierarchicalAllreduce(comm, algorithm=algorithm) as allreduce:
            for dtype, op in CASES:
                assert check(comm, allreduce, dtype, op) == (True, True), (algorithm, dtype, op)
            big = inputs(comm.Get_size(), "float64", "sum", shape=(1 << 17,))  # 1 MiB: MPI's large-message path
            x = big[comm.Get_rank()].copy()
            np.testing.assert_array_equal(allreduce(x), big.sum(axis=0))


def test_instances_over_one_comm_share_node_communicators_until_the_last_is_freed():
    """A dropped instance (a DDP never removed) leaves at most the one pair later instances over its comm share."""
    def run(comm):
        first = HierarchicalAllreduce(comm, algorithm="hierarchical")
        dropped = HierarchicalAllreduce(comm, algorithm="hierarchical")  # never freed
        shared = dropped.node_comm is first.node_comm and dropped.leader_comm is first.leader_comm
        first.free()  # not the last user: the dropped one still reduces over the pair
        arrays = inputs(comm.Get_size(), "float64", "sum")
        x = arrays[comm.Get_rank()].copy()
        dropped(x)
        return shared, np.array_equal(x, arrays.sum(axis=0))

    for shared, correct in mpidist.simulate(4, run, ranks_per_node=2):
        assert shared and correct, (shared, correct)


def test_freed_node_communicators_are_not_handed_out_again(comm):
    first = HierarchicalAllreduce(comm, algorithm="hierarchical")
    node_comm = first.node_comm
    first.free()
    with HierarchicalAllreduce(comm, algorithm="hierarchical") as second:
        assert second.node_comm is not node_comm
        arrays = inputs(comm.Get_size(), "int64", "sum")
        x = arrays[comm.Get_rank()].copy()
        np.testing.assert_array_equal(second(x), arrays.sum(axis=0))


@pytest.mark.parametrize("chunk_bytes", [8, 24, 1 << 20])
@pytest.mark.parametrize("shape", [(0,), (1,), (), (7,), (3, 5), (4, 4)])
def test_pipelined_chunks_match_numpy_whatever_the_chunk_and_size(shape, chunk_bytes):
    """Chunks that do not divide the array, one element, none, one chunk: numpy's reduction on every rank."""
    def run(comm):
        with HierarchicalAllreduce(comm, algorithm="hierarchical", chunk_bytes=chunk_bytes) as allreduce:
            results = []
            for dtype, op in CASES:
                arrays = inputs(comm.Get_size(), dtype, op, shape=shape)
                if 0 in shape and op in ("max", "min"):
                    continue  # numpy has no identity for an empty max/min: no reference to compare with
                x = np.array(arrays[comm.Get_rank()])  # shape (): a 0-d array, not a numpy scalar
                allreduce(x, op)
                results.append(np.array_equal(x, reference(arrays, dtype, op), equal_nan=x.dtype.kind in "fc"))
            return results

    for rank, results in enumerate(mpidist.simulate(5, run, ranks_per_node=2)):
        assert all(results), (rank, shape, chunk_bytes, results)


def test_pipelined_chunks_cross_nodes_one_call_each():
    """A 7-element float64 array in 16-byte chunks: 4 leader allreduces (the last chunk short), in order."""
    def run(comm):
        with HierarchicalAllreduce(comm, algorithm="hierarchical", chunk_bytes=16) as allreduce:
            sizes = []
            if allreduce.local_rank == 0:
                real = allreduce.leader_comm

                class Counting:
                    def __getattr__(self, name):
                        return getattr(real, name)

                    def Iallreduce(self, send, recv, op=None):
                        sizes.append(len(recv))
                        return real.Iallreduce(send, recv, op=op)

                allreduce.leader_comm = Counting()
            x = np.arange(7.0) + comm.Get_rank()
            allreduce(x)
            return sizes, x

    for rank, (sizes, x) in enumerate(mpidist.simulate(4, run, ranks_per_node=2)):
        assert sizes == ([2, 2, 2, 1] if rank % 2 == 0 else []), (rank, sizes)
        np.testing.assert_array_equal(x, 4 * np.arange(7.0) + 6)


def test_bad_chunk_bytes_raises_on_every_rank_and_ranks_must_agree():
    def run(comm, chunk_for):
        try:
            HierarchicalAllreduce(comm, algorithm="hierarchical", chunk_bytes=chunk_for(comm.Get_rank())).free()
        except ValueError as exc:
            return str(exc)
        return None

    for bad in (0, -8, 1.5, True, "1M"):
        for error in mpidist.simulate(4, run, lambda r, bad=bad: bad if r == 1 else 64, ranks_per_node=2):
            assert error is not None and "chunk_bytes must be a positive int" in error and "rank 1" in error, error
    for error in mpidist.simulate(4, run, lambda r: 64 if r else 128, ranks_per_node=2):
        assert error is not None and "disagree" in error and "128" in error and "64" in error, error
