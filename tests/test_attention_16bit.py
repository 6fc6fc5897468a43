"""``F.multi_head_attention`` under 16-bit activations keeps what Megatron-LM keeps (Korthikanti et al., arXiv
2205.05198, section 4.1): the 16-bit qkv itself, the 16-bit output (the output projection's input) and the
probabilities rounded to 16 bits, which forward's product with V, backward and a recompute all read.

References: the previous implementation (copied below: the fp32 op that cast qkv up and kept float32 copies),
bitwise, for float32 and float64; a float64 evaluation of the textbook formula on the same 16-bit inputs (itself
checked by central finite differences); a numpy emulation of what forward computes (float32 scores and softmax,
probabilities rounded to 16 bits, their product with V) and the exact gradient of that function at the rounded
probabilities, including inputs where it is exactly zero (probabilities that round to 0) or cancels exactly; and
the bytes the autograd graph keeps, walked (``saved_bytes``), against a formula.
"""

import builtins
import math

import ml_dtypes
import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import functional as F
from mpidist.nn.autograd import make_result
from mpidist.nn.functional import (_SCORES_CHUNK, _attention_probs, _attention_scores_grad, _causal_row_blocks, _d,
                                   _matmul_into, _recomputed_probs, _row_dot, _softmax_scores_)
from mpidist.nn.precision import bfloat16, cast, float16, fp32_op
from mpidist.nn.random import generator_for_draw
from mpidist.xp import get_array_module
from test_autograd import saved_bytes

LOW = [bfloat16, float16]


# -- the implementation before this change (mpidist c57c541), the float32/float64 reference ----------------------

@fp32_op
def _previous_multi_head_attention(qkv, num_heads, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                                   training=True, generator=None, recompute_probs=False):
    """The previous op, verbatim."""
    X = _d(qkv)
    xp = get_array_module(X)
    if X.ndim != 3 or X.shape[-1] % 3 or (X.shape[-1] // 3) % num_heads:
        raise ValueError(f"multi_head_attention: expected (batch, seq, 3 * dim) with dim divisible by "
                         f"num_heads={num_heads} (qkv: {X.shape})")
    b, t, d = X.shape[0], X.shape[1], X.shape[2] // 3
    h, hd = num_heads, d // num_heads
    s = 1.0 / math.sqrt(hd) if scale is None else scale

    def heads(a):  # (b, t, 3 d) -> q, k, v as (b, h, t, hd) views
        parts = a.reshape(b, t, 3, h, hd)
        return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))

    Q, K, V = heads(X)
    # Without a mask or dropout, sequence by sequence (as many as fill _SCORES_CHUNK scores): the scores' passes (scale,
    # causal bias, shift, exp, sum, division) and the product with V then read a slice that is still in L2.
    by_sequence = xp is np and attn_mask is None and not (dropout_p and training) and t
    # Causal: row block [r0, r1) sees keys [0, r1) only, so its scores, softmax and products stop there (3/4
    # of the square with two blocks); the scores right of r1 are never formed, read or written (and backward
    # reads the same regions). Without a mask, one block: the whole square.
    blocks = _causal_row_blocks(t) if is_causal else ((0, t),)
    per = builtins.max(1, _SCORES_CHUNK // (h * t * t)) if by_sequence else b

    def causal_bias():
        return xp.triu(xp.full((t, t), -np.inf, dtype=X.dtype), k=1) if is_causal else None

    def sequence_probs(Q, K, lo, p, bias, V=None, out4=None):
        """Write the probabilities of sequences [lo, lo + len(p)) into ``p`` (the same products and passes in
        forward and in a recompute: the same bits); with ``V``, each row block's product with V into ``out4``."""
        i = slice(lo, lo + p.shape[0])
        for r0, r1 in blocks:
            pr = p[:, :, r0:r1, :r1]
            _matmul_into(Q[i, :, r0:r1], K[i, :, :r1].swapaxes(-1, -2), pr)
            _softmax_scores_(pr, s, None if bias is None else bias[r0:r1, :r1])
            if V is not None:
                _matmul_into(pr, V[i, :, :r1], out4[i, :, r0:r1])
        return p

    start = None   # recompute with dropout: the generator and its state before the mask's draw
    if by_sequence:
        # A recompute keeps no probabilities: one slice's worth of scratch, reused slice by slice.
        probs, drop = xp.empty((builtins.min(per, b) if recompute_probs else b, h, t, t), dtype=X.dtype), None
        out = xp.empty((b, t, h, hd), dtype=X.dtype)
        out4 = out.transpose(0, 2, 1, 3)
        bias = causal_bias()
        for lo in range(0, b, per):
            n = builtins.min(per, b - lo)
            sequence_probs(Q, K, lo, probs[:n] if recompute_probs else probs[lo:lo + n], bias, V, out4)
        del bias
    else:
        if recompute_probs and dropout_p and training:
            gen = generator_for_draw(generator)
            start = (gen, gen.bit_generator.state)
        probs, drop = _attention_probs(Q, K, s, is_causal, attn_mask, dropout_p, training, generator)
        # the previous op held the multiplier, formed so (the helper now returns the booleans)
        drop = None if drop is None else drop.keep.astype(probs.dtype) / probs.dtype.type(1 - dropout_p)
        out = xp.empty((b, t, h, hd), dtype=np.result_type(probs.dtype, V.dtype))
        out4 = out.transpose(0, 2, 1, 3)
        _matmul_into(probs * drop if drop is not None else probs, V, out4)
    if recompute_probs:
        probs = drop = None   # the backward closure holds neither

    def backward(g, n):
        Q, K, V = heads(_d(qkv))
        G = g.reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        grad = xp.empty((b, t, 3, h, hd), dtype=np.result_type(g.dtype, X.dtype))
        gq, gk, gv = (grad[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        if by_sequence:
            dp = xp.empty((builtins.min(per, b), h, t, t), dtype=np.result_type(G.dtype, V.dtype))
            scratch = xp.empty((builtins.min(per, b), h, t, t), dtype=X.dtype) if recompute_probs else None
            bias = causal_bias() if recompute_probs else None
            for lo in range(0, b, per):
                i, k = slice(lo, lo + per), builtins.min(per, b - lo)
                p = sequence_probs(Q, K, lo, scratch[:k], bias) if recompute_probs else probs[i]
                Gi, ds = G[i], dp[:k]
                row_dot = _row_dot(Gi, out4[i])
                for r0, r1 in blocks:  # the scores' gradient, row block by row block, on the forward's regions
                    dsr = ds[:, :, r0:r1, :r1]
                    _matmul_into(Gi[:, :, r0:r1], V[i, :, :r1].swapaxes(-1, -2), dsr)
                    _attention_scores_grad(dsr, p[:, :, r0:r1, :r1], row_dot[:, :, r0:r1], s)
                    _matmul_into(dsr, K[i, :, :r1], gq[i, :, r0:r1])
                # Keys [c0, c1) are seen by the rows from c0 on: the column block of the same regions.
                for c0, c1 in blocks:
                    _matmul_into(p[:, :, c0:, c0:c1].swapaxes(-1, -2), Gi[:, :, c0:], gv[i, :, c0:c1])
                    _matmul_into(ds[:, :, c0:, c0:c1].swapaxes(-1, -2), Q[i, :, c0:], gk[i, :, c0:c1])
            return (grad.reshape(b, t, 3 * d),)
        P, D = probs, drop
        if recompute_probs:
            P, D = _recomputed_probs(Q, K, s, is_causal, attn_mask, dropout_p, training, generator, start)
            D = None if D is None else D.keep.astype(P.dtype) / P.dtype.type(1 - dropout_p)
        _matmul_into((P * D if D is not None else P).swapaxes(-1, -2), G, gv)
        dp = G @ V.swapaxes(-1, -2)
        if D is not None:
            dp *= D
        ds = _attention_scores_grad(dp, P, _row_dot(G, out4), s)
        _matmul_into(ds, K, gq)
        _matmul_into(ds.swapaxes(-1, -2), Q, gk)
        return (grad.reshape(b, t, 3 * d),)
    return make_result("MultiHeadAttention", out.reshape(b, t, d), (qkv,), backward)


# -- float64 references ---------------------------------------------------------------------------------------

def _heads(a, h):  # (b, t, d) -> (b, h, t, d / h)
    b, t, d = a.shape
    return a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)


def _merge(a):  # (b, h, t, hd) -> (b, t, h * hd)
    b, h, t, hd = a.shape
    return a.transpose(0, 2, 1, 3).reshape(b, t, h * hd)


def _causal(t, dtype):
    return np.triu(np.full((t, t), -np.inf, dtype=dtype), k=1)


def _softmax64(q, k, scale, causal):
    scores = q @ k.swapaxes(-1, -2) * scale + (_causal(q.shape[-2], np.float64) if causal else 0)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attention64(q, k, v, dy, causal, scale, probs=None):
    """Return (out, gq, gk, gv) of ``softmax(q k^T scale + causal bias) v`` in float64, all (b, h, t, hd), for
    the output gradient ``dy``; with ``probs``: of ``probs @ v``, the softmax's gradient taken at ``probs``."""
    if probs is None:
        probs = _softmax64(q, k, scale, causal)
    dp = dy @ v.swapaxes(-1, -2)
    ds = probs * (dp - (dp * probs).sum(-1, keepdims=True)) * scale
    return probs @ v, ds @ k, ds.swapaxes(-1, -2) @ q, probs.swapaxes(-1, -2) @ dy


def _rounded_probs(q, k, scale, causal, dtype):
    """Return the softmax of float64 ``q``, ``k`` rounded to ``dtype`` (as float64), and where it is ambiguous:
    within 2^-18 (relative) of a point halfway between two 16-bit values, where the op's float32 softmax (a few
    roundings of 2^-24) may round the other way."""
    probs = _softmax64(q, k, scale, causal)
    delta = 2.0 ** -18
    ambiguous = (probs * (1 - delta)).astype(dtype) != (probs * (1 + delta)).astype(dtype)
    return probs.astype(dtype).astype(np.float64), ambiguous


def _ulp(a):
    """Return the spacing of 16-bit ``a``'s values to the next one away from zero, in float64."""
    m = np.abs(a)
    return (m.view(np.uint16) + 1).view(a.dtype).astype(np.float64) - m.astype(np.float64)


def _run(op, qkv, h, dy, **kw):
    x = nn.Tensor(qkv.copy(), requires_grad=True)
    y = op(x, h, **kw)
    y.backward(dy)
    return y.data, x.grad


def _split64(a, h):
    return [_heads(p.astype(np.float64), h) for p in np.split(a, 3, axis=-1)]


# -- float32 / float64: bitwise the previous implementation ---------------------------------------------------

CASES = {   # (b, t, h, d), keyword arguments
    "slices-causal": ((6, 64, 8, 32), {"is_causal": True}),   # sequence by sequence: slices of 4 and 2
    "full": ((2, 8, 2, 8), {}),
    "mask": ((3, 8, 2, 8), {"is_causal": True, "attn_mask": "additive"}),
    "dropout": ((3, 8, 2, 8), {"dropout_p": 0.3}),
}


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_float32_and_float64_are_bitwise_the_previous_implementation(dtype, case, recompute):
    """float32 and float64 activations: outputs and gradients bitwise those of the previous op (it cast nothing)."""
    (b, t, h, d), kw = CASES[case]
    rng = np.random.default_rng(1)
    qkv, dy = rng.standard_normal((b, t, 3 * d)).astype(dtype), rng.standard_normal((b, t, d)).astype(dtype)
    if kw.get("attn_mask") == "additive":
        kw = {**kw, "attn_mask": rng.standard_normal((t, t)).astype(dtype)}
    got = []
    for op in (_previous_multi_head_attention, F.multi_head_attention):
        extra = {"generator": np.random.default_rng(5)} if "dropout_p" in kw else {}
        got.append(_run(op, qkv, h, dy, recompute_probs=recompute, **kw, **extra))
    (out0, grad0), (out1, grad1) = got
    assert out1.dtype == grad1.dtype == dtype
    np.testing.assert_array_equal(out1, out0)
    np.testing.assert_array_equal(grad1, grad0)


# -- 16-bit: against float64 and against the function forward computes -----------------------------------------

def _unit_roundoff(dtype):
    return float(ml_dtypes.finfo(dtype).eps) / 2   # bfloat16 2^-8, float16 2^-11


def _inputs16(dtype, b=2, t=16, d=16, seed=2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, t, 3 * d)).astype(dtype), rng.standard_normal((b, t, d)).astype(dtype)


PATHS16 = {"slices": {"is_causal": True}, "full": {}, "mask": {"attn_mask": "zeros"},
           "causal-mask": {"is_causal": True, "attn_mask": "zeros"}}   # mask: the unsliced path


def _kwargs(path, t, monkeypatch=None):
    """Return the op's keyword arguments for ``path``; "slices" (with ``monkeypatch``): one sequence a slice."""
    if path == "slices" and monkeypatch is not None:
        monkeypatch.setattr(F, "_SCORES_CHUNK", 1)
    kw = dict(PATHS16[path])
    if "attn_mask" in kw:
        kw["attn_mask"] = np.zeros((t, t), np.float32)
    return kw


@pytest.mark.parametrize("path", list(PATHS16))
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_16bit_output_and_gradients_within_rounding_of_float64(dtype, path, monkeypatch):
    """Against softmax(q k^T s) v in float64 on the same 16-bit inputs. Tolerance 3u of each array's largest
    value (u: the unit roundoff, 2^-8 bfloat16, 2^-11 float16): every value passes through at most three
    16-bit roundings of relative size u (the probabilities; the output, which backward's row terms dO . O read;
    the result itself) while products and sums run in float32 (2^-24); measured: at most 1.3u."""
    qkv, dy = _inputs16(dtype)
    h, t = 2, qkv.shape[1]
    kw = _kwargs(path, t, monkeypatch)
    out, grad = _run(F.multi_head_attention, qkv, h, dy, **kw)
    assert out.dtype == grad.dtype == dtype
    q, k, v = _split64(qkv, h)
    s = 1 / math.sqrt(q.shape[-1])
    ref = _attention64(q, k, v, _heads(dy.astype(np.float64), h), kw.get("is_causal", False), s)
    for name, got, want in zip(("out", "gq", "gk", "gv"), [out] + np.split(grad, 3, axis=-1), ref):
        want = _merge(want)
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= 3 * _unit_roundoff(dtype), (name, err)


@pytest.mark.parametrize("causal", [False, True])
def test_float64_reference_matches_central_finite_differences(causal):
    """The reference's gradient: d/de of sum(dy * out(qkv + e w)) at 0, by central differences, along random w."""
    qkv, dy = _inputs16(bfloat16, b=1, t=5, d=4, seed=3)
    x, g = qkv.astype(np.float64), dy.astype(np.float64)
    h, s = 2, 1 / math.sqrt(2)

    def loss(a):
        return float((_merge(_attention64(*_split64(a, h), _heads(g, h), causal, s)[0]) * g).sum())

    grads = np.concatenate([_merge(a) for a in _attention64(*_split64(x, h), _heads(g, h), causal, s)[1:]], -1)
    rng, eps = np.random.default_rng(4), 1e-5
    for _ in range(3):
        w = rng.standard_normal(x.shape)
        numeric = (loss(x + eps * w) - loss(x - eps * w)) / (2 * eps)
        assert numeric == pytest.approx(float((grads * w).sum()), rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("path", list(PATHS16))
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_16bit_gradients_are_those_of_the_function_forward_computed(dtype, path, monkeypatch):
    """Against the function forward computes: the softmax rounded to 16 bits (P16), out = P16 v, and the exact
    gradient of that function at P16 (the softmax's rule with P16). The output and dL/dv involve no row term:
    each is one rounding of a float32 sum of exact products, so within one unit in the last place of the
    reference (rows of the output, and keys of dL/dv, that meet an ambiguous probability are left out: see
    ``_rounded_probs``). dL/dq and dL/dk also read dO . O from the 16-bit output (FlashAttention's row term,
    not exactly P16's): 3u, as above. The previous op (float32 probabilities) fails the first check."""
    qkv, dy = _inputs16(dtype, seed=5)
    h, t = 2, qkv.shape[1]
    kw = _kwargs(path, t, monkeypatch)
    causal = kw.get("is_causal", False)
    out, grad = _run(F.multi_head_attention, qkv, h, dy, **kw)
    q, k, v = _split64(qkv, h)
    s = 1 / math.sqrt(q.shape[-1])
    probs, ambiguous = _rounded_probs(q, k, s, causal, dtype)
    assert ambiguous.mean() < 0.05   # most values are checked
    ref = [_merge(a) for a in _attention64(q, k, v, _heads(dy.astype(np.float64), h), causal, s, probs=probs)]
    gq, gk, gv = np.split(grad, 3, axis=-1)
    # Output rows with no ambiguous probability, and keys (dL/dv's rows) with none in their column.
    rows, keys = (_merge(np.broadcast_to(~ambiguous.any(axis)[..., None], q.shape)) for axis in (-1, -2))
    for name, got, want, checked in (("out", out, ref[0], rows), ("gv", gv, ref[3], keys)):
        assert checked.mean() > 0.5, name
        off = np.abs(got.astype(np.float64) - want) > _ulp(want.astype(dtype))
        assert not (off & checked).any(), (name, np.argwhere(off & checked)[:4])
    for name, got, want in (("gq", gq, ref[1]), ("gk", gk, ref[2])):
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= 3 * _unit_roundoff(dtype), (name, err)


@pytest.mark.parametrize("path", ["slices", "mask"])
def test_float16_probabilities_that_round_to_zero_give_their_key_no_gradient(path, monkeypatch):
    """Key 3's scores are 20 below the others': its probabilities, about e^-20 / 8 = 2.6e-10, round to 0 in
    float16 (whose least value is 2^-24 = 6e-8), so key 3 has no effect on the function forward computes and
    its dL/dk and dL/dv are exactly 0. Backward reading float32 probabilities would give values float16 holds
    (the float64 reference's, checked nonzero): so the previous op fails here."""
    b, t, h, hd = 1, 8, 1, 4
    rng = np.random.default_rng(6)
    q, k = rng.uniform(-0.25, 0.25, (2, b, t, hd))
    q[..., 0], k[..., 0] = 4.0, 0.0
    k[:, 3, 0] = -10.0   # score 0.5 (4 x -10) = -20
    v = rng.uniform(-1, 1, (b, t, hd))
    v[:, 3] = 30.0
    dy = rng.uniform(50, 100, (b, t, hd)).astype(float16)
    qkv = np.concatenate([q, k, v], axis=-1).astype(float16)
    out, grad = _run(F.multi_head_attention, qkv, h, dy, **_kwargs(path, t, monkeypatch))
    assert np.isfinite(out).all() and np.isfinite(grad).all()
    assert (grad[0, 3, hd:] == 0).all()   # dL/dk_3, dL/dv_3
    _, _, gk, gv = _attention64(*_split64(qkv, h), _heads(dy.astype(np.float64), h), False, 0.5)
    assert (gk[0, 0, 3, 0].astype(float16) != 0) and (gv[0, 0, 3].astype(float16) != 0).all()


# -- what the graph keeps ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recompute"])
@pytest.mark.parametrize("path", ["slices", "mask"])
@pytest.mark.parametrize("dtype", LOW + [np.dtype(np.float32)], ids=str)
def test_graph_keeps_qkv_output_and_probabilities_in_the_activations_dtype(dtype, path, recompute, monkeypatch):
    """The arrays the graph behind the output projection keeps, walked (``saved_bytes``): qkv (b t 3d: the
    input's own array), the attention's output (b t d: the projection's input, which attention's row terms
    read too: one array) and, unless recomputed, the probabilities (b h t t), each in the activations' dtype
    (Megatron-LM's 2-byte Q, K, V, softmax output and projection input), plus the caller's mask when given.
    The previous op kept float32 copies of qkv and of the output beside the 16-bit output, and float32
    probabilities; float32 activations keep what they kept."""
    b, t, h, d = 2, 8, 2, 8
    rng = np.random.default_rng(7)
    x = nn.Tensor(rng.standard_normal((b, t, 3 * d)), requires_grad=True)
    weight = nn.Tensor(rng.standard_normal((d, d)).astype(dtype), requires_grad=True)   # a parameter: not counted
    kw = _kwargs(path, t, monkeypatch)
    y = F.multi_head_attention(cast(x, dtype), h, recompute_probs=recompute, **kw)
    assert y.dtype == dtype
    held = saved_bytes(F.linear(y, weight))
    e = np.dtype(dtype).itemsize
    mask = kw["attn_mask"].nbytes if "attn_mask" in kw else 0
    assert held == e * (b * t * 3 * d + b * t * d + (0 if recompute else b * h * t * t)) + mask
