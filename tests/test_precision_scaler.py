"""Dynamic loss scaling (mpidist.amp.GradScaler): the scale schedule, skipped steps agreed by every rank, and
parity with a single process that skips the same steps."""

import logging

import numpy as np
import pytest

from mpidist import collectives, nn, optim
from mpidist.amp import GradScaler
from mpidist.nn import functional as F
from mpidist.nn.precision import Policy, apply_policy
from mpidist.parallel import comm_hooks
from mpidist.parallel.ddp import DDP

IN, HIDDEN, OUT = 6, 8, 4


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng), nn.Tanh(), nn.Linear(HIDDEN, OUT, rng=rng))


def global_batch(step, n):
    rng = np.random.default_rng([11, step])
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, OUT, size=n)


def expected_scales(init, interval, skipped, steps):
    """The scale before each step, by the rule: halve after a skipped step, double after ``interval`` good ones."""
    scales, scale, good = [], init, 0
    for step in range(steps):
        scales.append(scale)
        if step in skipped:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == interval:
                scale, good = scale * 2, 0
    return scales


def test_scale_schedule_and_state_dict():
    p = nn.Parameter(np.zeros(2, np.float32))
    opt = optim.SGD([p], lr=0.1)
    scaler = GradScaler(init_scale=8.0, growth_interval=2)
    bad = {1, 2}
    seen = []
    for step in range(6):
        seen.append(scaler.get_scale())
        p.grad = np.array([np.inf if step in bad else 1.0, 0.0], np.float32) * scaler.get_scale()
        stepped = scaler.step(opt)
        assert stepped == (step not in bad)
        scaler.update()
    assert seen == expected_scales(8.0, 2, bad, 6) == [8, 8, 4, 2, 2, 4]
    assert scaler.skipped_steps == [1, 2]
    assert p.data[0] == np.float32(-0.1) * 4  # four good steps of lr * 1 (unscaled exactly)
    other = GradScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.get_scale() == scaler.get_scale() and other.state_dict() == scaler.state_dict()


def test_bad_arguments_and_misuse_raise():
    with pytest.raises(ValueError, match=r"GradScaler: init_scale must be a finite number > 0 \(got 0\)"):
        GradScaler(init_scale=0)
    with pytest.raises(ValueError, match=r"GradScaler: growth_interval must be an int >= 1 \(got 0\)"):
        GradScaler(growth_interval=0)
    p = nn.Parameter(np.zeros(2, np.float32))
    opt = optim.SGD([p], lr=0.1)
    scaler = GradScaler()
    p.grad = np.ones(2, np.float32)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.unscale_: already called for this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"GradScaler.step: already called for this optimizer"):
        scaler.step(opt)


def test_a_skipped_step_is_logged(caplog):
    p = nn.Parameter(np.zeros(2, np.float32))
    opt = optim.SGD([p], lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    p.grad = np.array([np.nan, 0], np.float32)
    with caplog.at_level(logging.WARNING, logger="mpidist.amp"):
        scaler.step(opt)
        scaler.update()
    assert "GradScaler: NaN or Inf gradient at update 0: step skipped, scale 4 -> 2" in caplog.text
    np.testing.assert_array_equal(p.data, [0, 0])


def _inject_inf(param, when, step_box):
    """A leaf hook that puts an Inf into ``param``'s gradient at step ``when`` (before DDP sees it)."""
    def hook(g):
        if step_box[0] == when:
            g = g.copy()
            g.reshape(-1)[0] = np.inf
            return g
        return None
    return param.register_hook(hook)


def _train_with_inf_on_last_rank(wrapped, opt, scaler, comm, steps, bad, per_rank, observe):
    """Train ``wrapped`` with ``scaler`` on each rank's part of the global batches, an Inf put into the first
    layer's weight gradient on the last rank at step ``bad``; return ``observe()`` after each backward."""
    size, rank = comm.Get_size(), comm.Get_rank()
    step_box = [None]
    if rank == size - 1:
        _inject_inf(wrapped.module[0].weight, bad, step_box)
    seen = []
    for step in range(steps):
        step_box[0] = step
        x, y = global_batch(step, per_rank * size)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(wrapped(x[part]), y[part])).backward()
        seen.append(observe())
        scaler.step(opt)
        scaler.update()
    return seen


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("hook", [None, "bf16", "powerSGD"])
def test_ddp_inf_on_one_rank_skips_the_step_on_every_rank(comm, hook):
    """An Inf injected on the last rank at step 2: every rank skips step 2 and halves the scale (no collective of
    the scaler's own: the averaged gradients carry it, also through the 16-bit ring and PowerSGD); the parameters
    equal one process's training on the whole batch that skips step 2 (float32; power-of-two scales unscale
    exactly; 16-bit gradients on the wire: 1e-2). PowerSGD (plain for 1 synchronization, full rank) keeps its
    memory finite through the skipped step."""
    size = comm.Get_size()
    per_rank, steps, bad = 3, 6, 2
    ddp = DDP(make_model(), comm)
    state = None
    if hook == "bf16":
        ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    elif hook == "powerSGD":
        state = comm_hooks.PowerSGDState(matrix_approximation_rank=HIDDEN, start_powerSGD_iter=1,
                                         min_compression_rate=0.0)
        ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)
    opt = optim.Adam(ddp.parameters(), lr=0.01)
    scaler = GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    scales = _train_with_inf_on_last_rank(ddp, opt, scaler, comm, steps, bad, per_rank, scaler.get_scale)
    assert scaler.skipped_steps == [bad]
    assert scales == expected_scales(2.0 ** 10, 2, {bad}, steps)
    everyone = comm.allgather((scaler.skipped_steps, scales))
    assert all(e == everyone[0] for e in everyone)

    reference = make_model()
    ref_opt = optim.Adam(reference.parameters(), lr=0.01)
    for step in range(steps):
        x, y = global_batch(step, per_rank * size)
        if step == bad:
            continue
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(ddp.named_parameters(), reference.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=0, atol=1e-6 if hook is None else 1e-2, err_msg=name)
    if state is not None:
        assert all(np.isfinite(e).all() for e in state.errors.values())
        assert all(np.isfinite(q).all() for q in state.qs.values())


@pytest.mark.world_sizes(2, 4)
def test_ranks_with_different_gradients_agree_through_comm(comm):
    """Without a wrapper every rank holds its own gradients: an Inf on rank 1 alone must still skip every rank's
    step (the flag is MAX-allreduced); the skip list and scale are the same everywhere."""
    rank = comm.Get_rank()
    p = nn.Parameter(np.zeros(3, np.float32))
    opt = optim.SGD([p], lr=0.5)
    scaler = GradScaler(init_scale=4.0, growth_interval=3, comm=comm)
    for step in range(5):
        g = np.full(3, float(rank + 1), np.float32)
        if step == 1 and rank == 1:
            g[2] = np.inf
        p.grad = g * np.float32(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps == [1]
    np.testing.assert_array_equal(p.data, np.full(3, -0.5 * (rank + 1) * 4, np.float32))
    assert scaler.get_scale() == 4.0  # halved at step 1, doubled after steps 2, 3 and 4
    scales = np.array([scaler.get_scale()])
    collectives.allreduce(scales, comm, op="min")
    assert scales[0] == scaler.get_scale()


def test_float16_training_finds_a_scale_and_tracks_float32():
    """Policy("fp16") with a scale that overflows float16 at first: the scaler halves it until the gradients fit,
    skipping those steps, then trains with float32 master weights; the loss tracks the float32 run within 5%
    over the same (non-skipped) batches."""
    losses = {}
    for dtype in (np.float32, np.float16):
        model = make_model(1)
        if dtype == np.float16:
            apply_policy(model, Policy("fp16"))
        opt = optim.Adam(model.parameters(), lr=1e-2)
        scaler = GradScaler(init_scale=2.0 ** 24, growth_interval=1000, enabled=dtype == np.float16)
        step = 0
        with np.errstate(over="ignore", invalid="ignore"):  # the overflows the scaler is there to catch
            while step < 25:
                x, y = global_batch(step, 16)
                opt.zero_grad()
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                stepped = scaler.step(opt)
                scaler.update()
                step += stepped  # a skipped step retries the same batch
        losses[dtype] = np.mean([float(F.cross_entropy(model(x), y).data)
                                 for x, y in (global_batch(100 + k, 16) for k in range(4))])
        if dtype == np.float16:
            assert scaler.skipped_steps and scaler.get_scale() < 2.0 ** 24
            assert all(p.dtype == np.float16 for p in model.parameters())
    assert abs(losses[np.float16] - losses[np.float32]) <= 0.05 * losses[np.float32], losses


@pytest.mark.world_sizes(2, 4)
def test_fsdp_shards_agree_through_comm(comm):
    """Under FSDP each rank holds its shard's gradient, so an Inf from the last rank's backward reaches only the
    rank owning that element after the reduce-scatter: GradScaler(comm=) makes every rank skip step 1 alike, and
    the parameters equal one process on the whole batch that skips step 1."""
    from mpidist.parallel.fsdp import FSDP
    from mpidist.parallel.full_state import full_state_dict
    size = comm.Get_size()
    per_rank, steps, bad = 3, 4, 1
    fsdp = FSDP(make_model(), comm)
    opt = optim.SGD(fsdp.parameters(), lr=0.5)
    scaler = GradScaler(init_scale=2.0 ** 8, growth_interval=100, comm=comm)
    local_found = _train_with_inf_on_last_rank(
        fsdp, opt, scaler, comm, steps, bad, per_rank,
        lambda: any(not np.isfinite(p.grad).all() for p in fsdp.parameters() if p.grad is not None))
    assert scaler.skipped_steps == [bad] and scaler.get_scale() == 2.0 ** 7
    assert not all(comm.allgather(local_found[bad]))  # why comm= is needed: some rank saw no Inf itself
    reference = make_model()
    ref_opt = optim.SGD(reference.parameters(), lr=0.5)
    for step in range(steps):
        if step == bad:
            continue
        x, y = global_batch(step, per_rank * size)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for got, want in zip(full_state_dict(fsdp, all_ranks=True).values(), reference.state_dict().values()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
