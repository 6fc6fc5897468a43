"""The node-aware 16-bit allreduce (``collectives_hier.HierarchicalAllreduce16``) and the compression hooks over it.

Reference: a numpy emulation on all ranks' inputs that adds and rounds where the algorithm does: within each node
the 16-bit inputs cast to float32 and added in rank order; the leaders' 16-bit ring over the node sums (chunk c
starts at leader c + 1, each hop rounds the float32 partial sum to 16 bits and the receiver adds its node's
float32 sum to it, the owner rounds the last sum). Nodes are faked: ``simulate(ranks_per_node=)`` blocks, and
``FakeNodes``, a communicator whose ``Split_type(COMM_TYPE_SHARED)`` follows a placement rule (under mpiexec too).
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import nn, optim
from mpidist.collectives_hier import HierarchicalAllreduce16
from mpidist.comm.nodes import node_of_ranks
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16, float16
from mpidist.parallel.comm_hooks import CompressHookState, bf16_compress_hook, fp16_compress_hook
from mpidist.parallel.ddp import DDP

DTYPES = {"bfloat16": bfloat16, "float16": float16}


class FakeNodes:
    """``comm`` with rank r on node ``node_of(r)``, as ``Split_type(COMM_TYPE_SHARED)`` reports it (Dups too)."""

    def __init__(self, comm, node_of):
        self._comm, self._node_of = comm, node_of

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split_type(self, split_type, key=0, info=None):
        assert split_type == MPI.COMM_TYPE_SHARED
        return self._comm.Split(color=self._node_of(self._comm.Get_rank()), key=key)

    def Dup(self):
        return FakeNodes(self._comm.Dup(), self._node_of)


def ring(values, dtype):
    """The 16-bit ring over float32 ``values`` (one per ring member), in numpy: see the module's docstring."""
    n, size = len(values), values[0].size
    chunk = -(-size // n)
    out = np.empty(size, dtype)
    for c in range(n):
        span = slice(c * chunk, min((c + 1) * chunk, size))
        acc = values[(c + 1) % n][span]
        for j in range(2, n + 1):
            acc = values[(c + j) % n][span] + acc.astype(dtype).astype(np.float32)
        out[span] = acc.astype(dtype)
    return out


def node_aware_reference(inputs, nodes, dtype):
    """Node sums in float32 (rank order within the node), then the ring over the node sums in node order."""
    sums = []
    for node in range(max(nodes) + 1):
        ranks = [r for r in range(len(inputs)) if nodes[r] == node]
        total = inputs[ranks[0]].astype(np.float32)
        for r in ranks[1:]:
            total = total + inputs[r].astype(np.float32)
        sums.append(total)
    return ring(sums, dtype)


def flat_reference(inputs, dtype):
    return ring([x.astype(np.float32) for x in inputs], dtype)


def rank_inputs(size, n, dtype, seed=0):
    """Every rank's input, the same on every rank: normal values of mixed magnitudes (roundings do differ)."""
    rng = np.random.default_rng([seed, n])
    return [(rng.standard_normal(n) * 2.0 ** rng.integers(-3, 4, n)).astype(dtype) for _ in range(size)]


def sum_everywhere(comm, algorithm, dtype, n, seed=0):
    """Sum this rank's input in place; return (chosen, result, what rank 0 got, the inputs)."""
    inputs = rank_inputs(comm.Get_size(), n, dtype, seed)
    with HierarchicalAllreduce16(comm, algorithm) as allreduce16:
        x = inputs[comm.Get_rank()].copy()
        got = allreduce16(x)
        assert got is x
        return allreduce16.chosen, got, comm.bcast(got, root=0), inputs


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("size, per_node", [(4, 2), (6, 3), (5, 2), (3, 3), (4, 1)])
def test_sums_equal_the_numpy_emulation_on_simulated_nodes(size, per_node, dtype):
    """Every algorithm, block nodes (even, uneven, one node, one rank per node), sizes that do and do not divide
    by the nodes: the emulation of the chosen algorithm, bitwise, the same bits on every rank; "auto" is
    node-aware exactly where the communicator spans nodes and some node holds several ranks."""
    nodes = [r // per_node for r in range(size)]
    spans = 1 < max(nodes) + 1 < size

    def run(comm):
        return [sum_everywhere(comm, algorithm, DTYPES[dtype], n)
                for algorithm in ("hierarchical", "auto", "flat") for n in (1, 7, 1000)]

    for rank, results in enumerate(mpidist.simulate(size, run, ranks_per_node=per_node)):
        for (chosen, got, first, inputs), algorithm in zip(results, [a for a in ("hierarchical", "auto", "flat")
                                                                     for _ in range(3)]):
            assert chosen == ("hierarchical" if algorithm == "hierarchical" or (algorithm == "auto" and spans)
                              else "flat"), (algorithm, chosen)
            want = (node_aware_reference(inputs, nodes, DTYPES[dtype]) if chosen == "hierarchical"
                    else flat_reference(inputs, DTYPES[dtype]))
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=str((rank, algorithm)))
            assert got.tobytes() == first.tobytes()
    inputs = rank_inputs(4, 1000, DTYPES[dtype])
    # The two orders round differently on these inputs: the test tells the node-aware sum from the flat ring.
    assert not np.array_equal(node_aware_reference(inputs, [0, 0, 1, 1], DTYPES[dtype]),
                              flat_reference(inputs, DTYPES[dtype]))


def test_sums_equal_the_numpy_emulation_on_round_robin_fake_nodes(comm):
    """Rank r on node r % 2 (SimComm 1..4; real MPI under mpiexec): node-aware, bitwise the emulation."""
    size = comm.Get_size()
    nodes = [r % 2 for r in range(size)]
    for dtype in DTYPES.values():
        chosen, got, first, inputs = sum_everywhere(FakeNodes(comm, lambda r: r % 2), "hierarchical", dtype, 515)
        np.testing.assert_array_equal(got.view(np.uint16), node_aware_reference(inputs, nodes, dtype).view(np.uint16))
        assert got.tobytes() == first.tobytes()


def test_auto_on_the_real_nodes_equals_the_emulation_of_what_it_chose(comm):
    """The comm fixture's own placement (one node here; two in make test-cluster): "auto" is node-aware exactly
    where the ranks span nodes with several ranks on some node, and equals that algorithm's emulation."""
    nodes = node_of_ranks(comm)
    spans = 1 < max(nodes) + 1 < comm.Get_size()
    chosen, got, first, inputs = sum_everywhere(comm, "auto", bfloat16, 515, seed=3)
    assert chosen == ("hierarchical" if spans else "flat")
    want = node_aware_reference(inputs, nodes, bfloat16) if spans else flat_reference(inputs, bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert got.tobytes() == first.tobytes()


@pytest.mark.world_sizes(4)
def test_pending_sums_finish_by_test_alone_or_by_waiting_in_any_order(comm):
    """Three sums started before any finishes: pending when started; completed by test() alone, or by wait() in
    opposite orders on even and odd ranks (a group: each wait advances all), each equal to the emulation."""
    nodes = [r // 2 for r in range(4)]
    fake = FakeNodes(comm, lambda r: r // 2)
    with HierarchicalAllreduce16(fake, "hierarchical") as allreduce16:
        for drive in ("test", "wait"):
            inputs = [rank_inputs(4, n, bfloat16, seed=5) for n in (3, 64, 9)]
            group = []
            works = [allreduce16.start(every[comm.Get_rank()].copy(), group=group if drive == "wait" else None)
                     for every in inputs]
            assert not any(w.done() for w in works)
            if drive == "test":
                pending = list(works)
                while pending:
                    pending = [w for w in pending if not w.test()]
                results = [w.wait() for w in works]
            else:
                order = works if comm.Get_rank() % 2 == 0 else works[::-1]
                results = {id(w): w.wait() for w in order}
                results = [results[id(w)] for w in works]
                assert group == []
            for got, every in zip(results, inputs):
                np.testing.assert_array_equal(got.view(np.uint16),
                                              node_aware_reference(every, nodes, bfloat16).view(np.uint16))


def test_bad_input_and_disagreeing_ranks_raise_on_every_rank():
    def run(comm):
        allreduce16 = HierarchicalAllreduce16(comm, "hierarchical")
        errors = []
        for call in (lambda: HierarchicalAllreduce16(comm, "ring"),
                     lambda: HierarchicalAllreduce16(comm, "hierarchical" if comm.Get_rank() == 1 else "flat"),
                     lambda: allreduce16(np.zeros(4, np.float32)),
                     lambda: allreduce16(np.zeros((2, 2), bfloat16)),
                     lambda: allreduce16(np.zeros(4, bfloat16) if comm.Get_rank() else np.zeros(4, np.float32)),
                     lambda: allreduce16(np.zeros(4 + (comm.Get_rank() == 2), bfloat16)),
                     lambda: allreduce16(np.zeros(4, bfloat16), out=np.zeros(4, np.float32))):
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        allreduce16.free()
        return errors

    for errors in mpidist.simulate(4, run, ranks_per_node=2):
        assert None not in errors, errors
        assert errors[0].startswith("HierarchicalAllreduce16: ") and "'ring'" in errors[0]
        assert "disagree" in errors[1] and "'hierarchical'" in errors[1] and "'flat'" in errors[1]
        assert "1-D float16 or bfloat16" in errors[2] and "float32" in errors[2]
        assert "shape (2, 2)" in errors[3]
        assert "rank 0" in errors[4] and "float32" in errors[4]  # one rank's bad input: every rank raises
        assert "disagree" in errors[5] and "5" in errors[5]
        assert "out must be" in errors[6]


# -- DDP with the compression hooks over it -------------------------------------------------------------------
IN, HIDDEN, OUT = 6, 12, 4
STEPS, PER_RANK, LR = 3, 3, 0.5


def make_model():
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng), nn.Tanh(), nn.Linear(HIDDEN, OUT, rng=rng))


def global_batch(step, n):
    rng = np.random.default_rng([7, step])
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, OUT, size=n)


def train_ddp(comm, hook, state):
    """SGD under DDP with one-parameter buckets; return (parameters, each bucket's parameter indices)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ddp = DDP(make_model(), comm, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    ddp.register_comm_hook(state, hook)
    opt = optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        opt.zero_grad()
        F.cross_entropy(ddp(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK]) \
            .backward()
        opt.step()
    index = {id(p): i for i, p in enumerate(ddp.parameters())}
    layout = [[index[id(p)] for p in b.params] for b in ddp.buckets]
    params = [p.data.copy() for p in ddp.parameters()]
    ddp.remove()
    return params, layout


def emulated_training(size, nodes, dtype, layout, node_aware):
    """The ranks in one process: each rank's gradients times 1/size (DDP's share), each bucket cast to ``dtype``
    and summed by the emulation, cast back to float32, one SGD step."""
    model = make_model()
    params = list(model.parameters())
    opt = optim.SGD(params, lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        shares = []
        for r in range(size):
            opt.zero_grad()
            F.cross_entropy(model(x[r * PER_RANK:(r + 1) * PER_RANK]), y[r * PER_RANK:(r + 1) * PER_RANK]).backward()
            shares.append([p.grad * np.float32(1.0 / size) for p in params])
        for members in layout:
            inputs = [np.concatenate([share[i].reshape(-1) for i in members]).astype(dtype) for share in shares]
            total = (node_aware_reference(inputs, nodes, dtype) if node_aware
                     else flat_reference(inputs, dtype)).astype(np.float32)
            at = 0
            for i in members:
                params[i].grad = total[at:at + params[i].size].reshape(params[i].shape)
                at += params[i].size
        opt.step()
    return [p.data for p in params]


@pytest.mark.parametrize("hook, dtype", [(bf16_compress_hook, bfloat16), (fp16_compress_hook, float16)],
                         ids=["bf16", "fp16"])
@pytest.mark.parametrize("algorithm", ["auto", "hierarchical"])
def test_ddp_with_node_aware_compression_equals_the_emulated_ranks(hook, dtype, algorithm):
    """4 ranks on 2 simulated nodes, 3 SGD steps (lr 0.5): the parameters equal the emulation bitwise on every
    rank, and differ from the flat ring's emulation (what the hook did before)."""
    size, nodes = 4, [0, 0, 1, 1]
    out = mpidist.simulate(size, train_ddp, hook, CompressHookState(algorithm=algorithm), ranks_per_node=2)
    layout = out[0][1]
    want = emulated_training(size, nodes, dtype, layout, node_aware=True)
    flat = emulated_training(size, nodes, dtype, layout, node_aware=False)
    for params, _ in out:
        for got, w in zip(params, want):
            np.testing.assert_array_equal(got, w)
    assert any(not np.array_equal(w, f) for w, f in zip(want, flat))


@pytest.mark.parametrize("placement", ["round_robin", "real"])
def test_ddp_with_node_aware_compression_on_fake_nodes_equals_the_emulated_ranks(comm, placement):
    """The comm fixture's ranks (mpiexec too) on round-robin fake nodes, or on their real nodes (one here, two in
    make test-cluster): "auto" equals the emulation of what it chose, "flat" the flat ring's emulation."""
    size = comm.Get_size()
    if placement == "real":
        on, nodes = comm, node_of_ranks(comm)
    else:
        on, nodes = FakeNodes(comm, lambda r: r % 2), [r % 2 for r in range(size)]
    for algorithm in ("auto", "flat"):
        params, layout = train_ddp(on, bf16_compress_hook, CompressHookState(algorithm=algorithm))
        node_aware = algorithm == "auto" and 1 < max(nodes) + 1 < size
        want = emulated_training(size, nodes, bfloat16, layout, node_aware)
        for got, w in zip(params, want):
            np.testing.assert_array_equal(got, w)


def test_hook_state_refuses_a_bad_algorithm_and_ranks_that_disagree():
    with pytest.raises(ValueError, match=r"CompressHookState: algorithm must be one of \('auto', 'flat', "
                                         r"'hierarchical'\) \(got 'tree'\)"):
        CompressHookState(algorithm="tree")

    def run(comm):
        try:
            train_ddp(comm, bf16_compress_hook, CompressHookState(algorithm="flat" if comm.Get_rank() else "auto"))
        except ValueError as exc:
            return str(exc)
        return None

    for error in mpidist.simulate(4, run, ranks_per_node=2):
        assert error is not None and "disagree" in error and "'auto'" in error and "'flat'" in error, error
