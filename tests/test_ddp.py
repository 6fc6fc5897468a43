"""DDP parity: N ranks with their slices of a batch train exactly like one process on the whole batch."""

import re

import numpy as np
import pytest

from mpidist import nn, optim
from mpidist.nn import functional as F
from mpidist.data import DistributedSampler
from mpidist.parallel.ddp import DDP
from mpidist.parallel.grad_sync import GradSync

IN, HIDDEN, OUT = 6, 9, 4
TINY_BUCKET_MB = 300 / (1024 * 1024)  # ~300 bytes: several buckets even for this small model


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN, rng=rng, dtype=np.float64), nn.GELU(),
                         nn.Linear(HIDDEN, OUT, rng=rng, dtype=np.float64))


def global_batch(step, n):
    rng = np.random.default_rng([42, step])
    return rng.standard_normal((n, IN)), rng.integers(0, OUT, size=n)


def make_optimizer(kind, params):
    if kind == "sgd":
        return optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return optim.Adam(params, lr=0.01, weight_decay=1e-3)


def train_step(model, opt, crit, x, y, scale=1.0):
    loss = crit(model(x), y)
    (loss * scale).backward()


def reference_params(kind, steps, batch_for_step):
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = batch_for_step(step)
        opt.zero_grad()
        train_step(model, opt, crit, x, y)
        opt.step()
    return model.state_dict()


def assert_params_equal(state, reference, atol=1e-10):
    assert state.keys() == reference.keys()
    for k in reference:
        np.testing.assert_allclose(state[k], reference[k], rtol=0, atol=atol, err_msg=k)


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("overlap", [True, False])
def test_parity_with_single_process(comm, kind, overlap):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank, steps = 5, 10
    ddp = DDP(make_model(), comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, overlap=overlap)
    assert len(ddp.buckets) > 2
    opt = make_optimizer(kind, ddp.parameters())
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = global_batch(step, per_rank * size)
        opt.zero_grad()
        train_step(ddp, opt, crit, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        opt.step()
    reference = reference_params(kind, steps, lambda s: global_batch(s, per_rank * size))
    assert_params_equal(ddp.state_dict(), reference)


@pytest.mark.world_sizes(2, 3, 4)
def test_no_sync_accumulation_equals_big_batch(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    micro, k, steps = 2, 3, 4
    per_rank = micro * k
    ddp = DDP(make_model(), comm, bucket_cap_mb=TINY_BUCKET_MB)
    opt = make_optimizer("adam", ddp.parameters())
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = global_batch(step, per_rank * size)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        for i in range(k):
            chunk = slice(i * micro, (i + 1) * micro)
            if i < k - 1:
                with ddp.no_sync():
                    train_step(ddp, opt, crit, x[chunk], y[chunk], scale=1 / k)
            else:
                train_step(ddp, opt, crit, x[chunk], y[chunk], scale=1 / k)
        opt.step()
    assert_params_equal(ddp.state_dict(), reference_params("adam", steps, lambda s: global_batch(s, per_rank * size)))


def test_construction_broadcasts_rank0_parameters(comm):
    rank = comm.Get_rank()
    ddp = DDP(make_model(seed=100 + rank), comm)
    reference = make_model(seed=100).state_dict()
    assert_params_equal(ddp.state_dict(), reference, atol=0)


def test_buckets_hold_grads_in_reverse_parameter_order(comm):
    model = make_model()
    params = list(model.parameters())
    # first bucket ~ the last Linear (weight 36 + bias 4 doubles = 320 bytes)
    ddp = DDP(model, comm, bucket_cap_mb=1000 / (1024 * 1024), first_bucket_mb=320 / (1024 * 1024))
    flat_order = [p for b in ddp.buckets for p in b.params]
    assert flat_order == list(reversed(params))
    assert [len(b.params) for b in ddp.buckets][0] == 2
    x, y = global_batch(0, 4)
    nn.CrossEntropyLoss()(ddp(x), y).backward()
    for b in ddp.buckets:
        assert b.nbytes <= 1000 or len(b.params) == 1
        for p in b.params:  # after backward every gradient lives in its bucket (no copy for the optimizer)
            assert np.shares_memory(p.grad, b.flat)


def test_overlap_launches_buckets_during_backward(comm):
    ddp = DDP(make_model(), comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, overlap=True)
    seen = []  # (parameter, which buckets are in flight) at each gradient, in the order backward makes them
    for name, p in ddp.named_parameters():  # registered after DDP's hooks: each runs once DDP saw the gradient
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, [b.handle is not None for b in ddp.buckets])))
    x, y = global_batch(0, 4)
    nn.CrossEntropyLoss()(ddp(x), y).backward()
    names = [n for n, _ in ddp.named_parameters()]
    assert sorted(n for n, _ in seen) == sorted(names)  # every gradient once
    # Buckets launch while backward goes on: when the first layer's gradients arrive (the last two), every
    # bucket but the first layer's two is in flight already, and the last gradient launches the rest.
    assert seen[-2][1] == [True] * (len(ddp.buckets) - 2) + [False, False], seen
    assert all(seen[-1][1]), seen
    assert all(b.handle is None for b in ddp.buckets)  # all completed by the end of backward


@pytest.mark.world_sizes(2, 3, 4)
def test_uneven_inputs_with_join(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = 3
    batches = [3 + r for r in range(size)]  # rank r has 3 + r batches

    def rank_batch(r, step):
        rng = np.random.default_rng([7, r, step])
        return rng.standard_normal((per_rank, IN)), rng.integers(0, OUT, size=per_rank)

    ddp = DDP(make_model(), comm)
    opt = make_optimizer("sgd", ddp.parameters())
    crit = nn.CrossEntropyLoss()
    with ddp.join(optimizer=opt):
        for step in range(batches[rank]):
            x, y = rank_batch(rank, step)
            opt.zero_grad()
            train_step(ddp, opt, crit, x, y)
            opt.step()

    # Reference: at step t the global batch is the batches of the ranks that still have data.
    def reference_batch(step):
        active = [r for r in range(size) if batches[r] > step]
        parts = [rank_batch(r, step) for r in active]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    assert_params_equal(ddp.state_dict(), reference_params("sgd", max(batches), reference_batch))


def join_batches(size, per_rank=4):
    """Rank r has 2 + r batches of ``per_rank`` samples; returns (batch of rank r at step t, reference batch at t).

    The reference batch of step t joins the batches of the ranks that still have data at t: equal slices, so
    the mean of their mean gradients is its mean gradient.
    """
    def rank_batch(r, step):
        return global_batch(step + 10 * r, per_rank)

    def reference_batch(step):
        parts = [rank_batch(r, step) for r in range(size) if 2 + r > step]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return rank_batch, reference_batch


@pytest.mark.world_sizes(2, 3, 4)
def test_join_without_optimizer_ends_with_the_last_ranks_parameters(comm):
    """Joined ranks stop stepping; at the end every rank gets the parameters of the last rank to finish, which
    trained like one process on the batches of the ranks still active at each step."""
    size, rank = comm.Get_size(), comm.Get_rank()
    rank_batch, reference_batch = join_batches(size)
    ddp = DDP(make_model(), comm)
    opt = make_optimizer("sgd", ddp.parameters())
    crit = nn.CrossEntropyLoss()
    with ddp.join():
        for step in range(2 + rank):
            x, y = rank_batch(rank, step)
            opt.zero_grad()
            train_step(ddp, opt, crit, x, y)
            opt.step()
    assert_params_equal(ddp.state_dict(), reference_params("sgd", size + 1, reference_batch))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(IN, OUT, rng=np.random.default_rng(3), dtype=np.float64)
        self.spare = nn.Parameter(np.ones(5))

    def forward(self, x):
        return self.used(x)


def test_unused_parameters_zero_filled(comm):
    ddp = DDP(WithUnused(), comm, unused_parameters="zero")
    x, y = global_batch(0, 4)
    nn.CrossEntropyLoss()(ddp(x), y).backward()
    assert (ddp.module.spare.grad == 0).all()
    assert np.abs(ddp.module.used.weight.grad).sum() > 0


def test_unused_parameters_error_names_them_on_every_rank(comm):
    ddp = DDP(WithUnused(), comm, unused_parameters="error")
    x, y = global_batch(0, 4)
    loss = nn.CrossEntropyLoss()(ddp(x), y)
    with pytest.raises(RuntimeError, match=r"received no gradient.*\['spare'\]"):
        loss.backward()


def test_bad_arguments(comm):
    with pytest.raises(ValueError, match=r"DDP: bucket sizes must be positive \(bucket_cap_mb=0"):
        DDP(make_model(), comm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"unused_parameters must be 'zero' or 'error' \(got 'ignore'\)"):
        DDP(make_model(), comm, unused_parameters="ignore")


@pytest.mark.world_sizes(2, 4)
@pytest.mark.timeout(60)  # before the fix rank 1 raised alone and the others waited in DDP's next collective
@pytest.mark.parametrize("name, bad", [("bucket_cap_mb", -1), ("first_bucket_mb", 0),
                                       ("unused_parameters", "ignore"), ("broadcast_buffers", False)])
def test_an_argument_one_rank_passes_differently_raises_on_every_rank(comm, name, bad):
    """Rank 1 alone passes another value (invalid, or valid but unlike the others'): every rank raises, naming
    the argument and each rank's value (a different bucket size or buffer broadcast would mismatch collectives)."""
    good = {"bucket_cap_mb": 25, "first_bucket_mb": 1, "unused_parameters": "zero", "broadcast_buffers": True}[name]
    with pytest.raises(ValueError) as raised:
        DDP(make_model(), comm, **{name: bad if comm.Get_rank() == 1 else good})
    others = "rank 0" if comm.Get_size() == 2 else "ranks 0,2,3"
    assert f"{others}: {(name, good)!r}" in str(raised.value), raised.value
    assert f"rank 1: {(name, bad)!r}" in str(raised.value), raised.value


@pytest.mark.world_sizes(2, 4)
@pytest.mark.timeout(60)  # before the fix rank 1 raised alone and the others waited in the structure check
def test_a_module_without_parameters_on_one_rank_raises_on_every_rank(comm):
    """Rank 1 alone wraps a module without parameters: every rank raises, naming each rank's parameter count."""
    with pytest.raises(ValueError, match="ranks hold different models") as raised:
        DDP(nn.Tanh() if comm.Get_rank() == 1 else make_model(), comm)
    others = "rank 0" if comm.Get_size() == 2 else "ranks 0,2,3"
    assert f"parameter counts: {others}: 6; rank 1: 0" in str(raised.value), raised.value


def test_progress_poll_needs_threads_allowed_to_call_mpi_at_once(comm, monkeypatch):
    """The poll thread calls MPI beside the main thread: without MPI_THREAD_MULTIPLE DDP refuses it, saying why."""
    from mpi4py import MPI
    from mpidist.comm import calls_from_threads_allowed, is_simulated
    assert calls_from_threads_allowed(comm) == (is_simulated(comm) or MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    monkeypatch.setattr("mpidist.parallel.ddp.calls_from_threads_allowed", lambda c: False)
    with pytest.raises(ValueError, match=r"progress_poll_s=0.01 needs MPI_THREAD_MULTIPLE"):
        DDP(make_model(), comm, progress_poll_s=0.01)
    DDP(make_model(), comm).remove()  # without the poll nothing is asked


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "0.1", True])
def test_progress_poll_must_be_a_positive_finite_number(comm, bad):
    """inf passed the old check, and the thread then died in Event.wait(inf) (OverflowError), silently."""
    with pytest.raises(ValueError, match=r"progress_poll_s must be None or a positive, finite number of seconds "
                                         rf"\(got {re.escape(repr(bad))}\)"):
        DDP(make_model(), comm, progress_poll_s=bad)


# -- DistributedSampler ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 10, 17])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_shards(comm, n, drop_last):
    size = comm.Get_size()
    if drop_last and 0 < n < size:
        with pytest.raises(ValueError, match="leaves every rank empty"):
            DistributedSampler(n, comm, drop_last=True)
        return
    sampler = DistributedSampler(n, comm, seed=5, drop_last=drop_last)
    sampler.set_epoch(3)
    mine = sampler.indices()
    everyone = comm.allgather(mine.tolist())
    assert all(len(s) == len(sampler) for s in everyone)  # same number of batches everywhere
    flat = [i for s in everyone for i in s]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // size) * size  # disjoint
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // size) * size  # covers all, padded
    # Deterministic per (seed, epoch), different across epochs.
    again = DistributedSampler(n, comm, seed=5, drop_last=drop_last)
    again.set_epoch(3)
    assert (again.indices() == mine).all()
    if n >= 10:
        again.set_epoch(4)
        assert comm.allgather(again.indices().tolist()) != everyone


@pytest.mark.world_sizes(2, 3, 4)
def test_check_finite_names_parameter_and_rank_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    ddp = DDP(make_model(), comm, check_finite=True, bucket_cap_mb=TINY_BUCKET_MB)
    crit = nn.CrossEntropyLoss()
    x, y = global_batch(0, 4)
    crit(ddp(x), y).backward()  # finite: no error
    bad = size - 1
    ddp.zero_grad()
    loss = crit(ddp(x), y)
    # Poison the first layer's bias gradient on one rank only, through a tensor hook: it runs before the
    # gradient is accumulated, so before DDP's post-accumulate hook copies it into the bucket.
    if rank == bad:
        ddp.module[0].bias.register_hook(lambda g: g * np.nan)
    with pytest.raises(FloatingPointError, match=rf"non-finite gradient \(NaN or Inf\) at step 2: '0.bias' on "
                                                 rf"rank\(s\) \[{bad}\]; the optimizer step must not be taken"):
        loss.backward()


@pytest.mark.world_sizes(2, 3, 4)
def test_grad_sync_reports_name_parameters_and_ranks_on_every_rank(comm):
    """The shared core (DDP now, FSDP next): flags from some ranks become one error on every rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sync = GradSync(comm, "Wrapper", ["a", "b", "c"])
    sync.raise_if_nonfinite([False] * 3, "step 1")  # nothing flagged, reduction finite: no error
    sync.raise_if_unused([False] * 3)
    with pytest.raises(FloatingPointError, match=r"Wrapper: non-finite gradient \(NaN or Inf\) at step 2: 'b' on "
                                                 rf"rank\(s\) \[0, {size - 1}\]; 'c' on rank\(s\) \[{size - 1}\]"):
        sync.raise_if_nonfinite([False, rank in (0, size - 1), rank == size - 1], "step 2")
    with pytest.raises(FloatingPointError, match=r"at step 3: produced by the reduction itself \(overflow\)"):
        sync.raise_if_nonfinite([False] * 3, "step 3", reduced_nonfinite=True)
    with pytest.raises(RuntimeError, match=r"Wrapper: parameters received no gradient in this backward on at least "
                                           r"one rank: \['a', 'c'\]"):
        sync.raise_if_unused([rank == 1, False, rank == 0])
    with sync.no_sync():
        with sync.no_sync():
            assert not sync.syncing
        assert not sync.syncing
    assert sync.syncing


class SkipsB(nn.Module):
    """out = x*a + x*b; ranks with ``skip_b`` read b's array only, so b gets no gradient there (unused there only)."""

    def __init__(self, skip_b):
        super().__init__()
        self.a = nn.Parameter(np.ones(4))
        self.b = nn.Parameter(np.ones(4))
        self.skip_b = skip_b

    def forward(self, x):
        return x * self.a + x * (self.b.data if self.skip_b else self.b)


@pytest.mark.world_sizes(2, 3, 4)
def test_parameter_unused_on_one_rank_only_is_reported_everywhere(comm):
    # Tiny buckets: ranks that produce b's gradient launch its bucket during backward, the other does not.
    ddp = DDP(SkipsB(skip_b=comm.Get_rank() == 1), comm, first_bucket_mb=1e-6, bucket_cap_mb=1e-6,
              unused_parameters="error")
    out = ddp(np.ones(4))
    with pytest.raises(RuntimeError, match=r"received no gradient in this backward on at least one rank: \['b'\]"):
        out.backward(np.ones(4))
    # The buckets were all completed first: the next (zero-mode) step runs normally on every rank.
    ddp.unused_parameters = "zero"
    ddp.zero_grad()
    ddp(np.ones(4)).backward(np.ones(4))
    size = comm.Get_size()
    np.testing.assert_allclose(ddp.module.b.grad, np.full(4, (size - 1) / size))


class CountsSamples(nn.Module):
    """make_model() with a buffer its forward updates: the number of samples seen (a running statistic)."""

    def __init__(self, rank):
        super().__init__()
        self.net = make_model()
        self.register_buffer("seen", np.full(1, 1000.0 * rank))  # differs per rank until DDP broadcasts it

    def forward(self, x):
        self.seen[0] += len(x)
        return self.net(x)


def train_with_join_and_no_sync(comm, module):
    """Rank r runs 2 + r steps inside ``join(optimizer)``; each step accumulates two half-batches under
    no_sync, so the gradient is that of the whole batch of 4."""
    rank = comm.Get_rank()
    rank_batch, _ = join_batches(comm.Get_size())
    ddp = DDP(module, comm)
    opt = make_optimizer("sgd", ddp.parameters())
    crit = nn.CrossEntropyLoss()
    with ddp.join(opt):
        for step in range(2 + rank):
            x, y = rank_batch(rank, step)
            opt.zero_grad()
            with ddp.no_sync():
                train_step(ddp, opt, crit, x[:2], y[:2], scale=0.5)
            train_step(ddp, opt, crit, x[2:], y[2:], scale=0.5)
            opt.step()
    return ddp


@pytest.mark.world_sizes(2, 3, 4)
def test_join_with_no_sync_accumulation_trains_like_one_process(comm):
    """Joined ranks step the optimizer with the averaged gradients: every rank ends with the parameters of one
    process trained on the batches of the ranks still active at each step."""
    size = comm.Get_size()
    ddp = train_with_join_and_no_sync(comm, CountsSamples(comm.Get_rank()))
    _, reference_batch = join_batches(size)
    assert_params_equal(ddp.module.net.state_dict(), reference_params("sgd", size + 1, reference_batch))


@pytest.mark.world_sizes(2, 3, 4)
def test_join_with_no_sync_ends_with_the_buffers_of_one_process(comm):
    """Buffers follow a rank that still has data (a joined rank's are stale), and every rank ends with those of
    the last rank to finish: one process that saw its 2 + (size - 1) steps of two half-batches, 4 samples each."""
    size = comm.Get_size()
    ddp = train_with_join_and_no_sync(comm, CountsSamples(comm.Get_rank()))
    np.testing.assert_array_equal(ddp.module.seen, [4.0 * (size + 1)])


# -- tied weights, keyword arguments, the forward deciding the sync mode --------------------------------------
VOCAB, WIDTH = 11, 8


class TiedResidual(nn.Module):
    """A residual MLP over token embeddings: one Linear used twice, and the embedding tied to the output
    projection (``F.linear(h, embedding.weight)``). Each tied parameter's gradient is the sum of its uses."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(5)
        self.embed = nn.Embedding(VOCAB, WIDTH, rng=rng, dtype=np.float64, std=0.5)
        self.block = nn.Linear(WIDTH, WIDTH, rng=rng, dtype=np.float64)
        self.norm = nn.LayerNorm(WIDTH, dtype=np.float64)

    def forward(self, tokens, *, temperature=1.0):
        h = self.embed(tokens)
        h = h + F.tanh(self.block(h))
        h = h + F.tanh(self.block(h))  # the same Linear again
        return F.linear(self.norm(h), self.embed.weight) * (1.0 / temperature)


def token_batch(step, n):
    rng = np.random.default_rng([11, step])
    return rng.integers(0, VOCAB, size=n), rng.integers(0, VOCAB, size=n)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_tied_weights_with_overlap_match_one_process(comm, kind):
    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank, steps = 3, 5
    # Tiny buckets: the tied embedding (used first and last) sits alone in the last bucket, the twice-used
    # block in another; with overlap each bucket launches as soon as its parameters fired, once each.
    ddp = DDP(TiedResidual(), comm, bucket_cap_mb=TINY_BUCKET_MB, first_bucket_mb=TINY_BUCKET_MB, overlap=True)
    assert len(ddp.buckets) >= 3
    fired = {}
    for name, p in ddp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    opt = make_optimizer(kind, ddp.parameters())
    crit = nn.CrossEntropyLoss()
    ref = TiedResidual()
    ref_opt = make_optimizer(kind, ref.parameters())
    for step in range(steps):
        x, y = token_batch(step, per_rank * size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        crit(ddp(x[mine], temperature=0.7), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        crit(ref(x, temperature=0.7), y).backward()
        ref_opt.step()
    assert fired == {name: steps for name, _ in ddp.named_parameters()}  # once per backward, tied or not
    assert_params_equal(ddp.state_dict(), ref.state_dict())


@pytest.mark.world_sizes(2, 3)
@pytest.mark.parametrize("inside", ["forward", "backward"])
def test_no_sync_around_the_forward_or_the_backward_keeps_it_local(comm, inside):
    """As in PyTorch, a forward under no_sync gives a local backward even when backward runs after the block;
    as mpidist always did, so does a backward started under no_sync. The next synchronizing backward averages
    the sum."""
    size, rank = comm.Get_size(), comm.Get_rank()
    ddp = DDP(make_model(), comm, bucket_cap_mb=TINY_BUCKET_MB)
    crit = nn.CrossEntropyLoss()
    x, y = global_batch(0, 4 * size)
    mine = slice(rank * 4, (rank + 1) * 4)
    if inside == "forward":
        with ddp.no_sync():
            loss = crit(ddp(x[mine][:2]), y[mine][:2])
        loss.backward()  # outside the block, still local
    else:
        loss = crit(ddp(x[mine][:2]), y[mine][:2])
        with ddp.no_sync():
            loss.backward()
    first = {n: p.grad.copy() for n, p in ddp.named_parameters()}
    everyone = comm.allgather(first["0.weight"])
    assert not all(np.array_equal(everyone[0], w) for w in everyone[1:])  # not averaged: ranks differ
    crit(ddp(x[mine][2:]), y[mine][2:]).backward()
    ref = make_model()
    for r in range(size):  # the reference: the sum over each rank's two halves, averaged over ranks
        rows = slice(r * 4, (r + 1) * 4)
        (crit(ref(x[rows][:2]), y[rows][:2]) * (1 / size)).backward()
        (crit(ref(x[rows][2:]), y[rows][2:]) * (1 / size)).backward()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(dict(ddp.named_parameters())[n].grad, p.grad, rtol=0, atol=1e-12, err_msg=n)
