"""Tests for mpidist.optim against textbook reference updates written here in plain numpy."""

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist import optim
from mpidist.optim import SGD, Adam, AdamW

STEPS = 6


def _params_and_grads(seed=0):
    rng = np.random.default_rng(seed)
    params = [nn.Parameter(rng.standard_normal((3, 4))), nn.Parameter(rng.standard_normal(5))]
    grads = [[rng.standard_normal(p.data.shape) for p in params] for _ in range(STEPS)]
    return params, grads


def ref_sgd(p, grads, lr, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0):
    """SGD as documented for torch.optim.SGD."""
    b = None
    for t, g in enumerate(grads, start=1):
        g = g + weight_decay * p
        if momentum:
            b = g if t == 1 else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        p = p - lr * g
    return p


def ref_adam(p, grads, lr, betas, eps, weight_decay, decoupled):
    """Adam/AdamW as in Kingma & Ba / Loshchilov & Hutter, with bias-corrected moments."""
    b1, b2 = betas
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p - lr * weight_decay * p
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def _run(opt_cls, kwargs, grads_by_step, params):
    opt = opt_cls(params, **kwargs)
    arrays = [p.data for p in params]
    for grads in grads_by_step:
        for p, g in zip(params, grads):
            p.grad = g.copy()
        opt.step()
    assert all(p.data is a for p, a in zip(params, arrays)), "step must update p.data in place"
    return opt


SGD_CASES = [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
             dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)]
ADAM_CASES = [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_reference(kwargs):
    params, grads = _params_and_grads()
    start = [p.data.copy() for p in params]
    _run(SGD, kwargs, grads, params)
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, ref_sgd(start[i], [g[i] for g in grads], **kwargs), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls, decoupled", [(Adam, False), (AdamW, True)])
@pytest.mark.parametrize("kwargs", ADAM_CASES)
def test_adam_matches_reference(cls, decoupled, kwargs):
    params, grads = _params_and_grads()
    start = [p.data.copy() for p in params]
    _run(cls, kwargs, grads, params)
    full = dict(dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0 if cls is Adam else 1e-2), **kwargs)
    for i, p in enumerate(params):
        ref = ref_adam(start[i], [g[i] for g in grads], decoupled=decoupled, **full)
        np.testing.assert_allclose(p.data, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls, kwargs", [(SGD, SGD_CASES[2]), (Adam, ADAM_CASES[1]), (AdamW, ADAM_CASES[1])])
def test_state_dict_resume_equals_uninterrupted(cls, kwargs):
    params, grads = _params_and_grads()
    _run(cls, kwargs, grads, params)

    resumed, _ = _params_and_grads()
    opt = _run(cls, kwargs, grads[:3], resumed)
    sd = opt.state_dict()
    saved = [p.data.copy() for p in resumed]
    opt.step()  # mutate the live state after saving; the saved copy must not change
    for p, s in zip(resumed, saved):
        p.data[...] = s
    fresh = cls(resumed, **dict(kwargs, lr=123.0))
    fresh.load_state_dict(sd)
    assert fresh.lr == kwargs["lr"]
    for step_grads in grads[3:]:
        for p, g in zip(resumed, step_grads):
            p.grad = g.copy()
        fresh.step()
    for p, q in zip(params, resumed):
        np.testing.assert_array_equal(p.data, q.data)


@pytest.mark.parametrize("cls, kwargs", [(SGD, SGD_CASES[2]), (SGD, SGD_CASES[3]), (SGD, SGD_CASES[0]),
                                         (Adam, ADAM_CASES[1]), (AdamW, ADAM_CASES[1])])
@pytest.mark.parametrize("block", [None, 5])  # the default, and updates split into blocks of 5 elements
def test_packs_with_missing_grads_mixed_dtypes_and_shared_buffers_match_the_reference(cls, kwargs, block, monkeypatch):
    """Parameters are updated in flat packs; each must still follow its own textbook update: a parameter whose
    grad is None on some steps keeps its state and its own step count (Adam's bias correction), float32 and
    float64 parameters pack apart, and parameters that are views of one buffer update through it."""
    if block is not None:
        monkeypatch.setattr(optim, "_BLOCK", block)
    rng = np.random.default_rng(1)
    shared = rng.standard_normal(12 + 7)
    params = [nn.Parameter(rng.standard_normal((3, 4))), nn.Parameter(rng.standard_normal(5)),
              nn.Parameter(rng.standard_normal((2, 3)).astype(np.float32)),
              nn.Parameter(shared[:12].reshape(3, 4)), nn.Parameter(shared[12:])]
    start = [p.data.copy() for p in params]
    arrays = [p.data for p in params]
    received = [[] for _ in params]
    opt = cls(params, **kwargs)
    for step in range(STEPS):
        for i, p in enumerate(params):
            if i == 1 and step % 2 or i == 4 and step == 2:  # no gradient this step (set_to_none)
                p.grad = None
                continue
            g = rng.standard_normal(p.data.shape).astype(p.data.dtype)
            p.grad = g.copy()
            received[i].append(g)
        opt.step()
    assert all(p.data is a for p, a in zip(params, arrays)), "step must update p.data in place"
    assert [opt.state[i]["step"] for i in range(len(params))] == [len(r) for r in received]
    assert [p.version for p in params] == [len(r) for r in received]
    for i, p in enumerate(params):
        if cls is SGD:
            want = ref_sgd(start[i], received[i], **kwargs)
        else:
            full = dict(dict(betas=(0.9, 0.999), eps=1e-8), **kwargs)
            want = ref_adam(start[i], received[i], decoupled=cls is AdamW, **full)
        tol = 1e-6 if p.data.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(p.data, want, rtol=tol, atol=tol, err_msg=f"parameter {i}")


def test_state_dict_layout():
    params, grads = _params_and_grads()
    sd = _run(Adam, {}, grads[:2], params).state_dict()
    assert set(sd["state"]) == {0, 1} and sd["state"][0]["step"] == 2
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["param_groups"] == [dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, params=[0, 1])]


def test_load_state_dict_errors():
    params, grads = _params_and_grads()
    sd = _run(Adam, {}, grads[:1], params).state_dict()
    sd["state"][0]["exp_avg"] = np.zeros((4, 3))
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] \(state_dict: \(4, 3\), parameter: \(3, 4\)\)"):
        Adam(params).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"group sizes differ \(optimizer: \[1\], state_dict: \[2\]\)"):
        Adam(params[:1]).load_state_dict(sd)


def test_params_without_grad_are_skipped_and_lr_is_settable():
    params, _ = _params_and_grads()
    before = [p.data.copy() for p in params]
    params[0].grad = np.ones_like(params[0].data)
    opt = SGD(params, lr=0.1)
    opt.lr = 0.5
    opt.step()
    np.testing.assert_allclose(params[0].data, before[0] - 0.5)
    np.testing.assert_array_equal(params[1].data, before[1])
    assert 1 not in opt.state
    grad = params[0].grad
    opt.zero_grad(set_to_none=False)
    assert params[0].grad is grad and not grad.any()
    opt.zero_grad()  # the default, as in PyTorch
    assert params[0].grad is None


def test_param_groups_have_their_own_hyperparameters():
    params, _ = _params_and_grads()
    for p in params:
        p.grad = np.ones_like(p.data)
    before = [p.data.copy() for p in params]
    opt = SGD([{"params": params[:1]}, {"params": params[1:], "lr": 1.0}], lr=0.1)
    opt.step()
    np.testing.assert_allclose(params[0].data, before[0] - 0.1)
    np.testing.assert_allclose(params[1].data, before[1] - 1.0)
    with pytest.raises(TypeError, match=r"unexpected param group option\(s\) \['lrr'\]"):
        SGD([{"params": params, "lrr": 1.0}], lr=0.1)
    with pytest.raises(ValueError, match="nesterov needs momentum > 0"):
        SGD(params, lr=0.1, nesterov=True)


def test_mlp_learns_xor_with_adam():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(400, 2)).astype(np.float32)
    x = x[np.abs(x).min(axis=1) > 0.1]  # a margin around the axes keeps the task cleanly separable
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).astype(np.int64)
    model = nn.Sequential(nn.Linear(2, 32, rng=rng), nn.GELU(), nn.Linear(32, 32, rng=rng), nn.ReLU(),
                          nn.Linear(32, 2, rng=rng))
    crit, opt = nn.CrossEntropyLoss(), Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    with nn.no_grad():
        accuracy = (model(x).data.argmax(axis=1) == y).mean()
    assert accuracy > 0.95, f"accuracy {accuracy:.3f}"


# -- learning-rate schedules ----------------------------------------------------------------------------
from mpidist.optim import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR, StepLR  # noqa: E402


def _lrs(make, steps=12, lrs=(0.1, 0.02)):
    """Rates of both groups at steps 0..steps-1 (two groups with different starting rates)."""
    params = [nn.Parameter(np.zeros(2)), nn.Parameter(np.zeros(3))]
    opt = SGD([{"params": [params[0]], "lr": lrs[0]}, {"params": [params[1]], "lr": lrs[1]}], lr=lrs[0])
    schedule = make(opt)
    seen = []
    for _ in range(steps):
        seen.append(schedule.get_last_lr())
        opt.step()
        schedule.step()
    return np.array(seen)


@pytest.mark.parametrize("make, formula", [
    (lambda o: StepLR(o, step_size=3, gamma=0.5), lambda b, t: b * 0.5 ** (t // 3)),
    (lambda o: LambdaLR(o, lambda t: 1 / (1 + t)), lambda b, t: b / (1 + t)),
    (lambda o: LinearLR(o, start_factor=0.25, total_iters=4), lambda b, t: b * (0.25 + 0.75 * min(t, 4) / 4)),
    (lambda o: CosineAnnealingLR(o, T_max=8, eta_min=0.001),
     lambda b, t: 0.001 + (b - 0.001) * (1 + np.cos(np.pi * min(t, 8) / 8)) / 2),
])
def test_schedules_follow_their_formula(make, formula):
    got = _lrs(make)
    want = np.array([[formula(b, t) for b in (0.1, 0.02)] for t in range(12)])
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_warmup_then_cosine():
    def make(opt):
        warm = LinearLR(opt, start_factor=0.1, total_iters=3)
        cos = CosineAnnealingLR(opt, T_max=6)
        return SequentialLR(opt, [warm, cos], milestones=[3])
    got = _lrs(make, steps=10, lrs=(0.1, 0.1))[:, 0]
    want = [0.1 * (0.1 + 0.9 * t / 3) for t in range(3)] + \
           [0.1 * (1 + np.cos(np.pi * min(t, 6) / 6)) / 2 for t in range(7)]
    np.testing.assert_allclose(got, want, rtol=1e-14)


def test_schedule_resumes_from_its_state_dict():
    params = [nn.Parameter(np.zeros(2))]
    opt = Adam(params, lr=0.1)
    schedule = CosineAnnealingLR(opt, T_max=10)
    for _ in range(4):
        schedule.step()
    saved_opt, saved = opt.state_dict(), schedule.state_dict()
    fresh_opt = Adam([nn.Parameter(np.zeros(2))], lr=0.5)
    fresh = CosineAnnealingLR(fresh_opt, T_max=10)
    fresh_opt.load_state_dict(saved_opt)
    fresh.load_state_dict(saved)
    for _ in range(3):
        schedule.step()
        fresh.step()
        assert fresh.get_last_lr() == schedule.get_last_lr()


def test_schedule_arguments_are_checked_with_their_values():
    opt = SGD([nn.Parameter(np.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"StepLR: step_size must be an int >= 1 \(got 0\)"):
        StepLR(opt, step_size=0)
    with pytest.raises(ValueError, match=r"LinearLR: start_factor must be in \(0, 1\] \(got 0\)"):
        LinearLR(opt, start_factor=0)
    with pytest.raises(ValueError, match=r"CosineAnnealingLR: T_max must be an int >= 1 \(got 2.5\)"):
        CosineAnnealingLR(opt, T_max=2.5)
    with pytest.raises(ValueError, match=r"SequentialLR: milestones must be 1 increasing ints >= 1 \(got \[0\]\)"):
        SequentialLR(opt, [StepLR(opt, 1), StepLR(opt, 2)], milestones=[0])
    with pytest.raises(TypeError, match=r"LambdaLR: lr_lambda must be callable \(got float\)"):
        LambdaLR(opt, 0.5)
    with pytest.raises(TypeError, match=r"StepLR: optimizer must be an mpidist.optim.Optimizer \(got list\)"):
        StepLR([], 2)


@pytest.mark.parametrize("param_dtype, grad_dtype", [("float64", "float64"), ("float32", "float32"),
                                                     ("float32", "float16"), ("float64", "float32")])
@pytest.mark.parametrize("block", [None, 64])  # one block, and eight
def test_adam_in_place_update_is_bitwise_the_plain_expression(param_dtype, grad_dtype, block, monkeypatch):
    """The scratch-array update must round exactly like the textbook expression, dtype by dtype."""
    if block is not None:
        monkeypatch.setattr(optim, "_BLOCK", block)
    import math
    rng = np.random.default_rng(3)
    p = nn.Parameter(rng.standard_normal(500).astype(param_dtype))
    q, m, v = p.data.copy(), np.zeros(500, param_dtype), np.zeros(500, param_dtype)
    opt = Adam([p], lr=1e-2)
    with np.errstate(divide="ignore", over="ignore"):
        for t in range(1, 6):
            g = rng.standard_normal(500).astype(grad_dtype)
            p.grad = g.copy()
            opt.step()
            m *= 0.9
            m += (1 - 0.9) * g
            v *= 0.999
            v += (1 - 0.999) * g * g
            q -= (1e-2 / (1 - 0.9 ** t)) * m / (v ** 0.5 / math.sqrt(1 - 0.999 ** t) + 1e-8)
    np.testing.assert_array_equal(p.data, q)


def test_two_schedules_on_one_optimizer_refuse_to_overwrite_each_other():
    opt = SGD([nn.Parameter(np.zeros(1))], lr=np.float32(0.1))  # a numpy rate is stored as a float
    warm = LinearLR(opt, start_factor=0.5, total_iters=2)
    assert type(warm.base_lrs[0]) is float
    decay = StepLR(opt, step_size=1)
    with pytest.raises(RuntimeError, match=r"2 schedules drive this optimizer \(LinearLR, StepLR\).*SequentialLR"):
        decay.step()
    both = SequentialLR(opt, [warm, decay], milestones=[2])
    both.step()  # fine: the children are run by it
    with pytest.raises(RuntimeError, match=r"LinearLR.step: this schedule is run by a SequentialLR"):
        warm.step()

    # A schedule the user dropped no longer counts, even one a reference cycle keeps alive for now;
    # a copy of an optimizer has no schedules, and an optimizer with a schedule still pickles.
    import copy
    import pickle
    fresh = SGD([nn.Parameter(np.zeros(1))], lr=0.1)
    dropped = StepLR(fresh, step_size=1)
    dropped.cycle = dropped
    del dropped
    StepLR(fresh, step_size=1).step()
    StepLR(copy.deepcopy(fresh), step_size=1).step()
    assert pickle.loads(pickle.dumps(fresh)).param_groups[0]["lr"] == fresh.param_groups[0]["lr"]


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_16_bit_parameters_are_updated_through_float32_master_weights(cls):
    # Why (textbook Adam's first step in plain numpy float16): the squared-gradient average of a small
    # gradient underflows to 0, so does eps, and the step is infinite. The optimizers used to refuse 16-bit
    # parameters for this; now they update a float32 master and round it into the parameter
    # (tests/test_precision.py checks the rounding bitwise).
    with np.errstate(all="ignore"):
        g = np.full(3, 1e-4, np.float16)
        m, v = np.float16(0.1) * g, np.float16(0.001) * g * g
        assert not np.isfinite((m / np.float16(0.1)) / (np.sqrt(v / np.float16(0.001)) + np.float16(1e-8))).any()
    p, ref = nn.Parameter(np.ones(3, np.float16)), nn.Parameter(np.ones(3, np.float32))
    opt, ref_opt = cls([p], lr=0.1), cls([ref], lr=0.1)
    p.grad, ref.grad = g.copy(), g.astype(np.float32)
    opt.step()
    ref_opt.step()
    assert np.isfinite(p.data).all() and p.data.dtype == np.float16
    np.testing.assert_array_equal(p.data, ref.data.astype(np.float16))


@pytest.mark.parametrize("cls, kwargs", [(SGD, SGD_CASES[0]), (SGD, SGD_CASES[1]), (SGD, SGD_CASES[2]),
                                         (SGD, SGD_CASES[3]), (Adam, ADAM_CASES[1]), (AdamW, ADAM_CASES[1])])
@pytest.mark.parametrize("block", [None, 5])
def test_held_arrays_keep_their_values_and_the_update_is_bitwise_the_in_place_one(cls, kwargs, block, monkeypatch):
    """Copy-on-write: arrays made read-only by ``optim.hold`` (what an elastic commit does instead of copying)
    keep the values they had, the parameters move to other buffers, and every step gives bit for bit what an
    optimizer that never saw a hold gives; buffers given back by ``recycle`` are reused (no new ones in steady
    state); a parameter without a gradient stays in its held buffer, which recycle must not hand out."""
    if block is not None:
        monkeypatch.setattr(optim, "_BLOCK", block)
    rng = np.random.default_rng(3)
    shapes = [(3, 4), (5,), (2, 3)]
    steps = [[rng.standard_normal(s) for s in shapes] for _ in range(12)]
    starts = [rng.standard_normal(s) for s in shapes]
    plain_params = [nn.Parameter(a.copy()) for a in starts]
    held_params = [nn.Parameter(a.copy()) for a in starts]
    plain, held = cls(plain_params, **kwargs), cls(held_params, **kwargs)
    kept = []  # (snapshot arrays, their values when held), the last two, as an elastic State keeps them
    owners = set()
    for k, grads in enumerate(steps):
        for params in (plain_params, held_params):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if (i == 1 and k in (4, 5)) else g.copy()  # parameter 1 skips steps 4 and 5
        plain.step()
        held.step()
        for p, q in zip(plain_params, held_params):
            np.testing.assert_array_equal(p.data, q.data)
        for arrays, values in kept:
            for a, v in zip(arrays, values):
                np.testing.assert_array_equal(a, v)
        arrays = [optim.hold(q.data) for q in held_params]
        arrays += [optim.hold(v) for s in held.state.values() for v in s.values() if hasattr(v, "shape")]
        if k >= 7:  # steady state: every parameter has had a gradient since the skip
            owners.update(id(optim._owner(a)) for a in arrays)
        kept.append((arrays, [a.copy() for a in arrays]))
        if len(kept) > 2:
            dropped, _ = kept.pop(0)
            held.recycle(dropped, [a for arrays, _ in kept for a in arrays])
    with pytest.raises(ValueError, match="read-only"):
        held_params[0].data += 1  # held: anything but the optimizer writing into it fails loudly
    # parameters and each state live in one flat buffer per pack (Adam: parameter 1, two steps behind, packs
    # alone); in steady state three buffers take turns for each (live + two kept): recycled ones are reused
    live = {id(optim._owner(a)) for a in arrays}
    assert len(owners) == 3 * len(live), (len(owners), len(live))


@pytest.mark.parametrize("kwargs", SGD_CASES[1:])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("block", [None, 64])  # one block per parameter, and several
@pytest.mark.parametrize("shared", [False, True])  # parameters as separate arrays, or views of one buffer
def test_sgd_momentum_update_is_bitwise_the_plain_expression(kwargs, dtype, block, shared, monkeypatch):
    """The blocked momentum update (gradients read where they lie) must round exactly like PyTorch's
    expressions, evaluated here whole-array in numpy."""
    if block is not None:
        monkeypatch.setattr(optim, "_BLOCK", block)
    rng = np.random.default_rng(4)
    sizes = [300, 7, 130]
    start = rng.standard_normal(sum(sizes)).astype(dtype)
    if shared:
        params = [nn.Parameter(a) for a in np.split(start.copy(), np.cumsum(sizes)[:-1])]
    else:
        params = [nn.Parameter(a.copy()) for a in np.split(start, np.cumsum(sizes)[:-1])]
    refs = [p.data.copy() for p in params]
    bufs = [None] * len(params)
    opt = SGD(params, **kwargs)
    lr, mom, wd = kwargs["lr"], kwargs["momentum"], kwargs.get("weight_decay", 0.0)
    damp, nesterov = kwargs.get("dampening", 0.0), kwargs.get("nesterov", False)
    for t in range(5):
        grads = [rng.standard_normal(p.data.shape).astype(dtype) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.copy()
        opt.step()
        for i, g in enumerate(grads):
            d = g + wd * refs[i] if wd else g
            if t == 0:
                bufs[i] = d.copy()
            else:
                bufs[i] *= mom
                bufs[i] += (1 - damp) * d
            d = d + mom * bufs[i] if nesterov else bufs[i]
            refs[i] -= d * lr
    for p, q in zip(params, refs):
        np.testing.assert_array_equal(p.data, q)


def test_spare_buffers_stay_bounded_when_the_packs_keep_changing():
    """Parameters without a gradient in random steps change the packs every step: buffers of released
    snapshots must not pile up in the pool (only the sizes of packs in use are kept)."""
    rng = np.random.default_rng(5)
    params = [nn.Parameter(rng.standard_normal(500)) for _ in range(8)]
    model_bytes = sum(p.data.nbytes for p in params)
    for cls, kwargs in ((SGD, dict(lr=0.1, momentum=0.9)), (Adam, dict(lr=1e-2))):
        opt = cls(params, **kwargs)
        kept = []
        for step in range(120):
            for p in params:
                p.grad = rng.standard_normal(500) if rng.random() < 0.5 else None
            opt.step()
            arrays = [optim.hold(p.data) for p in params]
            arrays += [optim.hold(v) for s in opt.state.values() for v in s.values() if hasattr(v, "shape")]
            kept.append(arrays)
            if len(kept) > 2:
                opt.recycle(kept.pop(0), [a for arrays in kept for a in arrays])
        pooled = sum(b.nbytes for free in opt._spares._free.values() for b in free)
        assert pooled <= 6 * model_bytes, (cls.__name__, pooled, model_bytes)
        for p in params:
            p.data = p.data.copy()  # writable again for the next optimizer


def test_numpy_scalar_hyperparameters_round_like_the_plain_expressions():
    """An lr that is a numpy float64 (a schedule written with np.minimum, say) promotes the plain expressions
    to float64: the update must do the same (the blocked float32 path is for Python numbers only)."""
    rng = np.random.default_rng(6)
    p = nn.Parameter(rng.standard_normal(300).astype(np.float32))
    ref, buf = p.data.copy(), None
    lr, mom, wd = np.float64(0.03), np.float64(0.9), np.float64(0.01)
    opt = SGD([p], lr=lr, momentum=mom, weight_decay=wd)
    for t in range(4):
        g = rng.standard_normal(300).astype(np.float32)
        p.grad = g.copy()
        opt.step()
        d = g + wd * ref
        if t == 0:
            buf = d.astype(np.float32)
        else:
            buf *= mom
            buf += (1 - 0.0) * d
        ref -= buf * lr
    np.testing.assert_array_equal(p.data, ref)


def test_subclasses_with_their_own_update_are_not_copy_on_write():
    class Mine(SGD):
        def _update(self, pack, group):
            for p in pack.params:
                p.data -= group["lr"] * p.grad

    class Declared(SGD):
        copy_on_write = True

        def _update(self, pack, group):
            super()._update(pack, group)

    assert SGD.copy_on_write and Adam.copy_on_write and AdamW.copy_on_write
    assert not Mine.copy_on_write and Declared.copy_on_write


def test_a_replaced_state_dict_is_used_by_the_next_step():
    """Replacing ``opt.state`` (as checkpoint.load does) after steps must not leave the packs' cached flat
    state in use: the continuation equals an optimizer built fresh from the same state."""
    rng = np.random.default_rng(7)
    start = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(6)]
    a, b = nn.Parameter(start.copy()), nn.Parameter(start.copy())
    opt_a = SGD([a], lr=0.1, momentum=0.9)
    for g in grads[:3]:
        a.grad = g.copy()
        opt_a.step()
    saved = opt_a.state_dict()
    saved_value = a.data.copy()
    a.grad = grads[3].copy()
    opt_a.step()  # moves on: its pack caches this step's momentum
    a.data[...] = saved_value
    opt_a.state = {int(i): {k: (v.copy() if hasattr(v, "copy") else v) for k, v in s.items()}
                   for i, s in saved["state"].items()}
    b.data[...] = saved_value
    opt_b = SGD([b], lr=0.1, momentum=0.9)
    opt_b.load_state_dict(saved)
    for g in grads[3:]:
        a.grad, b.grad = g.copy(), g.copy()
        opt_a.step()
        opt_b.step()
    np.testing.assert_array_equal(a.data, b.data)
