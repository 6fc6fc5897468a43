"""Differentiable ops on Tensors (or plain numpy/CuPy arrays), each with its backward rule.

Every op computes its output from ``.data`` arrays and hands ``make_result`` a closure
``backward(grad, needs)`` that returns one gradient per input, computing only where ``needs[i]``
is true (no input gradient for a first layer; the weight half of a zero-bubble split). Closures keep
input *tensors* and read ``.data`` when they run (see autograd's glossary), and derived arrays they
need (a normalized input, a softmax) as arrays.
"""

import builtins
import functools
import math
import numbers
from typing import NamedTuple

import numpy as np

from mpidist.nn.autograd import Tensor, make_result, make_results, unbroadcast
from mpidist.nn.precision import float32, fp32_op, grads_as, input_dtypes, is_low_precision, upcast
from mpidist.nn.random import generator_for_draw
from mpidist.xp import get_array_module, scatter_add

__all__ = ["add", "sub", "mul", "div", "neg", "pow", "matmul", "linear", "reshape", "transpose", "permute",
           "swapaxes", "getitem", "cat", "split", "stack", "sum", "mean", "max", "exp", "log", "sqrt", "tanh",
           "sigmoid", "relu", "gelu", "swiglu", "softmax", "log_softmax", "layer_norm", "rms_norm", "embedding",
           "dropout", "cross_entropy", "mse_loss", "scaled_dot_product_attention", "multi_head_attention", "repeat_kv", "rotary", "where", "var", "conv2d",
           "max_pool2d", "avg_pool2d", "batch_norm"]


def _d(x):
    return x.data if isinstance(x, Tensor) else x


def _matmul_into(a, b, out):
    """Write ``a @ b`` into ``out`` (a strided view on numpy: BLAS writes it in place, no temporary)."""
    xp = get_array_module(out)
    if xp is np:
        np.matmul(a, b, out=out)
    else:  # CuPy's matmul wants a contiguous out: compute, then copy into the view
        out[...] = a @ b


def _row_dot(a, b):
    """Return the dot products of ``a`` and ``b`` along their last axis (broadcast), without a temporary."""
    xp = get_array_module(a)
    vecdot = getattr(xp, "vecdot", None)  # numpy >= 2.0; CuPy without it sums the product
    return vecdot(a, b) if vecdot is not None else (a * b).sum(axis=-1)


def _shape(x):
    return getattr(x, "shape", ())


# -- elementwise arithmetic (broadcasting) ----------------------------------------------------------------

def add(a, b):
    """Return ``a + b``."""
    out = _d(a) + _d(b)
    sa, sb = _shape(a), _shape(b)
    return make_result("Add", out, (a, b), lambda g, n: (unbroadcast(g, sa) if n[0] else None,
                                                         unbroadcast(g, sb) if n[1] else None))


def sub(a, b):
    """Return ``a - b``."""
    out = _d(a) - _d(b)
    sa, sb = _shape(a), _shape(b)
    return make_result("Sub", out, (a, b), lambda g, n: (unbroadcast(g, sa) if n[0] else None,
                                                         unbroadcast(-g, sb) if n[1] else None))


def mul(a, b):
    """Return ``a * b``."""
    out = _d(a) * _d(b)
    sa, sb = _shape(a), _shape(b)
    return make_result("Mul", out, (a, b), lambda g, n: (unbroadcast(g * _d(b), sa) if n[0] else None,
                                                         unbroadcast(g * _d(a), sb) if n[1] else None))


def div(a, b):
    """Return ``a / b``."""
    out = _d(a) / _d(b)
    sa, sb = _shape(a), _shape(b)

    def backward(g, n):
        db = _d(b)
        return (unbroadcast(g / db, sa) if n[0] else None,
                unbroadcast(-g * _d(a) / (db * db), sb) if n[1] else None)
    return make_result("Div", out, (a, b), backward)


def neg(a):
    """Return ``-a``."""
    return make_result("Neg", -_d(a), (a,), lambda g, n: (-g,))


def pow(a, exponent):
    """Return ``a ** exponent`` for a number ``exponent``."""
    if isinstance(exponent, Tensor):
        raise TypeError("pow: the exponent must be a number (a tensor exponent is not supported)")
    out = _power(_d(a), exponent)
    return make_result("Pow", out, (a,), lambda g, n: (g * (exponent * _power(_d(a), exponent - 1)),))


def _power(x, exponent):
    """``x ** exponent``, by multiplication for small whole exponents (numpy's float32 pow is per-element powf)."""
    if exponent in (0, 1, 2, 3, 4) and float(exponent).is_integer():
        e = int(exponent)
        if e == 0:
            return get_array_module(x).ones_like(x)
        out = x.copy() if e == 1 else x * x
        if e >= 3:
            out *= x
        if e == 4:
            out *= x
        return out
    return x ** exponent


def where(cond, a, b):
    """Return ``a`` where ``cond`` else ``b`` (``cond`` is a boolean array; no gradient)."""
    c = _d(cond)
    xp = get_array_module(c)
    out = xp.where(c, _d(a), _d(b))
    sa, sb = _shape(a), _shape(b)
    return make_result("Where", out, (a, b), lambda g, n: (unbroadcast(g * c, sa) if n[0] else None,
                                                           unbroadcast(g * ~c, sb) if n[1] else None))


# -- matrix products --------------------------------------------------------------------------------------

def matmul(a, b):
    """Return ``a @ b`` (numpy's rules: batched, broadcast over leading axes; 1-D operands allowed)."""
    da, db = _d(a), _d(b)
    if da.ndim == 0 or db.ndim == 0:
        raise ValueError(f"matmul: operands must have at least one axis (shapes: {da.shape}, {db.shape})")
    out = da @ db
    sa, sb = da.shape, db.shape

    def backward(g, n):
        x, w = _d(a), _d(b)
        # Promote 1-D operands to matrices as numpy does (a row on the left, a column on the right) and
        # give the gradient the promoted product's shape, so one rule covers every case (dot included).
        x2 = x[None, :] if x.ndim == 1 else x
        w2 = w[:, None] if w.ndim == 1 else w
        g2 = g.reshape(np.broadcast_shapes(x2.shape[:-2], w2.shape[:-2]) + (x2.shape[-2], w2.shape[-1]))
        ga = unbroadcast(g2 @ w2.swapaxes(-1, -2), x2.shape).reshape(sa) if n[0] else None
        gb = unbroadcast(x2.swapaxes(-1, -2) @ g2, w2.shape).reshape(sb) if n[1] else None
        return ga, gb
    return make_result("Matmul", out, (a, b), backward)


def linear(x, weight, bias=None):
    """Return ``x @ weight.T + bias`` over the last axis; weight has shape (out, in).

    Fused so that the weight is read from the parameter when backward runs (FSDP may have gathered it
    again) and so that backward skips the input gradient when nothing needs it.
    """
    dx, w = _d(x), _d(weight)
    if dx.shape[-1:] != w.shape[1:]:
        raise ValueError(f"linear: input last dim does not match the weight's in_features "
                         f"(input: {dx.shape}, weight: {w.shape})")
    # As one 2-D product: numpy runs a (batch, seq, in) @ (in, out) product as a loop over the batch, about
    # 20% slower than the same work as one (batch * seq, in) @ (in, out) BLAS call.
    # Rows counted, not reshape(-1, ...): -1 is ambiguous when a layer has no inputs or outputs (Linear(n, 0)).
    rows = math.prod(dx.shape[:-1])
    out = (dx.reshape(rows, dx.shape[-1]) @ w.T).reshape(dx.shape[:-1] + (w.shape[0],)) if dx.ndim > 2 else dx @ w.T
    if bias is not None:
        out += _d(bias)

    def backward(g, n):
        gx = linear_input_grad(g, _d(weight)) if n[0] else None
        return (gx,) + linear_param_grads(g, _d(x) if n[1] else None, bias is not None and n[2])
    return make_result("Linear", out, (x, weight, bias), backward)


def linear_input_grad(g, weight):
    """Return the gradient of ``linear``'s input for the output gradient ``g`` (arrays; ``weight`` is (out, in))."""
    rows = math.prod(g.shape[:-1])
    return (g.reshape(rows, g.shape[-1]) @ weight).reshape(g.shape[:-1] + (weight.shape[1],))


def linear_param_grads(g, x, bias_grad):
    """Return the gradients of ``linear``'s weight (None when ``x`` is None) and bias (None unless ``bias_grad``)
    for the output gradient ``g`` and the input array ``x``.

    Apart from the input's gradient so that an op which re-creates its input for them (sequence parallelism
    gathers it again: ``mpidist.parallel.tensor``) computes exactly ``linear``'s products."""
    rows = math.prod(g.shape[:-1])
    g2 = g.reshape(rows, g.shape[-1])
    gw = g2.T @ x.reshape(rows, x.shape[-1]) if x is not None else None
    # The bias gradient's column sums as one BLAS pass (ones @ g): about 2x numpy's sum over axis 0.
    gb = get_array_module(g2).ones(rows, dtype=g2.dtype) @ g2 if bias_grad else None
    return gw, gb


# -- shapes -----------------------------------------------------------------------------------------------

def reshape(a, *shape):
    """Return ``a`` with a new shape (same elements)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    da = _d(a)
    src = da.shape
    return make_result("Reshape", da.reshape(shape), (a,), lambda g, n: (g.reshape(src),))


def permute(a, *axes):
    """Return ``a`` with its axes reordered (``transpose`` with explicit axes)."""
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    da = _d(a)
    axes = tuple(ax % da.ndim for ax in axes)
    inverse = tuple(np.argsort(axes))
    return make_result("Permute", da.transpose(axes), (a,), lambda g, n: (g.transpose(inverse),))


def transpose(a, *axes):
    """Return ``a`` transposed: all axes reversed, or in the order ``axes``."""
    da = _d(a)
    if not axes or (len(axes) == 1 and axes[0] is None):
        axes = tuple(reversed(range(da.ndim)))
    return permute(a, *axes)


def swapaxes(a, axis1, axis2):
    """Return ``a`` with two axes exchanged."""
    da = _d(a)
    out = da.swapaxes(axis1, axis2)
    return make_result("Swapaxes", out, (a,), lambda g, n: (g.swapaxes(axis1, axis2),))


def _is_basic_index(index):
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


def getitem(a, index):
    """Return ``a[index]`` (slices, integers, integer arrays, boolean masks)."""
    if isinstance(index, Tensor):
        index = index.data
    if isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    da = _d(a)
    out = da[index]
    basic = _is_basic_index(index)

    def backward(g, n):
        x = _d(a)
        xp = get_array_module(x)
        full = xp.zeros(x.shape, dtype=g.dtype)
        if basic:
            full[index] = g
        else:
            # Repeated indices must add up: plain assignment would keep only one of them.
            scatter_add(full, index, g)
        return (full,)
    return make_result("Index", out, (a,), backward)


def cat(tensors, axis=0):
    """Return the tensors joined along ``axis``."""
    tensors = list(tensors)
    arrays = [_d(t) for t in tensors]
    xp = get_array_module(arrays[0])
    out = xp.concatenate(arrays, axis=axis)
    bounds = np.cumsum([a.shape[axis] for a in arrays])[:-1]

    def backward(g, n):
        parts = xp.split(g, bounds, axis=axis)
        return tuple(p if need else None for p, need in zip(parts, n))
    return make_result("Cat", out, tensors, backward)


def stack(tensors, axis=0):
    """Return the tensors stacked along a new ``axis``."""
    tensors = list(tensors)
    arrays = [_d(t) for t in tensors]
    xp = get_array_module(arrays[0])
    out = xp.stack(arrays, axis=axis)

    def backward(g, n):
        return tuple(xp.take(g, i, axis=axis) if need else None for i, need in enumerate(n))
    return make_result("Stack", out, tensors, backward)


def split(a, sizes_or_sections, axis=0):
    """Return a tuple of pieces of ``a`` along ``axis``: equal ``sections`` or a list of ``sizes``."""
    da = _d(a)
    xp = get_array_module(da)
    n = da.shape[axis]
    if isinstance(sizes_or_sections, int):
        if n % sizes_or_sections:
            raise ValueError(f"split: axis {axis} of length {n} does not divide into {sizes_or_sections} sections")
        sizes = [n // sizes_or_sections] * sizes_or_sections
    else:
        sizes = list(sizes_or_sections)
        if builtins.sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} do not add up to axis {axis}'s length {n}")
    bounds = np.cumsum(sizes)[:-1]
    outs = xp.split(da, bounds, axis=axis)

    def backward(grads, need):
        parts = [g if g is not None else xp.zeros(o.shape, dtype=o.dtype) for g, o in zip(grads, outs)]
        return (xp.concatenate(parts, axis=axis),)
    return make_results("Split", outs, (a,), backward)


# -- reductions -------------------------------------------------------------------------------------------

def _expand_reduced(g, shape, axis, keepdims):
    if axis is None:
        return g.reshape((1,) * len(shape)) if not keepdims else g
    if not keepdims:
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        axes = sorted(ax % len(shape) for ax in axes)
        for ax in axes:
            g = get_array_module(g).expand_dims(g, ax)
    return g


@fp32_op
def sum(a, axis=None, keepdims=False):
    """Return the sum over ``axis`` (all axes by default)."""
    da = _d(a)
    out = da.sum(axis=axis, keepdims=keepdims)
    shape = da.shape
    xp = get_array_module(da)
    return make_result("Sum", out, (a,), lambda g, n: (
        xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims), shape).copy(),))


@fp32_op
def mean(a, axis=None, keepdims=False):
    """Return the mean over ``axis`` (all axes by default)."""
    da = _d(a)
    out = da.mean(axis=axis, keepdims=keepdims)
    shape = da.shape
    count = da.size // builtins.max(out.size, 1) if da.size else 1
    xp = get_array_module(da)
    return make_result("Mean", out, (a,), lambda g, n: (
        xp.broadcast_to(_expand_reduced(g, shape, axis, keepdims) / count, shape).astype(da.dtype),))


@fp32_op
def var(a, axis=None, keepdims=False, ddof=0):
    """Return the variance over ``axis`` (composite of differentiable ops)."""
    m = mean(a, axis=axis, keepdims=True)
    c = sub(a, m)
    n = _d(a).size // builtins.max(_d(m).size, 1)
    return div(sum(mul(c, c), axis=axis, keepdims=keepdims), n - ddof)


def max(a, axis=None, keepdims=False):
    """Return the maximum over ``axis``; the gradient is shared evenly among tied maxima."""
    da = _d(a)
    out = da.max(axis=axis, keepdims=keepdims)

    def backward(g, n):
        x = _d(a)
        m = _expand_reduced(out if keepdims or axis is not None else out.reshape(()), x.shape, axis, keepdims)
        mask = (x == m)
        count = mask.sum(axis=axis, keepdims=True)
        return (mask * (_expand_reduced(g, x.shape, axis, keepdims) / count),)
    return make_result("Max", out, (a,), backward)


# -- elementwise functions --------------------------------------------------------------------------------

def exp(a):
    """Return ``exp(a)``."""
    out = get_array_module(_d(a)).exp(_d(a))
    return make_result("Exp", out, (a,), lambda g, n: (g * out,))


def log(a):
    """Return ``log(a)``."""
    out = get_array_module(_d(a)).log(_d(a))
    return make_result("Log", out, (a,), lambda g, n: (g / _d(a),))


def sqrt(a):
    """Return ``sqrt(a)``."""
    out = get_array_module(_d(a)).sqrt(_d(a))
    return make_result("Sqrt", out, (a,), lambda g, n: (g * 0.5 / out,))


def tanh(a):
    """Return ``tanh(a)``."""
    out = get_array_module(_d(a)).tanh(_d(a))
    return make_result("Tanh", out, (a,), lambda g, n: (g * (1 - out * out),))


def sigmoid(a):
    """Return ``1 / (1 + exp(-a))``, computed without overflow."""
    da = _d(a)
    xp = get_array_module(da)
    out = 0.5 * (xp.tanh(0.5 * da) + 1)
    return make_result("Sigmoid", out.astype(da.dtype, copy=False), (a,), lambda g, n: (g * out * (1 - out),))


def relu(a):
    """Return ``max(a, 0)``."""
    da = _d(a)
    out = get_array_module(da).maximum(da, 0)
    return make_result("Relu", out, (a,), lambda g, n: (g * (out > 0),))


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


# Elements per slice of the elementwise loops below: 512 KiB of float32, within the 1 MiB L2 per core here
# (GELU forward + backward on 2048 x 1024: 8.7 -> 8.3 ms against 256 KiB slices, fewer calls per pass).
_CHUNK = 1 << 17


_DEVICE_CHUNK = 1 << 24   # elements per slice on a GPU where a pass needs float32 scratch (a 16-bit input)


def _slices(n, xp, device_step=None):
    """Yield slices covering ``range(n)`` in ``_CHUNK`` pieces (on a GPU, where each pass is one kernel, one piece,
    or ``device_step`` pieces where each slice needs float32 scratch of its size)."""
    step = _CHUNK if xp is np else builtins.max(device_step or n, 1)
    return (slice(lo, lo + step) for lo in range(0, n, step))


def _half_tanh_into(xs, ss, dt):
    """Write ``s = (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2`` of slice ``xs`` into ``ss``, in place.

    GELU's forward and its backward both form s here, so backward's s is forward's to the bit. Written as
    products: numpy's float32 ``x ** 3`` calls powf per element and took 60x longer than the rest of GELU."""
    xp = get_array_module(xs)
    xp.multiply(xs, xs, out=ss)
    ss *= dt(_GELU_C * _GELU_K)
    ss += dt(_GELU_C)
    ss *= xs
    xp.tanh(ss, out=ss)
    ss *= dt(0.5)
    ss += dt(0.5)


def gelu(a):
    """Return GELU with the tanh approximation: ``0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``.

    A 16-bit input is computed in float32 slice by slice and rounded once (output and gradient), as a GPU's
    fused kernel does: numpy's bfloat16 ufuncs are slow (tanh 4x float32's) and round at every pass."""
    x = _d(a)
    xp = get_array_module(x)
    # In place, slice by slice so that the passes after the first read the slice from L2 (GPT-sized
    # activations, 8 MiB, otherwise stream through L3 nine times: 30% slower). Backward keeps only the input,
    # as Megatron-LM's fused bias-GeLU does, and forms s = (1 + tanh(u)) / 2 again (one more tanh there).
    low = is_low_precision(x.dtype)
    dt = float32.type if low else x.dtype.type
    shape = x.shape
    xf = x.reshape(-1)
    out = xp.empty_like(xf)
    # A 16-bit input's float32 scratch is a slice's, on a GPU too (not five float32 copies of the input).
    device_step = _DEVICE_CHUNK if low else None
    width = builtins.min(xf.size, _CHUNK if xp is np else (device_step or xf.size))
    # float32 working rows for a 16-bit input (its slice upcast, the result), none otherwise: in place.
    work = xp.empty((2, width), dtype=float32) if low else None
    for i in _slices(xf.size, xp, device_step):
        xs, outs = xf[i], out[i]
        if low:
            xs, outs = _upcast_into(xs, work[0]), work[1, :xs.size]
        _half_tanh_into(xs, outs, dt)
        outs *= xs
        if low:
            out[i] = outs

    def backward(g, n):
        # d/dx = s + x s (1 - s) (2C + 6CK x^2), as 0.5 (1 - tanh^2) = 2 s (1 - s).
        xf, gf = _d(a).reshape(-1), g.reshape(-1)
        grad = xp.empty_like(xf)
        scratch = xp.empty((5 if low else 2, width), dtype=dt)
        for i in _slices(xf.size, xp, device_step):
            xs, d, gs = xf[i], grad[i], gf[i]
            ss, q = scratch[0, :xs.size], scratch[1, :xs.size]
            if low:
                xs, gs, d = _upcast_into(xs, scratch[2]), _upcast_into(gs, scratch[3]), scratch[4, :xs.size]
            _half_tanh_into(xs, ss, dt)
            xp.multiply(xs, xs, out=d)
            d *= dt(6 * _GELU_C * _GELU_K)
            d += dt(2 * _GELU_C)
            d *= xs
            xp.subtract(1, ss, out=q)
            q *= ss
            d *= q
            d += ss
            d *= gs
            if low:
                grad[i] = d
        return (grad.reshape(shape),)
    return make_result("Gelu", out.reshape(shape), (a,), backward)


def swiglu(a):
    """Return SwiGLU of a packed ``[gate | up]`` array: ``silu(gate) * up``, ``silu(x) = x sigmoid(x)``; the last
    axis halves, (..., 2f) -> (..., f).

    The gated MLP of PaLM and Llama (Shazeer, arXiv 2002.05202) after one fused projection whose outputs are
    the f gate units, then the f up units (``nn.MLP(activation="swiglu")``). Backward keeps only the input, as
    Megatron-LM's fused bias-SwiGLU does, and forms sigmoid(gate) again. Row block by row block, each within L2
    as ``gelu``'s slices are; a 16-bit input is computed in float32 and rounded once (output and gradient)."""
    x = _d(a)
    if x.ndim < 1 or x.shape[-1] % 2 or not x.shape[-1]:
        raise ValueError(f"swiglu: the last axis holds [gate | up] and must have an even, non-zero length "
                         f"(got shape {tuple(x.shape)})")
    xp = get_array_module(x)
    low = is_low_precision(x.dtype)
    dt = float32.type if low else x.dtype.type
    f = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * f)
    rows = x2.shape[0]
    # Rows per block: the gate's and up's halves of about _CHUNK elements each (on a GPU one block, or blocks
    # of _DEVICE_CHUNK elements where they need float32 scratch: a 16-bit input).
    if xp is np:
        step = builtins.max(1, _CHUNK // builtins.max(f, 1))
    else:
        step = builtins.max(1, _DEVICE_CHUNK // builtins.max(f, 1)) if low else builtins.max(rows, 1)
    width = builtins.min(rows, step)
    out = xp.empty((rows, f), dtype=x.dtype)
    # float32 rows for a 16-bit input (gate, up, the result); none otherwise: computed in the output itself.
    work = xp.empty((3, width, f), dtype=float32) if low else None
    for lo in range(0, rows, step):
        gate, up, res = x2[lo:lo + step, :f], x2[lo:lo + step, f:], out[lo:lo + step]
        if low:
            n = gate.shape[0]
            gate, up, res = _upcast_into(gate, work[0]), _upcast_into(up, work[1]), work[2, :n]
        _sigmoid_into(gate, res, dt)
        res *= gate
        res *= up
        if low:
            out[lo:lo + step] = res

    def backward(g, n):
        # d/d gate = g up s (1 + gate (1 - s)), d/d up = g gate s, with s = sigmoid(gate).
        x2 = _d(a).reshape(-1, 2 * f)
        g2 = g.reshape(-1, f)
        grad = xp.empty((rows, 2 * f), dtype=x.dtype)
        # The two gradients are formed in contiguous rows and copied into their halves of the packed gradient
        # once: passes writing those halves in place (row-strided) took twice as long (2048 x 2 x 1024 float32:
        # 15.4 -> 8.3 ms). A 16-bit input also upcasts gate, up and the incoming gradient into float32 rows.
        scratch = xp.empty((5 if low else 2, width, f), dtype=dt)
        for lo in range(0, rows, step):
            gate, up, gs = x2[lo:lo + step, :f], x2[lo:lo + step, f:], g2[lo:lo + step]
            k = gate.shape[0]
            d_gate, d_up = scratch[-2, :k], scratch[-1, :k]
            if low:
                gate, up, gs = (_upcast_into(gate, scratch[0]), _upcast_into(up, scratch[1]),
                                _upcast_into(gs, scratch[2]))
            _sigmoid_into(gate, d_up, dt)
            xp.subtract(dt(1), d_up, out=d_gate)
            d_gate *= gate
            d_gate += dt(1)
            d_gate *= d_up
            d_gate *= up
            d_gate *= gs
            grad[lo:lo + step, :f] = d_gate
            d_up *= gate
            d_up *= gs
            grad[lo:lo + step, f:] = d_up
        return (grad.reshape(x.shape),)
    return make_result("SwiGLU", out.reshape(x.shape[:-1] + (f,)), (a,), backward)


def _sigmoid_into(xs, ss, dt):
    """Write ``sigmoid(xs) = 1 / (1 + exp(-xs))`` into ``ss``; forward and backward both call it, so backward's
    sigmoid is forward's to the bit. Not via tanh: 1 + tanh(x / 2) is 0 for x below about -38 (float64), where
    silu's tiny negative values keep their relative accuracy this way; exp(-x) overflowing gives the limit, 0."""
    xp = get_array_module(xs)
    xp.negative(xs, out=ss)
    with np.errstate(over="ignore"):
        xp.exp(ss, out=ss)
    ss += dt(1)
    xp.reciprocal(ss, out=ss)


def _upcast_into(xs, row):
    """Return 16-bit ``xs`` upcast into the first ``len(xs)`` entries of float32 ``row`` along its first axis (a
    1-D slice into a row of ``_CHUNK`` elements, or a block of rows into a scratch block of as many columns)."""
    view = row[:xs.shape[0]]
    view[...] = xs
    return view


@fp32_op
def softmax(a, axis=-1):
    """Return the softmax along ``axis`` (stable)."""
    x = _d(a)
    xp = get_array_module(x)
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    out = e / e.sum(axis=axis, keepdims=True)
    return make_result("Softmax", out, (a,), lambda g, n: (
        out * (g - (g * out).sum(axis=axis, keepdims=True)),))


@fp32_op
def log_softmax(a, axis=-1):
    """Return the log of the softmax along ``axis`` (stable)."""
    x = _d(a)
    xp = get_array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
    return make_result("LogSoftmax", out, (a,), lambda g, n: (
        g - xp.exp(out) * g.sum(axis=axis, keepdims=True),))


# -- fused layers -----------------------------------------------------------------------------------------

def _rows(x, rows, d):
    """Return Tensor ``x``'s array in the compute dtype as (rows, d), and whether that is a fresh copy (the
    float32 one of a 16-bit input, free to overwrite)."""
    data = upcast(x)
    return data.reshape(rows, d), data is not _d(x)


def _centered(x2, fresh, mean):
    """Return (rows, d) ``x2`` less each row's ``mean``: in place if ``x2`` is ``fresh``, else in a new array."""
    if fresh:
        x2 -= mean[:, None]
        return x2
    return x2 - mean[:, None]


@fp32_op(casts_inside=True)
def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``."""
    dx = _d(x)
    xp = get_array_module(dx)
    d = dx.shape[-1]
    if weight is not None and _d(weight).shape != (d,):
        raise ValueError(f"layer_norm: weight shape {_d(weight).shape} does not match the last axis {d} "
                         f"of the input {dx.shape}")
    # As (rows, d), with the row sums as products with a ones vector (one BLAS pass, no temporary: 3-4x
    # numpy's mean over the last axis) and the squares' row sums as row dot products. Backward keeps what
    # Megatron-LM keeps: the input as given (16-bit stays 16-bit: fp32_op's casts_inside) and each row's mean
    # and rstd, and forms xhat again by the same operations, so its gradients are the same to the bit.
    shape, rows = dx.shape, math.prod(dx.shape[:-1])
    dtypes = input_dtypes(x, weight, bias)
    x2, fresh = _rows(x, rows, d)
    dt = x2.dtype.type
    mean = (x2 @ xp.ones(d, dtype=x2.dtype)) * dt(1 / d) if d else xp.zeros(rows, dtype=x2.dtype)
    xhat = _centered(x2, fresh, mean)
    del x2
    rstd = _row_dot(xhat, xhat)
    rstd *= dt(1 / d) if d else dt(0)
    rstd += dt(eps)
    xp.sqrt(rstd, out=rstd)
    xp.divide(1, rstd, out=rstd)
    xhat *= rstd[:, None]
    if weight is not None:
        out = xhat * upcast(weight)
        if bias is not None:
            out += upcast(bias)
    else:
        out = xhat + upcast(bias) if bias is not None else xhat
    del xhat
    has_bias = bias is not None

    def backward(g, n):
        g2 = g.reshape(rows, d)
        w = upcast(weight) if weight is not None else None
        gw = gb = gx = None
        ones = xp.ones(rows, dtype=g.dtype)
        scratch = None
        if n[0] or (w is not None and n[1]):
            xhat = _centered(*_rows(x, rows, d), mean)
            xhat *= rstd[:, None]
            scratch = g2 * xhat
        if w is not None and n[1]:
            gw = ones @ scratch
        if has_bias and n[2]:
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
        return grads_as((gx, gw, gb), dtypes)
    return make_result("LayerNorm", out.reshape(shape), (x, weight, bias), backward)


@fp32_op(casts_inside=True)
def rms_norm(x, weight=None, eps=1e-6):
    """Divide by the root mean square over the last axis, then scale by ``weight``."""
    dx = upcast(x)
    xp = get_array_module(dx)
    dtypes = input_dtypes(x, weight)
    # Backward keeps the input as given and each row's 1 / rms, and forms xhat again (as layer_norm).
    rrms = 1.0 / xp.sqrt((dx * dx).mean(axis=-1, keepdims=True) + eps)
    xhat = dx * rrms
    del dx
    out = xhat * upcast(weight) if weight is not None else xhat
    del xhat

    def backward(g, n):
        gx = gw = None
        xhat = upcast(x) * rrms
        if n[0]:
            dxhat = g * upcast(weight) if weight is not None else g
            gx = rrms * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
        if weight is not None and n[1]:
            gw = (g * xhat).sum(axis=tuple(range(g.ndim - 1)))
        return grads_as((gx, gw), dtypes)
    return make_result("RMSNorm", out, (x, weight), backward)


def embedding(indices, weight):
    """Return rows ``weight[indices]``; the indices get no gradient."""
    idx = _d(indices)
    w = _d(weight)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers (dtype: {idx.dtype})")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= w.shape[0]):
        raise IndexError(f"embedding: index out of range [0, {w.shape[0]}) "
                         f"(min: {int(idx.min())}, max: {int(idx.max())})")
    out = w[idx]

    def backward(g, n):
        w = _d(weight)
        xp = get_array_module(w)
        dw = xp.zeros(w.shape, dtype=g.dtype)
        flat, rows = idx.reshape(-1), g.reshape(-1, w.shape[1])
        if xp is np and flat.size:
            # Rows of one index summed by reduceat over the sorted indices: the same sums as add.at (rounded
            # in another order), at 5-10x its speed on a GPT's token batch.
            order = np.argsort(flat, kind="stable")
            ids = flat[order]
            starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
            dw[ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
        else:
            scatter_add(dw, flat, rows)
        return (dw,)
    return make_result("Embedding", out, (weight,), backward)


def dropout(x, p=0.5, training=True, generator=None):
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p); identity when not training."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1] (p: {p})")
    if not training or p == 0.0:
        return x if isinstance(x, Tensor) else Tensor(x)
    dx = _d(x)
    xp = get_array_module(dx)
    gen = generator_for_draw(generator)
    scale = dx.dtype.type(0.0 if p == 1.0 else 1.0 / (1.0 - p))
    # Backward keeps the mask as booleans, 1 byte per element (as Megatron-LM does), not as multipliers
    keep, dtype = xp.asarray(gen.random(dx.shape, dtype=np.float32) >= p), dx.dtype
    return make_result("Dropout", dx * (keep.astype(dtype) * scale), (x,),
                       lambda g, n: (g * (keep.astype(dtype) * scale),))


@fp32_op(loss=True)
def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """Softmax cross-entropy of ``logits`` (..., C) against integer labels ``target`` (...).

    Labels equal to ``ignore_index`` contribute nothing and are not counted in the mean;
    ``label_smoothing`` mixes the one-hot target with the uniform distribution (PyTorch's definition).
    """
    z = _d(logits)
    t = _d(target)
    xp = get_array_module(z)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: unknown reduction '{reduction}' (expected mean, sum or none)")
    if t.shape != z.shape[:-1]:
        raise ValueError(f"cross_entropy: target shape must be the logits' shape without the class axis "
                         f"(logits: {z.shape}, target: {t.shape})")
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: labels must be integers (dtype: {t.dtype})")
    c = z.shape[-1]
    labels = t.reshape(-1)
    valid = labels != ignore_index
    bad = labels[valid]
    if bad.size and (int(bad.min()) < 0 or int(bad.max()) >= c):
        raise IndexError(f"cross_entropy: label out of range [0, {c}) (min: {int(bad.min())}, "
                         f"max: {int(bad.max())}; ignore_index: {ignore_index})")
    # Backward keeps the exponentials and their row sums (softmax = e / sum) instead of the log-probabilities:
    # log p is only needed at the labels (and, with smoothing, its row mean), so it is never formed in full.
    z2 = z.reshape(-1, c)
    shifted = z2 - z2.max(axis=-1, keepdims=True)
    e = xp.exp(shifted)
    sums = e @ xp.ones(c, dtype=e.dtype)
    lse = xp.log(sums)
    safe = xp.where(valid, labels, 0)
    rows = xp.arange(labels.shape[0])
    nll = lse - shifted[rows, safe]
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * (shifted.mean(axis=-1) - lse)
    del shifted
    nll = nll * valid
    count = int(valid.sum())
    if reduction == "mean":
        out = nll.sum() / z.dtype.type(builtins.max(count, 1)) if count else nll.sum() * z.dtype.type(float("nan"))
    elif reduction == "sum":
        out = nll.sum()
    else:
        out = nll.reshape(t.shape)
    out = xp.asarray(out, dtype=z.dtype)

    def backward(g, n):
        # Each row's factor (its incoming gradient, zero where ignored) folded into the one pass that forms
        # softmax: (softmax - target) * factor = e * (factor / sum) - target * factor.
        if reduction == "none":
            factor = g.reshape(-1) * valid
        else:
            factor = valid * (g / builtins.max(count, 1) if reduction == "mean" else g)
        grad = e * (factor / sums)[:, None]
        if label_smoothing:
            grad -= (label_smoothing / c) * factor[:, None]
            grad[rows, safe] -= (1 - label_smoothing) * factor
        else:
            grad[rows, safe] -= factor
        return (grad.reshape(z.shape).astype(z.dtype, copy=False),)
    return make_result("CrossEntropy", out, (logits,), backward)




@fp32_op(loss=True)
def mse_loss(pred, target, reduction="mean"):
    """Return the mean (or summed) squared error between ``pred`` and ``target``."""
    if _shape(pred) != _shape(target):
        raise ValueError(f"mse_loss: pred and target shapes differ (pred: {_shape(pred)}, target: {_shape(target)})")
    diff = sub(pred, target)
    sq = mul(diff, diff)
    if reduction == "mean":
        return mean(sq)
    if reduction == "sum":
        return sum(sq)
    raise ValueError(f"mse_loss: unknown reduction '{reduction}' (expected mean or sum)")


def _attention_probs(Q, K, scale, is_causal, attn_mask, dropout_p, training, generator):
    """Return ``softmax(Q K^T * scale + mask)`` and the dropout multiplier (None without dropout).

    In place on the one (..., Lq, Lk) array the scores' product allocates: the scale, the causal mask (an
    added 0 / -inf bias: the same values as choosing -inf), the shift, exp and the division.
    """
    xp = get_array_module(Q)
    probs = Q @ K.swapaxes(-1, -2)
    lq, lk = probs.shape[-2:]
    bias = xp.triu(xp.full((lq, lk), -np.inf, dtype=probs.dtype), k=lk - lq + 1) if is_causal else None
    if attn_mask is None:
        _softmax_scores_(probs, scale, bias)
    else:
        probs *= probs.dtype.type(scale)
        if bias is not None:
            probs += bias
        m = _d(attn_mask)
        if m.dtype == bool:
            probs = xp.where(m, probs, probs.dtype.type(-np.inf))
        elif np.broadcast_shapes(m.shape, probs.shape) == probs.shape and m.dtype == probs.dtype:
            probs += m
        else:
            probs = probs + m
        _softmax_scores_(probs, 1, None)
    drop = None
    if dropout_p and training:
        gen = generator_for_draw(generator)
        drop = _DropoutMask(xp.asarray(gen.random(probs.shape, dtype=np.float32) >= dropout_p), probs.dtype,
                            dropout_p)
    return probs, drop


class _DropoutMask(NamedTuple):
    """Attention probabilities' dropout mask kept as booleans, 1 byte per element (as Megatron-LM keeps it);
    ``values()`` forms the multiplier, 0 or 1 / (1 - p) in the probabilities' dtype, when it is used."""

    keep: object   # boolean array: True where the probability is kept
    dtype: object
    p: float

    def values(self):
        return self.keep.astype(self.dtype) / self.dtype.type(1 - self.p)

    def apply(self, a, out=None):
        """Return ``a * values()`` (into ``out``) without forming ``values()``: ``a`` times 1 or 0, then times
        1 / (1 - p) in the mask's dtype, the same bits as the product with the multiplier."""
        xp = get_array_module(a)
        r = xp.multiply(a, self.keep, out=out)
        r *= self.dtype.type(1) / self.dtype.type(1 - self.p)
        return r


def _softmax_scores_(scores, scale, bias):
    """Turn ``scores`` into ``softmax(scores * scale + bias)`` over the last axis, in place (``bias``: the causal
    0 / -inf, added: the same values as choosing -inf)."""
    xp = get_array_module(scores)
    if scale != 1:
        scores *= scores.dtype.type(scale)
    if bias is not None:
        scores += bias
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    # Row sums as a product with ones (BLAS; numpy's sum over a short last axis pays per row) and a multiply
    # by their reciprocals instead of a division per score: ~8% of the softmax on (4, 128, 128) slices.
    inv = scores @ xp.ones(scores.shape[-1], dtype=scores.dtype)
    xp.divide(1, inv, out=inv)
    scores *= inv[..., None]


_SCORES_CHUNK = 1 << 17  # scores per slice of multi_head_attention (the causal blocks fill 3/4 of them)
_CAUSAL_ROW_BLOCK = 64  # rows per block of causal attention: smaller blocks skip more, but BLAS slows on them


def _causal_row_blocks(t):
    """Return the row blocks [(r0, r1), ...] of causal attention over ``t`` positions (about _CAUSAL_ROW_BLOCK rows each)."""
    n = builtins.max(1, round(t / _CAUSAL_ROW_BLOCK))
    bounds = [t * j // n for j in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def _attention_scores_grad(dp, probs, row_dot, scale):
    """Turn ``dp = dL/d(probs * drop)`` into the scores' gradient, in place: ``probs (dp - row_dot) scale``.

    ``row_dot`` is sum_j dp_ij probs_ij (after the dropout multiplier), computed by the caller: from ``dp``
    itself, or as dO . O when the op's output O is at hand (a (.., Lq, Dv) product instead of (.., Lq, Lk)).
    """
    dp -= row_dot[..., None]
    dp *= probs
    dp *= dp.dtype.type(scale)
    return dp


@fp32_op
def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                                 training=True, generator=None):
    """Return ``softmax(q k^T * scale + mask) v`` over the last two axes (fused, with its own backward).

    q: (..., Lq, D), k: (..., Lk, D), v: (..., Lk, Dv). ``attn_mask``: an additive float array
    broadcastable to (..., Lq, Lk) (or boolean: True keeps). ``is_causal``: query i sees keys <= i.
    """
    Q, K, V = _d(q), _d(k), _d(v)
    if Q.shape[-1] != K.shape[-1] or K.shape[-2] != V.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: shapes do not fit (q: {Q.shape}, k: {K.shape}, "
                         f"v: {V.shape})")
    s = 1.0 / math.sqrt(Q.shape[-1]) if scale is None else scale
    probs, drop = _attention_probs(Q, K, s, is_causal, attn_mask, dropout_p, training, generator)
    out = (drop.apply(probs) if drop is not None else probs) @ V

    def backward(g, n):
        Q, K, V = _d(q), _d(k), _d(v)
        p = drop.apply(probs) if drop is not None else probs
        gv = unbroadcast(p.swapaxes(-1, -2) @ g, V.shape) if n[2] else None
        del p
        gq = gk = None
        if n[0] or n[1]:
            dp = g @ V.swapaxes(-1, -2)
            if drop is not None:
                drop.apply(dp, out=dp)
            ds = _attention_scores_grad(dp, probs, _row_dot(dp, probs), s)
            gq = unbroadcast(ds @ K, Q.shape) if n[0] else None
            gk = unbroadcast(ds.swapaxes(-1, -2) @ Q, K.shape) if n[1] else None
        return gq, gk, gv
    return make_result("Attention", out, (q, k, v), backward)


def _round_probs_(p, dtype, store=None):
    """Round float32 probabilities ``p`` to 16-bit ``dtype`` in place (``store``: a 16-bit array to write them to
    as well): forward's product with V, the kept array and a recompute then all read the same rounded values."""
    if store is None:
        p[...] = p.astype(dtype)
    else:
        store[...] = p
        p[...] = store


@fp32_op(casts_inside=True)
def multi_head_attention(qkv, num_heads, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                         training=True, generator=None, recompute_probs=False):
    """Return multi-head self-attention of packed projections: (batch, seq, 3 dim) -> (batch, seq, dim).

    ``qkv``'s last axis is q, k, v one after the other, each ``num_heads`` heads of dim / num_heads (what a
    (dim, 3 dim) projection gives); the output's is the heads side by side (what the output projection
    reads). The same numbers as splitting into (batch, heads, seq, head_dim) tensors and calling
    ``scaled_dot_product_attention``, without the copies: the products read q, k and v in place as strided
    views, write the output and the three input gradients straight into their (batch, seq, ...) arrays, and
    backward takes each row's sum_j dp_ij p_ij as dO . O from the output (which the next layer keeps anyway).

    16-bit ``qkv`` (what Megatron-LM keeps, Korthikanti et al., arXiv 2205.05198, section 4.1): backward keeps
    ``qkv`` itself (no float32 copy), the 16-bit output (no float32 one: its row terms dO . O read the rounded
    output upcast, as FlashAttention's do) and the probabilities in ``qkv``'s dtype. Scores and softmax are
    float32 slice by slice; the probabilities are rounded to 16 bits once, and forward's product with V,
    backward and a recompute all read those rounded values, so the gradients are those of the function forward
    computed. Products accumulate in float32 on float32 copies of each slice; the output and the input gradient
    are rounded to 16 bits once.

    ``recompute_probs``: selective activation recompute (Korthikanti et al.): keep only q, k, v (``qkv``) and
    the output, not the (batch, heads, seq, seq) probabilities nor the dropout mask; backward recomputes them
    from q and k by the same operations (the mask from the generator's state before the forward's draw), so the
    gradients are bitwise those of the kept ones, at the cost of the scores' product.
    """
    X = _d(qkv)
    xp = get_array_module(X)
    if X.ndim != 3 or X.shape[-1] % 3 or (X.shape[-1] // 3) % num_heads:
        raise ValueError(f"multi_head_attention: expected (batch, seq, 3 * dim) with dim divisible by "
                         f"num_heads={num_heads} (qkv: {X.shape})")
    b, t, d = X.shape[0], X.shape[1], X.shape[2] // 3
    h, hd = num_heads, d // num_heads
    s = 1.0 / math.sqrt(hd) if scale is None else scale
    low, kept_dtype = is_low_precision(X.dtype), X.dtype   # 16-bit: what the op keeps and returns
    cd = float32 if low else X.dtype   # what scores, softmax and products compute in
    if attn_mask is not None and is_low_precision(_d(attn_mask).dtype):
        attn_mask = _d(attn_mask).astype(float32)

    def heads(a):  # (n, t, 3 d) -> q, k, v as (n, h, t, hd) views
        parts = a.reshape(a.shape[0], t, 3, h, hd)
        return tuple(parts[:, :, i].transpose(0, 2, 1, 3) for i in range(3))

    # Without a mask or dropout, sequence by sequence (as many as fill _SCORES_CHUNK scores): the scores' passes (scale,
    # causal bias, shift, exp, sum, division) and the product with V then read a slice that is still in L2.
    by_sequence = xp is np and attn_mask is None and not (dropout_p and training) and t
    # Causal: row block [r0, r1) sees keys [0, r1) only, so its scores, softmax and products stop there (3/4
    # of the square with two blocks); the scores right of r1 are never formed, read or written (and backward
    # reads the same regions). Without a mask, one block: the whole square.
    blocks = _causal_row_blocks(t) if is_causal else ((0, t),)
    per = builtins.max(1, _SCORES_CHUNK // (h * t * t)) if by_sequence else b

    def causal_bias():
        return xp.triu(xp.full((t, t), -np.inf, dtype=cd), k=1) if is_causal else None

    def sequence_heads(A, lo, n):
        """Return q, k, v of sequences [lo, lo + n) of ``A`` (qkv's array) as (n, h, t, hd) views (of a float32
        copy if 16-bit)."""
        i = slice(lo, lo + n)
        return heads(A[i].astype(cd)) if low else tuple(a[i] for a in heads(A))

    def sequence_probs(Qi, Ki, p, bias, store=None, Vi=None, oi=None):
        """Write the probabilities of a slice's sequences (q ``Qi``, k ``Ki``) into ``p`` (the same products and
        passes in forward and in a recompute: the same bits), rounded to 16 bits when ``qkv`` is (``store``: the
        16-bit array kept for backward); with ``Vi``, each row block's product with V into ``oi``."""
        for r0, r1 in blocks:
            pr = p[:, :, r0:r1, :r1]
            _matmul_into(Qi[:, :, r0:r1], Ki[:, :, :r1].swapaxes(-1, -2), pr)
            _softmax_scores_(pr, s, None if bias is None else bias[r0:r1, :r1])
            if low:
                _round_probs_(pr, kept_dtype, None if store is None else store[:, :, r0:r1, :r1])
            if Vi is not None:
                _matmul_into(pr, Vi[:, :, :r1], oi[:, :, r0:r1])
        return p

    start = None   # recompute with dropout: the generator and its state before the mask's draw
    if by_sequence:
        # A recompute keeps no probabilities, and 16-bit ones are computed in float32: one slice's worth of
        # scratch, reused slice by slice.
        m = builtins.min(per, b)
        scratch = xp.empty((m, h, t, t), dtype=cd) if recompute_probs or low else None
        probs, drop = (None if recompute_probs else xp.empty((b, h, t, t), dtype=X.dtype)), None
        out = xp.empty((b, t, h, hd), dtype=X.dtype)
        out4 = out.transpose(0, 2, 1, 3)
        out_slice = xp.empty((m, t, h, hd), dtype=cd) if low else None   # float32, rounded into ``out``
        bias = causal_bias()
        for lo in range(0, b, per):
            n = builtins.min(per, b - lo)
            Qi, Ki, Vi = sequence_heads(X, lo, n)
            kept = None if recompute_probs else probs[lo:lo + n]
            p = scratch[:n] if scratch is not None else kept
            oi = out_slice[:n].transpose(0, 2, 1, 3) if low else out4[lo:lo + n]
            sequence_probs(Qi, Ki, p, bias, kept if low else None, Vi, oi)
            if low:
                out[lo:lo + n] = out_slice[:n]
        del bias, scratch, out_slice
    else:
        Qc, Kc, Vc = heads(X.astype(cd) if low else X)
        if recompute_probs and dropout_p and training:
            gen = generator_for_draw(generator)
            start = (gen, gen.bit_generator.state)
        probs, drop = _attention_probs(Qc, Kc, s, is_causal, attn_mask, dropout_p, training, generator)
        if low:
            _round_probs_(probs, kept_dtype)
        outc = xp.empty((b, t, h, hd), dtype=np.result_type(probs.dtype, Vc.dtype))
        _matmul_into(drop.apply(probs) if drop is not None else probs, Vc, outc.transpose(0, 2, 1, 3))
        out = outc.astype(kept_dtype) if low else outc
        out4 = out.transpose(0, 2, 1, 3)
        probs = probs.astype(kept_dtype) if low and not recompute_probs else probs
        del Qc, Kc, Vc, outc
    if recompute_probs:
        probs = drop = None   # the backward closure holds neither

    def backward(g, n):
        X = _d(qkv)
        G = g.reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        if low:
            grad = xp.empty((b, t, 3, h, hd), dtype=X.dtype)
        else:
            grad = xp.empty((b, t, 3, h, hd), dtype=np.result_type(g.dtype, X.dtype))
        if by_sequence:
            m = builtins.min(per, b)
            dp = xp.empty((m, h, t, t), dtype=cd if low else np.result_type(G.dtype, X.dtype))
            scratch = xp.empty((m, h, t, t), dtype=cd) if recompute_probs or low else None
            bias = causal_bias() if recompute_probs else None
            grad_slice = xp.empty((m, t, 3, h, hd), dtype=cd) if low else None   # float32, rounded into ``grad``
            for lo in range(0, b, per):
                i, k = slice(lo, lo + per), builtins.min(per, b - lo)
                Qi, Ki, Vi = sequence_heads(X, lo, k)
                if recompute_probs:
                    p = sequence_probs(Qi, Ki, scratch[:k], bias)
                elif low:
                    p = scratch[:k]
                    for r0, r1 in blocks:   # the regions forward wrote, upcast (exact)
                        p[:, :, r0:r1, :r1] = probs[i, :, r0:r1, :r1]
                else:
                    p = probs[i]
                if low:
                    Gi, Oi = G[i].astype(cd), out4[i].astype(cd)
                    gqi, gki, gvi = (grad_slice[:k, :, j].transpose(0, 2, 1, 3) for j in range(3))
                else:
                    Gi, Oi = G[i], out4[i]
                    gqi, gki, gvi = (grad[i, :, j].transpose(0, 2, 1, 3) for j in range(3))
                ds = dp[:k]
                row_dot = _row_dot(Gi, Oi)
                for r0, r1 in blocks:  # the scores' gradient, row block by row block, on the forward's regions
                    dsr = ds[:, :, r0:r1, :r1]
                    _matmul_into(Gi[:, :, r0:r1], Vi[:, :, :r1].swapaxes(-1, -2), dsr)
                    _attention_scores_grad(dsr, p[:, :, r0:r1, :r1], row_dot[:, :, r0:r1], s)
                    _matmul_into(dsr, Ki[:, :, :r1], gqi[:, :, r0:r1])
                # Keys [c0, c1) are seen by the rows from c0 on: the column block of the same regions.
                for c0, c1 in blocks:
                    _matmul_into(p[:, :, c0:, c0:c1].swapaxes(-1, -2), Gi[:, :, c0:], gvi[:, :, c0:c1])
                    _matmul_into(ds[:, :, c0:, c0:c1].swapaxes(-1, -2), Qi[:, :, c0:], gki[:, :, c0:c1])
                if low:
                    grad[i] = grad_slice[:k]
            return (grad.reshape(b, t, 3 * d),)
        Qc, Kc, Vc = heads(X.astype(cd) if low else X)
        P, D = probs, drop
        if recompute_probs:
            P, D = _recomputed_probs(Qc, Kc, s, is_causal, attn_mask, dropout_p, training, generator, start)
            if low:
                _round_probs_(P, kept_dtype)
        elif low:
            P = P.astype(cd)
        if low:
            G, O4 = G.astype(cd), out4.astype(cd)
            grad_c = xp.empty((b, t, 3, h, hd), dtype=cd)
        else:
            O4, grad_c = out4, grad
        gq, gk, gv = (grad_c[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
        _matmul_into((D.apply(P) if D is not None else P).swapaxes(-1, -2), G, gv)
        dp = G @ Vc.swapaxes(-1, -2)
        if D is not None:
            D.apply(dp, out=dp)
        ds = _attention_scores_grad(dp, P, _row_dot(G, O4), s)
        _matmul_into(ds, Kc, gq)
        _matmul_into(ds.swapaxes(-1, -2), Qc, gk)
        if low:
            grad[...] = grad_c
        return (grad.reshape(b, t, 3 * d),)
    return make_result("MultiHeadAttention", out.reshape(b, t, d), (qkv,), backward)


def repeat_kv(qkv, num_heads, num_kv_heads):
    """Return grouped-query projections as multi-head ones: (batch, seq, (h + 2 kv) hd) -> (batch, seq, 3 h hd).

    ``qkv``'s last axis is q (``num_heads`` heads), k and v (``num_kv_heads`` heads each) of head_dim hd; k and v
    head j serve the ``num_heads / num_kv_heads`` q heads from j times that on (grouped-query attention, Ainslie et
    al. 2023, the grouping of Megatron-LM and Llama). The output is the packed [q | k | v] ``multi_head_attention``
    reads, each k and v head repeated for its group. Nothing is kept for backward, which sums each group's
    gradients (in float32 for 16-bit arrays, rounded once)."""
    X = _d(qkv)
    h, kv = num_heads, num_kv_heads
    if not (isinstance(h, (int, np.integer)) and isinstance(kv, (int, np.integer)) and 1 <= kv <= h
            and h % kv == 0):
        raise ValueError(f"repeat_kv: num_heads must be a multiple of num_kv_heads >= 1 (num_heads={h}, "
                         f"num_kv_heads={kv})")
    if X.ndim != 3 or X.shape[-1] % (h + 2 * kv):
        raise ValueError(f"repeat_kv: expected (batch, seq, (num_heads + 2 * num_kv_heads) * head_dim) with "
                         f"num_heads={h}, num_kv_heads={kv} (qkv: {X.shape})")
    xp = get_array_module(X)
    b, t, hd, group = X.shape[0], X.shape[1], X.shape[2] // (h + 2 * kv), h // kv
    parts = X.reshape(b, t, h + 2 * kv, hd)
    out = xp.empty((b, t, 3, h, hd), dtype=X.dtype)
    out[:, :, 0] = parts[:, :, :h]
    out.reshape(b, t, 3, kv, group, hd)[:, :, 1:] = parts[:, :, h:].reshape(b, t, 2, kv, 1, hd)   # a view

    def backward(g, n):
        G = g.reshape(b, t, 3, h, hd)
        grad = xp.empty((b, t, h + 2 * kv, hd), dtype=G.dtype)
        grad[:, :, :h] = G[:, :, 0]
        grouped = G[:, :, 1:].reshape(b, t, 2, kv, group, hd)
        low = is_low_precision(G.dtype)
        sums = grouped.astype(float32).sum(axis=4) if low else grouped.sum(axis=4)
        grad[:, :, h:] = sums.reshape(b, t, 2 * kv, hd)   # rounded once to 16 bits here
        return (grad.reshape(b, t, (h + 2 * kv) * hd),)
    return make_result("RepeatKV", out.reshape(b, t, 3 * h * hd), (qkv,), backward)


def rotary(qkv, num_heads, num_kv_heads=None, base=10000.0):
    """Return packed ``[q | k | v]`` projections with q and k turned by their positions: rotary position embedding
    (Su et al. 2021, arXiv 2104.09864) in Llama's and Megatron-LM's layout. In each q and k head, channels i and
    i + hd / 2 of the token at position p rotate by the angle p * base^(-2i / hd); v is copied unchanged.
    (batch, seq, (num_heads + 2 num_kv_heads) hd) -> the same shape, positions 0 .. seq - 1 (attention's whole
    sequence). Nothing is kept for backward, which turns the gradient back; a 16-bit input is rotated in float32
    and rounded once (output and gradient)."""
    X = _d(qkv)
    h = num_heads
    kv = h if num_kv_heads is None else num_kv_heads
    if not (isinstance(h, (int, np.integer)) and isinstance(kv, (int, np.integer)) and 1 <= kv <= h
            and h % kv == 0):
        raise ValueError(f"rotary: num_heads must be a multiple of num_kv_heads >= 1 (num_heads={h}, "
                         f"num_kv_heads={kv})")
    heads = h + 2 * kv
    if X.ndim != 3 or not X.shape[-1] or X.shape[-1] % heads or (X.shape[-1] // heads) % 2:
        raise ValueError(f"rotary: expected (batch, seq, (num_heads + 2 * num_kv_heads) * head_dim) with an even "
                         f"head_dim, num_heads={h}, num_kv_heads={kv} (qkv: {X.shape})")
    if not valid_rope_base(base):
        raise ValueError(f"rotary: base must be a finite number > 0 (got {base!r})")
    xp = get_array_module(X)
    b, t, hd = X.shape[0], X.shape[1], X.shape[2] // heads
    cd = float32 if is_low_precision(X.dtype) else X.dtype
    cos, sin = _rotary_table(t, hd, float(base), np.dtype(cd).str)
    if xp is not np:   # one device copy per table, shared by every block (their backward closures keep it)
        key = (t, hd, float(base), np.dtype(cd).str, _device_id(xp))
        if key not in _DEVICE_ROTARY_TABLES:
            if len(_DEVICE_ROTARY_TABLES) >= 32:
                _DEVICE_ROTARY_TABLES.clear()
            _DEVICE_ROTARY_TABLES[key] = (xp.asarray(cos), xp.asarray(sin))
        cos, sin = _DEVICE_ROTARY_TABLES[key]
    parts = X.reshape(b, t, heads, hd)
    out = xp.empty_like(parts)
    _rotate_into(parts[:, :, :h + kv], out[:, :, :h + kv], cos, sin, cd, sign=1)
    out[:, :, h + kv:] = parts[:, :, h + kv:]
    shape, dtype = X.shape, X.dtype
    del X, parts   # backward needs neither: the closure keeps no input

    def backward(g, n):
        G = g.reshape(b, t, heads, hd)
        grad = xp.empty(G.shape, dtype=dtype)
        _rotate_into(G[:, :, :h + kv], grad[:, :, :h + kv], cos, sin, cd, sign=-1)   # the transpose: -angle
        grad[:, :, h + kv:] = G[:, :, h + kv:]
        return (grad.reshape(shape),)
    return make_result("Rotary", out.reshape(shape), (qkv,), backward)


def valid_rope_base(base) -> bool:
    """Return whether ``base`` is a rotary base: a finite real number > 0 (not a bool)."""
    return isinstance(base, numbers.Real) and not isinstance(base, bool) and math.isfinite(base) and base > 0


_DEVICE_ROTARY_TABLES = {}   # (t, hd, base, dtype, device) -> the table's device arrays


def _device_id(xp):
    try:
        return int(xp.cuda.runtime.getDevice())
    except Exception:   # a stand-in module without CUDA (tests): one device
        return 0


@functools.lru_cache(maxsize=32)   # one per (sequence, head size, base, dtype): every block of a step asks
def _rotary_table(t, hd, base, dtype):
    """Return cos and sin of the angles p * base^(-2i / hd), p < t, i < hd / 2, as read-only (t, 1, hd / 2)
    arrays of ``dtype`` (formed in float64, rounded once), shared by every caller."""
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.arange(t, dtype=np.float64)[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def _rotate_into(src, dst, cos, sin, cd, sign):
    """Write ``src``'s heads turned by ``sign`` x their angles into ``dst``: (x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin) for the first and second half of each head's channels, computed in ``cd``."""
    half = src.shape[-1] // 2
    x1, x2 = src[..., :half], src[..., half:]
    if x1.dtype != cd:
        x1, x2 = x1.astype(cd), x2.astype(cd)
    s = sin if sign > 0 else -sin
    dst[..., :half] = x1 * cos - x2 * s
    dst[..., half:] = x2 * cos + x1 * s


def _recomputed_probs(Q, K, scale, is_causal, attn_mask, dropout_p, training, generator, start):
    """Return ``_attention_probs`` again for a backward; ``start``: (generator, its state before the forward's
    draw), to draw the same dropout mask, the generator put back afterwards (later draws see no difference)."""
    if start is None:
        return _attention_probs(Q, K, scale, is_causal, attn_mask, dropout_p, training, generator)
    gen, state = start
    now = gen.bit_generator.state
    gen.bit_generator.state = state
    try:
        return _attention_probs(Q, K, scale, is_causal, attn_mask, dropout_p, training, gen)
    finally:
        gen.bit_generator.state = now


# -- convolution, pooling, batch norm (images: (N, C, H, W)) ------------------------------------------------

def _pair(name, v):
    t = (v, v) if isinstance(v, (int, np.integer)) else tuple(v)
    if len(t) != 2 or any(int(i) != i for i in t):
        raise ValueError(f"{name}: expected an int or a pair of ints (got {v!r})")
    return int(t[0]), int(t[1])


def _windows(xpad, kernel, stride, dilation, out_hw):
    """Return a read-only strided view (N, C, Ho, Wo, kh, kw) of the windows of ``xpad`` (no copy)."""
    xp = get_array_module(xpad)
    n, c, _, _ = xpad.shape
    s0, s1, s2, s3 = xpad.strides
    shape = (n, c, out_hw[0], out_hw[1], kernel[0], kernel[1])
    strides = (s0, s1, s2 * stride[0], s3 * stride[1], s2 * dilation[0], s3 * dilation[1])
    return xp.lib.stride_tricks.as_strided(xpad, shape=shape, strides=strides)


def _pad(x, padding, value=0.0):
    if padding == (0, 0):
        return x
    xp = get_array_module(x)
    ph, pw = padding
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _out_hw(name, shape, kernel, stride, padding, dilation):
    h, w = shape[2], shape[3]
    out = tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                for size, k, s, p, d in zip((h, w), kernel, stride, padding, dilation))
    if out[0] < 1 or out[1] < 1:
        raise ValueError(f"{name}: the window does not fit the input (input: {shape}, kernel: {kernel}, "
                         f"stride: {stride}, padding: {padding}, dilation: {dilation})")
    return out


def _col2im(dwin, xshape, kernel, stride, padding, dilation):
    """Sum window gradients (N, C, kh, kw, Ho, Wo) back onto the input (N, C, H, W): im2col's adjoint.

    One strided add per kernel offset (kh * kw of them): windows overlap when stride < kernel, and
    each offset touches every output position once, so no index is written twice in one add.
    """
    xp = get_array_module(dwin)
    n, c, h, w = xshape
    ph, pw = padding
    ho, wo = dwin.shape[4:6]
    full = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dwin.dtype)
    for i in range(kernel[0]):
        r = i * dilation[0]
        for j in range(kernel[1]):
            q = j * dilation[1]
            full[:, :, r:r + stride[0] * (ho - 1) + 1:stride[0], q:q + stride[1] * (wo - 1) + 1:stride[1]] += \
                dwin[:, :, i, j]
    return full[:, :, ph:ph + h, pw:pw + w]


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D cross-correlation of ``x`` (N, C, H, W) with ``weight`` (O, C/groups, kh, kw), plus ``bias`` (O,).

    im2col: a strided view of the windows copied once into (N, groups, C/groups*kh*kw, Ho*Wo), then one
    batched matmul whose result is already (N, O, Ho, Wo). That layout keeps the copy's inner loop on
    the input's rows (0.7 ms against 7.6 ms for (N*Ho*Wo, C*kh*kw) columns, 64x16x14x14 input, 3x3).
    Backward recomputes the columns when the weight needs a gradient (they are kh*kw times the
    input's size, too much to keep) and sums column gradients back with ``_col2im``.
    """
    dx, w = _d(x), _d(weight)
    stride, padding, dilation = _pair("conv2d stride", stride), _pair("conv2d padding", padding), \
        _pair("conv2d dilation", dilation)
    if dx.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d: expected input (N, C, H, W) and weight (O, C/groups, kh, kw) "
                         f"(input: {dx.shape}, weight: {w.shape})")
    n, c = dx.shape[:2]
    o, cg, kh, kw = w.shape
    if c % groups or o % groups or cg != c // groups:
        raise ValueError(f"conv2d: channels do not fit groups={groups} (input: {dx.shape}, weight: {w.shape}; "
                         f"weight.shape[1] must be C/groups and both C and O divisible by groups)")
    kernel = (kh, kw)
    ho, wo = _out_hw("conv2d", dx.shape, kernel, stride, padding, dilation)
    og, k, spots = o // groups, cg * kh * kw, ho * wo
    xp = get_array_module(dx)

    def columns(xa):
        win = _windows(_pad(xa, padding), kernel, stride, dilation, (ho, wo))  # (N, C, Ho, Wo, kh, kw)
        win = win.reshape(n, groups, cg, ho, wo, kh, kw).transpose(0, 1, 2, 5, 6, 3, 4)
        return xp.ascontiguousarray(win).reshape(n, groups, k, spots)

    out = (w.reshape(1, groups, og, k) @ columns(dx)).reshape(n, o, ho, wo)
    if bias is not None:
        out += _d(bias).reshape(1, o, 1, 1)

    def backward(g, need):
        g2 = g.reshape(n, groups, og, spots)
        gx = gw = gb = None
        if need[0]:
            dcols = _d(weight).reshape(1, groups, og, k).swapaxes(-1, -2) @ g2  # (N, G, K, Ho*Wo)
            gx = _col2im(dcols.reshape(n, c, kh, kw, ho, wo), dx.shape, kernel, stride, padding, dilation)
        if need[1]:
            gw = (g2 @ columns(_d(x)).swapaxes(-1, -2)).sum(axis=0).reshape(o, cg, kh, kw)
        if bias is not None and need[2]:
            gb = g.sum(axis=(0, 2, 3))
        return gx, gw, gb
    return make_result("Conv2d", out, (x, weight, bias), backward)


def _pool_args(name, kernel_size, stride, padding):
    kernel = _pair(f"{name} kernel_size", kernel_size)
    stride = kernel if stride is None else _pair(f"{name} stride", stride)
    padding = _pair(f"{name} padding", padding)
    if padding[0] * 2 > kernel[0] or padding[1] * 2 > kernel[1]:
        raise ValueError(f"{name}: padding must be at most half the kernel (kernel: {kernel}, padding: {padding})")
    return kernel, stride, padding


def max_pool2d(x, kernel_size, stride=None, padding=0):
    """Maximum over each window of ``x`` (N, C, H, W); padding counts as -inf. The gradient goes to the
    first maximum of each window (PyTorch's rule)."""
    dx = _d(x)
    kernel, stride, padding = _pool_args("max_pool2d", kernel_size, stride, padding)
    ho, wo = _out_hw("max_pool2d", dx.shape, kernel, stride, padding, (1, 1))
    win = _windows(_pad(dx, padding, -np.inf), kernel, stride, (1, 1), (ho, wo))
    flat = win.reshape(win.shape[:4] + (-1,))  # copies: windows overlap in memory
    arg = flat.argmax(axis=-1)
    xp = get_array_module(dx)
    out = xp.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    del flat, win
    shape = dx.shape

    def backward(g, need):
        kk = kernel[0] * kernel[1]
        onehot = (arg[..., None] == xp.arange(kk)) * g[..., None]  # (N, C, Ho, Wo, kh*kw)
        onehot = onehot.reshape(g.shape + kernel).transpose(0, 1, 4, 5, 2, 3)
        return (_col2im(onehot, shape, kernel, stride, padding, (1, 1)),)
    return make_result("MaxPool2d", out, (x,), backward)


def avg_pool2d(x, kernel_size, stride=None, padding=0, count_include_pad=True):
    """Mean over each window of ``x`` (N, C, H, W); ``count_include_pad`` divides by the whole window
    (PyTorch's default) instead of by the elements inside the input."""
    dx = _d(x)
    xp = get_array_module(dx)
    kernel, stride, padding = _pool_args("avg_pool2d", kernel_size, stride, padding)
    ho, wo = _out_hw("avg_pool2d", dx.shape, kernel, stride, padding, (1, 1))
    win = _windows(_pad(dx, padding), kernel, stride, (1, 1), (ho, wo))
    if count_include_pad or padding == (0, 0):
        divisor = dx.dtype.type(kernel[0] * kernel[1])
    else:
        ones = xp.ones((1, 1) + dx.shape[2:], dtype=dx.dtype)
        divisor = _windows(_pad(ones, padding), kernel, stride, (1, 1), (ho, wo)).sum(axis=(4, 5))
    out = win.sum(axis=(4, 5)) / divisor
    shape = dx.shape

    def backward(g, need):
        share = xp.broadcast_to((g / divisor)[:, :, None, None], g.shape[:2] + kernel + g.shape[2:])
        return (_col2im(share, shape, kernel, stride, padding, (1, 1)),)
    return make_result("AvgPool2d", out, (x,), backward)


def batch_norm(x, running_mean=None, running_var=None, weight=None, bias=None, training=True, momentum=0.1,
               eps=1e-5, comm=None):
    """Normalize ``x`` (N, C, ...) per channel (axis 1), then scale by ``weight`` and shift by ``bias``.

    Training: batch statistics (biased variance), and ``running_mean``/``running_var`` (arrays, updated
    in place when given) move by ``momentum`` towards the batch mean and unbiased variance. Eval: the
    running statistics. ``comm``: the batch is spread over its ranks (SyncBatchNorm); the per-channel sum,
    sum of squares and count are allreduced in one call, and backward allreduces the two gradient sums,
    so every rank normalizes and differentiates as one process holding the whole batch would.
    """
    dx = _d(x)
    xp = get_array_module(dx)
    if dx.ndim < 2:
        raise ValueError(f"batch_norm: expected input (N, C, ...) (input: {dx.shape})")
    c = dx.shape[1]
    for name, a in (("running_mean", running_mean), ("running_var", running_var), ("weight", _d(weight)),
                    ("bias", _d(bias))):
        if a is not None and tuple(a.shape) != (c,):
            raise ValueError(f"batch_norm: {name} shape {tuple(a.shape)} does not match the {c} channels of "
                             f"the input {dx.shape}")
    axes = (0,) + tuple(range(2, dx.ndim))
    bshape = (1, c) + (1,) * (dx.ndim - 2)
    dt = dx.dtype.type
    if training:
        if comm is not None:
            from mpidist import collectives  # lazily: only SyncBatchNorm communicates (as nn.utils does)
            # var = E[x^2] - E[x]^2 cancels badly when the mean is large against the spread (float32 data
            # with mean 1000 lost 2% of its variance). So each rank squares about a shift m (its own
            # mean, rounded to the input dtype) and forms sum(x^2) = sum((x-m)^2) + m (2 sum(x) - n m)
            # in float64: the sums stay additive over ranks, and the global subtraction loses only
            # float64 digits.
            f64 = xp.float64
            local_n = dx.size // c
            local_sum = dx.sum(axis=axes, dtype=f64)
            shift = (local_sum / local_n).astype(dx.dtype)
            centered = dx - shift.reshape(bshape)
            shift = shift.astype(f64)
            sumsq = (centered * centered).sum(axis=axes, dtype=f64) + shift * (2 * local_sum - local_n * shift)
            del centered
            stats = xp.concatenate([local_sum, sumsq, xp.full((1,), local_n, dtype=f64)])
            collectives.allreduce(stats, comm)
            count = int(round(float(stats[-1])))
            mean64 = stats[:c] / count
            mean = mean64.astype(dx.dtype)
            var = xp.maximum(stats[c:2 * c] / count - mean64 * mean64, 0).astype(dx.dtype)
        else:
            count = dx.size // c
            mean = dx.mean(axis=axes)
            var = ((dx - mean.reshape(bshape)) ** 2).mean(axis=axes)
        if count <= 1:
            raise ValueError(f"batch_norm: training needs more than one value per channel (input: {dx.shape})")
        if running_mean is not None:
            running_mean *= 1 - momentum
            running_mean += momentum * mean.astype(running_mean.dtype, copy=False)
        if running_var is not None:
            running_var *= 1 - momentum
            running_var += (momentum * count / (count - 1)) * var.astype(running_var.dtype, copy=False)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: evaluation needs running_mean and running_var")
        mean, var = running_mean.astype(dx.dtype), running_var.astype(dx.dtype)
    rstd = (1.0 / xp.sqrt(var + eps)).astype(dx.dtype, copy=False).reshape(bshape)
    xhat = (dx - mean.reshape(bshape)) * rstd
    out = xhat * _d(weight).reshape(bshape) if weight is not None else xhat
    if bias is not None:
        out = out + _d(bias).reshape(bshape)

    def backward(g, need):
        gx = None
        if need[0]:
            dxhat = g * _d(weight).reshape(bshape) if weight is not None else g
            if training:
                sums = xp.concatenate([dxhat.sum(axis=axes), (dxhat * xhat).sum(axis=axes)])
                if comm is not None:
                    collectives.allreduce(sums, comm)
                gx = rstd * (dxhat - (sums[:c] / dt(count)).reshape(bshape)
                             - xhat * (sums[c:] / dt(count)).reshape(bshape))
            else:
                gx = dxhat * rstd
        gw = (g * xhat).sum(axis=axes) if weight is not None and need[1] else None
        gb = g.sum(axis=axes) if bias is not None and need[2] else None
        return gx, gw, gb
    return make_result("BatchNorm", out, (x, weight, bias), backward)


# -- Tensor methods and operators ----------------------------------------------------------------------------

def _install():
    T = Tensor
    T.__add__ = lambda a, b: add(a, b)
    T.__radd__ = lambda a, b: add(b, a)
    T.__sub__ = lambda a, b: sub(a, b)
    T.__rsub__ = lambda a, b: sub(b, a)
    T.__mul__ = lambda a, b: mul(a, b)
    T.__rmul__ = lambda a, b: mul(b, a)
    T.__truediv__ = lambda a, b: div(a, b)
    T.__rtruediv__ = lambda a, b: div(b, a)
    T.__neg__ = lambda a: neg(a)
    T.__pow__ = lambda a, p: pow(a, p)
    T.__matmul__ = lambda a, b: matmul(a, b)
    T.__rmatmul__ = lambda a, b: matmul(b, a)
    T.__getitem__ = lambda a, i: getitem(a, i)
    T.__lt__ = lambda a, b: _d(a) < _d(b)
    T.__le__ = lambda a, b: _d(a) <= _d(b)
    T.__gt__ = lambda a, b: _d(a) > _d(b)
    T.__ge__ = lambda a, b: _d(a) >= _d(b)
    T.reshape = reshape
    T.view = reshape
    T.permute = permute
    T.transpose = transpose
    T.swapaxes = swapaxes
    T.T = property(lambda a: transpose(a))
    T.sum = sum
    T.mean = mean
    T.max = max
    T.var = var
    T.exp = exp
    T.log = log
    T.sqrt = sqrt
    T.tanh = tanh
    T.sigmoid = sigmoid
    T.relu = relu
    T.softmax = softmax
    T.log_softmax = log_softmax
    T.matmul = matmul
    T.split = split
    T.flatten = lambda a, start=0: reshape(a, _d(a).shape[:start] + (-1,))
    T.astype = lambda a, dtype: _astype(a, dtype)


def _astype(a, dtype):
    da = _d(a)
    out = da.astype(dtype)
    src = da.dtype
    return make_result("Cast", out, (a,), lambda g, n: (g.astype(src),))


_install()
