"""FSDP mixed precision: param_dtype (gathered and computed in 16 bits) and reduce_dtype over float32 shards.

Reference: the ranks emulated in one process, rounding exactly where FSDP rounds: the weights gathered as
the shards rounded to the param dtype, each rank's gradient rounded to it (autograd gives a parameter's
gradient its dtype), their mean in float32 (or the 16-bit ring's rounding, within its bound)."""

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16, float16
from mpidist.optim import SGD
from mpidist.parallel.full_state import full_state_dict
from mpidist.parallel.fsdp import FSDP

IN, HIDDEN, OUT = 6, 10, 4
LR, STEPS, PER_RANK = 0.5, 3, 3


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng), nn.Tanh(), nn.Linear(HIDDEN, OUT, rng=rng))


def global_batch(step, n):
    rng = np.random.default_rng([17, step])
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, OUT, size=n)


def reference(size, dtype):
    """float32 masters; each step every emulated rank runs on the masters rounded to ``dtype`` and rounds its
    gradient to ``dtype``; the mean over ranks is taken in float32, rank by rank."""
    model = make_model()
    masters = [p.data.copy() for p in model.parameters()]
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        total = [np.zeros_like(m) for m in masters]
        for r in range(size):
            for p, m in zip(model.parameters(), masters):
                p.data = m.astype(dtype).astype(np.float32)
                p.grad = None
            part = slice(r * PER_RANK, (r + 1) * PER_RANK)
            F.cross_entropy(model(x[part]), y[part]).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad.astype(dtype).astype(np.float32)
        for m, t in zip(masters, total):
            m -= np.float32(LR) * (t / np.float32(size))
    return masters


def run_fsdp(comm, **kwargs):
    size, rank = comm.Get_size(), comm.Get_rank()
    fsdp = FSDP(make_model(), comm, **kwargs)
    opt = SGD(fsdp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(fsdp(x[part]), y[part]).backward()
        opt.step()
    assert all(p.dtype == np.float32 and (p.grad is None or p.grad.dtype == np.float32) for p in fsdp.parameters())
    return fsdp, list(full_state_dict(fsdp, all_ranks=True).values())


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [bfloat16, float16], ids=["bf16", "fp16"])
def test_param_dtype_gathers_16_bit_and_keeps_float32_shards(comm, dtype):
    """The gathered weights are the float32 shards rounded to ``dtype`` (checked inside a forward), and training
    equals the reference that rounds there and at the gradients (float32 sums: 1e-6; 2 ranks add exactly)."""
    fsdp, params = run_fsdp(comm, param_dtype=dtype)
    seen = []
    hook = fsdp.module[0].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.data.copy()))
    fsdp(np.zeros((1, IN), np.float32))
    hook.remove()
    assert seen[0].dtype == dtype
    np.testing.assert_array_equal(seen[0], params[0].astype(dtype))
    for got, want in zip(params, reference(comm.Get_size(), dtype)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.world_sizes(2, 4)
def test_reduce_dtype_bf16_tracks_the_float32_reduction(comm):
    """Gradients reduce-scattered as bfloat16 (the 16-bit ring): within bfloat16 rounding of the float32
    reduction's training (|difference| <= LR * STEPS * 2**-7 * the largest gradient, bounded by 1e-2 here)."""
    _, exact = run_fsdp(comm, param_dtype="bf16")
    _, narrow = run_fsdp(comm, param_dtype="bf16", reduce_dtype="bf16")
    for a, b in zip(narrow, exact):
        assert float(np.abs(a - b).max()) < 1e-2
    assert any(not np.array_equal(a, b) for a, b in zip(narrow, exact))  # it did round somewhere


def test_bad_precision_arguments_raise(comm):
    with pytest.raises(ValueError, match=r"FSDP: param_dtype: dtype must be float16, bfloat16 or float32 "
                                         r"\(got 'int8'\)"):
        FSDP(make_model(), comm, param_dtype="int8")
    with pytest.raises(ValueError, match=r"FSDP: param_dtype and reduce_dtype need a sharding strategy "
                                         r"\(got strategy='no_shard'"):
        FSDP(make_model(), comm, strategy="no_shard", param_dtype="bf16")


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("reduce_dtype", [None, "bf16"], ids=["reduce_fp32", "reduce_bf16"])
def test_hybrid_sharding_with_param_and_reduce_dtypes(comm, reduce_dtype):
    """Hybrid sharding (2 shard groups of 2): a 16-bit reduce-scatter within the group, then the float32 chunk
    averaged over the replicas; the reference rounds where FSDP rounds (float32 reduction: 1e-6; bfloat16 on the
    wire: 1e-2), and the shards are float32 everywhere."""
    _, params = run_fsdp(comm, strategy="hybrid_shard", shard_size=2, param_dtype="bf16", reduce_dtype=reduce_dtype)
    for got, want in zip(params, reference(comm.Get_size(), bfloat16)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 if reduce_dtype is None else 1e-2)
