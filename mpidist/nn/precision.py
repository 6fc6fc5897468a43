"""Mixed precision for ``mpidist.nn``: 16-bit parameters, the ops that always run in float32, and a policy.

Glossary:
  param dtype    what parameters are stored (and gathered, and communicated) in: float16, bfloat16 or float32.
  compute dtype  what activations are: the param dtype (16-bit arithmetic), or float32 with 16-bit parameters
                 (numpy promotes ``float32 @ bfloat16`` to float32 and upcasts the weight exactly, so the
                 matmul runs on BLAS: on numpy this is the fast choice, see ``docs/precision.md``).
  master weight  the float32 copy of a 16-bit parameter the optimizer updates (``mpidist.optim``): every step
                 writes it back rounded to the param dtype (round to nearest even), so small steps accumulate.
  fp32 op        an op that computes in float32 whatever its inputs (``FP32_OPS``): its 16-bit inputs are
                 cast up exactly, the result is rounded back once to the dtype of its first input (the
                 activation; losses stay float32, so the loss scale and the backward's seed are float32).
                 One that casts inside (``fp32_op(casts_inside=True)``: the norms) keeps a 16-bit input for
                 backward as it is and casts it up again there, never a float32 copy.

bfloat16 on numpy is ``ml_dtypes.bfloat16``; MPI has no such type. The collectives take it as any dtype, by one
rule (``mpidist.wire``): copies (broadcast, allgather, send/recv, alltoall) carry its uint16 bit patterns, and
reductions (sum, mean, prod) accumulate in float32 and round once; ``mpidist.parallel.comm_hooks``' 16-bit ring
keeps 16 bits on the wire instead.
"""

import dataclasses
import functools

import ml_dtypes
import numpy as np

from mpidist.nn.autograd import Tensor, make_result
from mpidist.nn.deferred import deferred_like, is_deferred
from mpidist.xp import check_dtype, is_device_array

__all__ = ["bfloat16", "float16", "float32", "LOW_PRECISION", "FP32_OPS", "as_dtype", "is_low_precision",
           "is_floating", "fp32_op", "upcast", "input_dtypes", "grads_as", "cast", "Policy", "apply_policy"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
LOW_PRECISION = (float16, bfloat16)

# The ops that run in float32 whatever their inputs' dtype (decorated with ``fp32_op`` in nn.functional):
# reductions (16-bit partial sums lose the small addends: a bfloat16 sum of 4096 values near 1 is off by
# several percent), softmax and log-softmax (exp of 16-bit logits, then a sum), the norms (a mean and a
# variance), attention (its softmax), and the losses (which return float32). batch_norm is not listed: it
# computes its statistics in float64 already.
FP32_OPS = ("sum", "mean", "var", "softmax", "log_softmax", "layer_norm", "rms_norm",
            "scaled_dot_product_attention", "multi_head_attention", "cross_entropy", "mse_loss")

_NAMES = {"bfloat16": bfloat16, "bf16": bfloat16, "float16": float16, "fp16": float16, "half": float16,
          "float32": float32, "fp32": float32}


def as_dtype(dtype, context="precision"):
    """Return ``dtype`` (a name such as "bf16", or a dtype) as a numpy dtype of float16, bfloat16 or float32."""
    if isinstance(dtype, str):
        found = _NAMES.get(dtype.lower())
    else:
        try:
            found = np.dtype(dtype)
        except TypeError:
            found = None
    if found not in (float16, bfloat16, float32):
        raise ValueError(f"{context}: dtype must be float16, bfloat16 or float32 (got {dtype!r})")
    return found


def is_low_precision(dtype):
    """Whether ``dtype`` is float16 or bfloat16."""
    return dtype in LOW_PRECISION


def is_floating(dtype):
    """Whether ``dtype`` is a real floating dtype, bfloat16 included (numpy gives ml_dtypes' bfloat16 kind "V")."""
    return dtype.kind == "f" or dtype == bfloat16


def cast(x, dtype):
    """Return Tensor ``x`` as ``dtype``, differentiably (the gradient is cast back to ``x``'s dtype)."""
    data = x.data if isinstance(x, Tensor) else x
    if data.dtype == dtype:
        return x
    src = data.dtype
    return make_result("Cast", data.astype(dtype), (x,), lambda g, n: (g.astype(src),))


_LOW_CHARS = frozenset(d.char for d in LOW_PRECISION)  # "e", and ml_dtypes' "E": a set lookup, not dtype equality


def _low(x):
    dtype = getattr(x.data if isinstance(x, Tensor) else x, "dtype", None)
    return dtype if dtype is not None and getattr(dtype, "char", None) in _LOW_CHARS else None


def fp32_op(fn=None, *, loss=False, casts_inside=False):
    """Decorate op ``fn`` to compute in float32 when an input is 16-bit, rounding the result back once.

    ``loss``: the result stays float32. Inputs of other dtypes pass unchanged (float32 costs one dtype check).

    ``casts_inside``: ``fn`` gets its inputs as given and casts them itself, so that its backward can keep a
    16-bit input as it is (2 bytes an element, the caller's own array) instead of a float32 copy, and cast it
    again when it runs (Megatron-LM's norms keep their 16-bit input this way). Such an op reads each input's
    array with ``upcast(t)`` in forward and again in backward, notes ``input_dtypes(...)`` in forward and
    returns ``grads_as(grads, dtypes)``; the wrapper still rounds the result once::

        @fp32_op(casts_inside=True)
        def op(x, weight):
            dtypes = input_dtypes(x, weight)
            out = f(upcast(x), upcast(weight))
            return make_result("Op", out, (x, weight),
                               lambda g, n: grads_as(df(g, upcast(x), upcast(weight)), dtypes))
    """
    if fn is None:
        return functools.partial(fp32_op, loss=loss, casts_inside=casts_inside)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # The common case (no 16-bit input) costs one attribute look-up per argument: these ops run often.
        for a in args:
            if _low(a) is not None:
                break
        else:
            for v in kwargs.values():
                if _low(v) is not None:
                    break
            else:
                return fn(*args, **kwargs)
        # The result takes the dtype of the first input (the activation): a float32 activation normalized with
        # a bfloat16 weight stays float32.
        first = args[0] if args else next(iter(kwargs.values()))
        out_dtype = None if loss else _low(first)
        if not casts_inside:
            args = [cast(a, float32) if _low(a) is not None else a for a in args]
            kwargs = {k: (cast(v, float32) if _low(v) is not None else v) for k, v in kwargs.items()}
        out = fn(*args, **kwargs)
        return out if out_dtype is None else cast(out, out_dtype)
    return wrapper


def upcast(x):
    """Return the array of Tensor (or array) ``x`` in float32 if it is 16-bit (a fresh copy), else ``x``'s own."""
    data = x.data if isinstance(x, Tensor) else x
    return data.astype(float32) if _low(data) is not None else data


def input_dtypes(*inputs):
    """Return the dtype of each input's array (None for None): what ``grads_as`` returns their gradients in."""
    return tuple(None if t is None else (t.data if isinstance(t, Tensor) else t).dtype for t in inputs)


def grads_as(grads, dtypes):
    """Return each gradient (or None) in its input's dtype (``input_dtypes``), as ``cast``'s backward does."""
    return tuple(g if g is None or g.dtype == dt else g.astype(dt) for g, dt in zip(grads, dtypes))


@dataclasses.dataclass(frozen=True)
class Policy:
    """Store parameters in ``param_dtype``; run activations in ``compute_dtype`` (default: ``param_dtype``).

    ``Policy("bf16")``: bfloat16 parameters and activations; ``Policy("bf16", "fp32")``: bfloat16 parameters
    (half the memory and the bytes on the wire) with float32 activations. Either way the fp32 ops (``FP32_OPS``)
    compute in float32 and the optimizer keeps float32 master weights.
    """

    param_dtype: object = float32
    compute_dtype: object = None

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", as_dtype(self.param_dtype, "Policy: param_dtype"))
        compute = self.param_dtype if self.compute_dtype is None else self.compute_dtype
        object.__setattr__(self, "compute_dtype", as_dtype(compute, "Policy: compute_dtype"))


class _PolicyHandle:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        """Stop casting activations (the parameters keep their dtype)."""
        for h in self.handles:
            h.remove()
        self.handles = []


def _cast_floating(value, dtype):
    if isinstance(value, Tensor) or hasattr(value, "__array_interface__") or is_device_array(value):  # CuPy has none
        data = value.data if isinstance(value, Tensor) else value
        if is_floating(data.dtype):
            return cast(value, dtype)
        return value
    if isinstance(value, tuple):
        return tuple(_cast_floating(v, dtype) for v in value)
    return value


def _deferred_as(data, dtype):
    """Return a copy of DeferredArray ``data`` of ``dtype``: no values to cast, it is drawn (or read) in it."""
    out = deferred_like(data, data.shape)
    out.dtype = dtype
    return out


def apply_policy(module, policy):
    """Cast ``module``'s floating parameters to ``policy.param_dtype`` in place; cast activations to its
    ``compute_dtype`` (the root's floating inputs, and the outputs of every module holding parameters).

    Call it before wrapping (DDP, FSDP) and before building the optimizer. Buffers (batch-norm statistics) stay
    as they are. Returns a handle whose ``remove()`` stops the activation casts."""
    if not isinstance(policy, Policy):
        raise TypeError(f"apply_policy: policy must be an mpidist.nn.precision.Policy (got {type(policy).__name__})")
    for _, p in module.named_parameters():
        if is_floating(p.data.dtype):
            for dtype in (policy.param_dtype, policy.compute_dtype):  # bfloat16 on a CuPy without it: an error
                check_dtype(p.data, dtype, "apply_policy")
            if p.data.dtype != policy.param_dtype:
                p.data = _deferred_as(p.data, policy.param_dtype) if is_deferred(p.data) \
                    else p.data.astype(policy.param_dtype)
    compute = policy.compute_dtype

    def cast_inputs(_, args):
        return _cast_floating(tuple(args), compute)

    def cast_output(_, args, out):
        return _cast_floating(out, compute)

    handles = [module.register_forward_pre_hook(cast_inputs)]
    # The outputs of modules holding parameters: an embedding's lookup of 16-bit weights is 16-bit whatever the
    # compute dtype, and numpy gives float32 for a bfloat16 matmul (ml_dtypes accumulates in float32): cast
    # once there, as a GPU's 16-bit matmul with float32 accumulation rounds once.
    for _, sub in module.named_modules():
        if sub._params:
            handles.append(sub.register_forward_hook(cast_output))
    return _PolicyHandle(handles)
