"""Mixed precision: the fp32 ops, the policy, and float32 master weights in the optimizers.

References: float64 numpy (with the tolerance one 16-bit rounding allows), and float32 training written here
that rounds exactly where the policy rounds (bitwise)."""

import math

import numpy as np
import pytest

import mpidist.nn as nn
import mpidist.nn.functional as F
from mpidist.nn.autograd import make_result
from mpidist.nn.precision import (FP32_OPS, Policy, apply_policy, as_dtype, bfloat16, float16, float32, fp32_op,
                                  grads_as, input_dtypes, is_floating, is_low_precision, upcast)
from mpidist.optim import SGD, Adam, AdamW

LOW = [pytest.param(float16, id="float16"), pytest.param(bfloat16, id="bfloat16")]
# One rounding to the dtype: half a unit in the last place, relative (float16: 11 bits, bfloat16: 8 bits).
HALF_ULP = {float16: 2.0 ** -11, bfloat16: 2.0 ** -8}


def _round(a, dtype):
    """Round float64/float32 values to ``dtype`` and back to float64."""
    return np.asarray(a).astype(dtype).astype(np.float64)


def _close_to_one_rounding(out, ref, dtype, atol=0.0):
    """Whether ``out`` is within one rounding of ``ref`` (plus float32 arithmetic's own error, far smaller)."""
    out = np.asarray(out).astype(np.float64)
    atol = max(atol, 2.0 ** -25 if dtype == float16 else 0.0)  # float16's subnormals have absolute steps
    return np.all(np.abs(out - ref) <= 1.01 * HALF_ULP[dtype] * np.abs(ref) + atol)


@pytest.mark.parametrize("dtype, floating", [(bfloat16, True), (float16, True), (float32, True),
                                             (np.float64, True), (np.complex64, False), (np.int32, False),
                                             (np.uint16, False), (np.bool_, False), (np.void, False)])
def test_is_floating_is_real_floating_bfloat16_included(dtype, floating):
    assert is_floating(np.dtype(dtype)) is floating


def test_as_dtype_names_and_refusals():
    assert as_dtype("bf16") == bfloat16 and as_dtype("float16") == float16 and as_dtype(np.float32) == float32
    assert is_low_precision(bfloat16) and is_low_precision(float16) and not is_low_precision(float32)
    with pytest.raises(ValueError, match=r"Policy: param_dtype: dtype must be float16, bfloat16 or float32 "
                                         r"\(got 'float64'\)"):
        Policy("float64")
    with pytest.raises(ValueError, match=r"Policy: compute_dtype: .*\(got 'int8'\)"):
        Policy("bf16", "int8")
    with pytest.raises(TypeError, match=r"apply_policy: policy must be an mpidist.nn.precision.Policy \(got str\)"):
        apply_policy(nn.Linear(2, 2), "bf16")


def test_fp32_ops_are_the_documented_ones():
    for name in FP32_OPS:
        assert getattr(F, name).__wrapped__ is not None, name  # decorated with fp32_op


@pytest.mark.parametrize("dtype", LOW)
def test_reductions_accumulate_in_float32(dtype):
    # 4096 values near 1: a bfloat16 running sum stops growing at 256 (256 + 1 rounds to 256); numpy's float16
    # sum already accumulates in float32. The float32 sum rounded once is within half a unit in the last place.
    rng = np.random.default_rng(0)
    x64 = _round(1 + 0.01 * rng.standard_normal((2, 4096)), dtype)
    x = nn.Tensor(x64.astype(dtype), requires_grad=True)
    for op, ref in ((F.sum, x64.sum(axis=-1)), (F.mean, x64.mean(axis=-1)), (F.var, x64.var(axis=-1))):
        out = op(x, axis=-1)
        assert out.dtype == dtype
        assert _close_to_one_rounding(out.data, ref, dtype), (op.__name__, out.data, ref)
    out = F.sum(x)
    out.backward(np.ones((), dtype))
    assert x.grad.dtype == dtype and np.all(x.grad == 1)


@pytest.mark.parametrize("dtype", LOW)
def test_softmax_norms_attention_compute_in_float32_and_round_once(dtype):
    rng = np.random.default_rng(1)
    z64 = _round(4 * rng.standard_normal((3, 64)), dtype)
    z = nn.Tensor(z64.astype(dtype))
    e = np.exp(z64 - z64.max(axis=-1, keepdims=True))
    softmax_ref = e / e.sum(axis=-1, keepdims=True)
    assert F.softmax(z).dtype == dtype
    assert _close_to_one_rounding(F.softmax(z).data, softmax_ref, dtype, atol=1e-30)
    log_ref = np.log(softmax_ref)
    assert _close_to_one_rounding(F.log_softmax(z).data, log_ref, dtype)
    xc = z64 - z64.mean(axis=-1, keepdims=True)
    ln_ref = xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5)
    assert _close_to_one_rounding(F.layer_norm(z).data, ln_ref, dtype, atol=1e-6)
    rms_ref = z64 / np.sqrt((z64 * z64).mean(axis=-1, keepdims=True) + 1e-6)
    assert _close_to_one_rounding(F.rms_norm(z).data, rms_ref, dtype, atol=1e-6)
    q = nn.Tensor(z.data.reshape(1, 3, 64))
    scores = z64 @ z64.T / 8.0
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    attn = F.scaled_dot_product_attention(q, q, q)
    assert attn.dtype == dtype
    assert _close_to_one_rounding(attn.data.reshape(3, 64), p @ z64, dtype, atol=1e-3)


@pytest.mark.parametrize("dtype", LOW)
def test_losses_return_float32_and_their_gradient_comes_back_in_the_input_dtype(dtype):
    rng = np.random.default_rng(2)
    z64 = _round(3 * rng.standard_normal((16, 10)), dtype)
    labels = rng.integers(0, 10, 16)
    logits = nn.Tensor(z64.astype(dtype), requires_grad=True)
    loss = F.cross_entropy(logits, labels)
    shifted = z64 - z64.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    ref = -logp[np.arange(16), labels].mean()
    assert loss.dtype == np.float32
    assert abs(float(loss.data) - ref) <= 1e-6 * abs(ref)  # float32 arithmetic on exact inputs
    loss.backward()
    probs = np.exp(logp)
    probs[np.arange(16), labels] -= 1
    assert logits.grad.dtype == dtype
    assert _close_to_one_rounding(logits.grad, probs / 16, dtype, atol=1e-9)
    pred = nn.Tensor(z64.astype(dtype))
    mse = F.mse_loss(pred, nn.Tensor(np.zeros((16, 10), dtype)))
    assert mse.dtype == np.float32 and abs(float(mse.data) - (z64 ** 2).mean()) <= 1e-6 * (z64 ** 2).mean()


def _mlp(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(8, 16, rng=rng, dtype=dtype), nn.GELU(), nn.LayerNorm(16),
                         nn.Linear(16, 4, rng=rng, dtype=dtype))


def test_policy_casts_parameters_and_activations():
    model = _mlp()
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    handle = apply_policy(model, Policy("bf16"))
    assert all(p.dtype == bfloat16 for p in model.parameters())
    assert model(x).dtype == bfloat16  # a float32 input is cast to the compute dtype
    model = _mlp()
    apply_policy(model, Policy("bf16", "fp32"))
    assert all(p.dtype == bfloat16 for p in model.parameters())
    emb = nn.Embedding(10, 8)
    apply_policy(emb, Policy("bf16", "fp32"))
    assert model(x).dtype == np.float32 and emb(np.arange(3)).dtype == np.float32  # a lookup is cast up
    handle.remove()


# -- master weights ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("cls, kwargs", [(SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
                                         (Adam, dict(lr=1e-3)), (AdamW, dict(lr=1e-3, weight_decay=0.1))])
def test_16_bit_parameters_step_a_float32_master_and_get_it_rounded(dtype, cls, kwargs):
    """Reference: the same optimizer on float32 parameters (the masters), rounded to the dtype after each step;
    its gradients are the 16-bit gradients cast up. Bitwise, and the state is float32."""
    rng = np.random.default_rng(4)
    starts = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (5,))]
    low = [nn.Parameter(a.astype(dtype)) for a in starts]
    ref = [nn.Parameter(a.astype(dtype).astype(np.float32)) for a in starts]
    opt, ref_opt = cls(low, **kwargs), cls(ref, **kwargs)
    for step in range(5):
        grads = [rng.standard_normal(p.shape).astype(dtype) for p in low]
        for p, q, g in zip(low, ref, grads):
            p.grad, q.grad = g.copy(), g.astype(np.float32)
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(low, ref)):
            assert p.dtype == dtype
            np.testing.assert_array_equal(p.data, q.data.astype(dtype))
            np.testing.assert_array_equal(opt.state[i]["master_param"], q.data)
            assert all(v.dtype == np.float32 for v in opt.state[i].values() if hasattr(v, "dtype"))


def test_small_steps_accumulate_in_the_master_where_in_place_16_bit_updates_round_away():
    # bfloat16 near 1 has steps of 2**-7: lr * g = 1e-3 rounds away in place, 20 of them move the master by 0.02.
    p = nn.Parameter(np.ones(4, bfloat16))
    opt = SGD([p], lr=1e-3)
    for _ in range(20):
        p.grad = np.ones(4, bfloat16)
        opt.step()
    assert abs(float(opt.state[0]["master_param"][0]) - (1 - 20e-3)) < 1e-6
    assert float(p.data[0]) == float(np.float32(0.98).astype(bfloat16))
    assert float(np.ones(1, bfloat16)[0] - bfloat16.type(1e-3)) == 1.0  # why: in place it never moves


def test_master_weights_checkpoint_and_a_model_reload():
    rng = np.random.default_rng(5)
    p = nn.Parameter(rng.standard_normal(6).astype(bfloat16))
    opt = Adam([p], lr=1e-2)
    p.grad = rng.standard_normal(6).astype(bfloat16)
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["master_param"].dtype == np.float32
    q = nn.Parameter(p.data.copy())
    other = Adam([q], lr=1e-2)
    other.load_state_dict(saved)
    g = rng.standard_normal(6).astype(bfloat16)
    p.grad, q.grad = g.copy(), g.copy()
    opt.step()
    other.step()
    np.testing.assert_array_equal(other.state[0]["master_param"], opt.state[0]["master_param"])
    # New values put into the parameter (a model load without the optimizer's state) start a new master.
    p.data = np.full(6, 2.0, bfloat16)
    p.grad = np.zeros(6, bfloat16)
    opt.step()
    assert np.all(np.abs(opt.state[0]["master_param"] - 2.0) < 1e-2)


def test_float32_gradients_of_16_bit_parameters_are_used_unrounded():
    p = nn.Parameter(np.zeros(3, bfloat16))
    opt = SGD([p], lr=1.0)
    p.grad = np.full(3, 1e-3, np.float32)  # not a bfloat16 value: used as it is
    opt.step()
    assert opt.state[0]["master_param"][0] == np.float32(0) - np.float32(1e-3)


def test_clip_grad_norm_of_bfloat16_gradients():
    """The norm accumulates in float64 (any dtype); bfloat16 gradients used to be refused as not floating."""
    rng = np.random.default_rng(6)
    params = [nn.Parameter(np.zeros(s, bfloat16)) for s in ((4, 3), (5,))]
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(bfloat16)
    ref = math.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum()) for p in params))
    assert abs(nn.clip_grad_norm_(params, 1.0) - ref) <= 1e-9 * ref
    clipped = math.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum()) for p in params))
    assert abs(clipped - 1.0) < 2 * 2.0 ** -8


# -- training under a policy against references ----------------------------------------------------------------

def _data(seed=7):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6)) for _ in range(4)]


def test_bf16_parameters_fp32_compute_equal_a_float32_run_rounding_where_the_policy_rounds():
    """Policy("bf16", "fp32") with AdamW, bitwise: the reference trains float32 masters on a float32 model whose
    weights are the masters rounded to bfloat16, with gradients rounded to bfloat16 (where the policy's
    parameters hold them)."""
    model = _mlp()
    apply_policy(model, Policy("bf16", "fp32"))
    opt = AdamW(model.parameters(), lr=1e-2)
    ref_model = _mlp()
    masters = [nn.Parameter(p.data.astype(bfloat16).astype(np.float32)) for p in ref_model.parameters()]
    ref_opt = AdamW(masters, lr=1e-2)
    for x, y in _data():
        for p, m in zip(ref_model.parameters(), masters):
            p.data = m.data.astype(bfloat16).astype(np.float32)
        ref_model.zero_grad()
        F.cross_entropy(ref_model(x), y).backward()
        for p, m in zip(ref_model.parameters(), masters):
            m.grad = p.grad.astype(bfloat16).astype(np.float32)
        ref_opt.step()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for p, m in zip(model.parameters(), masters):
        np.testing.assert_array_equal(p.data, m.data.astype(bfloat16))


@pytest.mark.parametrize("dtype", LOW)
def test_16_bit_training_tracks_the_float32_run(dtype):
    """Policy(dtype) end to end (16-bit activations): after 30 steps on a fixed task the loss and the weights
    stay near the float32 run's (tolerances: loss within 5%, weights within 0.05 of a scale-1 init)."""
    data = _data(8) * 8
    losses = {}
    weights = {}
    for run in (np.float32, dtype):
        model = _mlp(3)
        if run != np.float32:
            apply_policy(model, Policy(run))
        opt = Adam(model.parameters(), lr=3e-3)
        for x, y in data[:30]:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        losses[run] = float(np.mean([float(F.cross_entropy(model(x), y).data) for x, y in data[:4]]))
        weights[run] = [p.data.astype(np.float64) for p in model.parameters()]
    assert math.isfinite(losses[dtype])
    assert abs(losses[dtype] - losses[np.float32]) <= 0.05 * losses[np.float32], losses
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights[dtype], weights[np.float32])) < 0.05


def test_checkpoint_keeps_bfloat16_parameters_float32_masters_and_the_scaler(tmp_path):
    """mpidist.checkpoint saves a Policy("bf16") model (bfloat16 is stored by name: numpy calls it "<V2"), the
    optimizer's float32 masters and moments, and GradScaler's state; a fresh run loaded from it continues
    bitwise like the run that saved."""
    from mpidist import checkpoint, simulate
    from mpidist.amp import GradScaler

    def body(comm):
        runs = []
        for _ in range(2):
            model = _mlp(seed=len(runs))
            apply_policy(model, Policy("bf16", "fp32"))
            runs.append((model, AdamW(model.parameters(), lr=1e-2), GradScaler(init_scale=2.0 ** 8)))
        (model, opt, scaler), (model2, opt2, scaler2) = runs
        data = _data(9)
        for x, y in data[:2]:
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        checkpoint.save(str(tmp_path), {"model": model, "opt": opt, "scaler": scaler.state_dict()}, comm, 2)
        loaded = {"model": model2, "opt": opt2, "scaler": None}
        checkpoint.load(str(tmp_path), loaded, comm)
        scaler2.load_state_dict(loaded["scaler"])
        assert opt2.state[0]["master_param"].dtype == np.float32 and model2[0].weight.dtype == bfloat16
        for run_model, run_opt, run_scaler in ((model, opt, scaler), (model2, opt2, scaler2)):
            for x, y in data[2:]:
                run_opt.zero_grad()
                run_scaler.scale(F.cross_entropy(run_model(x), y)).backward()
                run_scaler.step(run_opt)
                run_scaler.update()
        for p, q in zip(model.parameters(), model2.parameters()):
            np.testing.assert_array_equal(p.data, q.data)
        for i in opt.state:
            np.testing.assert_array_equal(opt.state[i]["master_param"], opt2.state[i]["master_param"])
        assert scaler.state_dict() == scaler2.state_dict()
        with pytest.raises(checkpoint.CheckpointError, match=r"'model.0.weight' has dtype bfloat16 in the checkpoint, "
                                                             r"float32 in the model"):
            checkpoint.load(str(tmp_path), {"model": _mlp()}, comm, strict=False)
    simulate(1, body)


def test_an_fp32_op_casting_inside_gets_its_inputs_as_given_and_rounds_its_result_once():
    # What the norms use (and attention may): the op sees the 16-bit input itself (so backward can keep it), the
    # wrapper still rounds the float32 result once to the first input's dtype; each gradient comes back in its
    # input's dtype.
    seen = []

    @fp32_op(casts_inside=True)
    def scale(x, w):
        seen.append(input_dtypes(x, w))
        dtypes = input_dtypes(x, w)
        return make_result("Scale", upcast(x) * upcast(w), (x, w),
                           lambda g, n: grads_as((g * upcast(w), (g * upcast(x)).sum()), dtypes))

    x64 = np.array([1.5, 2.5, -3.0, 7.0])
    w = np.float32(1 / 3)
    x = nn.Tensor(x64.astype(bfloat16), requires_grad=True)
    wt = nn.Tensor(np.full((), w), requires_grad=True)
    out = scale(x, wt)
    assert seen == [(bfloat16, np.dtype(np.float32))]
    assert out.dtype == bfloat16
    np.testing.assert_array_equal(out.data, (x64.astype(np.float32) * w).astype(bfloat16))   # one rounding
    out.backward(np.ones(4, bfloat16))
    assert x.grad.dtype == bfloat16 and wt.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, np.full(4, w).astype(bfloat16))
    assert wt.grad == np.float32(x64.sum())
