"""Tests for mpidist.nn: finite-difference gradients, several graphs in flight, hooks, state.

Ported from the explicit-backward API (``module.forward(x, mb)``, ``module.backward(dy, mb)``): a
micro-batch is now simply a graph that is kept alive until its backward; the checks stay the same.
"""

import math

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.xp import asarray_like, copy_into, get_array_module, is_device_array, scatter_add, to_numpy
from gradcheck import gradcheck, numeric_grad

F64 = np.float64


def _away_from_zero(rng, shape):
    # Keeps ReLU's kink out of reach of the finite-difference step.
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.1, 1.0, size=shape)


def check_module_grads(module, x, reset=None, input_grad=True):
    """Compare backward with central differences of sum(module(x) * r) for x and every parameter."""
    gradcheck(module, x, module=module, reset=reset, wrt=None if input_grad else [])


def run(model, x, dy):
    """Forward ``x`` (a leaf that requires grad), backward ``dy``; return the input gradient."""
    xt = nn.Tensor(x, requires_grad=True)
    model(xt).backward(dy)
    return xt.grad


# -- finite-difference gradient checks -------------------------------------------


def test_linear_grads_with_leading_dims():
    rng = np.random.default_rng(0)
    check_module_grads(nn.Linear(4, 3, rng=rng, dtype=F64), rng.standard_normal((2, 3, 4)))


@pytest.mark.parametrize("features,batch", [((3, 0), (2,)), ((0, 3), (2,)), ((0, 0), (2,)), ((3, 0), (2, 5)),
                                            ((0, 3), (2, 5)), ((3, 4), (2, 0))],
                         ids=["no-outputs", "no-inputs", "neither", "no-outputs-3d", "no-inputs-3d", "no-rows-3d"])
def test_linear_with_an_empty_dimension_has_gradients_of_every_shape(features, batch):
    """Linear(n, 0), Linear(0, n) and empty batches: gradients of the parameters' and input's shapes (finite
    differences where there are elements; the bias of Linear(0, n) gets the output gradient's row sums)."""
    rng = np.random.default_rng(0)
    lin = nn.Linear(*features, rng=rng, dtype=F64)
    x = rng.standard_normal(batch + (features[0],))
    grads = gradcheck(lin, x, module=lin)
    assert grads[0].shape == x.shape
    assert grads["weight"].shape == (features[1], features[0]) and grads["bias"].shape == (features[1],)


def test_linear_without_bias_grads():
    rng = np.random.default_rng(0)
    lin = nn.Linear(4, 3, bias=False, rng=rng, dtype=F64)
    assert lin.bias is None and [n for n, _ in lin.named_parameters()] == ["weight"]
    check_module_grads(lin, rng.standard_normal((5, 4)))


@pytest.mark.parametrize("cls", [nn.ReLU, nn.GELU, nn.Tanh])
def test_activation_grads(cls):
    check_module_grads(cls(), _away_from_zero(np.random.default_rng(0), (3, 5)))


def test_dropout_grads():
    drop = nn.Dropout(0.4, seed=3)
    check_module_grads(drop, np.random.default_rng(0).standard_normal((4, 6)),
                       reset=lambda: setattr(drop, "generator", np.random.default_rng(3)))


def test_layernorm_grads():
    rng = np.random.default_rng(0)
    ln = nn.LayerNorm(5, dtype=F64)
    # Non-trivial affine parameters so their gradients are exercised.
    ln.weight.data = rng.standard_normal(5)
    ln.bias.data = rng.standard_normal(5)
    check_module_grads(ln, rng.standard_normal((2, 3, 5)))


def test_embedding_grads_with_repeated_indices():
    emb = nn.Embedding(6, 3, rng=np.random.default_rng(0), dtype=F64)
    idx = np.array([[0, 2, 2], [5, 0, 2]])
    check_module_grads(emb, idx, input_grad=False)
    assert emb.weight.grad[[1, 3, 4]].sum() == 0  # rows never looked up get no gradient


def test_flatten_grads():
    check_module_grads(nn.Flatten(), np.random.default_rng(0).standard_normal((2, 3, 4)))


def test_sequential_grads():
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(4, 6, rng=rng, dtype=F64), nn.GELU(), nn.LayerNorm(6, dtype=F64),
                          nn.Linear(6, 6, rng=rng, dtype=F64), nn.Tanh(), nn.Linear(6, 2, rng=rng, dtype=F64))
    check_module_grads(model, rng.standard_normal((3, 4)))


def test_cnn_grads():
    rng = np.random.default_rng(0)
    bn = nn.BatchNorm2d(3, dtype=F64)
    bn.weight.data, bn.bias.data = rng.standard_normal(3), rng.standard_normal(3)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, rng=rng, dtype=F64), bn, nn.Tanh(), nn.AvgPool2d(2),
                          nn.Flatten(), nn.Linear(12, 2, rng=rng, dtype=F64))
    check_module_grads(model, rng.standard_normal((3, 2, 4, 4)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_cross_entropy_grads(reduction, scale):
    rng = np.random.default_rng(0)
    pred = rng.standard_normal((2, 3, 5)) * 3
    target = rng.integers(0, 5, size=(2, 3))
    crit = nn.CrossEntropyLoss(reduction)
    p = nn.Tensor(pred, requires_grad=True)
    (crit(p, target) * scale).backward()
    num = numeric_grad(lambda: scale * float(crit(pred, target)), pred)
    np.testing.assert_allclose(p.grad, num, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_grads(reduction):
    rng = np.random.default_rng(0)
    pred, target = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    crit = nn.MSELoss(reduction)
    p = nn.Tensor(pred, requires_grad=True)
    (crit(p, target) * 0.5).backward()
    num = numeric_grad(lambda: 0.5 * float(crit(pred, target)), pred)
    np.testing.assert_allclose(p.grad, num, rtol=1e-6, atol=1e-9)


# -- forward values against independent formulas --------------------------------------


def test_forward_values_match_formulas():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    lin = nn.Linear(4, 2, rng=rng, dtype=F64)
    np.testing.assert_allclose(lin(x), x @ lin.weight.data.T + lin.bias.data)
    gelu = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x.ravel()]
    np.testing.assert_allclose(nn.GELU()(x).numpy().ravel(), gelu)
    ln = nn.LayerNorm(4, eps=0.0, dtype=F64)
    np.testing.assert_allclose(ln(x), (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True))
    logits, labels = rng.standard_normal((3, 4)), np.array([0, 3, 1])
    ref = np.mean([-math.log(math.exp(row[t]) / sum(math.exp(v) for v in row)) for row, t in zip(logits, labels)])
    assert float(nn.CrossEntropyLoss()(logits, labels)) == pytest.approx(ref, rel=1e-12)
    np.testing.assert_allclose(nn.MSELoss()(x, 2 * x), np.mean(x ** 2))


def test_cross_entropy_is_stable_for_huge_logits():
    loss = nn.CrossEntropyLoss()(np.array([[1000.0, 0.0], [0.0, -1000.0]]), np.array([0, 1]))
    assert float(loss) == pytest.approx(500.0)


def test_linear_init_and_dtype():
    lin = nn.Linear(16, 8)
    assert lin.weight.data.dtype == np.float32 and lin.weight.data.shape == (8, 16)
    assert np.abs(lin.weight.data).max() <= 1 / 4 and np.abs(lin.bias.data).max() <= 1 / 4
    assert nn.Linear(16, 8, dtype=F64).bias.data.dtype == F64
    # The default generator advances: two layers never start equal (the old default_rng(0) per layer did).
    assert not np.array_equal(nn.Linear(16, 8).weight.data, lin.weight.data)
    nn.manual_seed(5)
    a = nn.Linear(16, 8)
    nn.manual_seed(5)
    np.testing.assert_array_equal(nn.Linear(16, 8).weight.data, a.weight.data)  # seeded


# -- several graphs (micro-batches) in flight ---------------------------------------------------


def _mlp(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(4, 8, rng=rng, dtype=F64), nn.GELU(), nn.LayerNorm(8, dtype=F64),
                         nn.Linear(8, 8, rng=rng, dtype=F64), nn.ReLU(), nn.Linear(8, 3, rng=rng, dtype=F64))


def test_microbatches_in_flight_match_separate_runs():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((2, 4)) for _ in range(3)]
    dys = [rng.standard_normal((2, 3)) for _ in range(3)]

    ref, ref_dx, ref_grads = _mlp(), [], []
    for x, dy in zip(xs, dys):
        ref.zero_grad(set_to_none=True)
        ref_dx.append(run(ref, x, dy))
        ref_grads.append([p.grad.copy() for p in ref.parameters()])

    model = _mlp()
    inputs = [nn.Tensor(x, requires_grad=True) for x in xs]
    outs = [model(x) for x in inputs]  # three graphs alive at once
    for mb in (1, 0, 2):
        outs[mb].backward(dys[mb])
    for mb in range(3):
        np.testing.assert_array_equal(inputs[mb].grad, ref_dx[mb])
    for i, p in enumerate(model.parameters()):
        np.testing.assert_allclose(p.grad, (ref_grads[1][i] + ref_grads[0][i]) + ref_grads[2][i], rtol=1e-14)


def test_one_f_one_b_interleaving_matches_sequential_accumulation():
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 4)) for _ in range(3)]
    dys = [rng.standard_normal((2, 3)) for _ in range(3)]
    ref = _mlp()
    for x, dy in zip(xs, dys):
        ref(x).backward(dy)
    model = _mlp()
    y0 = model(xs[0])
    y1 = model(xs[1])
    y0.backward(dys[0])
    y2 = model(xs[2])
    y1.backward(dys[1])
    y2.backward(dys[2])
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)


def test_backward_twice_or_without_graph_says_why():
    # Replaces "backward without forward names the module and mb": the engine's errors.
    model = _mlp()
    y = model(np.ones((1, 4)))
    y.backward(np.ones((1, 3)))
    with pytest.raises(RuntimeError, match="already freed by an earlier backward"):
        y.backward(np.ones((1, 3)))
    with nn.no_grad():
        z = model(np.ones((1, 4)))
    with pytest.raises(RuntimeError, match=r"output 0 does not require grad .*shape: \(1, 3\)"):
        z.backward(np.ones((1, 3)))
    with pytest.raises(RuntimeError, match=r"gradient can be implied only for a scalar output"):
        model(np.ones((1, 4))).backward()


def test_same_module_twice_builds_two_graphs():
    # Replaces "forward twice for the same mb is an error": graphs are independent, both backward.
    lin = nn.Linear(2, 2, dtype=F64)
    a, b = lin(np.ones((1, 2))), lin(2 * np.ones((1, 2)))
    b.backward(np.ones((1, 2)))
    a.backward(np.ones((1, 2)))
    np.testing.assert_array_equal(lin.weight.grad, np.full((2, 2), 3.0))


def test_eval_and_no_grad_save_nothing():
    model = _mlp()
    x = np.ones((2, 4))
    with nn.no_grad():
        y1 = model(x)
        assert not nn.is_grad_enabled()
    assert nn.is_grad_enabled() and y1.grad_fn is None and not y1.requires_grad
    y2 = model.eval()(x)
    assert not any(m.training for m in model.modules())
    np.testing.assert_array_equal(y1, y2)
    model.train()
    assert model(x).grad_fn is not None


def test_dropout_modes_and_per_graph_masks():
    drop = nn.Dropout(0.5, seed=0)
    x = np.ones((200, 50), np.float32)
    t0, t1 = nn.Tensor(x, requires_grad=True), nn.Tensor(x, requires_grad=True)
    y0, y1 = drop(t0), drop(t1)
    assert set(np.unique(y0.data)) == {0.0, 2.0} and 0.45 < (y0.data == 0).mean() < 0.55
    assert not np.array_equal(y0.data, y1.data)
    y0.backward(x)
    y1.backward(x)
    np.testing.assert_array_equal(t0.grad, y0.data)  # graph 0's mask, not the latest one
    np.testing.assert_array_equal(t1.grad, y1.data)
    np.testing.assert_array_equal(nn.Dropout(0.5, seed=0)(x).data, y0.data)  # seeded
    assert drop.eval()(x).data is x
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\] \(p: 1.5\)"):
        nn.Dropout(1.5)


# -- parameters, hooks and swapped storage -------------------------------------------------


def test_named_parameters_order_and_names():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(np.ones(1))
            self.layers = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.LayerNorm(3))
            self.head = nn.Linear(3, 1, bias=False)

    net = Net()
    assert [n for n, _ in net.named_parameters()] == [
        "scale", "layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias", "head.weight"]
    assert [n for n, _ in net.named_children()] == ["layers", "head"]
    assert len(list(net.modules())) == 6
    net.head = nn.Linear(3, 1)  # replacing a child re-registers it in place
    assert [n for n, _ in net.named_parameters()][-2:] == ["head.weight", "head.bias"]


def test_post_accumulate_grad_hooks_fire_once_in_reverse_layer_order():
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(2, 3, rng=rng), nn.ReLU(), nn.Linear(3, 4, rng=rng), nn.Linear(4, 2, rng=rng))
    fired = []
    names = {id(p): n for n, p in model.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda q: fired.append(names[id(q)]))
               for p in model.parameters()]
    x = np.ones((3, 2), np.float32)
    for _ in range(2):
        fired.clear()
        model(x).backward(np.ones((3, 2), np.float32))
        # Backward visits layers last to first; a layer's weight and bias are final together.
        assert fired == ["3.weight", "3.bias", "2.weight", "2.bias", "0.weight", "0.bias"]
    handles[0].remove()
    fired.clear()
    model(x).backward(np.ones((3, 2), np.float32))
    assert "0.weight" not in fired and len(fired) == 5


def test_accumulate_grad_writes_into_preset_views():
    ref, model = _mlp(), _mlp()
    x, dy = np.random.default_rng(0).standard_normal((2, 4)), np.ones((2, 3))
    ref(x).backward(dy)
    flat = np.zeros(sum(p.data.size for p in model.parameters()))
    views, off = [], 0
    for p in model.parameters():
        p.grad = flat[off:off + p.data.size].reshape(p.data.shape)
        views.append(p.grad)
        off += p.data.size
    for _ in range(2):  # the second backward must add into the same memory
        model(x).backward(dy)
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    np.testing.assert_allclose(flat, 2 * np.concatenate([p.grad.ravel() for p in ref.parameters()]))
    model[0].weight.grad = np.ones(3)
    with pytest.raises(RuntimeError, match=r"does not match \.grad's shape \(3,\)"):
        model(x).backward(dy)


def test_swapping_param_data_is_seen_by_forward_and_backward():
    rng = np.random.default_rng(0)
    lin = nn.Linear(3, 2, rng=rng, dtype=F64)
    x = nn.Tensor(rng.standard_normal((4, 3)), requires_grad=True)
    w_a, w_b = lin.weight.data, rng.standard_normal((2, 3))
    lin.weight.data = w_b
    y = lin(x)
    np.testing.assert_allclose(y, x.data @ w_b.T + lin.bias.data)
    lin.weight.data = np.zeros(0)  # placeholder between forward and backward, as FSDP does
    lin.weight.data = w_a
    dy = rng.standard_normal((4, 2))
    y.backward(dy)
    np.testing.assert_allclose(x.grad, dy @ w_a)  # backward read the weight at backward time
    np.testing.assert_allclose(lin.weight.grad, dy.T @ x.data)


# -- state ----------------------------------------------------------------------------------


def test_state_dict_round_trip_copies_in_place():
    class WithBuffer(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.body = _mlp(seed)
            self.register_buffer("count", np.array([seed], dtype=np.int64))

    a, b = WithBuffer(0), WithBuffer(1)
    sd = a.state_dict()
    assert list(sd)[-1] == "count" and list(sd)[0] == "body.0.weight"
    assert all(sd[n] is not p.data for n, p in a.named_parameters())
    before = {n: p.data for n, p in b.named_parameters()}
    count = b.count
    b.load_state_dict(sd)
    assert all(p.data is before[n] for n, p in b.named_parameters()) and b.count is count and b.count[0] == 0
    x = np.ones((2, 4))
    np.testing.assert_array_equal(a.body(x), b.body(x))
    sd["body.0.bias"][...] = 123.0  # the state dict holds copies
    assert not np.any(a.body[0].bias.data == 123.0)


def test_batchnorm_buffers_in_state_dict_and_apply():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert [n for n, _ in model.named_buffers()] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    model(np.random.default_rng(0).standard_normal((4, 1, 5, 5)).astype(np.float32))
    other = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    other.load_state_dict(model.state_dict())
    np.testing.assert_array_equal(other[1].running_var, model[1].running_var)
    assert int(other[1].num_batches_tracked) == 1
    visited = []
    model.apply(lambda m: visited.append(type(m).__name__))
    assert visited == ["Conv2d", "BatchNorm2d", "Sequential"]


def test_load_state_dict_errors_name_the_key():
    model = _mlp()
    sd = model.state_dict()
    del sd["3.bias"]
    sd["extra"] = np.zeros(1)
    with pytest.raises(KeyError, match=r"missing: \['3.bias'\], unexpected: \['extra'\]"):
        model.load_state_dict(sd)
    keys = model.load_state_dict(sd, strict=False)
    assert keys.missing_keys == ["3.bias"] and keys.unexpected_keys == ["extra"]
    sd = model.state_dict()
    sd["0.weight"] = np.zeros((4, 8))
    with pytest.raises(ValueError, match=r"'0.weight' \(checkpoint: \(4, 8\), model: \(8, 4\)\)"):
        model.load_state_dict(sd)


def test_zero_grad_keeps_grad_objects_or_sets_none():
    model = _mlp()
    model(np.ones((2, 4))).backward(np.ones((2, 3)))
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(model.parameters(), grads))
    model.zero_grad()  # PyTorch's default: None
    assert all(p.grad is None for p in model.parameters())


# -- errors and xp ---------------------------------------------------------------------------


def test_input_errors_carry_values():
    with pytest.raises(IndexError, match=r"label out of range \[0, 3\) \(min: 0, max: 3;"):
        nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match=r"logits: \(2, 3\), target: \(3,\)"):
        nn.CrossEntropyLoss()(np.zeros((2, 3)), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"mse_loss: pred and target shapes differ"):
        nn.MSELoss()(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(IndexError, match=r"embedding: index out of range \[0, 4\) \(min: -1, max: 2\)"):
        nn.Embedding(4, 2)(np.array([-1, 2]))
    with pytest.raises(ValueError, match=r"linear: input last dim"):
        nn.Linear(3, 2)(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        nn.MSELoss("avg")
    with pytest.raises(ValueError, match=r"conv2d: channels do not fit groups=1"):
        nn.Conv2d(3, 2, 3)(np.ones((1, 2, 5, 5), np.float32))
    with pytest.raises(ValueError, match=r"conv2d: the window does not fit the input"):
        nn.Conv2d(1, 1, 5)(np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match=r"batch_norm: training needs more than one value per channel"):
        nn.BatchNorm2d(2)(np.ones((1, 2), np.float32))


def test_xp_helpers_on_numpy():
    x = np.arange(3)
    assert get_array_module(x) is np and not is_device_array(x) and to_numpy(x) is x
    target = np.zeros((3, 2))
    scatter_add(target, np.array([2, 0, 2]), np.ones((3, 2)))
    np.testing.assert_array_equal(target, [[1, 1], [0, 0], [2, 2]])  # repeated indices add up
    dst = np.zeros(3)
    copy_into(dst, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(dst, [1, 2, 3])
    assert asarray_like(x, dst) is x


def test_public_names():
    assert set(nn.__all__) >= {"Parameter", "Module", "Sequential", "no_grad", "Linear", "ReLU", "GELU", "Tanh",
                               "Dropout", "LayerNorm", "Embedding", "Flatten", "CrossEntropyLoss", "MSELoss",
                               "Tensor", "Conv2d", "MaxPool2d", "AvgPool2d", "BatchNorm2d", "SyncBatchNorm",
                               "manual_seed", "recompute", "backward_input"}
    assert all(hasattr(nn, name) for name in nn.__all__)
    assert not hasattr(nn, "checkpoint")  # activation checkpointing is nn.recompute (mpidist.checkpoint saves)


def test_split_backward_equals_full_backward():
    """backward_input now + the deferred weight pass later (zero-bubble B/W) gives the same gradients as
    backward, with two micro-batches in flight."""
    from mpidist.nn import Linear, Sequential, Tanh

    def model():
        rng = np.random.default_rng(4)
        return Sequential(Linear(5, 6, rng=rng, dtype=np.float64), Tanh(), Linear(6, 3, rng=rng, dtype=np.float64))

    x = np.random.default_rng(1).standard_normal((2, 4, 5))
    dy = np.random.default_rng(2).standard_normal((2, 4, 3))
    full, split = model(), model()
    dx_full = run(full, x, dy)
    x0, x1 = nn.Tensor(x, requires_grad=True), nn.Tensor(x * 2, requires_grad=True)
    y0, y1 = split(x0), split(x1)
    (dx_split,), w0 = nn.backward_input(y0, dy, [x0])
    assert all(p.grad is None for p in split.parameters())  # the weight work really was deferred
    _, w1 = nn.backward_input(y1, dy, [x1])
    w0.run()
    np.testing.assert_allclose(dx_split, dx_full, rtol=1e-13)
    for (name, p), q in zip(full.named_parameters(), split.parameters()):
        np.testing.assert_allclose(q.grad, p.grad, rtol=1e-13, err_msg=name)
    split2 = model()
    run(split2, x * 2, dy)
    w1.run()
    for p, q, r in zip(full.parameters(), split.parameters(), split2.parameters()):
        np.testing.assert_allclose(q.grad, p.grad + r.grad, rtol=1e-12)
    with pytest.raises(RuntimeError, match=r"DeferredWeightGrads.run: already ran"):
        w1.run()


def test_replacing_a_child_or_parameter_keeps_its_place():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    setattr(seq, "0", nn.Tanh())
    assert [type(m).__name__ for m in seq] == ["Tanh", "ReLU", "Linear"]  # was moved to the end
    lin = nn.Linear(2, 2)
    lin.weight = nn.Parameter(np.zeros((2, 2), np.float32))
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]


def test_convert_sync_batchnorm_reuses_parameters_and_buffers():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Sequential(nn.ReLU(), nn.BatchNorm2d(2)))
    before = [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()]
    sentinel = object()
    out = nn.SyncBatchNorm.convert_sync_batchnorm(model, sentinel)
    assert out is model and type(model[1]) is nn.SyncBatchNorm and type(model[2][1]) is nn.SyncBatchNorm
    assert model[1].comm is sentinel and [type(m).__name__ for m in model][:2] == ["Conv2d", "SyncBatchNorm"]
    assert [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()] == before
