"""Gradient clipping by global norm: the formula, and parity with one process for DDP, FSDP and pipelines.

The reference is the same model trained in one process with ``clip_grad_norm_`` on the whole-batch
gradients; the distributed run must clip with the same norm (over shards or stages) and end with the
same parameters. ``MAX_NORM`` is small enough that every step clips (checked).
"""

import math

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.optim import SGD, Adam
from mpidist.parallel.ddp import DDP
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel.pipeline import Pipeline

import test_fsdp
import test_pipeline

MAX_NORM = 0.05
PIPELINE_MAX_NORM = 0.005  # the 8-stage interleaved model has small gradients
NORM_TYPES = [2.0, 1.0, 3.0, math.inf]


def params_with_grads(grads):
    params = []
    for g in grads:
        # A parameter must be floating point; an integer gradient is set on a float parameter by hand.
        p = nn.Parameter(np.zeros_like(g) if g.dtype.kind in "fc" else np.zeros(g.shape))
        p.grad = g.copy()
        params.append(p)
    return params


def numpy_norm(grads, norm_type):
    flat = np.concatenate([g.ravel() for g in grads])
    return float(np.linalg.norm(flat, ord=norm_type))


@pytest.mark.mpi_skip
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_matches_the_formula(norm_type):
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((3, 4)), rng.standard_normal(5), np.zeros((0, 2))]
    total = numpy_norm(grads, norm_type)
    params = params_with_grads(grads) + [nn.Parameter(np.ones(2))]  # a parameter without grad is skipped
    got = nn.clip_grad_norm_(params, max_norm=total / 4, norm_type=norm_type)
    assert got == pytest.approx(total, rel=1e-12)
    for p, g in zip(params, grads):
        np.testing.assert_allclose(p.grad, g * (total / 4) / (total + 1e-6), rtol=1e-12)
    assert numpy_norm([p.grad for p in params[:3]], norm_type) == pytest.approx(total / 4, rel=1e-6)
    # Below the limit nothing changes.
    params = params_with_grads(grads)
    assert nn.clip_grad_norm_(params, max_norm=2 * total, norm_type=norm_type) == pytest.approx(total, rel=1e-12)
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(p.grad, g)


@pytest.mark.mpi_skip
def test_clip_rejects_bad_arguments_and_reports_nonfinite_norms():
    params = params_with_grads([np.array([3.0, 4.0])])
    for bad in (-1.0, math.inf, "1", None):
        with pytest.raises(ValueError, match=rf"max_norm must be a finite number >= 0 \(got {bad!r}\)"):
            nn.clip_grad_norm_(params, bad)
    for bad in (0, -2.0, "2", True):
        with pytest.raises(ValueError, match=rf"norm_type must be a positive number or math.inf \(got {bad!r}\)"):
            nn.clip_grad_norm_(params, 1.0, norm_type=bad)
    params = params_with_grads([np.array([3.0, np.nan]), np.array([1.0])])
    assert math.isnan(nn.clip_grad_norm_(params, 1.0))
    np.testing.assert_array_equal(params[1].grad, [1.0])  # left as it was
    assert math.isnan(nn.grad_norm(params, math.inf))
    with pytest.raises(FloatingPointError, match=r"total norm of the gradients is nan \(order 2.0\)"):
        nn.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_norm_over_ranks_equals_the_norm_of_the_whole(comm, norm_type):
    """Each rank holds a different part of the gradients; every rank gets the norm of all of them."""
    size, rank = comm.Get_size(), comm.Get_rank()
    everyone = [np.random.default_rng(r).standard_normal(3 + r) for r in range(size)]
    total = numpy_norm(everyone, norm_type)
    params = params_with_grads([everyone[rank]])
    got = nn.clip_grad_norm_(params, total / 3, norm_type=norm_type, comm=comm)
    assert got == pytest.approx(total, rel=1e-12)
    np.testing.assert_allclose(params[0].grad, everyone[rank] * (total / 3) / (total + 1e-6), rtol=1e-12)
    nan_on_last = [np.array([np.nan]) if rank == size - 1 else np.ones(1)]
    assert math.isnan(nn.grad_norm(params_with_grads(nan_on_last), norm_type, comm=comm))


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.world_sizes(2, 3, 4)
def test_ddp_with_clipping_matches_single_process(comm):
    ddp = DDP(test_fsdp.make_model(), comm)
    ref = test_fsdp.make_model()
    opt, ref_opt = SGD(list(ddp.parameters()), lr=0.5), SGD(list(ref.parameters()), lr=0.5)
    crit = nn.CrossEntropyLoss()
    for x, y in test_fsdp.batches(5):
        crit(ddp(test_fsdp.my_slice(comm, x)), test_fsdp.my_slice(comm, y)).backward()
        norm = ddp.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        crit(ref(x), y).backward()
        ref_norm = nn.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        assert ref_norm > MAX_NORM and norm == pytest.approx(ref_norm, rel=1e-10)
    for (name, a), (_, b) in zip(ddp.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("strategy", test_fsdp.STRATEGIES)
def test_fsdp_with_clipping_matches_single_process(comm, strategy, norm_type):
    """Shards of 3 ranks are uneven: the zero padding must not change the norm."""
    fsdp = FSDP(test_fsdp.make_model(), comm, strategy=strategy)
    ref = test_fsdp.make_model()
    opt, ref_opt = Adam(list(fsdp.parameters()), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in test_fsdp.batches(6):
        crit(fsdp(test_fsdp.my_slice(comm, x)), test_fsdp.my_slice(comm, y)).backward()
        norm = fsdp.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
        opt.step()
        opt.zero_grad()
        crit(ref(x), y).backward()
        ref_norm = nn.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
        assert ref_norm > MAX_NORM and norm == pytest.approx(ref_norm, rel=1e-10)
    test_fsdp.assert_matches(comm, fsdp, ref)


def test_fsdp_refuses_to_clip_in_the_middle_of_a_step(comm):
    fsdp = FSDP(test_fsdp.make_model(), comm)
    x, _ = next(test_fsdp.batches(1))
    fsdp(test_fsdp.my_slice(comm, x))  # forward without its backward
    with pytest.raises(RuntimeError, match=r"FSDP.clip_grad_norm_: micro-batches are in flight"):
        fsdp.clip_grad_norm_(1.0)


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("schedule", test_pipeline.SCHEDULES)
def test_pipeline_with_clipping_matches_single_process(comm, schedule):
    p, rank = comm.Get_size(), comm.Get_rank()
    chunks, num_stages = test_pipeline.split_model(comm, schedule)
    pipe = Pipeline(chunks if schedule == "interleaved" else chunks[0], comm, 3, schedule=schedule,
                    loss_fn=nn.CrossEntropyLoss())
    opt = SGD(list(pipe.parameters()), lr=test_pipeline.LR)
    ref = test_pipeline.Reference(num_stages)
    for t in range(test_pipeline.STEPS):
        x, y = test_pipeline.batch(t, 13)
        for c in chunks:
            c.zero_grad()
        pipe.step(x, y)
        norm = pipe.clip_grad_norm_(PIPELINE_MAX_NORM)
        opt.step()
        ref.grads(x, y)
        ref_norm = nn.clip_grad_norm_(ref.model.parameters(), PIPELINE_MAX_NORM)
        ref.opt.step()
        assert ref_norm > PIPELINE_MAX_NORM and norm == pytest.approx(ref_norm, rel=1e-10)
    test_pipeline.assert_stage_matches(chunks, ref, rank, p)


@pytest.mark.mpi_skip
def test_clip_accepts_one_parameter_large_orders_and_refuses_integer_grads():
    single = params_with_grads([np.array([3.0, 4.0])])[0]
    assert nn.clip_grad_norm_(single, 1.0) == pytest.approx(5.0)
    np.testing.assert_allclose(single.grad, np.array([3.0, 4.0]) / (5.0 + 1e-6))
    big = params_with_grads([np.array([2.0, -2.0, 1.0])])  # 2**1000 overflows without scaling
    assert nn.grad_norm(big, 1000) == pytest.approx(2.0 * 2 ** (1 / 1000), rel=1e-12)
    ints = params_with_grads([np.array([1, 2])])
    with pytest.raises(TypeError, match=r"clip_grad_norm_: gradients must be floating point: gradient 0 is int64"):
        nn.clip_grad_norm_(ints, 1.0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_complex_gradients_count_with_their_magnitude(comm, norm_type):
    grads = [np.array([3 + 4j, 0.5j]), np.array([-1.0 + 0j])]
    want = float(np.linalg.norm(np.abs(np.concatenate(grads)), ord=norm_type))
    assert nn.grad_norm(params_with_grads(grads), norm_type) == pytest.approx(want, rel=1e-12)
    if comm.Get_size() > 1:
        mine = params_with_grads([grads[0]] if comm.Get_rank() == 0 else [grads[1]] if comm.Get_rank() == 1 else [])
        assert nn.grad_norm(mine, norm_type, comm=comm) == pytest.approx(want, rel=1e-12)


def test_an_integer_gradient_on_one_rank_raises_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    grads = [np.array([1, 2])] if rank == size - 1 else [np.array([1.0, 2.0])]
    # The same message on every rank, naming the rank and its gradient.
    with pytest.raises(TypeError, match=rf"^clip_grad_norm_: gradients must be floating point: rank {size - 1}: gradient 0 is int64$"):
        nn.clip_grad_norm_(params_with_grads(grads), 1.0, comm=comm)
