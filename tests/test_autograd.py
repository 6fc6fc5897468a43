"""Autograd: every op and layer against central finite differences (float64), and the engine's rules.

Gradient checks use random shapes with broadcasting and non-contiguous inputs (Fortran-ordered and
strided views); the reference is ``tests/gradcheck.py`` (finite differences of the forward alone).
"""

import tracemalloc

import numpy as np
import pytest

import mpidist
import mpidist.nn as nn
from mpidist.nn import functional as F
from gradcheck import gradcheck, numeric_grad, strided, transposed

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
    gradcheck(lambda t: 2.0 * t - t / 3.0 + 1.0 - (-t) + 2.0 / (t + 3.0) - (1.0 - t), a)  # reflected ops
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


# -- the engine -------------------------------------------------------------------------------------------

def mlp(seed=0, dropout=0.0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(4, 8, rng=rng, dtype=F64), nn.Tanh(), nn.Dropout(dropout),
                         nn.Linear(8, 8, rng=rng, dtype=F64), nn.GELU(), nn.Linear(8, 3, rng=rng, dtype=F64))


def spy_needs(module):
    """Record the ``needs`` every backward of ``module``'s output node receives."""
    seen = []

    def hook(mod, args, out):
        node = out.grad_fn
        if node is None:  # nothing required grad: no node
            return
        inner = node.backward_fn

        def backward(g, needs):
            seen.append(tuple(needs))
            return inner(g, needs)
        node.backward_fn = backward
    module.register_forward_hook(hook)
    return seen


def test_tied_parameter_hook_fires_once_after_last_use():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4, rng=np.random.default_rng(0), dtype=F64)
            self.mid = nn.Linear(4, 4, rng=np.random.default_rng(1), dtype=F64)

        def forward(self, idx):
            h = F.tanh(self.mid(self.emb(idx)))
            return F.linear(h, self.emb.weight)  # the table again, as the output projection

    model = Tied()
    fired = []
    model.emb.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.copy()))
    idx = np.array([[0, 3, 3], [4, 1, 0]])
    dy = rand(2, 3, 5, seed=2)
    model(idx).backward(dy)
    assert len(fired) == 1
    np.testing.assert_array_equal(fired[0], model.emb.weight.grad)  # final when it fired
    # The final gradient is the sum of both uses: against finite differences.
    gradcheck(model, idx, module=model)
    # A second backward fires it once more and accumulates.
    model.zero_grad()
    model(idx).backward(dy)
    model(idx).backward(dy)
    assert len(fired) == 4  # 1 before, 1 in gradcheck's own backward, then one per backward
    np.testing.assert_allclose(model.emb.weight.grad, 2 * fired[0])


def test_gradients_flow_only_to_what_requires_them():
    model = mlp()
    first, last = spy_needs(model[0]), spy_needs(model[5])
    x = rand(2, 4)
    model(x).backward(rand(2, 3, seed=1))
    assert first == [(False, True, True)]  # no input gradient for the first layer
    assert last == [(True, True, True)]
    xt = nn.Tensor(rand(2, 4), requires_grad=True)
    model(xt).backward(rand(2, 3, seed=1))
    assert first[-1] == (True, True, True) and xt.grad is not None
    model.zero_grad()
    model[5].requires_grad_(False)  # frozen head: its weight gradient is never computed
    model(x).backward(rand(2, 3, seed=1))
    assert last[-1] == (True, False, False) and model[5].weight.grad is None and model[0].weight.grad is not None
    model.requires_grad_(False)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(x).backward(rand(2, 3))


def test_no_aliasing_between_leaf_grads():
    a = nn.Tensor(rand(3), requires_grad=True)
    b = nn.Tensor(rand(3, seed=1), requires_grad=True)
    g = np.ones(3)
    (a + b).backward(g)
    assert a.grad is not b.grad and a.grad is not g and b.grad is not g
    a.grad += 1
    np.testing.assert_array_equal(b.grad, np.ones(3))
    np.testing.assert_array_equal(g, np.ones(3))
    c = nn.Tensor(rand(3), requires_grad=True)
    (c + c).backward(g)  # one leaf reached twice through one node
    np.testing.assert_array_equal(c.grad, 2 * g)
    d = nn.Tensor(rand(3), requires_grad=True)
    d.backward(g)  # the output is the leaf itself
    assert d.grad is not g
    np.testing.assert_array_equal(d.grad, g)


def test_retain_graph_and_second_backward_error():
    x = nn.Tensor(rand(3), requires_grad=True)
    y = (F.exp(x) * x).sum()
    y.backward(retain_graph=True)
    first = x.grad.copy()
    y.backward()
    np.testing.assert_allclose(x.grad, 2 * first)
    with pytest.raises(RuntimeError, match="already freed by an earlier backward; pass retain_graph=True"):
        y.backward()


def test_grad_returns_without_accumulating():
    x = nn.Tensor(rand(3), requires_grad=True)
    w = nn.Tensor(rand(3, seed=1), requires_grad=True)
    gx = nn.grad((x * w).sum(), x)
    np.testing.assert_array_equal(gx, w.data)
    assert x.grad is None and w.grad is None
    with pytest.raises(RuntimeError, match="was not used"):
        nn.grad((x * 2).sum(), [x, w])


def test_tensor_hooks_no_grad_detach():
    x = nn.Tensor(rand(3), requires_grad=True)
    h = x * 2
    seen = []
    handle = h.register_hook(lambda g: (seen.append(g.copy()), g * 10)[1])
    x.register_hook(lambda g: seen.append(g.copy()))
    (h * 3).sum().backward()
    np.testing.assert_array_equal(seen[0], np.full(3, 3.0))
    np.testing.assert_array_equal(x.grad, np.full(3, 60.0))  # the hook's return replaced the gradient
    handle.remove()
    x.grad = None
    (x * 2 * 3).sum().backward()
    np.testing.assert_array_equal(x.grad, np.full(3, 6.0))
    with nn.no_grad():
        assert (x * 2).grad_fn is None and not nn.is_grad_enabled()
    assert nn.is_grad_enabled()
    d = (x * 2).detach()
    assert d.grad_fn is None and not d.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        d.register_hook(lambda g: None)
    with pytest.raises(TypeError, match="only floating point tensors can require grad"):
        nn.Tensor(np.arange(3), requires_grad=True)


def test_backward_input_then_deferred_weights_equals_full_backward():
    x, dy = rand(2, 5, 4), rand(2, 5, 3, seed=1)
    full = mlp()
    xf = nn.Tensor(x, requires_grad=True)
    full(xf).backward(dy)

    split = mlp()
    xs = nn.Tensor(x, requires_grad=True)
    out = split(xs)
    (dx,), deferred = nn.backward_input(out, dy, [xs])
    assert len(deferred) > 0 and all(p.grad is None for p in split.parameters())  # W pass really deferred
    np.testing.assert_allclose(dx, xf.grad, rtol=1e-13)
    fired = []
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    deferred.run()
    assert len(fired) == len(list(split.parameters()))
    for (name, p), q in zip(full.named_parameters(), split.parameters()):
        np.testing.assert_allclose(q.grad, p.grad, rtol=1e-13, err_msg=name)
    with pytest.raises(RuntimeError, match="already ran"):
        deferred.run()


def test_backward_input_with_no_inputs_defers_everything():
    model = mlp()
    ref = mlp()
    x, dy = rand(3, 4), rand(3, 3, seed=1)
    ref(x).backward(dy)
    grads, deferred = nn.backward_input(model(x), dy, [])
    assert grads == [] and all(p.grad is None for p in model.parameters())
    deferred.run()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-13)


# -- hooks in grad(), backward_input() and the deferred weight pass (PyTorch's rules) -------------------------
def weighted_loss(model, x, dy):
    """The scalar sum(model(x) * dy) computed without a graph: the function finite differences look at."""
    with nn.no_grad():
        return float((model(nn.Tensor(x)).data * dy).sum())


def test_grad_fires_the_hooks_of_its_inputs_and_returns_what_they_return():
    model = mlp()
    x, dy = rand(3, 4), rand(3, 3, seed=1)
    numeric = numeric_grad(lambda: weighted_loss(model, x, dy), x)
    xt = nn.Parameter(x.copy())  # a leaf with a post-accumulate-grad hook, which grad() must not fire
    seen, accumulated = [], []
    xt.register_hook(lambda g: (seen.append(g.copy()), 3 * g)[1])
    xt.register_post_accumulate_grad_hook(lambda t: accumulated.append(t))
    got = nn.grad(model(xt), xt, grad_outputs=dy)
    assert len(seen) == 1 and not accumulated and xt.grad is None  # grad() accumulates nothing
    np.testing.assert_allclose(seen[0], numeric, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got, 3 * numeric, rtol=1e-6, atol=1e-8)


def test_backward_input_fires_input_hooks_now_and_parameter_hooks_in_the_weight_pass():
    model = mlp()
    x, dy = rand(3, 4), rand(3, 3, seed=1)
    numeric_x = numeric_grad(lambda: weighted_loss(model, x, dy), x)
    first = model[0].weight
    numeric_w = numeric_grad(lambda: weighted_loss(model, x, dy), first.data)
    xt = nn.Tensor(x, requires_grad=True)
    events = []
    xt.register_hook(lambda g: (events.append(("x", g.copy())), 2 * g)[1])
    first.register_hook(lambda g: events.append(("w", g.copy())))
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("final", name)))
    (dx,), deferred = nn.backward_input(model(xt), dy, [xt])
    assert [e[0] for e in events] == ["x"]
    np.testing.assert_allclose(events[0][1], numeric_x, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dx, 2 * numeric_x, rtol=1e-6, atol=1e-8)
    deferred.run()
    finals = [e[1] for e in events if e[0] == "final"]
    assert sorted(finals) == sorted(name for name, _ in model.named_parameters())  # each fires once
    (w,) = [e[1] for e in events if e[0] == "w"]
    np.testing.assert_allclose(w, numeric_w, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(first.grad, numeric_w, rtol=1e-6, atol=1e-8)


def test_the_weight_pass_fires_hooks_on_outputs_whose_whole_backward_was_deferred():
    """A first pipeline stage: nothing leads to an input, so all of backward runs in run(); the hooks of its
    output and of a tensor inside fire there, once each, and the output hook's return replaces its gradient."""
    model, ref = mlp(), mlp()
    x, dy = rand(3, 4), rand(3, 3, seed=1)
    ref(x).backward(2 * dy)
    events = []
    model[1].register_forward_hook(lambda m, a, out: (out.register_hook(lambda g: events.append("hidden")), None)[1])
    out = model(x)
    out.register_hook(lambda g: (events.append("out"), 2 * g)[1])
    grads, deferred = nn.backward_input(out, dy, [])
    assert grads == [] and events == []
    deferred.run()
    assert events == ["out", "hidden"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-13, err_msg=name)


def test_a_weight_callback_runs_before_the_deferred_gradients_and_may_queue_a_callback():
    model = mlp()
    xt = nn.Tensor(rand(3, 4), requires_grad=True)
    events = []

    def at_weight_pass():
        events.append(("before W", [p.grad is None for p in model.parameters()]))
        nn.queue_callback(lambda: events.append(("end of W", [p.grad is not None for p in model.parameters()])))

    def on_output_grad(g):
        events.append(("B", nn.autograd.weights_deferred()))
        nn.autograd.queue_weight_callback(at_weight_pass)

    out = model(xt)
    out.register_hook(on_output_grad)
    _, deferred = nn.backward_input(out, rand(3, 3, seed=1), [xt])
    assert events == [("B", True)]
    deferred.run()
    n = len(list(model.parameters()))
    assert events[1:] == [("before W", [True] * n), ("end of W", [True] * n)]
    assert not nn.autograd.weights_deferred()
    with pytest.raises(RuntimeError, match="no backward_input pass is running"):
        nn.autograd.queue_weight_callback(lambda: None)
    seen = []
    y = model(xt)
    y.register_hook(lambda g: seen.append(nn.autograd.weights_deferred()))
    y.backward(rand(3, 3, seed=2))
    assert seen == [False]  # an ordinary backward defers nothing


def saved_bytes(out):
    """Bytes of activation arrays the graph behind ``out`` keeps alive: arrays (and tensors' arrays) held
    in backward closures, each underlying buffer counted once, parameters excluded."""
    params, seen_nodes, bases, stack = set(), set(), {}, [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for edge in node.edges:
            if edge is not None:
                if isinstance(edge[0], nn.Tensor) and edge[0].grad_fn is None:
                    params.add(id(edge[0].data))
                else:
                    stack.append(edge[0])
        fn = node.backward_fn
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if c.cell_contents is not None]
        while cells:
            v = cells.pop()
            if isinstance(v, (tuple, list)):
                cells.extend(v)
            elif isinstance(v, nn.Tensor):
                cells.append(v.data)
            elif isinstance(v, np.ndarray) and v.size > 1:
                base = v
                while isinstance(base.base, np.ndarray):
                    base = base.base
                bases[id(base)] = base
    return sum(b.nbytes for i, b in bases.items() if i not in params)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_keeps_its_mask_as_one_byte_per_element(dtype):
    """Backward keeps the mask as booleans (as Megatron-LM does): the graph holds x.size bytes; forward and the
    gradient are x and g times the mask's 0 or 1 / (1 - p), drawn from the generator's next uniform draw."""
    x = np.random.default_rng(0).standard_normal((6, 10)).astype(dtype)
    g = np.random.default_rng(1).standard_normal((6, 10)).astype(dtype)
    xt = nn.Tensor(x, requires_grad=True)
    out = F.dropout(xt * 1.0, 0.25, generator=np.random.default_rng(7))   # its input an activation, not a leaf
    assert saved_bytes(out) == x.size   # the mask only: neither the input nor a multiplier of its dtype
    keep = np.random.default_rng(7).random(x.shape, dtype=np.float32) >= 0.25
    multiplier = keep.astype(dtype) * dtype(1 / 0.75)
    np.testing.assert_array_equal(out.data, x * multiplier)
    out.backward(g)
    np.testing.assert_array_equal(xt.grad, g * multiplier)


def test_checkpoint_with_dropout_same_gradients_and_fewer_saved_bytes(capsys):
    def make():
        rng = np.random.default_rng(0)
        blocks = [nn.Sequential(nn.Linear(32, 64, rng=rng, dtype=F64), nn.GELU(), nn.Dropout(0.3),
                                nn.Linear(64, 32, rng=rng, dtype=F64)) for _ in range(4)]
        return nn.Sequential(*blocks)

    x, dy = rand(16, 32), rand(16, 32, seed=1)
    results = {}
    for ckpt in (False, True):
        model = make()
        for block in model:
            block.activation_checkpointing = ckpt
        nn.manual_seed(11)
        xt = nn.Tensor(x, requires_grad=True)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        out = model(xt)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        walked = saved_bytes(out)
        after_forward = nn.default_generator().bit_generator.state
        out.backward(dy)
        # The recompute replays the masks and leaves the generator where the forward left it.
        assert nn.default_generator().bit_generator.state == after_forward
        results[ckpt] = (out.data.copy(), xt.grad, [p.grad for p in model.parameters()], walked, held)
    (y0, dx0, g0, w0, h0), (y1, dx1, g1, w1, h1) = results[False], results[True]
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-13)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-13)
    with capsys.disabled():
        print(f"\ncheckpoint saved-activation bytes (4 blocks 32-64-32, batch 16, float64): "
              f"graph walk {w0} -> {w1}, tracemalloc after forward {h0} -> {h1}")
    assert w1 < w0 / 2 and h1 < h0


def test_checkpoint_function_form_and_module_flag_agree():
    block = nn.Sequential(nn.Linear(4, 6, rng=np.random.default_rng(0), dtype=F64), nn.Dropout(0.5), nn.Tanh())
    x = rand(3, 4)
    outs = []
    for form in ("plain", "function"):
        block.zero_grad()
        nn.manual_seed(2)
        xt = nn.Tensor(x, requires_grad=True)
        out = block(xt) if form == "plain" else nn.recompute(block, xt)
        out.backward(rand(3, 6, seed=1))
        outs.append((xt.grad, [p.grad for p in block.parameters()]))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-13)
    for a, b in zip(outs[0][1], outs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-13)


# -- seeding ----------------------------------------------------------------------------------------------

def test_manual_seed_layers_differ_and_same_seed_same_model():
    mpidist.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    assert not np.array_equal(a.weight.data, b.weight.data)
    mpidist.manual_seed(42)
    m1 = mlp_default()
    mpidist.manual_seed(42)
    m2 = mlp_default()
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    mpidist.manual_seed(43)
    assert not np.array_equal(mlp_default()[0].weight.data, m1[0].weight.data)


def mlp_default():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Conv2d(1, 2, 3), nn.Embedding(5, 3))


def test_manual_seed_gives_every_rank_the_same_model(comm):
    mpidist.manual_seed(7 + 0 * comm.Get_rank())
    model = mlp_default()
    flat = np.concatenate([p.data.ravel() for p in model.parameters()]).astype(F64)
    everyone = comm.allgather(flat)
    for r, other in enumerate(everyone):
        np.testing.assert_array_equal(other, flat, err_msg=f"rank {r} built a different model")


# -- forward hooks ----------------------------------------------------------------------------------------

def test_forward_hooks_pre_post_kwargs_prepend_removal():
    class Scale(nn.Module):
        def forward(self, x, factor=1.0):
            return x * factor

    m = Scale()
    calls = []
    h1 = m.register_forward_pre_hook(lambda mod, args: (calls.append("pre"), (args[0] + 1,))[1])
    h2 = m.register_forward_pre_hook(lambda mod, args, kwargs: (calls.append("pre-kw"), (args, {"factor": 3.0}))[1],
                                     with_kwargs=True)
    h3 = m.register_forward_pre_hook(lambda mod, args: calls.append("first"), prepend=True)
    h4 = m.register_forward_hook(lambda mod, args, out: (calls.append("post"), out + 100)[1])
    h5 = m.register_forward_hook(lambda mod, args, kwargs, out: calls.append(("post-kw", kwargs["factor"])),
                                 with_kwargs=True)
    h6 = m.register_forward_hook(lambda mod, args, out: calls.append("post-first"), prepend=True)
    x = nn.Tensor(np.ones(2), requires_grad=True)
    y = m(x, factor=2.0)
    assert calls == ["first", "pre", "pre-kw", "post-first", "post", ("post-kw", 3.0)]
    np.testing.assert_array_equal(y.data, (1 + 1) * 3.0 + 100)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])  # hooks' ops are part of the graph
    for h in (h1, h2, h3, h4, h5, h6):
        h.remove()
    h1.remove()  # idempotent
    calls.clear()
    np.testing.assert_array_equal(m(x, factor=2.0).data, [2.0, 2.0])
    assert calls == []


def test_reductions_to_a_scalar_hold_an_array():
    # numpy's full reductions return numpy scalars; a Tensor must hold a 0-d ndarray (np.asarray of it).
    for t in (F.mean(rand(3)), F.sum(nn.Tensor(rand(3), requires_grad=True)), nn.Tensor(np.float64(2.0))):
        assert type(t.data) is np.ndarray and t.data.shape == ()
        assert np.asarray(t).shape == () and float(t) == float(t.data)


def test_sync_batch_norm_float32_with_a_large_mean(comm):
    # E[x^2] - E[x]^2 in float32 would lose the variance of data with mean 1000 and spread 1.
    x = (rand(4 * comm.Get_size(), 2, 3, seed=1) + 1000.0).astype(np.float32)
    rank = comm.Get_rank()
    sync = nn.SyncBatchNorm(2, comm)
    y = sync(x[4 * rank:4 * rank + 4]).data
    ref = nn.BatchNorm2d(2)(x).data[4 * rank:4 * rank + 4]
    np.testing.assert_allclose(y, ref, atol=2e-3)
    np.testing.assert_allclose(sync.running_var, 0.9 + 0.1 * x.astype(F64).var(axis=(0, 2)) * x[:, 0].size
                               / (x[:, 0].size - 1), rtol=1e-4)


def test_backward_inputs_and_no_grad_decorator():
    a = nn.Tensor(rand(3), requires_grad=True)
    b = nn.Tensor(rand(3, seed=1), requires_grad=True)
    nn.backward((a * b).sum(), inputs=[a])
    np.testing.assert_array_equal(a.grad, b.data)
    assert b.grad is None

    @nn.no_grad()
    def infer(t):
        return t * 2

    assert infer(a).grad_fn is None and nn.is_grad_enabled()


def test_checkpoint_passes_gradients_to_keyword_tensors():
    x = nn.Tensor(rand(3), requires_grad=True)
    m = nn.Tensor(rand(3, seed=1), requires_grad=True)
    out = nn.recompute(lambda a, scale=None: F.tanh(a * scale), x, scale=m * 2)
    out.sum().backward()
    t = np.tanh(x.data * m.data * 2)
    np.testing.assert_allclose(x.grad, (1 - t * t) * m.data * 2)
    np.testing.assert_allclose(m.grad, (1 - t * t) * x.data * 2)  # was None: keyword inputs were dropped


def test_cnn_with_sync_batch_norm_under_ddp_matches_one_process(comm):
    """DDP (small buckets, overlap on) over a CNN whose BatchNorms are SyncBatchNorm, each rank with its
    slice of the global batch, trains to the parameters and running statistics of one process with
    BatchNorm2d on the whole batch (3 SGD steps, float64)."""
    from mpidist import DDP, optim

    def cnn():
        rng = np.random.default_rng(0)
        return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, rng=rng, dtype=F64), nn.BatchNorm2d(3, dtype=F64),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, rng=rng, dtype=F64),
                             nn.BatchNorm2d(4, dtype=F64), nn.Tanh(), nn.Flatten(),
                             nn.Linear(16, 5, rng=rng, dtype=F64))

    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank = 3
    ref = cnn()
    ref_opt = optim.SGD(list(ref.parameters()), lr=0.1)
    model = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(cnn(), comm), comm, bucket_cap_mb=1e-4,
                first_bucket_mb=1e-4)
    opt = optim.SGD(list(model.parameters()), lr=0.1)
    crit = nn.CrossEntropyLoss()
    for step in range(3):
        x = rand(per_rank * size, 1, 8, 8, seed=10 + step)
        y = np.random.default_rng(20 + step).integers(0, 5, per_rank * size)
        ref_opt.zero_grad()
        crit(ref(x), y).backward()
        ref_opt.step()
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        crit(model(x[part]), y[part]).backward()
        opt.step()
    got = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
    for name, want in ref.state_dict().items():
        np.testing.assert_allclose(got[name], want, rtol=1e-9, atol=1e-12, err_msg=f"{name} on rank {rank}")
