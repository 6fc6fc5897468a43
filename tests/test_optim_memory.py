"""The optimizers' transient memory: a step's scratch is a few blocks whatever the model's size."""

import tracemalloc

import numpy as np
import pytest

from mpidist import nn, optim
from mpidist.optim import _BLOCK


def _model(rng):
    """Parameters of 40 blocks in all, each its own array (gradients not back to back): large ones, a
    block's tail, and small ones that the update gathers into one block."""
    shapes = [(8 * _BLOCK,), (2, 5 * _BLOCK), (_BLOCK + 17,), (300, 300)] * 2 + [(7,), (64, 3), (1000,)] * 4
    params = [nn.Parameter(rng.standard_normal(s)) for s in shapes]
    for p in params:
        p.grad = rng.standard_normal(p.data.shape)
    return params


def _step_bytes(opt):
    """Return (peak, retained) bytes that ``opt.step()`` allocates, numpy arrays included (tracemalloc)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        opt.step()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before, current - before


@pytest.mark.parametrize("make", [
    lambda ps: optim.Adam(ps, lr=1e-3),
    lambda ps: optim.Adam(ps, lr=1e-3, weight_decay=0.1),   # L2: g + wd * p, block by block
    lambda ps: optim.AdamW(ps, lr=1e-3, weight_decay=0.1),  # decoupled: p *= 1 - lr * wd, block by block
], ids=["adam", "adam_l2", "adamw"])
def test_adam_step_allocates_a_few_blocks_whatever_the_model_size(make):
    params = _model(np.random.default_rng(0))
    model_bytes = sum(p.data.nbytes for p in params)
    bound = 8 * _BLOCK * 8  # eight float64 blocks: the scratch of one pack, far below the model
    assert model_bytes > 4 * bound
    opt = make(params)
    # The first step allocates the two moments (2 x the model), and nothing model-sized besides.
    peak, retained = _step_bytes(opt)
    assert peak < 2 * model_bytes + bound, (peak, model_bytes, bound)
    assert retained < 2 * model_bytes + bound, (retained, model_bytes, bound)
    peak, retained = _step_bytes(opt)
    assert peak < bound, (peak, bound)


def test_blocked_adamw_matches_the_plain_expressions():
    """The block-by-block update equals PyTorch's AdamW written as whole-array expressions, bit for bit."""
    rng = np.random.default_rng(1)
    params = _model(rng)
    ref = [p.data.copy() for p in params]
    m = [np.zeros_like(r) for r in ref]
    v = [np.zeros_like(r) for r in ref]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
    opt = optim.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    for t in (1, 2):
        grads = [rng.standard_normal(r.shape) for r in ref]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        c1, c2 = lr / (1 - b1 ** t), np.sqrt(1 - b2 ** t)
        for i, g in enumerate(grads):
            ref[i] = ref[i] * (1 - lr * wd)
            m[i] = m[i] * b1 + (1 - b1) * g
            v[i] = v[i] * b2 + (1 - b2) * g * g
            ref[i] = ref[i] - (m[i] * c1) / (np.sqrt(v[i]) / c2 + eps)
    for p, r in zip(params, ref):
        np.testing.assert_array_equal(p.data, r)


def test_master_weights_cast_one_gradient_at_a_time():
    """bfloat16 parameters: the float32 copy of a gradient lives only during its own parameter's update."""
    from mpidist.nn.precision import bfloat16
    rng = np.random.default_rng(2)
    params = [nn.Parameter(rng.standard_normal(4 * _BLOCK).astype(bfloat16)) for _ in range(12)]
    for p in params:
        p.grad = rng.standard_normal(p.data.shape).astype(bfloat16)
    opt = optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    opt.step()  # the first step makes the masters and moments: 12 bytes per element
    largest = 4 * _BLOCK * 4  # one parameter's float32 gradient
    bound = largest + 8 * _BLOCK * 4
    assert 12 * largest > 3 * bound
    peak, retained = _step_bytes(opt)
    assert peak < bound, (peak, bound)
    assert retained < bound, (retained, bound)
