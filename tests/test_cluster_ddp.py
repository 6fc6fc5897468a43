"""DDP with its buckets summed by the hierarchical allreduce (``DDP(allreduce=)``) trains like one process.

Simulated nodes (``simulate(ranks_per_node=)``: even and uneven blocks), and under mpiexec the ``comm``
fixture's ranks (one node; two network-namespace nodes where tests/test_cluster.py runs the file). The reference
is test_ddp's single process on the whole batch (float64); each rank trains on its slice.
"""

import threading
import time

import pytest
from mpi4py import MPI

import mpidist
from mpidist import nn
from mpidist.collectives_hier import HierarchicalAllreduce
from mpidist.parallel.ddp import DDP

from test_ddp import TINY_BUCKET_MB, assert_params_equal, global_batch, make_model, make_optimizer, reference_params

STEPS = 3


def train(comm, allreduce, kind="adam", overlap=True):
    """Train test_ddp's model for STEPS steps on this rank's slice of a batch of 2 per rank; return its state."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ddp = DDP(make_model(), comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, overlap=overlap,
              allreduce=allreduce)
    opt = make_optimizer(kind, ddp.parameters())
    crit = nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = global_batch(step, 2 * size)
        opt.zero_grad()
        crit(ddp(x[2 * rank: 2 * rank + 2]), y[2 * rank: 2 * rank + 2]).backward()
        opt.step()
    buckets = len(ddp.buckets)
    ddp.remove()
    return ddp.state_dict(), buckets


@pytest.fixture
def hierarchical_calls(monkeypatch):
    """Count the bucket sums that took the three hierarchical steps (on any rank)."""
    calls, lock, inner = [], threading.Lock(), HierarchicalAllreduce._hierarchical

    def counted(self, x, op):
        with lock:
            calls.append(x.nbytes)
        return inner(self, x, op)
    monkeypatch.setattr(HierarchicalAllreduce, "_hierarchical", counted)
    return calls


@pytest.mark.parametrize("allreduce", ["hierarchical", "auto"])
@pytest.mark.parametrize("size, per_node", [(4, 2), (5, 2), (3, 3)])
@pytest.mark.parametrize("kind, overlap", [("adam", True), ("sgd", False)])
def test_ddp_hierarchical_allreduce_matches_one_process_on_simulated_nodes(hierarchical_calls, allreduce, size,
                                                                           per_node, kind, overlap):
    reference = reference_params(kind, STEPS, lambda step: global_batch(step, 2 * size))
    out = mpidist.simulate(size, train, allreduce, kind, overlap, ranks_per_node=per_node)
    for state, _ in out:
        assert_params_equal(state, reference)
    if allreduce == "hierarchical" and per_node < size:
        # every bucket of every step on every rank took the three steps
        assert len(hierarchical_calls) == size * STEPS * out[0][1], len(hierarchical_calls)


@pytest.mark.parametrize("allreduce", ["flat", "hierarchical", "auto"])
def test_ddp_allreduce_choice_matches_one_process(comm, allreduce):
    """On the comm fixture's ranks (SimComm 1..4; real MPI under mpiexec, across nodes in make test-cluster)."""
    reference = reference_params("adam", STEPS, lambda step: global_batch(step, 2 * comm.Get_size()))
    state, _ = train(comm, allreduce)
    assert_params_equal(state, reference)


def test_ddp_bad_allreduce_raises_on_every_rank():
    def run(comm):
        errors = []
        for choice in ("ring", "hierarchical" if comm.Get_rank() else "flat"):
            try:
                DDP(make_model(), comm, allreduce=choice)
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        return errors

    for bad, disagree in mpidist.simulate(4, run, ranks_per_node=2):
        assert bad == "DDP: allreduce must be one of ('auto', 'flat', 'hierarchical') (got 'ring')", bad
        assert disagree is not None and "allreduce choice" in disagree and "'flat'" in disagree, disagree


@pytest.mark.world_sizes(2, 4)
def test_ddp_allreduce_rejected_by_one_rank_raises_on_every_rank(comm):
    """Rank 1 alone passes a bad value: every rank raises, naming it (before: rank 1 alone, the others waited)."""
    with pytest.raises(ValueError, match="allreduce choice") as raised:
        DDP(make_model(), comm, allreduce="ring" if comm.Get_rank() == 1 else "flat")
    assert "rank 1: 'ring'" in str(raised.value), raised.value


def test_ddp_progress_poll_tests_buckets_during_a_slow_layer_and_trains_like_one_process(comm):
    """``progress_poll_s``: under real MPI a thread tests the launched buckets while a layer's backward runs.

    The first layer's backward is held up 30 ms (a hook on its output's gradient), after the later layers'
    buckets launched: the thread must call into the buckets meanwhile. SimComm completes without progress calls,
    so there the option is off. The parameters equal the one-process reference either way.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    reference = reference_params("adam", STEPS, lambda step: global_batch(step, 2 * size))
    model = make_model()

    def slow_backward(module, args, out):
        out.register_hook(lambda grad: time.sleep(0.03))  # returns None: the gradient and output stay as they are
    model[0].register_forward_hook(slow_backward)
    ddp = DDP(model, comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, progress_poll_s=0.001)
    polls, inner, main = [], ddp._progress, threading.get_ident()

    def recorded():
        polls.append(threading.get_ident() != main)
        inner()
    ddp._progress = recorded
    opt, crit = make_optimizer("adam", ddp.parameters()), nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = global_batch(step, 2 * size)
        opt.zero_grad()
        crit(ddp(x[2 * rank: 2 * rank + 2]), y[2 * rank: 2 * rank + 2]).backward()
        opt.step()
        assert ddp._poller is None  # stopped when backward ended
    ddp.remove()
    assert_params_equal(ddp.state_dict(), reference)
    if isinstance(comm, MPI.Comm):
        assert ddp.progress_poll_s == 0.001 and sum(polls) >= STEPS, polls  # at least once in each slow layer
    else:
        assert ddp.progress_poll_s is None and not any(polls), polls


def test_ddp_progress_poll_thread_ends_when_a_backward_raises(comm):
    """A backward that raises never reaches its end callback: the next forward stops the poll thread, which
    would otherwise keep calling MPI on stale requests beside whatever the recovery runs."""
    model = make_model()
    failing = [True]

    def fail_once(module, args, out):
        out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("injected")) if failing[0] else None)
    model[0].register_forward_hook(fail_once)
    ddp = DDP(model, comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, progress_poll_s=0.001)
    crit, size, rank = nn.CrossEntropyLoss(), comm.Get_size(), comm.Get_rank()
    x, y = global_batch(0, 2 * size)
    with pytest.raises(RuntimeError, match="injected"):
        crit(ddp(x[2 * rank: 2 * rank + 2]), y[2 * rank: 2 * rank + 2]).backward()
    poller = ddp._poller
    if isinstance(comm, MPI.Comm):
        assert poller is not None and poller._thread.is_alive()  # left running by the raise
    failing[0] = False
    ddp(x[2 * rank: 2 * rank + 2])
    assert ddp._poller is None and (poller is None or not poller._thread.is_alive())
    comm.Barrier()  # the failed step's launched buckets may still be pending: drop the DDP on every rank alike
    ddp.remove()


def test_ddp_bad_progress_poll_raises_on_every_rank():
    def run(comm, value_for):
        try:
            DDP(make_model(), comm, progress_poll_s=value_for(comm.Get_rank()))
        except ValueError as exc:
            return str(exc)
        return None

    for bad in (0, -1.0, "1ms", True):
        for error in mpidist.simulate(3, run, lambda r, bad=bad: bad):
            assert error is not None and "progress_poll_s must be None or a positive, finite number" in error, error
        for error in mpidist.simulate(3, run, lambda r, bad=bad: bad if r == 1 else 0.01):
            assert error is not None and "progress_poll_s" in error and "rank 1" in error, error
