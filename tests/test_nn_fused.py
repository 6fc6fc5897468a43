"""The fused, in-place forms of GELU, LayerNorm, attention, the bias gradient and the embedding's backward.

Their float32 rounding differs from the plain formulas (fewer passes, row sums as BLAS products, dO . O for
attention's row term), so each is held to a float64 evaluation of the textbook formula on the same inputs:
relative error at most ``RTOL`` = 2e-5 of the reference's scale (float32 carries 6e-8 per rounding; these
ops round a few dozen times along a row of up to 256 terms). ``multi_head_attention`` is also checked, in
float64, against splitting the heads and calling ``scaled_dot_product_attention`` (1e-12), and by gradcheck.
"""

import math
import resource
import sys

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import functional as F
from mpidist.nn.allocator import retain_freed_memory
from tests import reference_ops
from tests.gradcheck import gradcheck
from test_autograd import saved_bytes

RTOL = 2e-5


def _close(got, ref, rtol=RTOL):
    """Assert ``got`` (float32) is within ``rtol`` of the float64 ``ref``, measured against ref's largest value."""
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - ref).max()) / scale
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


def _grads(fn, arrays, dy):
    ts = [nn.Tensor(a, requires_grad=True) for a in arrays]
    out = fn(*ts)
    out.backward(dy)
    return out.data, [t.grad for t in ts]


def _gelu64(x):
    c, k = math.sqrt(2 / math.pi), 0.044715
    u = c * (x + k * x ** 3)
    t = np.tanh(u)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)


@pytest.mark.parametrize("shape", [(64, 96), (2 * F._CHUNK + 7,)])  # one slice; three, the last a short one
def test_gelu_float32_within_float64_reference(shape):
    x = np.random.default_rng(0).uniform(-8, 8, shape).astype(np.float32)
    dy = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
    out, (gx,) = _grads(F.gelu, [x], dy)
    ref, deriv = _gelu64(x.astype(np.float64))
    assert out.dtype == gx.dtype == np.float32
    _close(out, ref)
    _close(gx, deriv * dy)


def _layer_norm64(x, w, b, dy, eps):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = 1 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    dxhat = dy * w
    gx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    lead = tuple(range(x.ndim - 1))
    return xhat * w + b, gx, (dy * xhat).sum(lead), dy.sum(lead)


@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_layer_norm_float32_within_float64_reference(offset):
    rng = np.random.default_rng(2)
    x = (offset + rng.standard_normal((4, 32, 256))).astype(np.float32)
    w, b = rng.standard_normal(256).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    out, (gx, gw, gb) = _grads(lambda x, w, b: F.layer_norm(x, w, b), [x, w, b], dy)
    refs = _layer_norm64(*(a.astype(np.float64) for a in (x, w, b, dy)), 1e-5)
    for got, ref in zip((out, gx, gw, gb), refs):
        assert got.dtype == np.float32 and got.shape == ref.shape
        _close(got, ref)


def test_layer_norm_without_weight_and_bias_float32_within_float64_reference():
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 8, 64)).astype(np.float32), rng.standard_normal((2, 8, 64)).astype(np.float32)
    out, (gx,) = _grads(F.layer_norm, [x], dy)
    ones, zeros = np.ones(64), np.zeros(64)
    ref, ref_gx, _, _ = _layer_norm64(x.astype(np.float64), ones, zeros, dy.astype(np.float64), 1e-5)
    _close(out, ref)
    _close(gx, ref_gx)


def _attention64(q, k, v, dy, causal):
    """Softmax attention and its gradients in float64, by the textbook formulas (heads as leading axes)."""
    s = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.swapaxes(-1, -2) * s
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = dy @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * s
    return p @ v, ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ dy


def _heads(a, h):  # (b, t, d) -> (b, h, t, d / h)
    b, t, d = a.shape
    return a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)


def _merge(a):  # (b, h, t, hd) -> (b, t, h * hd)
    b, h, t, hd = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b, t, h * hd)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_float32_within_float64_reference(causal):
    rng = np.random.default_rng(4)
    b, t, h, d = 2, 48, 4, 64
    qkv = rng.standard_normal((b, t, 3 * d)).astype(np.float32)
    dy = rng.standard_normal((b, t, d)).astype(np.float32)
    q, k, v = (_heads(a.astype(np.float64), h) for a in np.split(qkv, 3, axis=-1))
    ref_out, ref_gq, ref_gk, ref_gv = _attention64(q, k, v, _heads(dy.astype(np.float64), h), causal)
    ref_grad = np.concatenate([_merge(g) for g in (ref_gq, ref_gk, ref_gv)], axis=-1)
    out, (grad,) = _grads(lambda x: F.multi_head_attention(x, h, is_causal=causal), [qkv], dy)
    assert out.dtype == grad.dtype == np.float32
    _close(out, _merge(ref_out))
    _close(grad, ref_grad)
    # The per-head op on (b, h, t, hd) tensors rounds the same way up to its own row term.
    out, grads = _grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        [np.ascontiguousarray(a.astype(np.float32)) for a in (q, k, v)],
                        _heads(dy, h))
    _close(out, ref_out)
    for got, ref in zip(grads, (ref_gq, ref_gk, ref_gv)):
        _close(got, ref)


@pytest.mark.parametrize("mask", [None, "additive", "bool"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_multi_head_attention_is_split_heads_attention(mask, causal, dropout):
    # Against the unfused composition the layer used before: split, per-head attention, heads merged.
    rng = np.random.default_rng(5)
    b, t, h, d = 2, 5, 2, 8
    qkv, dy = rng.standard_normal((b, t, 3 * d)), rng.standard_normal((b, t, d))
    m = {None: None, "additive": rng.standard_normal((t, t)), "bool": rng.random((t, t)) > 0.3}[mask]
    if mask == "bool":
        m[:, 0] = True  # every query sees some key

    def split(x):
        parts = F.permute(F.reshape(x, (b, t, 3, h, d // h)), (2, 0, 3, 1, 4))
        q, k, v = (F.reshape(a, (b, h, t, d // h)) for a in F.split(parts, 3, axis=0))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, dropout_p=dropout)
        return F.reshape(F.permute(y, (0, 2, 1, 3)), (b, t, d))

    nn.manual_seed(7)
    ref, (ref_grad,) = _grads(split, [qkv], dy)
    nn.manual_seed(7)  # the same dropout mask: one draw of the (b, h, t, t) probabilities' shape
    out, (grad,) = _grads(lambda x: F.multi_head_attention(x, h, attn_mask=m, is_causal=causal, dropout_p=dropout),
                          [qkv], dy)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_multi_head_attention_gradcheck():
    rng = np.random.default_rng(6)
    m = rng.standard_normal((4, 4))
    gradcheck(lambda x: F.multi_head_attention(x, 2, attn_mask=m, is_causal=True), rng.standard_normal((2, 4, 12)))
    gradcheck(lambda x: F.multi_head_attention(x, 3, dropout_p=0.2), rng.standard_normal((1, 3, 18)),
              reset=lambda: nn.manual_seed(3))


def test_multi_head_attention_layer_output_and_input_gradient_share_no_copies():
    # The layer's attention output is the (batch, seq, dim) array the output projection reads, and the input
    # gradient is written straight into one (batch, seq, 3 dim) array (no split/concatenate on the way back).
    rng = np.random.default_rng(8)
    qkv = nn.Tensor(rng.standard_normal((2, 6, 24)).astype(np.float32), requires_grad=True)
    y = F.multi_head_attention(qkv, 4, is_causal=True)
    assert y.shape == (2, 6, 8) and y.data.flags.c_contiguous
    y.backward(np.ones(y.shape, np.float32))
    assert qkv.grad.shape == (2, 6, 24) and qkv.grad.flags.c_contiguous


def test_multi_head_attention_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"multi_head_attention: expected \(batch, seq, 3 \* dim\) with dim "
                                         r"divisible by num_heads=4 \(qkv: \(2, 3, 18\)\)"):
        F.multi_head_attention(np.zeros((2, 3, 18)), 4)
    with pytest.raises(ValueError, match=r"qkv: \(2, 10\)"):
        F.multi_head_attention(np.zeros((2, 10)), 1)


def test_linear_bias_gradient_float32_within_float64_reference():
    rng = np.random.default_rng(9)
    x, dy = rng.standard_normal((8, 256, 32)).astype(np.float32), rng.standard_normal((8, 256, 16)).astype(np.float32)
    lin = nn.Linear(32, 16, rng=rng)
    lin(nn.Tensor(x)).backward(dy)
    _close(lin.bias.grad, dy.astype(np.float64).sum(axis=(0, 1)))
    _close(lin.weight.grad, dy.astype(np.float64).reshape(-1, 16).T @ x.astype(np.float64).reshape(-1, 32))


def test_embedding_gradient_sums_repeated_rows_within_float64_reference():
    rng = np.random.default_rng(10)
    idx = rng.integers(0, 7, (5, 40))
    dy = rng.standard_normal((5, 40, 3)).astype(np.float32)
    w = nn.Tensor(np.zeros((9, 3), np.float32), requires_grad=True)
    F.embedding(idx, w).backward(dy)
    ref = np.zeros((9, 3))
    np.add.at(ref, idx.reshape(-1), dy.reshape(-1, 3).astype(np.float64))
    assert w.grad.dtype == np.float32
    _close(w.grad, ref)
    assert not w.grad[7:].any()


def _page_faults_of_a_fresh_array(nbytes):
    """Minor page faults of allocating, touching and freeing ``nbytes`` of float64 (after one warm-up round)."""
    np.ones(nbytes // 8).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(nbytes // 8).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


# mpi_skip: under mpiexec the MPI library's memory hooks (UCX's registration cache) keep unmapped pages mapped, so
# the default path stops faulting too; the allocator is process-local and needs no MPI to be tested.
@pytest.mark.mpi_skip
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_retain_freed_memory_reuses_freed_pages():
    # 2 MiB is 512 pages (below numpy's 4 MiB huge-page advice): served by mmap and unmapped on free under
    # glibc's starting thresholds, so every round faults them in again; retained, a round reuses the last one's.
    nbytes = 2 << 20
    try:
        if not retain_freed_memory():
            pytest.skip("no glibc mallopt")
        retained = _page_faults_of_a_fresh_array(nbytes)
        assert retain_freed_memory(False)
        default = _page_faults_of_a_fresh_array(nbytes)
    finally:
        retain_freed_memory(False)
    assert retained < 50, retained
    assert default > 400, default


def test_retain_freed_memory_rejects_bad_threshold():
    with pytest.raises(ValueError, match=r"retain_freed_memory: threshold_bytes must be in \(0, 2\*\*31\) \(got 0\)"):
        retain_freed_memory(threshold_bytes=0)


@pytest.mark.parametrize("b, t, h", [(9, 64, 4), (7, 141, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_sequence_by_sequence_is_split_heads_attention(causal, b, t, h):
    # Long enough that the plain path runs a few sequences at a time (their scores fill _SCORES_CHUNK), and with a
    # batch that does not divide evenly into those runs; at t = 141 causal attention runs in two row blocks of
    # unequal length (70 and 71 rows).
    rng = np.random.default_rng(11)
    d = 8
    per = max(1, F._SCORES_CHUNK // (h * t * t))
    assert 1 < -(-b // per) and b % per
    assert len(F._causal_row_blocks(t)) == (1 if t == 64 else 2)
    qkv, dy = rng.standard_normal((b, t, 3 * d)), rng.standard_normal((b, t, d))

    def split(x):
        parts = F.permute(F.reshape(x, (b, t, 3, h, d // h)), (2, 0, 3, 1, 4))
        q, k, v = (F.reshape(a, (b, h, t, d // h)) for a in F.split(parts, 3, axis=0))
        return F.reshape(F.permute(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (0, 2, 1, 3)), (b, t, d))

    ref, (ref_grad,) = _grads(split, [qkv], dy)
    out, (grad,) = _grads(lambda x: F.multi_head_attention(x, h, is_causal=causal), [qkv], dy)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.2)])
def test_cross_entropy_float32_within_float64_reference(reduction, smoothing):
    # Backward reuses the forward's exponentials and their row sums; log p is formed only at the labels.
    rng = np.random.default_rng(11)
    z = (4 * rng.standard_normal((6, 50, 64))).astype(np.float32)
    y = rng.integers(0, 64, (6, 50))
    y[0, :7] = -1  # ignored
    dy = np.float32(1.5) if reduction != "none" else rng.standard_normal((6, 50)).astype(np.float32)
    out, (gz,) = _grads(lambda t: F.cross_entropy(t, y, ignore_index=-1, label_smoothing=smoothing,
                                                 reduction=reduction), [z], dy)
    z64 = z.astype(np.float64).reshape(-1, 64)
    logp = z64 - z64.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    valid = (y.reshape(-1) != -1)
    safe = np.where(valid, y.reshape(-1), 0)
    target = np.full(z64.shape, smoothing / 64)
    target[np.arange(len(safe)), safe] += 1 - smoothing
    nll = -(target * logp).sum(-1) * valid
    grad = (np.exp(logp) - target) * valid[:, None]
    if reduction == "mean":
        ref, grad = nll.sum() / valid.sum(), grad * 1.5 / valid.sum()
    elif reduction == "sum":
        ref, grad = nll.sum(), grad * 1.5
    else:
        ref, grad = nll.reshape(6, 50), grad * dy.reshape(-1, 1)
    assert out.dtype == gz.dtype == np.float32
    _close(out, ref)
    _close(gz, grad.reshape(z.shape))


def _op_names(t):
    """Return the names of the ops in ``t``'s autograd graph."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or not hasattr(node, "edges") or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(node.name)
        todo.extend(e[0] for e in node.edges if e is not None)
    return names


@pytest.mark.world_sizes(2)
def test_tensor_parallel_attention_reads_its_heads_packed_without_copies(comm):
    # Each rank's projection is [q | k | v] of its heads: multi_head_attention's packed layout, so neither the
    # projection nor the output is reshaped, permuted or split on the way to the row-parallel projection.
    from mpidist.parallel.tensor import ParallelAttention
    layer = ParallelAttention(nn.MultiheadAttention(16, 4, causal=True, rng=np.random.default_rng(12)), comm)
    x = nn.Tensor(np.random.default_rng(13).standard_normal((2, 5, 16)).astype(np.float32), requires_grad=True)
    names = _op_names(layer(x))
    assert "MultiHeadAttention" in names
    assert not names & {"Permute", "Split", "Attention"}, names


def test_causal_attention_never_forms_the_scores_of_unseen_keys():
    # Query 0 against key t-1 overflows float32 (1e20 * 1e20); causal attention masks it, so nothing may depend on
    # it. Row block by row block, no query forms a score against keys past its block, so every value stays finite
    # and matches the float64 formula (which forms the score and masks it); the full (t, t) square gave NaN here.
    b, t, h, hd = 1, 128, 1, 2
    assert len(F._causal_row_blocks(t)) > 1
    rng = np.random.default_rng(13)
    q, k, v = (rng.uniform(0.5, 1.0, (b, t, hd)).astype(np.float32) for _ in range(3))
    q[..., 0] = k[..., 0] = 0.0
    q[0, 0], k[0, t - 1] = (1e20, 0.0), (1e20, 0.0)
    dy = rng.standard_normal((b, t, hd)).astype(np.float32)
    out, (grad,) = _grads(lambda x: F.multi_head_attention(x, h, is_causal=True),
                          [np.concatenate([q, k, v], axis=-1)], dy)
    assert np.isfinite(out).all() and np.isfinite(grad).all()
    ref_out, ref_gq, ref_gk, ref_gv = _attention64(*(a.astype(np.float64)[:, None] for a in (q, k, v, dy)), True)
    _close(out, ref_out[:, 0])
    np.testing.assert_allclose(grad[..., hd:], np.concatenate([ref_gk, ref_gv], axis=-1)[:, 0], rtol=1e-4, atol=1e-6)
    # dL/dq_0 is ds @ k: 1e20-sized rows of k meet zero score gradients; held to the reference's own scale.
    _close(grad[..., :hd], ref_gq[:, 0])


# -- the norms and GELU keep for backward what Megatron-LM keeps (Korthikanti et al. 2022, section 4.1) ----------
# LayerNorm and RMSNorm keep their input in its own dtype and per-row statistics, GELU its input alone; backward forms
# xhat and GELU's half-tanh again by the same operations, so outputs and gradients equal the old ops'
# (tests/reference_ops.py, which kept those arrays and float32 copies of 16-bit inputs) to the bit.

BF16 = nn.precision.bfloat16
# (activation dtype, parameter dtype): each dtype alone, and float32 activations with bfloat16 weights
NORM_DTYPES = [(np.float64, np.float64), (np.float32, np.float32), (BF16, BF16), (np.float16, np.float16),
               (np.float32, BF16)]
NORM_IDS = ["float64", "float32", "bfloat16", "float16", "float32-bfloat16_weights"]


def _assert_bits_equal(got, ref):
    assert (got.dtype, got.shape) == (ref.dtype, ref.shape)
    assert got.tobytes() == ref.tobytes(), f"{got.dtype}: differs in {int((got != ref).sum())} elements"


def _bitwise_same_as_old(new_op, old_op, arrays, dy, needs):
    """Assert ``new_op`` and ``old_op`` give the same bits: output, and the gradient of each input in ``needs``."""
    results = []
    for op in (new_op, old_op):
        ts = [nn.Tensor(a, requires_grad=r) for a, r in zip(arrays, needs)]
        out = op(*ts)
        out.backward(dy)
        results.append([out.data] + [t.grad for t in ts if t.requires_grad])
    for got, ref in zip(*results):
        _assert_bits_equal(got, ref)


def _norm_inputs(dtype, param_dtype, d=48):
    rng = np.random.default_rng(20)
    x = (3 + rng.standard_normal((2, 5, d))).astype(dtype)   # an offset mean: centering matters
    w = (1 + 0.1 * rng.standard_normal(d)).astype(param_dtype)
    b = (0.1 * rng.standard_normal(d)).astype(param_dtype)
    return x, w, b, rng.standard_normal(x.shape).astype(dtype)


@pytest.mark.parametrize("dtype,param_dtype", NORM_DTYPES, ids=NORM_IDS)
@pytest.mark.parametrize("needs", [(True, True, True), (True, True), (True,), (False, True, True)],
                         ids=["weight_bias", "weight", "plain", "weights_only"])   # the last: the weights' pass alone
def test_layer_norm_outputs_and_gradients_are_the_old_ones_bitwise(dtype, param_dtype, needs):
    x, w, b, dy = _norm_inputs(dtype, param_dtype)
    arrays = [x, w, b][:len(needs)]
    _bitwise_same_as_old(F.layer_norm, reference_ops.layer_norm, arrays, dy, needs)


@pytest.mark.parametrize("dtype,param_dtype", NORM_DTYPES, ids=NORM_IDS)
@pytest.mark.parametrize("needs", [(True, True), (True,), (False, True)], ids=["weight", "plain", "weight_only"])
def test_rms_norm_outputs_and_gradients_are_the_old_ones_bitwise(dtype, param_dtype, needs):
    x, w, _, dy = _norm_inputs(dtype, param_dtype)
    _bitwise_same_as_old(F.rms_norm, reference_ops.rms_norm, [x, w][:len(needs)], dy, needs)


@pytest.mark.parametrize("dtype,shape", [(np.float64, (5, 33)), (np.float32, (5, 33)),
                                         (np.float32, (2 * F._CHUNK + 7,))])   # three slices
def test_gelu_output_and_gradient_are_the_old_ones_bitwise(dtype, shape):
    rng = np.random.default_rng(21)
    x = rng.uniform(-6, 6, shape).astype(dtype)
    _bitwise_same_as_old(F.gelu, reference_ops.gelu, [x], rng.standard_normal(shape).astype(dtype), (True,))


@pytest.mark.parametrize("dtype,shape", [(np.float16, (5, 33)), (BF16, (5, 33)), (BF16, (2 * F._CHUNK + 3,))],
                         ids=["float16", "bfloat16", "bfloat16-three-slices"])
def test_16_bit_gelu_is_the_float32_gelu_rounded_once(dtype, shape):
    """A 16-bit GELU computes in float32 and rounds once, output and gradient, as a GPU's fused kernel does:
    the old float32 op on the upcast input and gradient, rounded to the input's dtype, to the bit."""
    rng = np.random.default_rng(23)
    x = rng.uniform(-6, 6, shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    t = nn.Tensor(x, requires_grad=True)
    out = F.gelu(t)
    out.backward(dy)
    t32 = nn.Tensor(x.astype(np.float32), requires_grad=True)
    ref = reference_ops.gelu(t32)
    ref.backward(dy.astype(np.float32))
    assert out.data.dtype == dtype and t.grad.dtype == dtype
    _assert_bits_equal(out.data, ref.data.astype(dtype))
    _assert_bits_equal(t.grad, t32.grad.astype(dtype))


def _activation(shape, dtype):
    """Return a computed (non-leaf) tensor of ``dtype``: made by a cast, which keeps no array for backward."""
    source = np.float32 if dtype == np.float64 else np.float64
    leaf = nn.Tensor(np.random.default_rng(22).standard_normal(shape).astype(source), requires_grad=True)
    return nn.precision.cast(leaf, np.dtype(dtype))


@pytest.mark.parametrize("dtype,param_dtype", NORM_DTYPES, ids=NORM_IDS)
def test_norms_keep_their_input_and_per_row_statistics_only(dtype, param_dtype):
    rows, d = 6, 40
    itemsize = np.dtype(dtype).itemsize
    stat = 8 if dtype == np.float64 else 4   # float32 statistics for 16-bit and float32 inputs
    x = _activation((2, 3, d), dtype)
    w = nn.Tensor(np.ones(d, param_dtype), requires_grad=True)
    b = nn.Tensor(np.zeros(d, param_dtype), requires_grad=True)
    assert saved_bytes(F.layer_norm(x, w, b)) == rows * d * itemsize + 2 * rows * stat   # mean and rstd
    assert saved_bytes(F.layer_norm(x)) == rows * d * itemsize + 2 * rows * stat
    assert saved_bytes(F.rms_norm(x, w)) == rows * d * itemsize + rows * stat            # 1 / rms


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16],
                         ids=["float64", "float32", "float16", "bfloat16"])
def test_gelu_keeps_its_input_only(dtype):
    x = _activation((4, 2 * F._CHUNK // 4 + 1), dtype)   # more than one slice
    assert saved_bytes(F.gelu(x)) == x.data.nbytes
