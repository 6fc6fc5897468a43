"""Gradient checks against central finite differences (float64), for tests.

``gradcheck(fn, *args)`` differentiates ``fn(*tensors)`` (one Tensor or a tuple) weighted by random
output gradients with the engine, and compares the gradient of every float input (and of every
parameter of ``module``) with central differences of the same weighted sum computed under
``no_grad``: an independent reference that needs nothing but the forward.
"""

import numpy as np

import mpidist.nn as nn


def numeric_grad(f, a, eps=1e-6):
    """Central differences of the scalar ``f()`` with respect to every element of ``a`` (perturbed in place)."""
    g = np.zeros(a.shape)
    for idx in np.ndindex(a.shape):
        old = a[idx]
        a[idx] = old + eps
        fp = f()
        a[idx] = old - eps
        fm = f()
        a[idx] = old
        g[idx] = (fp - fm) / (2 * eps)
    return g


def transposed(a):
    """Return a non-contiguous (Fortran-ordered) array with ``a``'s values."""
    return np.asfortranarray(a) if a.ndim > 1 else strided(a)


def strided(a):
    """Return a non-contiguous view (every other element of a larger array) with ``a``'s values."""
    big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
    big[..., ::2] = a
    view = big[..., ::2]
    assert not view.flags.c_contiguous
    return view


def _differentiable(a):
    return isinstance(a, np.ndarray) and a.dtype.kind == "f"


def gradcheck(fn, *args, module=None, reset=None, wrt=None, rtol=1e-6, atol=1e-8, eps=1e-6, seed=12345):
    """Check the engine's gradients of ``fn(*args)`` against finite differences; return them by name.

    ``args``: float arrays become tensors that require grad (``wrt``: indices of the ones that should,
    default all), anything else is passed as is. ``module``: its parameters are checked too (and
    ``reset()``, if given, runs before every forward, e.g. to re-seed dropout).
    """
    reset = reset or (lambda: None)
    wrt = [i for i, a in enumerate(args) if _differentiable(a)] if wrt is None else list(wrt)
    tensors = [nn.Tensor(a, requires_grad=i in wrt) if _differentiable(a) else a for i, a in enumerate(args)]
    for i in wrt:
        assert tensors[i].data is args[i]  # perturbing args[i] in place must perturb the forward's input
    params = [] if module is None else list(module.named_parameters())
    for _, p in params:
        p.grad = None
    reset()
    out = fn(*tensors)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(o.shape) for o in outs]
    nn.backward(list(outs), weights)

    def loss():
        reset()
        with nn.no_grad():
            o = fn(*tensors)
        return float(sum(np.sum(np.asarray(x.data if isinstance(x, nn.Tensor) else x) * w)
                         for x, w in zip(o if isinstance(o, (tuple, list)) else (o,), weights)))

    found = {}
    for i in wrt:
        got = tensors[i].grad
        assert got is not None, f"gradcheck: input {i} got no gradient"
        np.testing.assert_allclose(got, numeric_grad(loss, args[i], eps), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of input {i} (shape {args[i].shape})")
        found[i] = got
    for name, p in params:
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"gradcheck: parameter {name} got no gradient"
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data, eps), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of parameter {name}")
        found[name] = p.grad
    return found
