"""FSDP mixed precision: param_dtype (gathered and computed in 16 bits) and reduce_dtype over float32 shards.

Reference: the ranks emulated in one process, rounding exactly where FSDP rounds: the weights gathered as
the shards rounded to the param dtype, each rank's gradient rounded to it (autograd gives a parameter's
gradient its dtype), their mean in float32 (its sums exact, asserted: MPI's reduce-scatter order cannot show)
or in the 16-bit ring's order and roundings, then over hybrid sharding's replicas. Every test is bitwise
(SimComm 2/4, mpiexec -n 2/4)."""

import ml_dtypes
import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16, float16
from mpidist.optim import SGD
from mpidist.parallel.full_state import full_state_dict
from mpidist.parallel.fsdp import FSDP
from mpidist.ring16 import private_comm

IN, HIDDEN, OUT = 6, 10, 4
LR, STEPS, PER_RANK = 0.5, 3, 3


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng), nn.Tanh(), nn.Linear(HIDDEN, OUT, rng=rng))


def global_batch(step, n):
    rng = np.random.default_rng([17, step])
    return rng.standard_normal((n, IN)).astype(np.float32), rng.integers(0, OUT, size=n)


def exact_sum_in_float32(values, dtype):
    """Whether every partial sum of ``values`` (the ranks' gradients, 16-bit ``dtype`` values held as float32,
    stacked on axis 0) is exact in float32, so that any summation order gives the same bits.

    A ``dtype`` value is a multiple of its unit in the last place; every partial sum is then a multiple of the
    smallest such unit U among the values and at most the sum S of their magnitudes, and float32 holds every
    multiple of U up to 2**24 * U exactly."""
    info = ml_dtypes.finfo(dtype) if dtype == bfloat16 else np.finfo(dtype)
    wide = values.astype(np.float64)
    _, exponent = np.frexp(wide)
    ulp = np.maximum(np.ldexp(1.0, exponent - (info.nmant + 1)), float(info.smallest_subnormal))
    smallest = np.where(wide != 0, ulp, np.inf).min(axis=0)
    return bool((np.abs(wide).sum(axis=0) <= 2.0 ** 24 * smallest).all())


def ring_mean(flats, shard_numel, dtype):
    """Return the 16-bit ring's mean (ring16.ring_reduce_scatter_16) of the ranks' flat gradients ``flats``
    (float32 holding 16-bit values, padded to ``len(flats)`` chunks of ``shard_numel``). Chunk c, owned by rank
    c: rank c + 1's value travels right, each rank adds what arrives (rounded to ``dtype`` for the message) to
    its own in float32, rank c adds last; then the mean in float32, rounded to ``dtype`` once."""
    n = len(flats)
    chunks = [[f[c * shard_numel:(c + 1) * shard_numel] for c in range(n)] for f in flats]
    out = []
    for c in range(n):
        acc = chunks[(c + 1) % n][c].copy()
        for k in range(2, n + 1):
            acc = chunks[(c + k) % n][c] + acc.astype(dtype).astype(np.float32)
        out.append((acc / np.float32(n)).astype(dtype).astype(np.float32))
    return np.concatenate(out)


def reference(size, dtype, reduce_dtype=None, units=None, shard_size=None):
    """float32 masters; each step every emulated rank runs on the masters rounded to ``dtype`` and rounds its
    gradient to ``dtype`` (autograd gives a parameter's gradient its dtype); the ranks' gradients are reduced
    where and as FSDP reduces them: over each shard group of ``shard_size`` consecutive ranks (default: all) a
    float32 mean (its sum exact, asserted, so MPI's order does not matter) or, with a 16-bit ``reduce_dtype``,
    the ring's order and roundings on each unit's flat gradient (``units``: FSDP.units(), padded to equal
    shards); then the float32 mean over the replicas (two: one addition, whatever the order)."""
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    masters = {name: p.data.copy() for name, p in model.named_parameters()}
    k = size if shard_size is None else shard_size
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        grads = []  # per rank: name -> its gradient, a 16-bit value held in float32
        for r in range(size):
            for name, p in model.named_parameters():
                p.data = masters[name].astype(dtype).astype(np.float32)
                p.grad = None
            part = slice(r * PER_RANK, (r + 1) * PER_RANK)
            F.cross_entropy(model(x[part]), y[part]).backward()
            grads.append({name: p.grad.astype(dtype).astype(np.float32) for name, p in model.named_parameters()})
        group_means = []  # per shard group: name -> the group's mean as FSDP's shard grads hold it (float32)
        for g in range(size // k):
            members = grads[g * k:(g + 1) * k]
            if reduce_dtype is None:
                mean = {}
                for name in names:
                    stack = np.stack([m[name] for m in members])
                    assert exact_sum_in_float32(stack, dtype), name
                    mean[name] = stack.sum(axis=0) / np.float32(k)
            else:
                mean = {}
                for unit in (u for u in units if u.params):
                    padded = unit.shard_numel * k
                    flats = [np.zeros(padded, np.float32) for _ in members]
                    for flat, m in zip(flats, members):
                        flat[:unit.numel] = np.concatenate([m[name].reshape(-1) for name in unit.params])
                    flat = ring_mean(flats, unit.shard_numel, reduce_dtype)
                    offset = 0
                    for name in unit.params:
                        mean[name] = flat[offset: offset + masters[name].size].reshape(masters[name].shape)
                        offset += masters[name].size
            group_means.append(mean)
        for name in names:
            total = group_means[0][name]
            for mean in group_means[1:]:
                total = total + mean[name]
            masters[name] -= np.float32(LR) * (total / np.float32(len(group_means)))
    return list(masters.values())


def run_fsdp(comm, before=None, **kwargs):
    """Train FSDP(**kwargs) ``STEPS`` steps (``before(fsdp)`` first); return it and its full float32 state."""
    size, rank = comm.Get_size(), comm.Get_rank()
    fsdp = FSDP(make_model(), comm, **kwargs)
    if before is not None:
        before(fsdp)
    opt = SGD(fsdp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step, PER_RANK * size)
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(fsdp(x[part]), y[part]).backward()
        opt.step()
    assert all(p.dtype == np.float32 and (p.grad is None or p.grad.dtype == np.float32) for p in fsdp.parameters())
    return fsdp, list(full_state_dict(fsdp, all_ranks=True).values())


def assert_bitwise(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == np.float32
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [bfloat16, float16], ids=["bf16", "fp16"])
def test_param_dtype_gathers_16_bit_and_keeps_float32_shards(comm, dtype):
    """The gathered weights are the float32 shards rounded to ``dtype`` (checked inside a forward), and training
    equals, bitwise, the reference that rounds there and at the gradients and averages in float32."""
    fsdp, params = run_fsdp(comm, param_dtype=dtype)
    seen = []
    hook = fsdp.module[0].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.data.copy()))
    fsdp(np.zeros((1, IN), np.float32))
    hook.remove()
    assert seen[0].dtype == dtype
    np.testing.assert_array_equal(seen[0], params[0].astype(dtype))
    assert_bitwise(params, reference(comm.Get_size(), dtype))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [bfloat16, float16], ids=["bf16", "fp16"])
def test_16_bit_reduce_dtype_equals_the_rings_order_and_roundings(comm, dtype):
    """Gradients reduce-scattered in ``dtype`` (the 16-bit ring, float32 accumulation): bitwise the reference
    that sums each chunk in the ring's order and rounds each message to ``dtype``; and not the float32 mean's
    training (so the reference's ring is not the float32 reduction under another name)."""
    fsdp, params = run_fsdp(comm, param_dtype=dtype, reduce_dtype=dtype)
    want = reference(comm.Get_size(), dtype, reduce_dtype=dtype, units=fsdp.units)
    assert_bitwise(params, want)
    assert any(not np.array_equal(a, b) for a, b in zip(want, reference(comm.Get_size(), dtype)))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [bfloat16, float16], ids=["bf16", "fp16"])
def test_16_bit_reduce_scatter_is_in_flight_after_the_units_gradients_are_final(comm, dtype):
    """The last unit's 16-bit reduce-scatter, started when its last gradient is final, is still in flight when
    that gradient's later post-accumulate-grad hook runs (as the float32 one is: the rest of backward overlaps
    it), in every step; FSDP finishes it where it waits for the float32 one, bitwise the ring reference."""
    in_flight = []  # per step: whether the ring had completed when the hook after FSDP's saw it started

    def watch(fsdp):
        last = fsdp.units[-1].label
        units = {u.label: u for u in fsdp._param_units}  # FSDP's lifecycle objects: their reduction in flight

        def after_fsdps_hook(param):
            reduction = units[last].reduction
            if reduction is not None and len(in_flight) < fsdp._syncs:
                in_flight.append(reduction.handle.done())
        for p in fsdp.module[-1].parameters():
            p.register_post_accumulate_grad_hook(after_fsdps_hook)  # registered after FSDP's: runs after it

    fsdp, params = run_fsdp(comm, before=watch, param_dtype=dtype, reduce_dtype=dtype)
    assert in_flight == [False] * STEPS
    assert_bitwise(params, reference(comm.Get_size(), dtype, reduce_dtype=dtype, units=fsdp.units))


@pytest.mark.world_sizes(2, 4)
def test_16_bit_reduce_names_its_rings_communicator_for_elastic(comm):
    """The 16-bit ring runs on the shard group's private duplicate (ring16.private_comm), made when FSDP is built
    and listed in communicators() (mpidist.elastic revokes those after a failure: a ring blocked on a duplicate
    nobody revokes would wait forever); a float32 reduce_dtype makes none."""
    fsdp = FSDP(make_model(), comm, param_dtype="bf16", reduce_dtype="bf16")
    ring_comm = private_comm(fsdp.shard_comm)  # FSDP made it: local now
    assert ring_comm is not comm and fsdp.communicators() == (ring_comm,)
    assert FSDP(make_model(), comm, param_dtype="bf16").communicators() == ()


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
def test_16_bit_parameters_without_a_reduce_dtype_name_their_rings_communicator(comm, dtype):
    """A 16-bit model wrapped without reduce_dtype reduces in its own 16 bits: the ring's duplicate is made when
    FSDP is built (not inside backward, where it was once made and never listed) and listed for mpidist.elastic."""
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng, dtype=dtype), nn.Tanh(),
                          nn.Linear(HIDDEN, OUT, rng=rng, dtype=dtype))
    fsdp = FSDP(model, comm)
    ring_comm = private_comm(fsdp.shard_comm)
    assert ring_comm is not comm and fsdp.communicators() == (ring_comm,)
    x, y = global_batch(0, comm.Get_size())
    mine = slice(comm.Get_rank(), comm.Get_rank() + 1)
    F.cross_entropy(fsdp(x[mine].astype(dtype)), y[mine]).backward()
    assert private_comm(fsdp.shard_comm) is ring_comm   # backward made no other


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
    """Hybrid sharding (2 shard groups of 2 consecutive ranks): the reduce-scatter within the group (float32 or
    the 16-bit ring), then the float32 chunk averaged over the replicas; bitwise the reference that reduces in
    the same groups, order and roundings, and the shards are float32 everywhere."""
    fsdp, params = run_fsdp(comm, strategy="hybrid_shard", shard_size=2, param_dtype="bf16", reduce_dtype=reduce_dtype)
    assert_bitwise(params, reference(comm.Get_size(), bfloat16, reduce_dtype=None if reduce_dtype is None else bfloat16,
                                     units=fsdp.units, shard_size=2))
