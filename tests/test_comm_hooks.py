"""DDP communication hooks: the 16-bit ring, bf16/fp16 compression, bfloat16 parameters, PowerSGD.

References: float64 sums of every rank's inputs, one process training on the whole batch, plain DDP."""

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn, optim
from mpidist.nn import functional as F
from mpidist.nn.precision import Policy, apply_policy, bfloat16, float16
from mpidist.parallel.comm_hooks import (HookBucket, PowerSGDState, allreduce_hook, bf16_compress_hook,
                                         fp16_compress_hook, powerSGD_hook)
from mpidist.parallel.ddp import DDP
from mpidist.ring16 import ring_allreduce_16
from helpers import ring_reference

IN, HIDDEN, OUT = 6, 12, 4
HALF_ULP = {float16: 2.0 ** -11, bfloat16: 2.0 ** -8}


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN, rng=rng), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT, rng=rng))


def global_batch(step, n):
    rng = np.random.default_rng([5, step])
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, OUT, size=n)


def shard(comm, step, per_rank):
    size, rank = comm.Get_size(), comm.Get_rank()
    x, y = global_batch(step, per_rank * size)
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def assert_same_on_every_rank(comm, arrays):
    mine = [np.asarray(a).tobytes() for a in arrays]
    assert all(other == mine for other in comm.allgather(mine))


@pytest.mark.parametrize("dtype", [float16, bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3, 1000])
def test_ring_allreduce_16_is_the_sum_with_float32_accumulation(comm, dtype, n):
    """Within one rounding per hop of the float64 sum (scaled by the summed magnitudes), and the same bits on
    every rank; fewer elements than ranks works (empty chunks)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [np.random.default_rng([r, n]).standard_normal(n).astype(dtype) for r in range(size)]
    out = ring_allreduce_16(inputs[rank].copy(), comm)
    assert out.dtype == dtype
    exact = np.sum([a.astype(np.float64) for a in inputs], axis=0)
    magnitude = np.sum([np.abs(a.astype(np.float64)) for a in inputs], axis=0)
    assert np.all(np.abs(out.astype(np.float64) - exact) <= size * HALF_ULP[dtype] * magnitude * 1.01)
    assert_same_on_every_rank(comm, [out])
    with pytest.raises(TypeError, match=r"ring_allreduce_16: needs a float16 or bfloat16 array \(got float32\)"):
        ring_allreduce_16(np.zeros(2, np.float32), comm)


def train(ddp, opt, comm, steps, per_rank=4):
    for step in range(steps):
        x, y = shard(comm, step, per_rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()


def reference(steps, size, per_rank=4, policy=None, make_opt=lambda params: optim.Adam(params, lr=0.01)):
    model = make_model()
    if policy is not None:
        apply_policy(model, policy)
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = global_batch(step, per_rank * size)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("hook", [bf16_compress_hook, fp16_compress_hook, allreduce_hook],
                         ids=["bf16", "fp16", "allreduce"])
def test_compression_hooks_track_one_process_and_keep_replicas_equal(comm, hook):
    """float32 model, gradients summed as 16-bit on the wire: the parameters stay identical on every rank and
    within 1e-3 of one process on the whole batch after 4 Adam steps (lr 0.01; plain allreduce: 1e-6)."""
    ddp = DDP(make_model(), comm)
    ddp.register_comm_hook(None, hook)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    train(ddp, opt, comm, 4)
    ref = reference(4, comm.Get_size())
    tol = 1e-6 if hook is allreduce_hook else 1e-3
    for p, q in zip(ddp.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=tol)
    assert_same_on_every_rank(comm, [p.data for p in ddp.parameters()])


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("poll", [None, 0.001], ids=["no_poll", "poll"])
def test_bf16_parameters_under_ddp_equal_ranks_emulated_rounding_where_ddp_rounds(comm, poll):
    """Policy("bf16", "fp32") under DDP (bfloat16 buckets, summed in float32 by the collectives, no hook), 3 SGD
    steps, against the ranks emulated in one process: float32 masters, weights = masters rounded to bfloat16, each
    rank's gradient rounded to bfloat16 and divided by the world size (exact: a power of two), the shares summed
    in float32 rank by rank and rounded to bfloat16 once. Equal replicas; 1e-6 (MPI may add four shares in another
    order; two add exactly). With ``progress_poll_s`` (one bucket per parameter, the first layer's backward held
    up 30 ms after the later buckets launched): under real MPI its thread tests the bfloat16 buckets meanwhile, at
    least once a step on the whole (as float32 ones; a default hook used to switch it off); SimComm needs none."""
    size = comm.Get_size()
    per_rank, lr = 4, 0.5
    model = make_model()
    apply_policy(model, Policy("bf16", "fp32"))
    if poll is None:
        ddp = DDP(model, comm)
    else:
        def slow_backward(module, args, out):  # returns None: the output stays as it is
            out.register_hook(lambda grad: time.sleep(0.03))
        model[0].register_forward_hook(slow_backward)
        ddp = DDP(model, comm, bucket_cap_mb=1e-6, first_bucket_mb=1e-6, progress_poll_s=poll)
        polls, progress, main = [], ddp._progress, threading.get_ident()

        def recorded():  # DDP's test of its launched buckets, from whichever thread calls it
            polls.append(threading.get_ident() != main)
            progress()
        ddp._progress = recorded
    assert all(b.flat.dtype == bfloat16 for b in ddp.buckets)
    opt = optim.SGD(ddp.parameters(), lr=lr)
    train(ddp, opt, comm, 3, per_rank)
    if poll is not None:
        simulated = not isinstance(comm, MPI.Comm)
        assert sum(polls) >= (0 if simulated else 3) and (not simulated or not any(polls)), polls

    ref = make_model()
    masters = [p.data.astype(bfloat16).astype(np.float32) for p in ref.parameters()]
    for step in range(3):
        x, y = global_batch(step, per_rank * size)
        total = [np.zeros_like(m) for m in masters]
        for r in range(size):
            for p, m in zip(ref.parameters(), masters):
                p.data, p.grad = m.astype(bfloat16).astype(np.float32), None
            part = slice(r * per_rank, (r + 1) * per_rank)
            F.cross_entropy(ref(x[part]), y[part]).backward()
            for t, p in zip(total, ref.parameters()):
                t += p.grad.astype(bfloat16).astype(np.float32) * np.float32(1 / size)
        for m, t in zip(masters, total):
            m -= np.float32(lr) * t.astype(bfloat16).astype(np.float32)
    for p, m in zip(ddp.parameters(), masters):
        assert p.dtype == bfloat16
        np.testing.assert_allclose(opt.state[[id(q) for q in opt.params].index(id(p))]["master_param"], m,
                                   rtol=0, atol=1e-6)
        np.testing.assert_allclose(p.data.astype(np.float32), m.astype(bfloat16).astype(np.float32), rtol=0,
                                   atol=2.0 ** -8)
    assert_same_on_every_rank(comm, [p.data for p in ddp.parameters()])


def test_register_comm_hook_refuses_bad_use(comm):
    ddp = DDP(make_model(), comm)
    with pytest.raises(TypeError, match=r"DDP.register_comm_hook: hook must be callable \(got int\)"):
        ddp.register_comm_hook(None, 3)
    x, y = shard(comm, 0, 2)
    F.cross_entropy(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match=r"DDP.register_comm_hook: register before the first backward "
                                           r"\(1 synchronizations ran\)"):
        ddp.register_comm_hook(None, bf16_compress_hook)
    with pytest.raises(ValueError, match=r"PowerSGDState: matrix_approximation_rank must be an int >= 1 \(got 0\)"):
        PowerSGDState(matrix_approximation_rank=0)


@pytest.mark.world_sizes(2, 4)
def test_powerSGD_at_full_rank_is_the_plain_allreduce(comm):
    """With r >= min(rows, cols) the approximation P Q^T spans every matrix exactly: after warm-up (2 plain
    synchronizations) SGD's training equals plain DDP's to float32 rounding; every rank's error feedback is its
    deviation from the mean, and they sum to ~0. Batches of 16 or more samples make every gradient of full rank
    (PowerSGD of a rank-deficient matrix orthonormalizes noise)."""
    per_rank = 16 // comm.Get_size()
    plain = DDP(make_model(), comm)
    opt = optim.SGD(plain.parameters(), lr=0.5)
    train(plain, opt, comm, 5, per_rank)
    ddp = DDP(make_model(), comm)
    state = PowerSGDState(matrix_approximation_rank=HIDDEN, start_powerSGD_iter=2, min_compression_rate=0.0)
    ddp.register_comm_hook(state, powerSGD_hook)
    opt = optim.SGD(ddp.parameters(), lr=0.5)
    train(ddp, opt, comm, 5, per_rank)
    assert state.iter == 5 and state.qs
    for p, q in zip(ddp.parameters(), plain.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=1e-5)
    errors = np.sum(comm.allgather(state.errors[0]), axis=0)
    assert float(np.abs(errors).max()) < 1e-5
    assert_same_on_every_rank(comm, [p.data for p in ddp.parameters()])


@pytest.mark.world_sizes(2, 4)
def test_powerSGD_rank_1_trains_saves_and_resumes(comm):
    """Rank 1: the warm-up steps are bitwise plain DDP's; then replicas stay equal, the loss falls, and a run
    restored from state_dict (PowerSGD's error feedback and Qs, the model, the optimizer) continues bitwise like
    the run that never stopped."""
    plain = DDP(make_model(), comm)
    opt = optim.Adam(plain.parameters(), lr=0.01)
    train(plain, opt, comm, 2)
    ddp = DDP(make_model(), comm)
    state = PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.0)
    ddp.register_comm_hook(state, powerSGD_hook)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    train(ddp, opt, comm, 2)
    for p, q in zip(ddp.parameters(), plain.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    def training_loss():  # over the four global batches the run cycles through
        return np.mean([float(F.cross_entropy(ddp.module(x), y).data)
                        for x, y in (global_batch(s, 4 * comm.Get_size()) for s in range(4))])
    before = training_loss()
    for step in range(2, 30):
        x_, y_ = shard(comm, step % 4, 4)
        opt.zero_grad()
        F.cross_entropy(ddp(x_), y_).backward()
        opt.step()
    assert training_loss() < 0.9 * before
    assert any(float(np.abs(e).max()) > 0 for e in state.errors.values())  # rank 1 loses something
    saved = (state.state_dict(), ddp.state_dict(), opt.state_dict())
    resumed = DDP(make_model(), comm)
    resumed.load_state_dict(saved[1])
    state2 = PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.0)
    state2.load_state_dict(saved[0])
    resumed.register_comm_hook(state2, powerSGD_hook)
    opt2 = optim.Adam(resumed.parameters(), lr=0.01)
    opt2.load_state_dict(saved[2])
    for run, o in ((ddp, opt), (resumed, opt2)):
        for step in range(3):
            x_, y_ = shard(comm, step, 4)
            o.zero_grad()
            F.cross_entropy(run(x_), y_).backward()
            o.step()
    for p, q in zip(ddp.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    assert_same_on_every_rank(comm, [p.data for p in ddp.parameters()])


@pytest.mark.world_sizes(2, 4)
def test_hooks_run_once_per_synchronization_under_no_sync(comm):
    """Two micro-batches, the first under no_sync: a hook sees the accumulated gradients once per step (PowerSGD
    counts 4 synchronizations for 4 steps), and full-rank PowerSGD after 1 plain synchronization equals plain DDP's
    accumulation to float32 rounding."""
    per_rank = 16 // comm.Get_size()
    runs = []
    for hooked in (False, True):
        ddp = DDP(make_model(), comm)
        state = PowerSGDState(matrix_approximation_rank=HIDDEN, start_powerSGD_iter=1, min_compression_rate=0.0)
        if hooked:
            ddp.register_comm_hook(state, powerSGD_hook)
        opt = optim.SGD(ddp.parameters(), lr=0.5)
        for step in range(4):
            x, y = shard(comm, step, per_rank)
            half = per_rank // 2
            opt.zero_grad()
            with ddp.no_sync():
                (F.cross_entropy(ddp(x[:half]), y[:half]) * 0.5).backward()
            (F.cross_entropy(ddp(x[half:]), y[half:]) * 0.5).backward()
            opt.step()
        runs.append((ddp, state))
    assert runs[1][1].iter == 4
    for p, q in zip(runs[1][0].parameters(), runs[0][0].parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=1e-5)


# -- overlap: the hooks return pending work that DDP advances during backward -----------------------------------
def fake_bucket(comm, index, shapes, seed, comms=None):
    """A HookBucket over a fresh flat float32 buffer holding gradients of ``shapes`` (rank-dependent values);
    ``comms``: the HookComms of the DDP it would belong to."""
    sizes = [int(np.prod(s)) for s in shapes]
    flat = np.random.default_rng([seed, index, comm.Get_rank()]).standard_normal(sum(sizes)).astype(np.float32)
    offsets = np.cumsum([0] + sizes)
    views = [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], shapes)]
    return HookBucket(flat, index, False, [None] * len(shapes), views, comm, comms)


def drive_with_test(works):
    """Complete ``works`` by test() alone (no wait()), as DDP's progress calls do between layers."""
    pending = list(works)
    while pending:
        pending = [w for w in pending if not w.test()]
        time.sleep(0)  # SimComm: let the other rank threads run


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("drive", ["test", "wait"])
@pytest.mark.parametrize("hook,dtype", [(bf16_compress_hook, bfloat16), (fp16_compress_hook, float16)],
                         ids=["bf16", "fp16"])
def test_compress_hooks_return_pending_rings_that_finish_to_the_numpy_ring(comm, hook, dtype, drive):
    """Three buckets launched before any is waited for (DDP's order; sizes that do and do not divide by the ranks,
    one smaller than the world): each hook returns work still pending (done() is False: the ring has more steps
    than it can take before anyone advances it); completed by test() alone or by wait() in launch order, every
    bucket holds the numpy emulation of the ring on all ranks' inputs, bitwise."""
    size = comm.Get_size()
    shapes = [[(5, 7), (7,)], [(64,)], [(1,)]]
    buckets = [fake_bucket(comm, i, s, seed=3) for i, s in enumerate(shapes)]
    inputs = [comm.allgather(b.buffer().astype(dtype)) for b in buckets]
    works = [hook(None, b) for b in buckets]
    assert not any(w.done() for w in works)
    if drive == "test":
        drive_with_test(works)
    results = [w.wait() for w in works]
    assert all(w.done() for w in works)
    for b, got, every in zip(buckets, results, inputs):
        assert got is b.buffer()
        want = ring_reference(every, dtype).astype(np.float32)
        np.testing.assert_array_equal(got, want)
        assert np.abs(want - np.sum([a.astype(np.float64) for a in every], axis=0)).max() < 0.1 * size
    assert_same_on_every_rank(comm, results)


def powerSGD_reference(inputs, shapes, qs):
    """PowerSGD of one bucket from every rank's flat input, in numpy float64: P = sum M Q, orthonormalized (QR with
    a positive diagonal: Gram-Schmidt's), Q' = sum M^T P, M ~ P Q'^T; 1-D gradients summed plainly."""
    out, at = np.zeros(inputs[0].size), 0
    for shape, q in zip(shapes, qs):
        n = int(np.prod(shape))
        ms = [a[at: at + n].astype(np.float64).reshape(shape[0], -1) for a in inputs]
        if len(shape) == 1:
            out[at: at + n] = np.sum(ms, axis=0).reshape(-1)
        else:
            p, tri = np.linalg.qr(np.sum([m @ q for m in ms], axis=0))
            p *= np.sign(np.diag(tri))
            out[at: at + n] = (p @ np.sum([m.T @ p for m in ms], axis=0).T).reshape(-1)
        at += n
    return out


@pytest.mark.world_sizes(2, 4)
def test_powerSGD_returns_pending_work_that_finishes_to_the_numpy_reference(comm):
    """After warm-up, PowerSGD's hook returns with the rest's and P's allreduces started and Q's not (done() is
    False); two buckets launched before either is waited for, the first completed by test() alone (Q's allreduce
    starts there), the second by wait(): each equals numpy's rank-2 PowerSGD on all ranks' inputs (1e-5), the
    same bits on every rank."""
    state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, min_compression_rate=1.0)
    shapes = [[(6, 5), (5,), (6, 4)], [(8, 4)]]  # each matrix compressed: rows * cols >= (rows + cols) * 2
    warm = [fake_bucket(comm, i, s, seed=9) for i, s in enumerate(shapes)]
    for w in [powerSGD_hook(state, b) for b in warm]:  # the plain allreduce of synchronization 1
        w.wait()
    buckets = [fake_bucket(comm, i, s, seed=11) for i, s in enumerate(shapes)]
    inputs = [comm.allgather(b.buffer().copy()) for b in buckets]
    qs = [[state.qs.get((i, k)) for k in range(len(s))] for i, s in enumerate(shapes)]
    works = [powerSGD_hook(state, b) for b in buckets]
    assert not any(w.done() for w in works)
    drive_with_test(works[:1])
    results = [works[0].wait(), works[1].wait()]
    for i, (b, got, every) in enumerate(zip(buckets, results, inputs)):
        assert got is b.buffer()
        first_qs = [rng_q(state, i, k, s) for k, s in enumerate(shapes[i])]
        assert all(q is None for q in qs[i])  # the first compressed step: Q from the seed
        np.testing.assert_allclose(got, powerSGD_reference(every, shapes[i], first_qs), rtol=0, atol=1e-5)
    assert_same_on_every_rank(comm, results)


def rng_q(state, bucket, index, shape):
    """The first Q PowerSGD draws for a matrix (seeded alike on every rank), orthonormalized in float64."""
    if len(shape) == 1:
        return None
    cols = int(np.prod(shape[1:]))
    q = np.random.default_rng([state.seed, bucket, index, 0]).standard_normal((cols, 2)).astype(np.float32)
    basis, tri = np.linalg.qr(q.astype(np.float64))
    return basis * np.sign(np.diag(tri))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("hook,dtype", [(bf16_compress_hook, bfloat16)], ids=["bf16"])
def test_ddp_overlaps_the_ring_with_backward_and_ends_with_the_numpy_ring(comm, hook, dtype):
    """DDP with 1-parameter buckets: every bucket's ring is pending when its hook returns, DDP advances it with
    test() at the later buckets' ready points, and after backward each bucket's gradients are the numpy ring of
    all ranks' bucket inputs, bitwise."""
    seen = []

    def recording_hook(state, bucket):
        given = bucket.buffer().astype(dtype)
        work = hook(state, bucket)
        seen.append((bucket.index(), given, work, work.done()))
        calls = [0]
        test = work.test

        def counted_test():
            calls[0] += 1
            return test()
        work.test = counted_test
        seen[-1] += (calls,)
        return work

    ddp = DDP(make_model(), comm, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    assert len(ddp.buckets) > 3
    ddp.register_comm_hook(None, recording_hook)
    x, y = shard(comm, 0, 4)
    F.cross_entropy(ddp(x), y).backward()
    assert [s[0] for s in seen] == list(range(len(ddp.buckets)))
    assert not any(s[3] for s in seen)  # pending when the hook returned
    assert all(s[4][0] > 0 for s in seen[:-1])  # advanced by DDP while later gradients were computed
    for (index, given, work, _, _), bucket in zip(seen, ddp.buckets):
        assert work.done()
        want = ring_reference(comm.allgather(given), dtype).astype(np.float32)
        np.testing.assert_array_equal(bucket.flat, want)


@pytest.mark.world_sizes(2, 4)
def test_pending_ring_messages_are_in_the_flight_recorder(comm):
    """The ring's point-to-point messages (on the DDP's private comm) are recorded as collectives.isend/irecv's are: while a hook's work is
    pending the watchdog sees its receive from the left neighbour and its send to the right one in flight (a
    neighbour that never sends is reported, not waited for silently), and nothing of it once it is done."""
    from mpidist.guard import record
    size, rank = comm.Get_size(), comm.Get_rank()

    def ring_calls():
        return sorted((r[record.OP], r[record.PEER]) for r in record.in_flight(ring_comm)
                      if r[record.OP] in ("send", "recv"))

    bucket = fake_bucket(comm, 0, [(10,)], seed=5)
    ring_comm = bucket.private_comm(comm)  # where the ring runs (made now; the hook reuses it)
    work = bf16_compress_hook(None, bucket)
    assert ring_calls() == sorted([("recv", (rank - 1) % size), ("send", (rank + 1) % size)])
    work.wait()
    assert ring_calls() == []


@pytest.mark.world_sizes(2, 4)
def test_two_hook_comms_keep_same_index_rings_apart_however_ranks_progress(comm):
    """Two DDPs over one comm both launch a bucket 0: with each DDP's HookComms the rings run on private comms,
    so when odd ranks finish DDP A's ring before DDP B launches and even ranks launch both first (messages of
    one tag would then match the wrong ring), each bucket is the numpy ring of its own inputs, bitwise, on
    every rank."""
    from mpidist.parallel.comm_hooks import HookComms
    rank = comm.Get_rank()
    comms = [HookComms(), HookComms()]
    for c in comms:
        c.private(comm)  # collective: made where every rank makes it
        c.allreduce16(comm, "auto")  # the compression hooks' (collective: placement and settings agreed)
    buckets = []
    for k, c in enumerate(comms):
        flat = np.full(9, 1.0 + rank, np.float32) * (1 + 100 * k) + np.arange(9, dtype=np.float32)
        buckets.append(HookBucket(flat, 0, True, [None], [flat], comm, c))
    inputs = [comm.allgather(b.buffer().astype(float16)) for b in buckets]
    work_a = fp16_compress_hook(None, buckets[0])
    if rank % 2:
        work_a.wait()
        work_b = fp16_compress_hook(None, buckets[1])
    else:
        work_b = fp16_compress_hook(None, buckets[1])
        work_a.wait()
    work_b.wait()
    for b, every in zip(buckets, inputs):
        np.testing.assert_array_equal(b.buffer(), ring_reference(every, float16).astype(np.float32))
    assert_same_on_every_rank(comm, [b.buffer() for b in buckets])
    for c in comms:
        c.free()


@pytest.mark.world_sizes(2, 4)
def test_two_ddps_over_one_comm_with_compress_hooks_end_with_each_buckets_numpy_ring(comm):
    """One backward through two DDPs over one comm (both have buckets 0, 1, ...), rank 1 slowed before DDP B's
    first gradient: every bucket of both holds the numpy ring of its own inputs, bitwise, the same on every
    rank (on the DDP's comm the rings' tags collided and ranks ended with different gradients)."""
    rank = comm.Get_rank()
    seen = []

    def recording_hook(state, bucket):
        seen.append((bucket, bucket.buffer().astype(float16)))
        return fp16_compress_hook(state, bucket)

    inner, outer = make_model(1), nn.Sequential(nn.Linear(OUT, OUT, rng=np.random.default_rng(2)))
    ddps = [DDP(m, comm, bucket_cap_mb=1e-6, first_bucket_mb=1e-6) for m in (inner, outer)]
    for d in ddps:
        d.register_comm_hook(None, recording_hook)
    x, _ = shard(comm, 0, 4)
    out = ddps[1](ddps[0](x * (1 + rank)))
    if rank == 1:
        out.register_hook(lambda g: time.sleep(0.05))
    (out * out).sum().backward()
    assert len(seen) == sum(len(d.buckets) for d in ddps)
    for bucket, given in seen:
        np.testing.assert_array_equal(bucket.buffer(), ring_reference(comm.allgather(given), float16).astype(np.float32))
    assert_same_on_every_rank(comm, [p.grad for m in (inner, outer) for p in m.parameters()])
    for d in ddps:
        d.remove()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("hook", [powerSGD_hook, fp16_compress_hook], ids=["powerSGD", "fp16"])
def test_ddp_remove_frees_the_private_comm_its_hooks_ran_on(comm, hook):
    """The rings and PowerSGD's Q allreduces run on one duplicate of the DDP's comm (not the comm itself), kept
    across steps; DDP.remove() frees it (the handle becomes COMM_NULL)."""
    from mpi4py import MPI
    used = []

    def recording_hook(state, bucket):
        work = hook(state, bucket)
        if hook is fp16_compress_hook:
            used.append(work._handle.comm)  # the hook's work wraps the ring
        elif getattr(work._handle, "compressed", None):
            used.append(work._handle.q_comm)
        return work

    ddp = DDP(make_model(), comm, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    state = PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=1, min_compression_rate=1.0)
    ddp.register_comm_hook(state if hook is powerSGD_hook else None, recording_hook)
    train(ddp, optim.SGD(ddp.parameters(), lr=0.01), comm, 3)
    assert used and all(c is used[0] for c in used) and used[0] is not comm and used[0] != MPI.COMM_NULL
    ddp.remove()
    assert used[0] == MPI.COMM_NULL


@pytest.mark.world_sizes(2, 4)
def test_powerSGD_never_starts_qs_of_work_abandoned_by_an_exception(comm):
    """A synchronization whose works were never waited for (an exception ended its backward): the next one's
    bucket 0 drops them, so their Q allreduces never start, and its own results are numpy's PowerSGD (1e-5)."""
    state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, min_compression_rate=1.0)
    shapes = [[(6, 5)], [(8, 4)]]
    for w in [powerSGD_hook(state, fake_bucket(comm, i, s, seed=9)) for i, s in enumerate(shapes)]:
        w.wait()  # the plain allreduce of synchronization 1
    abandoned = [powerSGD_hook(state, fake_bucket(comm, i, s, seed=10)) for i, s in enumerate(shapes)]
    buckets = [fake_bucket(comm, i, s, seed=11) for i, s in enumerate(shapes)]
    inputs = [comm.allgather(b.buffer().copy()) for b in buckets]
    results = [w.wait() for w in [powerSGD_hook(state, b) for b in buckets]]
    assert all(w._handle.q_handle is None for w in abandoned)
    for i, (got, every) in enumerate(zip(results, inputs)):
        first_qs = [rng_q(state, i, k, s) for k, s in enumerate(shapes[i])]
        np.testing.assert_allclose(got, powerSGD_reference(every, shapes[i], first_qs), rtol=0, atol=1e-5)
    for w in abandoned:  # complete their started allreduces (MPI requests are not left pending)
        w._handle.p_handle.wait()
        w._handle.rest_handle.wait()


@pytest.mark.world_sizes(2, 4)
def test_waiting_for_one_ring_advances_every_pending_ring_of_the_ddp(comm):
    """Two buckets of one DDP (one HookComms) in flight, waited for in opposite orders on even and odd ranks:
    each wait() advances both rings (blocking on one ring's steps alone, each rank would wait for a step its
    neighbour only posts after its own wait: a deadlock), and both end as the numpy ring, bitwise."""
    from mpidist.parallel.comm_hooks import HookComms
    comms = HookComms()
    comms.private(comm)  # collective: made where every rank makes it
    buckets = [fake_bucket(comm, i, [(2 * comm.Get_size() + i,)], seed=13, comms=comms) for i in range(2)]
    inputs = [comm.allgather(b.buffer().astype(float16)) for b in buckets]
    works = [fp16_compress_hook(None, b) for b in buckets]
    for w in (works if comm.Get_rank() % 2 == 0 else works[::-1]):
        w.wait()
    for b, every in zip(buckets, inputs):
        np.testing.assert_array_equal(b.buffer(), ring_reference(every, float16).astype(np.float32))
    assert comms.rings == []
    comms.free()


def test_compress_hooks_refuse_a_bucket_index_past_the_tags(comm):
    """A ring is tagged by its bucket index: an index past MPI's guaranteed largest tag (32767) is refused on
    every rank (wrapping it would let two pending rings share a tag)."""
    with pytest.raises(ValueError, match=r"fp16_compress_hook: bucket index 32768 exceeds the ring's tags "
                                         r"\(0\.\.32767\); use fewer, larger buckets"):
        fp16_compress_hook(None, fake_bucket(comm, 32768, [(3,)], seed=1))
