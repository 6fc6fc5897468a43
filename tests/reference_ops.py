"""GELU, LayerNorm and RMSNorm as they were before they kept only what Megatron-LM keeps (commit c328efe).

Copied unchanged (numpy only) as the bitwise references of tests/test_nn_fused.py: the new ops form the same
arrays again in backward by the same operations, so their outputs and gradients must equal these to the bit.
These keep GELU's half-tanh array, LayerNorm's float32 xhat and, through ``fp32_op``'s casts, float32 copies
of 16-bit inputs, weights and biases.
"""

import builtins
import math

import numpy as np

from mpidist.nn.autograd import Tensor, make_result
from mpidist.nn.precision import fp32_op

__all__ = ["gelu", "layer_norm", "rms_norm"]

xp = np  # the CPU only
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715
_CHUNK = 1 << 17


def _d(x):
    return x.data if isinstance(x, Tensor) else x


def _row_dot(a, b):
    return np.vecdot(a, b)


def _slices(n, xp):
    step = _CHUNK if xp is np else builtins.max(n, 1)
    return (slice(lo, lo + step) for lo in range(0, n, step))


def gelu(a):
    """Return GELU with the tanh approximation: ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``."""
    x = _d(a)
    # In place, eight passes and one tanh (the costly one), slice by slice so that the passes after the first
    # read the slice from L2 (GPT-sized activations, 8 MiB, otherwise stream through L3 nine times: 30% slower).
    # Backward keeps s = (1 + tanh(u)) / 2, what both the output and the derivative are made of. Written as
    # products: numpy's float32 ``x ** 3`` calls powf per element and took 60x longer than the rest of GELU.
    dt = x.dtype.type
    xf = x.reshape(-1)
    s, out = xp.empty_like(xf), xp.empty_like(xf)
    for i in _slices(xf.size, xp):
        xs, ss = xf[i], s[i]
        xp.multiply(xs, xs, out=ss)
        ss *= dt(_GELU_C * _GELU_K)
        ss += dt(_GELU_C)
        ss *= xs
        xp.tanh(ss, out=ss)
        ss *= dt(0.5)
        ss += dt(0.5)
        xp.multiply(xs, ss, out=out[i])

    def backward(g, n):
        # d/dx = s + x s (1 - s) (2C + 6CK x^2), as 0.5 (1 - tanh^2) = 2 s (1 - s).
        xf, gf = _d(a).reshape(-1), g.reshape(-1)
        grad = xp.empty_like(xf)
        scratch = xp.empty(builtins.min(xf.size, _CHUNK) if xp is np else xf.size, dtype=s.dtype)
        for i in _slices(xf.size, xp):
            xs, ss, d = xf[i], s[i], grad[i]
            q = scratch[:d.size]
            xp.multiply(xs, xs, out=d)
            d *= dt(6 * _GELU_C * _GELU_K)
            d += dt(2 * _GELU_C)
            d *= xs
            xp.subtract(1, ss, out=q)
            q *= ss
            d *= q
            d += ss
            d *= gf[i]
        return (grad.reshape(x.shape),)
    return make_result("Gelu", out.reshape(x.shape), (a,), backward)


@fp32_op
def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``."""
    dx = _d(x)
    d = dx.shape[-1]
    if weight is not None and _d(weight).shape != (d,):
        raise ValueError(f"layer_norm: weight shape {_d(weight).shape} does not match the last axis {d} "
                         f"of the input {dx.shape}")
    # As (rows, d), with the row sums as products with a ones vector (one BLAS pass, no temporary: 3-4x
    # numpy's mean over the last axis) and the squares' row sums as row dot products. Backward keeps
    # xhat and rstd, as before; it works in place on one fresh array and one scratch.
    shape, rows = dx.shape, math.prod(dx.shape[:-1])
    dt = dx.dtype.type
    x2 = dx.reshape(rows, d)
    xhat = x2 - ((x2 @ xp.ones(d, dtype=dx.dtype)) * dt(1 / d))[:, None] if d else x2.copy()
    rstd = _row_dot(xhat, xhat)
    rstd *= dt(1 / d) if d else dt(0)
    rstd += dt(eps)
    xp.sqrt(rstd, out=rstd)
    xp.divide(1, rstd, out=rstd)
    xhat *= rstd[:, None]
    if weight is not None:
        out = xhat * _d(weight)
        if bias is not None:
            out += _d(bias)
    else:
        out = xhat + _d(bias) if bias is not None else xhat.copy()

    def backward(g, n):
        g2 = g.reshape(rows, d)
        w = _d(weight) if weight is not None else None
        gw = gb = gx = None
        ones = xp.ones(rows, dtype=g.dtype)
        scratch = g2 * xhat if (n[0] or (w is not None and n[1])) else None
        if w is not None and n[1]:
            gw = ones @ scratch
        if bias is not None and n[2]:
            gb = ones @ g2
        if n[0]:
            # gx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = g w; the two row means are
            # products with w (dxhat xhat = (g xhat) w), so dxhat is formed once, in gx's own array.
            if w is not None:
                mean_g = (g2 @ w) * dt(1 / d)
                mean_gx = (scratch @ w) * dt(1 / d)
                gx = g2 * w
            else:
                mean_g = (g2 @ xp.ones(d, dtype=g.dtype)) * dt(1 / d)
                mean_gx = (scratch @ xp.ones(d, dtype=g.dtype)) * dt(1 / d)
                gx = g2.copy()
            xp.multiply(xhat, mean_gx[:, None], out=scratch)
            gx -= scratch
            gx -= mean_g[:, None]
            gx *= rstd[:, None]
            gx = gx.reshape(shape)
        return gx, gw, gb
    return make_result("LayerNorm", out.reshape(shape), (x, weight, bias), backward)


@fp32_op
def rms_norm(x, weight=None, eps=1e-6):
    """Divide by the root mean square over the last axis, then scale by ``weight``."""
    dx = _d(x)
    rrms = 1.0 / xp.sqrt((dx * dx).mean(axis=-1, keepdims=True) + eps)
    xhat = dx * rrms
    out = xhat * _d(weight) if weight is not None else xhat

    def backward(g, n):
        gx = None
        if n[0]:
            dxhat = g * _d(weight) if weight is not None else g
            gx = rrms * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
        gw = (g * xhat).sum(axis=tuple(range(g.ndim - 1))) if weight is not None and n[1] else None
        return gx, gw
    return make_result("RMSNorm", out, (x, weight), backward)
