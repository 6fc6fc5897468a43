"""Layers written as forward code only; autograd derives their backward.

Initial weights come from ``rng`` when given, else from the thread's default generator
(``mpidist.manual_seed``): no two layers start equal, and one seed gives every rank the same model.
"""

import math

import numpy as np

from mpidist.nn import functional as F
from mpidist.nn.module import Module, Parameter
from mpidist.nn.random import default_generator

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "Sigmoid", "Dropout", "LayerNorm", "RMSNorm", "Embedding", "Flatten",
           "Identity", "MultiheadAttention", "MLP", "TransformerBlock"]


def _gen(rng):
    return default_generator() if rng is None else rng


class Linear(Module):
    """Affine map ``y = x @ W.T + b`` over the last axis; W has shape (out, in)."""

    def __init__(self, in_features, out_features, bias=True, *, rng=None, dtype=np.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        rng = _gen(rng)
        # PyTorch's default init: kaiming_uniform(a=sqrt(5)) reduces to U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)).astype(dtype))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_features,)).astype(dtype)) if bias else None

    def forward(self, x):
        """Return ``x @ W.T + b`` for ``x`` of shape (..., in)."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _Elementwise(Module):
    fn = None

    def forward(self, x):
        return type(self).fn(x)


class ReLU(_Elementwise):
    """Elementwise ``max(x, 0)``."""
    fn = staticmethod(F.relu)


class GELU(_Elementwise):
    """GELU, tanh approximation."""
    fn = staticmethod(F.gelu)


class Tanh(_Elementwise):
    """Elementwise ``tanh(x)``."""
    fn = staticmethod(F.tanh)


class Sigmoid(_Elementwise):
    """Elementwise logistic function."""
    fn = staticmethod(F.sigmoid)


class Identity(Module):
    """Return the input unchanged."""

    def forward(self, x):
        return x


class Flatten(Module):
    """Flatten all axes after the first."""

    def forward(self, x):
        return F.reshape(x, (x.shape[0], -1))


class Dropout(Module):
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p); identity in eval mode.

    Masks come from the thread's default generator (``mpidist.manual_seed``), or from an own generator
    seeded with ``seed``; activation checkpointing replays either.
    """

    def __init__(self, p=0.5, *, seed=None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1] (p: {p})")
        self.p = p
        self.generator = None if seed is None else np.random.default_rng(seed)

    def forward(self, x):
        """Return ``x`` with a fresh random mask applied (training mode only)."""
        return F.dropout(x, self.p, self.training, self.generator)

    def extra_repr(self):
        return f"p={self.p}"


def _normalized_dim(name, normalized_shape):
    dims = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(dims) != 1:
        raise ValueError(f"{name}: only the last axis can be normalized (normalized_shape: {normalized_shape})")
    return dims


class LayerNorm(Module):
    """Normalize over the last axis, then scale by ``weight`` and shift by ``bias``."""

    def __init__(self, normalized_shape, eps=1e-5, *, bias=True, dtype=np.float32):
        super().__init__()
        dims = _normalized_dim("LayerNorm", normalized_shape)
        self.eps = eps
        self.weight = Parameter(np.ones(dims, dtype=dtype))
        self.bias = Parameter(np.zeros(dims, dtype=dtype)) if bias else None

    def forward(self, x):
        """Return ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis."""
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"eps={self.eps}"


class RMSNorm(Module):
    """Divide by the root mean square over the last axis, then scale by ``weight``."""

    def __init__(self, normalized_shape, eps=1e-6, *, dtype=np.float32):
        super().__init__()
        dims = _normalized_dim("RMSNorm", normalized_shape)
        self.eps = eps
        self.weight = Parameter(np.ones(dims, dtype=dtype))

    def forward(self, x):
        """Return ``x / rms(x) * weight`` over the last axis."""
        return F.rms_norm(x, self.weight, self.eps)

    def extra_repr(self):
        return f"eps={self.eps}"


class Embedding(Module):
    """Look up rows of a (num, dim) table for integer indices; no gradient flows to the indices."""

    def __init__(self, num_embeddings, embedding_dim, *, rng=None, dtype=np.float32, std=1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # PyTorch's default init: N(0, 1).
        self.weight = Parameter((_gen(rng).standard_normal((num_embeddings, embedding_dim)) * std).astype(dtype))

    def forward(self, x):
        """Return ``weight[x]`` of shape ``x.shape + (dim,)``."""
        return F.embedding(x, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class MultiheadAttention(Module):
    """Self-attention with ``num_heads`` heads over (batch, seq, dim) inputs; ``causal`` masks the future."""

    def __init__(self, embed_dim, num_heads, *, causal=False, dropout=0.0, bias=True, rng=None,
                 dtype=np.float32):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.causal, self.dropout = embed_dim, num_heads, causal, dropout
        self.qkv = Linear(embed_dim, 3 * embed_dim, bias=bias, rng=rng, dtype=dtype)
        self.proj = Linear(embed_dim, embed_dim, bias=bias, rng=rng, dtype=dtype)

    def forward(self, x, attn_mask=None):
        """Return the attention output for ``x`` of shape (batch, seq, dim); ``attn_mask`` is additive."""
        b, t, d = x.shape
        h = self.num_heads
        qkv = F.permute(F.reshape(self.qkv(x), (b, t, 3, h, d // h)), (2, 0, 3, 1, 4))
        q, k, v = F.split(qkv, 3, axis=0)
        q, k, v = (F.reshape(a, (b, h, t, d // h)) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=self.causal,
                                           dropout_p=self.dropout, training=self.training)
        return self.proj(F.reshape(F.permute(y, (0, 2, 1, 3)), (b, t, d)))

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}"


class MLP(Module):
    """Two linear layers with GELU between: dim -> hidden -> dim."""

    def __init__(self, dim, hidden, *, dropout=0.0, rng=None, dtype=np.float32):
        super().__init__()
        self.fc = Linear(dim, hidden, rng=rng, dtype=dtype)
        self.proj = Linear(hidden, dim, rng=rng, dtype=dtype)
        self.drop = Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim, num_heads, *, mlp_ratio=4, causal=True, dropout=0.0, rng=None, dtype=np.float32):
        super().__init__()
        self.ln1 = LayerNorm(dim, dtype=dtype)
        self.attn = MultiheadAttention(dim, num_heads, causal=causal, dropout=dropout, rng=rng, dtype=dtype)
        self.drop = Dropout(dropout)
        self.ln2 = LayerNorm(dim, dtype=dtype)
        self.mlp = MLP(dim, mlp_ratio * dim, dropout=dropout, rng=rng, dtype=dtype)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))
