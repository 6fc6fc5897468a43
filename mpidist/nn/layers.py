"""Layers with explicit backward, agnostic to numpy/CuPy.

Each backward computes the input gradient first and accumulates parameter
gradients last, in reverse registration order: a grad-ready hook may then
release a parameter's storage (FSDP) without breaking the rest of backward,
and hooks fire in reverse ``parameters()`` order along a Sequential (DDP).
"""

import math

import numpy as np

from mpidist.nn.module import Module, Parameter
from mpidist.xp import get_array_module, scatter_add

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "Dropout", "LayerNorm", "Embedding", "Flatten"]


def _rng(rng):
    return np.random.default_rng(0) if rng is None else rng


class Linear(Module):
    """Affine map ``y = x @ W.T + b`` over the last axis; W has shape (out, in)."""

    def __init__(self, in_features, out_features, bias=True, *, rng=None, dtype=np.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rng = _rng(rng)
        # PyTorch's default init: kaiming_uniform(a=sqrt(5)) reduces to U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_features,)).astype(dtype)) if bias else None
        self._deferred_weight_grads = {}  # mb -> (x, dy) between backward_input and backward_weight

    def forward(self, x, mb=0):
        """Return ``x @ W.T + b`` for ``x`` of shape (..., in)."""
        w = self.weight.data
        if x.shape[-1:] != w.shape[1:]:
            raise ValueError(f"Linear.forward: input last dim does not match in_features "
                             f"(input: {x.shape}, weight: {w.shape})")
        y = x @ w.T
        if self.bias is not None:
            y += self.bias.data
        self.save_for_backward(mb, x)
        return y

    def backward(self, grad_out, mb=0):
        """Accumulate dW, db and return dx."""
        x = self.pop_saved(mb)
        w = self.weight.data
        dx = grad_out @ w
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        if self.bias is not None:
            self.bias.accumulate_grad(dy2.sum(axis=0))
        self.weight.accumulate_grad(dy2.T @ x.reshape(-1, x.shape[-1]))
        return dx

    def backward_input(self, grad_out, mb=0):
        """Return dx now; keep (x, dy) so ``backward_weight`` computes dW and db later."""
        x = self.pop_saved(mb)
        self._deferred_weight_grads[mb] = (x, grad_out)
        return grad_out @ self.weight.data

    def backward_weight(self, mb=0):
        """Accumulate dW and db of micro-batch ``mb`` deferred by ``backward_input``."""
        if mb not in self._deferred_weight_grads:
            raise KeyError(f"Linear.backward_weight: no deferred weight gradient for micro-batch {mb} "
                           f"(pending: {sorted(self._deferred_weight_grads)})")
        x, grad_out = self._deferred_weight_grads.pop(mb)
        dy2 = grad_out.reshape(-1, grad_out.shape[-1])
        if self.bias is not None:
            self.bias.accumulate_grad(dy2.sum(axis=0))
        self.weight.accumulate_grad(dy2.T @ x.reshape(-1, x.shape[-1]))

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """Elementwise ``max(x, 0)``."""

    def forward(self, x, mb=0):
        """Return ``max(x, 0)``."""
        mask = x > 0
        self.save_for_backward(mb, mask)
        return x * mask

    def backward(self, grad_out, mb=0):
        """Return ``grad_out`` where the input was positive, 0 elsewhere."""
        return grad_out * self.pop_saved(mb)


class GELU(Module):
    """GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    _C = math.sqrt(2.0 / math.pi)
    _K = 0.044715

    def forward(self, x, mb=0):
        """Return the tanh-approximated GELU of ``x``."""
        xp = get_array_module(x)
        t = xp.tanh(self._C * (x + self._K * x ** 3))
        self.save_for_backward(mb, (x, t))
        return 0.5 * x * (1 + t)

    def backward(self, grad_out, mb=0):
        """Return the input gradient of the tanh-approximated GELU."""
        x, t = self.pop_saved(mb)
        dt = (1 - t * t) * self._C * (1 + 3 * self._K * x * x)
        return grad_out * (0.5 * (1 + t) + 0.5 * x * dt)


class Tanh(Module):
    """Elementwise ``tanh(x)``."""

    def forward(self, x, mb=0):
        """Return ``tanh(x)``."""
        y = get_array_module(x).tanh(x)
        self.save_for_backward(mb, y)
        return y

    def backward(self, grad_out, mb=0):
        """Return ``grad_out * (1 - tanh(x)^2)``."""
        y = self.pop_saved(mb)
        return grad_out * (1 - y * y)


class Dropout(Module):
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p); identity in eval mode."""

    def __init__(self, p=0.5, *, seed=0):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1] (p: {p})")
        self.p = p
        # Owned, seeded generator: masks are reproducible and independent of global state.
        self.rng = np.random.default_rng(seed)

    def forward(self, x, mb=0):
        """Return ``x`` with a fresh random mask applied (training mode only)."""
        if not self.training or self.p == 0.0:
            self.save_for_backward(mb, None)
            return x
        xp = get_array_module(x)
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        keep = self.rng.random(x.shape) >= self.p
        mask = xp.asarray(keep.astype(x.dtype) * x.dtype.type(scale))
        self.save_for_backward(mb, mask)
        return x * mask

    def backward(self, grad_out, mb=0):
        """Return ``grad_out`` through the same mask forward used for ``mb``."""
        mask = self.pop_saved(mb)
        return grad_out if mask is None else grad_out * mask

    def extra_repr(self):
        return f"p={self.p}"


class LayerNorm(Module):
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``."""

    def __init__(self, normalized_shape, eps=1e-5, *, dtype=np.float32):
        super().__init__()
        dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(dims) != 1:
            raise ValueError(f"LayerNorm: only the last axis can be normalized (normalized_shape: {normalized_shape})")
        self.eps = eps
        self.weight = Parameter(np.ones(dims, dtype=dtype))
        self.bias = Parameter(np.zeros(dims, dtype=dtype))

    def forward(self, x, mb=0):
        """Return ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis."""
        xp = get_array_module(x)
        w = self.weight.data
        if x.shape[-1:] != w.shape:
            raise ValueError(f"LayerNorm.forward: input last dim does not match normalized_shape "
                             f"(input: {x.shape}, weight: {w.shape})")
        xc = x - x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
        xhat = xc * rstd
        self.save_for_backward(mb, (xhat, rstd))
        return xhat * w + self.bias.data

    def backward(self, grad_out, mb=0):
        """Accumulate dweight, dbias and return dx."""
        xhat, rstd = self.pop_saved(mb)
        dxhat = grad_out * self.weight.data
        dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                     - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
        lead = tuple(range(grad_out.ndim - 1))
        self.bias.accumulate_grad(grad_out.sum(axis=lead))
        self.weight.accumulate_grad((grad_out * xhat).sum(axis=lead))
        return dx

    def extra_repr(self):
        return f"eps={self.eps}"


class Embedding(Module):
    """Look up rows of a (num, dim) table for integer indices; no gradient flows to the indices."""

    def __init__(self, num_embeddings, embedding_dim, *, rng=None, dtype=np.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # PyTorch's default init: N(0, 1).
        self.weight = Parameter(_rng(rng).standard_normal((num_embeddings, embedding_dim)).astype(dtype))

    def forward(self, x, mb=0):
        """Return ``weight[x]`` of shape ``x.shape + (dim,)``."""
        w = self.weight.data
        if x.dtype.kind not in "iu":
            raise TypeError(f"Embedding.forward: indices must be integers (dtype: {x.dtype})")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= w.shape[0]):
            raise IndexError(f"Embedding.forward: index out of range [0, {w.shape[0]}) "
                             f"(min: {int(x.min())}, max: {int(x.max())})")
        self.save_for_backward(mb, x)
        return w[x]

    def backward(self, grad_out, mb=0):
        """Accumulate dweight by scatter-add and return None (indices have no gradient)."""
        x = self.pop_saved(mb)
        w = self.weight.data
        xp = get_array_module(w)
        dw = xp.zeros_like(w)
        scatter_add(dw, x.reshape(-1), grad_out.reshape(-1, w.shape[1]))
        self.weight.accumulate_grad(dw)
        return None

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Flatten(Module):
    """Flatten all axes after the first."""

    def forward(self, x, mb=0):
        """Return ``x`` reshaped to (batch, -1)."""
        self.save_for_backward(mb, x.shape)
        return x.reshape(x.shape[0], -1)

    def backward(self, grad_out, mb=0):
        """Return ``grad_out`` reshaped to the input's shape."""
        return grad_out.reshape(self.pop_saved(mb))
