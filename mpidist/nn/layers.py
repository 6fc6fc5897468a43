"""Layers written as forward code only; autograd derives their backward.

Initial weights come from ``rng`` when given, else from the thread's default generator
(``mpidist.manual_seed``): no two layers start equal, and one seed gives every rank the same model. Inside
``mpidist.nn.deferred()`` they record the initializer instead (``mpidist.nn.init``): nothing is allocated.
"""

import math

import numpy as np

from mpidist.nn import functional as F
from mpidist.nn.deferred import new_parameter
from mpidist.nn.init import Constant, Normal, Uniform
from mpidist.nn.module import Module
from mpidist.nn.random import default_generator

__all__ = ["Linear", "ReLU", "GELU", "Tanh", "Sigmoid", "Dropout", "LayerNorm", "RMSNorm", "Embedding", "Flatten",
           "Identity", "MultiheadAttention", "MLP", "TransformerBlock", "Conv2d", "MaxPool2d", "AvgPool2d",
           "BatchNorm2d", "SyncBatchNorm"]


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
        self.weight = new_parameter((out_features, in_features), Uniform(-bound, bound), dtype, rng)
        self.bias = new_parameter((out_features,), Uniform(-bound, bound), dtype, rng) if bias else None

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
        self.weight = new_parameter(dims, Constant(1.0), dtype)
        self.bias = new_parameter(dims, Constant(0.0), dtype) if bias else None

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
        self.weight = new_parameter(dims, Constant(1.0), dtype)

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
        self.weight = new_parameter((num_embeddings, embedding_dim), Normal(0.0, std), dtype, rng)

    def forward(self, x):
        """Return ``weight[x]`` of shape ``x.shape + (dim,)``."""
        return F.embedding(x, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class MultiheadAttention(Module):
    """Self-attention with ``num_heads`` heads over (batch, seq, dim) inputs; ``causal`` masks the future.

    ``recompute_probs``: selective activation recompute: backward recomputes the attention probabilities (and
    dropout mask) from q and k instead of keeping them (``F.multi_head_attention``); ``GPT.checkpoint_blocks(
    mode="selective")`` sets it on every block.

    ``num_kv_heads`` (grouped-query attention; None: ``num_heads``): k and v have that many heads, each serving
    ``num_heads / num_kv_heads`` q heads; the projection is (dim, dim + 2 num_kv_heads head_dim), its k and v
    heads repeated for their groups (``F.repeat_kv``) before the fused attention.

    ``rope``: q and k are turned by their positions (``F.rotary``, rotary position embedding with ``rope_base``)
    before attention, as Llama's are.
    """

    def __init__(self, embed_dim, num_heads, *, causal=False, dropout=0.0, bias=True, rng=None,
                 dtype=np.float32, recompute_probs=False, num_kv_heads=None, rope=False, rope_base=10000.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if not (isinstance(kv, (int, np.integer)) and 1 <= kv <= num_heads and num_heads % kv == 0):
            raise ValueError(f"MultiheadAttention: num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads!r} (a positive divisor of it)")
        self.embed_dim, self.num_heads, self.causal, self.dropout = embed_dim, num_heads, causal, dropout
        self.num_kv_heads = int(kv)
        self.recompute_probs = bool(recompute_probs)
        if rope and (embed_dim // num_heads) % 2:
            raise ValueError(f"MultiheadAttention: rotary positions turn channel pairs: the head size "
                             f"{embed_dim // num_heads} must be even")
        if rope and not F.valid_rope_base(rope_base):
            raise ValueError(f"MultiheadAttention: rope_base must be a finite number > 0 (got {rope_base!r})")
        self.rope, self.rope_base = bool(rope), float(rope_base)
        width = embed_dim + 2 * self.num_kv_heads * (embed_dim // num_heads)
        self.qkv = Linear(embed_dim, width, bias=bias, rng=rng, dtype=dtype)
        self.proj = Linear(embed_dim, embed_dim, bias=bias, rng=rng, dtype=dtype)

    def forward(self, x, attn_mask=None):
        """Return the attention output for ``x`` of shape (batch, seq, dim); ``attn_mask`` is additive."""
        # One fused op from the packed projections to the heads side by side: no split, permute or copy.
        qkv = self.qkv(x)
        if self.rope:
            qkv = F.rotary(qkv, self.num_heads, self.num_kv_heads, self.rope_base)
        if self.num_kv_heads != self.num_heads:
            qkv = F.repeat_kv(qkv, self.num_heads, self.num_kv_heads)
        y = F.multi_head_attention(qkv, self.num_heads, attn_mask=attn_mask, is_causal=self.causal,
                                   dropout_p=self.dropout, training=self.training,
                                   recompute_probs=self.recompute_probs)
        return self.proj(y)

    def extra_repr(self):
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        rope = f", rope_base={self.rope_base:g}" if self.rope else ""
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, causal={self.causal}{rope}"


class MLP(Module):
    """dim -> hidden -> dim: ``fc``, the activation, ``proj``.

    ``activation="gelu"``: GELU (tanh approximation) between two linears, GPT-2's. ``"swiglu"``: the gated MLP of
    PaLM and Llama, ``proj(silu(gate) * up)``, with the gate and up projections fused in ``fc`` (2 hidden outputs:
    the gate units, then the up units, as Megatron-LM fuses them), so the block reads its input once."""

    ACTIVATIONS = ("gelu", "swiglu")

    def __init__(self, dim, hidden, *, dropout=0.0, rng=None, dtype=np.float32, activation="gelu"):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"MLP: activation must be one of {self.ACTIVATIONS} (got {activation!r})")
        if not isinstance(hidden, (int, np.integer)) or isinstance(hidden, bool) or hidden < 1:
            raise ValueError(f"MLP: hidden must be an int >= 1 (got {hidden!r})")
        self.activation = activation
        self.hidden = hidden
        self.fc = Linear(dim, 2 * hidden if activation == "swiglu" else hidden, rng=rng, dtype=dtype)
        self.proj = Linear(hidden, dim, rng=rng, dtype=dtype)
        self.drop = Dropout(dropout)

    def forward(self, x):
        return self.drop(self.proj(mlp_activation(self.activation)(self.fc(x))))

    def extra_repr(self):
        return f"activation={self.activation!r}"


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``. The MLP has ``mlp_hidden`` units
    (default ``mlp_ratio * dim``) and ``mlp`` its activation (``MLP``'s: "gelu" or "swiglu"); ``norm`` is
    "layernorm" (GPT-2's) or "rmsnorm" (Llama's: no mean, no bias); ``rope``: rotary positions in attention."""

    NORMS = ("layernorm", "rmsnorm")

    def __init__(self, dim, num_heads, *, mlp_ratio=4, causal=True, dropout=0.0, rng=None, dtype=np.float32,
                 num_kv_heads=None, mlp_hidden=None, mlp="gelu", norm="layernorm", rope=False, rope_base=10000.0):
        super().__init__()
        self.ln1 = make_norm(norm, dim, dtype)
        self.attn = MultiheadAttention(dim, num_heads, causal=causal, dropout=dropout, rng=rng, dtype=dtype,
                                       num_kv_heads=num_kv_heads, rope=rope, rope_base=rope_base)
        self.drop = Dropout(dropout)
        self.ln2 = make_norm(norm, dim, dtype)
        hidden = mlp_ratio * dim if mlp_hidden is None else mlp_hidden
        self.mlp = MLP(dim, hidden, dropout=dropout, rng=rng, dtype=dtype, activation=mlp)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


def mlp_activation(name):
    """Return the op of ``MLP``'s activation ``name``: ``F.gelu``, or ``F.swiglu`` (on the fused [gate | up])."""
    return F.swiglu if name == "swiglu" else F.gelu


def make_norm(kind, dim, dtype, bias=True):
    """Return the block norm ``kind`` names: ``LayerNorm(dim)`` (with a bias unless ``bias=False``) or
    ``RMSNorm(dim)``, at its own default eps."""
    if kind == "layernorm":
        return LayerNorm(dim, dtype=dtype, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, dtype=dtype)
    raise ValueError(f"norm must be one of {TransformerBlock.NORMS} (got {kind!r})")


class Conv2d(Module):
    """2-D convolution over (N, C, H, W) inputs; weight (out, in/groups, kh, kw)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, *, rng=None, dtype=np.float32):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels {in_channels} and out_channels {out_channels} must both be "
                             f"divisible by groups {groups}")
        kh, kw = F._pair("Conv2d kernel_size", kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, (kh, kw)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        rng = _gen(rng)
        # PyTorch's default init, as for Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        fan_in = in_channels // groups * kh * kw
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        self.weight = new_parameter((out_channels, in_channels // groups, kh, kw), Uniform(-bound, bound), dtype, rng)
        self.bias = new_parameter((out_channels,), Uniform(-bound, bound), dtype, rng) if bias else None

    def forward(self, x):
        """Return the convolution of ``x`` (N, C, H, W)."""
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}")


class MaxPool2d(Module):
    """Maximum over windows of (N, C, H, W) inputs; ``stride`` defaults to the kernel size."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(Module):
    """Mean over windows of (N, C, H, W) inputs; ``stride`` defaults to the kernel size."""

    def __init__(self, kernel_size, stride=None, padding=0, count_include_pad=True):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.count_include_pad = count_include_pad

    def forward(self, x):
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.count_include_pad)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class BatchNorm2d(Module):
    """Per-channel normalization of (N, C, ...) inputs with batch statistics in training and running
    statistics in eval; buffers ``running_mean``, ``running_var``, ``num_batches_tracked``.

    ``momentum=None`` makes the running statistics a cumulative average (PyTorch's rule).
    """

    _comm = None  # SyncBatchNorm: the ranks the batch is spread over

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, *,
                 dtype=np.float32):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = new_parameter((num_features,), Constant(1.0), dtype) if affine else None
        self.bias = new_parameter((num_features,), Constant(0.0), dtype) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, dtype=dtype))
            self.register_buffer("running_var", np.ones(num_features, dtype=dtype))
            self.register_buffer("num_batches_tracked", np.zeros((), dtype=np.int64))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def reset_running_stats(self):
        """Set the running statistics back to mean 0, variance 1, no batches seen."""
        if self.track_running_stats:
            self.running_mean[...] = 0
            self.running_var[...] = 1
            self.num_batches_tracked[...] = 0

    def forward(self, x):
        """Return the normalized ``x``; in training, update the running statistics."""
        batch_stats = self.training or not self.track_running_stats
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked += 1  # in place: the buffer array stays the one in state_dict
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        update = self.training and self.track_running_stats
        return F.batch_norm(x, self.running_mean if update or not batch_stats else None,
                            self.running_var if update or not batch_stats else None,
                            self.weight, self.bias, batch_stats, momentum, self.eps, self._comm)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class SyncBatchNorm(BatchNorm2d):
    """BatchNorm whose training statistics are those of the whole batch spread over ``comm``'s ranks.

    Every rank must call forward and backward of this layer in the same order (the statistics and the
    two gradient sums are allreduced); the running statistics are then the same on every rank.
    """

    def __init__(self, num_features, comm, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, *,
                 dtype=np.float32):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype=dtype)
        self._comm = comm

    @property
    def comm(self):
        """The communicator whose ranks share the batch."""
        return self._comm

    @classmethod
    def convert_sync_batchnorm(cls, module, comm):
        """Replace every BatchNorm2d in ``module`` by a SyncBatchNorm over ``comm``; return the module.

        The new layers take over the old ones' parameters and buffers (the same objects), so an
        optimizer built before the conversion still updates them.
        """
        if isinstance(module, BatchNorm2d) and not isinstance(module, SyncBatchNorm):
            sync = cls(module.num_features, comm, module.eps, module.momentum, module.affine,
                       module.track_running_stats)
            sync.weight, sync.bias = module.weight, module.bias
            for name, array in module.named_buffers():
                setattr(sync, name, array)
            return sync.train(module.training)
        for name, child in list(module.named_children()):
            setattr(module, name, cls.convert_sync_batchnorm(child, comm))
        return module
