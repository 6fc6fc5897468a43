"""Autograd: every op and layer against central finite differences (float64), and the engine's rules.

Gradient checks use random shapes with broadcasting and non-contiguous inputs (Fortran-ordered and
strided views); the reference is ``tests/gradcheck.py`` (finite differences of the forward alone).
"""

import sys
import tracemalloc

import numpy as np
import pytest

import mpidist
import mpidist.nn as nn
from mpidist.nn import functional as F
from gradcheck import gradcheck, strided, transposed

F64 = np.float64


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def away_from_zero(*shape, seed=0):
    # Keeps kinks (ReLU, max ties) out of reach of the finite-difference step.
    rng = np.random.default_rng(seed)
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.1, 1.0, size=shape)


def distinct(*shape, seed=0):
    # Values at least 1e-3 apart: max and max-pool have one clear winner per window.
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    return (rng.permutation(n) * 1e-2 + rng.uniform(0, 1e-3, n)).reshape(shape) - n * 5e-3


# -- elementwise with broadcasting --------------------------------------------------------------------

@pytest.mark.parametrize("op", [F.add, F.sub, F.mul, F.div])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 1, 4), (3, 1)), ((4,), (2, 3, 4)), ((2, 3), ())])
def test_binary_ops_broadcast(op, shapes):
    a = rand(*shapes[0], seed=1)
    b = rand(*shapes[1], seed=2) + (3.0 if op is F.div else 0.0)  # away from division by zero
    if a.ndim > 1:
        a = transposed(a)
    gradcheck(op, a, np.asarray(b))


def test_binary_ops_with_numbers_and_arrays():
    a = rand(2, 3)
    gradcheck(lambda t: 2.0 * t - t / 3.0 + 1.0 - (-t), a)
    gradcheck(lambda t: rand(2, 3, seed=5) * t + rand(3, seed=6), a)  # plain array on either side


def test_pow_neg_where():
    a = np.abs(rand(3, 4)) + 0.5
    gradcheck(lambda t: F.pow(t, 2.5), a)
    gradcheck(lambda t: t ** 3, rand(3, 4))
    gradcheck(F.neg, strided(rand(3, 4)))
    cond = rand(3, 4, seed=3) > 0
    gradcheck(lambda x, y: F.where(cond, x, y), rand(3, 4), rand(4, seed=1))


# -- matrix products ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((4,), (4, 3)),
                                    ((2, 3, 4), (4,)), ((4,), (4,))])
def test_matmul(shapes):
    a, b = rand(*shapes[0], seed=1), rand(*shapes[1], seed=2)
    gradcheck(F.matmul, transposed(a), b)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_leading_dims_noncontiguous(bias):
    x = transposed(rand(2, 3, 4))
    w = strided(rand(5, 4, seed=1))
    b = rand(5, seed=2) if bias else None
    gradcheck(lambda x, w, *b: F.linear(x, w, *b), x, w, *([b] if bias else []))


# -- shapes, indexing, joining --------------------------------------------------------------------------

def test_shape_ops():
    a = transposed(rand(2, 3, 4))
    gradcheck(lambda t: F.reshape(t, (4, 6)), a)
    gradcheck(lambda t: t.reshape(3, 8).T, a)
    gradcheck(lambda t: F.permute(t, (2, 0, 1)), a)
    gradcheck(lambda t: F.transpose(t), a)
    gradcheck(lambda t: F.swapaxes(t, 0, 2), a)
    gradcheck(lambda t: t.flatten(1), a)


@pytest.mark.parametrize("index", [
    (slice(None), 1), (0, slice(1, None, 2)), (Ellipsis, 2), (None, 1), np.array([2, 0, 2, 1]),
    (np.array([0, 1, 1]), slice(None), np.array([3, 0, 3])), "mask"], ids=str)
def test_getitem(index):
    a = transposed(rand(3, 3, 4))
    if isinstance(index, str):
        index = rand(3, 3, 4, seed=9) > 0
    gradcheck(lambda t: t[index], a)


def test_getitem_with_integer_tensor_index():
    idx = nn.Tensor(np.array([1, 1, 0]))
    gradcheck(lambda t: t[idx], rand(3, 2))


def test_cat_split_stack():
    a, b, c = rand(2, 3), transposed(rand(2, 5, seed=1)), rand(2, 1, seed=2)
    gradcheck(lambda *t: F.cat(t, axis=1), a, b, c)
    gradcheck(lambda *t: F.stack(t, axis=1), a, rand(2, 3, seed=3))
    gradcheck(lambda t: F.split(t, [1, 3, 2], axis=1), rand(2, 6))
    gradcheck(lambda t: F.split(t, 3, axis=1)[1], rand(2, 6))  # unused pieces get zeros


# -- reductions -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [F.sum, F.mean, F.var])
@pytest.mark.parametrize("axis,keepdims", [(None, False), (1, False), ((0, 2), True), (-1, True)])
def test_reductions(op, axis, keepdims):
    gradcheck(lambda t: op(t, axis=axis, keepdims=keepdims), transposed(rand(2, 3, 4)))


@pytest.mark.parametrize("axis,keepdims", [(None, False), (1, False), (2, True), (None, True)])
def test_max(axis, keepdims):
    gradcheck(lambda t: F.max(t, axis=axis, keepdims=keepdims), distinct(2, 3, 4))


def test_max_shares_gradient_among_ties():
    x = nn.Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    F.max(x, axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad, [[0, 0.5, 0.5], [1, 0, 0]])


# -- elementwise functions ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [F.exp, F.tanh, F.sigmoid, F.relu, F.gelu], ids=lambda f: f.__name__)
def test_unary(op):
    gradcheck(op, transposed(away_from_zero(3, 4)))


@pytest.mark.parametrize("op", [F.log, F.sqrt], ids=lambda f: f.__name__)
def test_unary_positive(op):
    gradcheck(op, strided(np.abs(rand(3, 4)) + 0.5))


@pytest.mark.parametrize("op", [F.softmax, F.log_softmax], ids=lambda f: f.__name__)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(op, axis):
    gradcheck(lambda t: op(t, axis=axis), transposed(rand(3, 4, 5)))


def test_astype_roundtrip():
    gradcheck(lambda t: t.astype(np.float32).astype(F64) * 2, rand(3), atol=1e-5, rtol=1e-5, eps=1e-3)


# -- fused layers ---------------------------------------------------------------------------------------

def test_layer_norm_and_rms_norm():
    x = transposed(rand(2, 3, 5))
    gradcheck(lambda x, w, b: F.layer_norm(x, w, b), x, rand(5, seed=1), rand(5, seed=2))
    gradcheck(F.layer_norm, x)
    gradcheck(lambda x, w: F.rms_norm(x, w), x, rand(5, seed=1))
    gradcheck(F.rms_norm, x)


def test_embedding_repeated_indices():
    idx = np.array([[0, 2, 2], [5, 0, 2]])
    got = gradcheck(lambda w: F.embedding(idx, w), rand(6, 3))
    assert not got[0][[1, 3, 4]].any()  # rows never looked up get no gradient


def test_dropout_with_fixed_mask():
    x = rand(4, 6)
    reset = lambda: nn.manual_seed(3)  # noqa: E731 - the same mask in every forward
    reset()
    gradcheck(lambda t: F.dropout(t, 0.4), x, reset=reset)
    module = nn.Dropout(0.4)
    gradcheck(module, x, reset=reset)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_ignore_index_and_smoothing(reduction, smoothing):
    logits = transposed(rand(2, 3, 5) * 3)
    target = np.array([[1, -1, 4], [0, 2, -1]])
    gradcheck(lambda z: F.cross_entropy(z, target, ignore_index=-1, label_smoothing=smoothing,
                                        reduction=reduction), logits)


def test_cross_entropy_ignored_rows_get_zero_gradient():
    z = nn.Tensor(rand(3, 4), requires_grad=True)
    F.cross_entropy(z, np.array([1, 7, 2]), ignore_index=7, label_smoothing=0.1).backward()
    assert not z.grad[1].any() and z.grad[0].any()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse(reduction):
    gradcheck(lambda p, t: F.mse_loss(p, t, reduction), rand(4, 3), transposed(rand(4, 3, seed=1)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "additive", "bool"])
def test_attention(causal, mask):
    q, k, v = transposed(rand(2, 2, 3, 4, seed=1)), rand(2, 2, 5, 4, seed=2), rand(1, 5, 3, seed=3)
    m = None
    if mask == "additive":
        m = rand(3, 5, seed=4)
    elif mask == "bool":
        m = np.ones((3, 5), bool)
        m[0, 3:] = False
    gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal), q, k, v)


def test_attention_with_dropout_fixed_mask():
    q, k, v = rand(2, 4, 3, seed=1), rand(2, 4, 3, seed=2), rand(2, 4, 3, seed=3)
    reset = lambda: nn.manual_seed(5)  # noqa: E731
    gradcheck(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3), q, k, v,
              reset=reset)


def test_attention_matches_composite_ops():
    # The fused op against the same formula written with differentiable ops: values and gradients.
    q, k, v = rand(2, 4, 3, seed=1), rand(2, 4, 3, seed=2), rand(2, 4, 3, seed=3)
    mask = rand(4, 4, seed=4)
    tq, tk, tv = (nn.Tensor(a, requires_grad=True) for a in (q, k, v))
    fused = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=True)
    causal = np.where(np.tril(np.ones((4, 4), bool)), 0.0, -np.inf)
    sq, sk, sv = (nn.Tensor(a, requires_grad=True) for a in (q, k, v))
    comp = F.softmax(sq @ F.swapaxes(sk, -1, -2) / np.sqrt(3) + mask + causal) @ sv
    np.testing.assert_allclose(fused.data, comp.data, rtol=1e-12)
    dy = rand(2, 4, 3, seed=6)
    fused.backward(dy)
    comp.backward(dy)
    for a, b in ((tq, sq), (tk, sk), (tv, sv)):
        np.testing.assert_allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)


# -- convolution, pooling, batch norm -------------------------------------------------------------------

def conv_reference(x, w, b, stride, pad, dil, groups):
    """Direct loops over output positions (independent of the im2col path)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0],) * 2, (pad[1],) * 2))
    ho = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, o, ho, wo))
    og = o // groups
    for oc in range(o):
        g = oc // og
        for i in range(ho):
            for j in range(wo):
                r, q = i * stride[0], j * stride[1]
                patch = xp[:, g * cg:(g + 1) * cg, r:r + dil[0] * (kh - 1) + 1:dil[0], q:q + dil[1] * (kw - 1) + 1:dil[1]]
                y[:, oc, i, j] = (patch * w[oc]).sum(axis=(1, 2, 3)) + (0 if b is None else b[oc])
    return y


CONV_CASES = [  # (input shape, weight shape, stride, padding, dilation, groups)
    ((2, 3, 5, 5), (4, 3, 3, 3), 1, 0, 1, 1),
    ((1, 2, 6, 5), (3, 2, 3, 2), (2, 1), (1, 2), 1, 1),
    ((2, 4, 7, 6), (6, 2, 3, 2), (2, 1), 1, (1, 2), 2),
    ((1, 3, 4, 4), (3, 1, 2, 2), 2, 1, 1, 3),  # depthwise
    ((2, 2, 3, 3), (2, 2, 1, 1), 1, 0, 1, 1),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_values_and_grads(case):
    xs, ws, stride, pad, dil, groups = case
    x, w, b = transposed(rand(*xs, seed=1)), rand(*ws, seed=2), rand(ws[0], seed=3)
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    np.testing.assert_allclose(F.conv2d(x, w, b, stride, pad, dil, groups).data,
                               conv_reference(x, w, b, pair(stride), pair(pad), pair(dil), groups), rtol=1e-12)
    gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride, pad, dil, groups), x, w, b)
    gradcheck(lambda x, w: F.conv2d(x, w, None, stride, pad, dil, groups), x, w)


def test_max_pool_values_and_grads():
    x = distinct(2, 2, 5, 6)
    y = F.max_pool2d(x, 2)
    np.testing.assert_array_equal(y.data, x[:, :, :4, :6].reshape(2, 2, 2, 2, 3, 2).max(axis=(3, 5)))
    gradcheck(lambda t: F.max_pool2d(t, 2), transposed(x))
    gradcheck(lambda t: F.max_pool2d(t, 3, stride=2, padding=1), x)  # overlapping windows, -inf padding
    gradcheck(lambda t: F.max_pool2d(t, (2, 3), stride=(1, 2)), x)


@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool_values_and_grads(include_pad):
    x = rand(2, 2, 5, 6)
    np.testing.assert_allclose(F.avg_pool2d(x, 2).data, x[:, :, :4, :6].reshape(2, 2, 2, 2, 3, 2).mean(axis=(3, 5)))
    gradcheck(lambda t: F.avg_pool2d(t, 3, stride=2, padding=1, count_include_pad=include_pad), transposed(x))
    gradcheck(lambda t: F.avg_pool2d(t, (2, 3), stride=(1, 2)), x)
    corner = F.avg_pool2d(np.ones((1, 1, 2, 2)), 2, stride=2, padding=1, count_include_pad=include_pad).data
    assert corner[0, 0, 0, 0] == (0.25 if include_pad else 1.0)


@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 4, 5)])
def test_batch_norm_training_and_eval(shape):
    x = transposed(rand(*shape) * 2 + 1)
    c = shape[1]
    axes = (0,) + tuple(range(2, len(shape)))
    gradcheck(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, rand(c, seed=1), rand(c, seed=2))
    gradcheck(lambda x: F.batch_norm(x, training=True), x)
    rm, rv = rand(c, seed=3), np.abs(rand(c, seed=4)) + 0.5
    gradcheck(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, rand(c, seed=1), rand(c, seed=2))
    # Running statistics move by momentum toward the batch mean and *unbiased* variance.
    rm0, rv0 = rm.copy(), rv.copy()
    F.batch_norm(x, rm, rv, training=True, momentum=0.25)
    n = x.size // c
    np.testing.assert_allclose(rm, 0.75 * rm0 + 0.25 * x.mean(axis=axes))
    np.testing.assert_allclose(rv, 0.75 * rv0 + 0.25 * x.var(axis=axes) * n / (n - 1))
    bshape = (1, c) + (1,) * (len(shape) - 2)
    np.testing.assert_allclose(F.batch_norm(x, rm, rv, training=False, eps=0.0).data,
                               (x - rm.reshape(bshape)) / np.sqrt(rv.reshape(bshape)))


# -- layers -----------------------------------------------------------------------------------------------

def layer_cases():
    rng = lambda s: np.random.default_rng(s)  # noqa: E731
    ln = nn.LayerNorm(5, dtype=F64)
    ln.weight.data, ln.bias.data = rand(5, seed=7), rand(5, seed=8)
    rms = nn.RMSNorm(5, dtype=F64)
    rms.weight.data = rand(5, seed=9)
    bn = nn.BatchNorm2d(3, dtype=F64)
    bn.weight.data, bn.bias.data = rand(3, seed=10), rand(3, seed=11)
    return [
        ("Linear", nn.Linear(5, 4, rng=rng(0), dtype=F64), rand(2, 3, 5)),
        ("Linear-nobias", nn.Linear(5, 4, bias=False, rng=rng(0), dtype=F64), rand(3, 5)),
        ("LayerNorm", ln, rand(2, 3, 5)),
        ("RMSNorm", rms, rand(2, 3, 5)),
        ("ReLU", nn.ReLU(), away_from_zero(3, 5)),
        ("GELU", nn.GELU(), rand(3, 5)),
        ("Tanh", nn.Tanh(), rand(3, 5)),
        ("Sigmoid", nn.Sigmoid(), rand(3, 5)),
        ("Flatten", nn.Flatten(), rand(2, 3, 4)),
        ("Identity", nn.Identity(), rand(2, 3)),
        ("MHA", nn.MultiheadAttention(8, 2, rng=rng(1), dtype=F64), rand(2, 3, 8)),
        ("MHA-causal", nn.MultiheadAttention(8, 2, causal=True, rng=rng(1), dtype=F64), rand(2, 3, 8)),
        ("MLP", nn.MLP(4, 6, rng=rng(2), dtype=F64), rand(2, 4)),
        ("TransformerBlock", nn.TransformerBlock(8, 2, mlp_ratio=2, rng=rng(3), dtype=F64), rand(2, 3, 8)),
        ("Conv2d", nn.Conv2d(2, 3, 3, stride=2, padding=1, rng=rng(4), dtype=F64), rand(2, 2, 5, 5)),
        ("Conv2d-groups", nn.Conv2d(4, 2, (1, 2), groups=2, bias=False, rng=rng(4), dtype=F64), rand(1, 4, 3, 3)),
        ("MaxPool2d", nn.MaxPool2d(2), distinct(2, 2, 4, 4)),
        ("AvgPool2d", nn.AvgPool2d(3, stride=1, padding=1), rand(1, 2, 4, 4)),
        ("BatchNorm2d", bn, rand(4, 3, 2, 2)),
        ("Sequential", nn.Sequential(nn.Linear(4, 6, rng=rng(5), dtype=F64), nn.GELU(), nn.LayerNorm(6, dtype=F64),
                                     nn.Linear(6, 2, rng=rng(5), dtype=F64)), rand(3, 4)),
    ]


@pytest.mark.parametrize("name,module,x", layer_cases(), ids=[c[0] for c in layer_cases()])
def test_layer_grads(name, module, x):
    gradcheck(module, transposed(x), module=module)


def test_mha_with_additive_mask():
    mha = nn.MultiheadAttention(8, 2, causal=True, rng=np.random.default_rng(1), dtype=F64)
    mask = rand(3, 3, seed=5)
    gradcheck(lambda x: mha(x, attn_mask=mask), rand(2, 3, 8), module=mha)


def test_embedding_layer_grads():
    emb = nn.Embedding(6, 3, rng=np.random.default_rng(0), dtype=F64)
    gradcheck(emb, np.array([[0, 2, 2], [5, 0, 2]]), module=emb)


def test_batchnorm2d_eval_grads_and_buffers():
    bn = nn.BatchNorm2d(3, momentum=None, dtype=F64)
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var", "num_batches_tracked"]
    xs = [rand(4, 3, 2, 2, seed=s) for s in range(3)]
    for x in xs:
        bn(x)
    assert int(bn.num_batches_tracked) == 3
    # momentum=None: the running mean is the plain average of the batch means.
    np.testing.assert_allclose(bn.running_mean, np.mean([x.mean(axis=(0, 2, 3)) for x in xs], axis=0))
    sd = bn.state_dict()
    assert set(sd) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    bn.eval()
    before = bn.running_mean.copy()
    gradcheck(bn, rand(2, 3, 2, 2, seed=9), module=bn)
    np.testing.assert_array_equal(bn.running_mean, before)  # eval leaves the statistics alone
    fresh = nn.BatchNorm2d(3, dtype=F64)
    fresh.load_state_dict(sd)
    assert int(fresh.num_batches_tracked) == 3


def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(comm):
    """Each rank holds a slice (uneven sizes) of one global batch; values, input gradients, parameter
    gradients (summed over ranks, as DDP's average times the world) and running statistics match
    BatchNorm2d on the concatenated batch in one process."""
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = [2 + r % 2 for r in range(size)]
    x = rand(sum(counts), 3, 2, 3, seed=1) * 2 + 0.5
    dy = rand(*x.shape, seed=2)
    start = sum(counts[:rank])
    part = slice(start, start + counts[rank])

    ref = nn.BatchNorm2d(3, dtype=F64)
    ref.weight.data, ref.bias.data = rand(3, seed=3), rand(3, seed=4)
    xr = nn.Tensor(x, requires_grad=True)
    ref_y = ref(xr)
    ref_y.backward(dy)

    sync = nn.SyncBatchNorm(3, comm, dtype=F64)
    sync.weight.data, sync.bias.data = rand(3, seed=3), rand(3, seed=4)
    xs = nn.Tensor(x[part], requires_grad=True)
    y = sync(xs)
    np.testing.assert_allclose(y.data, ref_y.data[part], rtol=1e-10, atol=1e-12)
    y.backward(dy[part])
    np.testing.assert_allclose(xs.grad, xr.grad[part], rtol=1e-10, atol=1e-12)
    for name in ("weight", "bias"):
        total = comm.allreduce(getattr(sync, name).grad)
        np.testing.assert_allclose(total, getattr(ref, name).grad, rtol=1e-10, err_msg=name)
    np.testing.assert_allclose(sync.running_mean, ref.running_mean, rtol=1e-12)
    np.testing.assert_allclose(sync.running_var, ref.running_var, rtol=1e-12)
    sync.eval()
    ref.eval()
    np.testing.assert_allclose(sync(x[part]).data, ref(x).data[part], rtol=1e-12)
