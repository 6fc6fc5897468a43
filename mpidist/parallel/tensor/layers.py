"""Tensor-parallel layers: each built from the unsharded layer (same seed, same values), holding its slice.

- ``ColumnParallelLinear``: the output features split over the TP ranks (weight rows); its input is the full
  activation (``copy_to_tp``, or gathered along the sequence under sequence parallelism, where backward keeps
  only this rank's shard: ``gather_sequence_linear``), its output a feature slice.
- ``RowParallelLinear``: the input features split (weight columns); it adds the ranks' partial products
  (``reduce_from_tp``, or ``scatter_sequence``) and then its bias, which is replicated.
- ``ParallelAttention``: heads split over the ranks: the fused q/k/v projection column-parallel by heads, the
  output projection row-parallel. ``ParallelMLP``: fc column-parallel, proj row-parallel.
- ``VocabParallelEmbedding``: vocabulary rows split; each rank looks up the ids in its range and the ranks add.
- ``vocab_parallel_cross_entropy``: the loss over vocabulary-sliced logits, reducing the row max, the sum of
  exponentials and the target logit over the ranks; the full logits are never gathered.

Sizes that do not divide by the TP size are padded where padding is exact: vocabulary rows (padded logits are
masked out of the softmax) and MLP hidden units (zero rows and columns contribute nothing and get zero
gradients, so they stay zero). Heads cannot be padded that way without changing the attention's shape, so a
head count that does not divide is an error naming both sizes.

Every parameter carries its placement (``mpidist.nn.placement``): Shard for slices, Replicate for norms,
replicated biases and position embeddings.
"""
from __future__ import annotations


import numpy as np

from mpidist import collectives
from mpidist.nn import functional as F
from mpidist.nn.autograd import Tensor, make_result
from mpidist.nn.deferred import deferred_like, is_deferred
from mpidist.nn.layers import RMSNorm, mlp_activation
from mpidist.nn.module import Module, Parameter
from mpidist.nn.placement import Replicate, Shard, set_placement
from mpidist.nn.precision import fp32_op
from mpidist.xp import get_array_module

from .ops import copy_to_tp, gather_sequence, gather_sequence_linear, reduce_from_tp, scatter_sequence

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelAttention", "ParallelMLP", "VocabParallelEmbedding",
           "ParallelLayerNorm", "vocab_parallel_cross_entropy", "padded_split", "padded_rows", "sharded_parameter",
           "replicated_parameter", "TensorParallelModule"]


def padded_split(n, size, what):
    """Return the per-rank length ceil(n / size) (the last ranks hold padding when ``size`` does not divide)."""
    if n < 1:
        raise ValueError(f"{what}: size {n} cannot be split over {size} tensor-parallel ranks")
    return -(-n // size)


def padded_rows(array, start, length, axis=0):
    """Return ``array``'s rows ``start .. start + length`` along ``axis``, zero-padded past its end."""
    shape = list(array.shape)
    shape[axis] = length
    if is_deferred(array):  # a slice of a deferred parameter stays deferred: materializing draws its rows
        return deferred_like(array, tuple(shape))
    xp = get_array_module(array)
    out = xp.zeros(shape, dtype=array.dtype)
    stop = min(start + length, array.shape[axis])
    if stop > start:
        src = [slice(None)] * array.ndim
        dst = [slice(None)] * array.ndim
        src[axis], dst[axis] = slice(start, stop), slice(0, stop - start)
        out[tuple(dst)] = array[tuple(src)]
    return out


def _rows(array, take):
    """Return ``array[take]`` as a new contiguous array (deferred for a deferred parameter: its rows are drawn later)."""
    if is_deferred(array):
        return deferred_like(array, (len(take),) + tuple(array.shape[1:]))
    return get_array_module(array).ascontiguousarray(array[take])


def sharded_parameter(source, array, comm, dim, start, pieces=None):
    """Return this rank's slice ``array`` of the unsharded Parameter ``source`` as a Parameter placed ``Shard``.

    ``dim``, ``start`` and ``pieces`` are those of ``nn.placement.Shard``; the Parameter is frozen if ``source`` is.
    """
    return set_placement(Parameter(array, requires_grad=source.requires_grad),
                         Shard(dim, comm, tuple(source.data.shape), start, pieces))


def replicated_parameter(param, comm):
    """Return ``param`` itself, marked as replicated over ``comm`` (every TP rank holds the same values)."""
    return set_placement(param, Replicate(comm))


class TensorParallelModule(Module):
    """Base of a module split over the tensor-parallel ranks of ``comm``: the entry and exit of its activations.

    A subclass (these layers, or a model's own blocks: ``mpidist.models.gpt_parallel``) calls ``column_linear``
    for a column-parallel layer's product, ``row_output`` on a row-parallel layer's partial result, and
    ``read_replicated`` on a replicated parameter it uses; all three follow ``sequence_parallel``.
    """

    def __init__(self, comm, sequence_parallel):
        super().__init__()
        object.__setattr__(self, "comm", comm)
        object.__setattr__(self, "sequence_parallel", bool(sequence_parallel))

    def column_linear(self, x, weight, bias=None):
        """Return ``linear(full x, weight, bias)`` for a column-parallel slice ``weight``: ``x`` is the full
        activation (its gradient summed over the ranks), or under SP this rank's sequence shard, gathered for the
        product and gathered again in backward (only the shard is kept: ``gather_sequence_linear``)."""
        if self.sequence_parallel:
            return gather_sequence_linear(x, weight, bias, self.comm)
        return F.linear(copy_to_tp(x, self.comm), weight, bias)

    def column_input(self, x):
        """Return the full activation a column-parallel layer reads (gathered along the sequence under SP).

        Kept for blocks written against it; ``column_linear`` is the one to use: an op reading this keeps the
        gathered copy for backward, where ``column_linear`` keeps only this rank's shard."""
        return gather_sequence(x, self.comm) if self.sequence_parallel else copy_to_tp(x, self.comm)

    def row_output(self, partial):
        """Return the sum of the row-parallel partial results (sequence parallel: this rank's sequence shard of it)."""
        return scatter_sequence(partial, self.comm) if self.sequence_parallel else reduce_from_tp(partial, self.comm)

    def read_replicated(self, param):
        """Return a replicated parameter as read on this rank: under sequence parallelism its gradient is partial."""
        if param is None or not self.sequence_parallel:
            return param
        read = copy_to_tp(param, self.comm)
        # Its own array, not a view of the parameter's: an op keeping it for backward (a norm's weight) would
        # otherwise keep FSDP's whole gathered unit alive after FSDP frees it (O(d) here, O(unit) there).
        read.data = read.data.copy()
        return read


class ColumnParallelLinear(TensorParallelModule):
    """``y[..., slice] = x @ W[slice].T + b[slice]``: this rank's rows of the weight (output features)."""

    def __init__(self, linear, comm, sequence_parallel=False):
        super().__init__(comm, sequence_parallel)
        out, size, rank = linear.out_features, comm.Get_size(), comm.Get_rank()
        self.local = padded_split(out, size, "ColumnParallelLinear (out_features)")
        self.in_features, self.out_features = linear.in_features, out
        start = rank * self.local
        self.weight = sharded_parameter(linear.weight, padded_rows(linear.weight.data, start, self.local), comm, 0,
                                        start)
        self.bias = (None if linear.bias is None else
                     sharded_parameter(linear.bias, padded_rows(linear.bias.data, start, self.local), comm, 0, start))

    def forward(self, x):
        return self.column_linear(x, self.weight, self.bias)


class RowParallelLinear(TensorParallelModule):
    """``y = sum over ranks of x[..., slice] @ W[:, slice].T``, then ``+ b`` (replicated)."""

    def __init__(self, linear, comm, sequence_parallel=False, local_in=None):
        super().__init__(comm, sequence_parallel)
        n_in, size, rank = linear.in_features, comm.Get_size(), comm.Get_rank()
        self.local = local_in or padded_split(n_in, size, "RowParallelLinear (in_features)")
        self.in_features, self.out_features = n_in, linear.out_features
        start = rank * self.local
        self.weight = sharded_parameter(linear.weight, padded_rows(linear.weight.data, start, self.local, axis=1),
                                        comm, 1, start)
        self.bias = None if linear.bias is None else replicated_parameter(linear.bias, comm)

    def forward(self, x):
        y = self.row_output(F.linear(x, self.weight))
        return y if self.bias is None else y + self.read_replicated(self.bias)


class ParallelLayerNorm(TensorParallelModule):
    """A LayerNorm (or an ``nn.RMSNorm``: ``rms``) whose replicated gain and shift see a sequence shard under
    sequence parallelism."""

    def __init__(self, norm, comm, sequence_parallel=False):
        super().__init__(comm, sequence_parallel)
        self.eps = norm.eps
        self.rms = isinstance(norm, RMSNorm)
        self.weight = replicated_parameter(norm.weight, comm)
        bias = getattr(norm, "bias", None)
        self.bias = None if bias is None else replicated_parameter(bias, comm)

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, self.read_replicated(self.weight), self.eps)
        return F.layer_norm(x, self.read_replicated(self.weight), self.read_replicated(self.bias), self.eps)


class _Projection(TensorParallelModule):
    """The column-parallel product by the weight and bias set on it: a module, so forward hooks (a precision
    policy's rounding of the output, as on the unsharded layer's ``nn.Linear``) see its output."""

    def forward(self, x):
        return self.column_linear(x, self.weight, self.bias)


class ParallelAttention(TensorParallelModule):
    """Causal self-attention with this rank's heads; input and output as the block's residual stream."""

    def __init__(self, attn, comm, sequence_parallel=False):
        super().__init__(comm, sequence_parallel)
        d, h, size, rank = attn.embed_dim, attn.num_heads, comm.Get_size(), comm.Get_rank()
        kv = getattr(attn, "num_kv_heads", h)
        if h % size:
            raise ValueError(f"ParallelAttention: {h} heads do not split over {size} tensor-parallel ranks; "
                             f"use a number of heads divisible by the TP size (or a TP size dividing {h})")
        if kv % size:
            raise ValueError(f"ParallelAttention: {kv} k/v heads do not split over {size} tensor-parallel ranks; "
                             f"use a number of k/v heads divisible by the TP size")
        self.embed_dim, self.num_heads, self.causal, self.dropout = d, h, attn.causal, attn.dropout
        self.recompute_probs = getattr(attn, "recompute_probs", False)   # selective recompute (nn.MultiheadAttention)
        self.rope, self.rope_base = getattr(attn, "rope", False), getattr(attn, "rope_base", 10000.0)
        self.local_heads, self.head_dim, self.local_kv_heads = h // size, d // h, kv // size
        width, kv_width = self.local_heads * self.head_dim, self.local_kv_heads * self.head_dim
        start = rank * width
        # The fused projection's rows are [q heads | k heads | v heads] (k and v of kv heads each): this rank takes
        # its heads' rows of each, its q heads' k/v groups with them (grouped-query attention).
        pieces = ((start, 0, width), (d + rank * kv_width, width, kv_width),
                  (d + kv * self.head_dim + rank * kv_width, width + kv_width, kv_width))
        w, b = attn.qkv.weight, attn.qkv.bias
        take = np.concatenate([np.arange(g, g + n) for g, _, n in pieces])
        self.qkv = _Projection(comm, sequence_parallel)
        self.qkv.weight = sharded_parameter(w, _rows(w.data, take), comm, 0, start, pieces)
        self.qkv.bias = None if b is None else sharded_parameter(b, _rows(b.data, take), comm, 0, start, pieces)
        self.proj = RowParallelLinear(attn.proj, comm, sequence_parallel, local_in=width)

    def forward(self, x):
        # The local projection is [q | k | v] of this rank's heads: the packed layout multi_head_attention reads
        # in place (no split, permute or copy), the heads side by side as the row-parallel projection wants.
        qkv = self.qkv(x)
        if self.rope:   # per head and position: this rank's heads over the whole sequence, as unsplit
            qkv = F.rotary(qkv, self.local_heads, self.local_kv_heads, self.rope_base)
        if self.local_kv_heads != self.local_heads:
            qkv = F.repeat_kv(qkv, self.local_heads, self.local_kv_heads)
        y = F.multi_head_attention(qkv, self.local_heads, is_causal=self.causal, dropout_p=self.dropout,
                                   training=self.training, recompute_probs=self.recompute_probs)
        return self.proj(y)


class ParallelMLP(TensorParallelModule):
    """fc (column-parallel), the activation, proj (row-parallel). GELU: the hidden units padded to a multiple of
    the TP size. SwiGLU: each rank takes the same units of the gate and of up (its fc rows are [its gate units |
    its up units], the packed layout ``F.swiglu`` reads), so the hidden units must divide by the TP size."""

    def __init__(self, mlp, comm, sequence_parallel=False):
        super().__init__(comm, sequence_parallel)
        self.activation = getattr(mlp, "activation", "gelu")
        if self.activation != "swiglu":
            self.fc = ColumnParallelLinear(mlp.fc, comm, sequence_parallel)
            self.proj = RowParallelLinear(mlp.proj, comm, sequence_parallel, local_in=self.fc.local)
            self.drop = mlp.drop
            return
        f, size, rank = mlp.hidden, comm.Get_size(), comm.Get_rank()
        if f % size:
            raise ValueError(f"ParallelMLP: a SwiGLU MLP's {f} hidden units do not split over {size} tensor-parallel "
                             f"ranks; use a number of hidden units (ffn_hidden) divisible by the TP size")
        local = f // size
        start = rank * local
        pieces = ((start, 0, local), (f + start, local, local))   # its gate units, then its up units
        take = np.concatenate([np.arange(g, g + n) for g, _, n in pieces])
        w, b = mlp.fc.weight, mlp.fc.bias
        self.fc = _Projection(comm, sequence_parallel)
        self.fc.weight = sharded_parameter(w, _rows(w.data, take), comm, 0, start, pieces)
        self.fc.bias = None if b is None else sharded_parameter(b, _rows(b.data, take), comm, 0, start, pieces)
        self.proj = RowParallelLinear(mlp.proj, comm, sequence_parallel, local_in=local)
        self.drop = mlp.drop

    def forward(self, x):
        return self.drop(self.proj(mlp_activation(self.activation)(self.fc(x))))


class VocabParallelEmbedding(TensorParallelModule):
    """Token embedding with vocabulary rows split: each rank looks up the ids in its range, the ranks add.

    The output is the full embedding (plain TP) or this rank's sequence shard of it (sequence parallel).
    """

    def __init__(self, embedding, comm, sequence_parallel=False):
        super().__init__(comm, sequence_parallel)
        v, size, rank = embedding.num_embeddings, comm.Get_size(), comm.Get_rank()
        self.num_embeddings, self.embedding_dim = v, embedding.embedding_dim
        self.local = padded_split(v, size, "VocabParallelEmbedding (vocabulary)")
        self.vocab_start = rank * self.local
        rows = padded_rows(embedding.weight.data, self.vocab_start, self.local)
        self.weight = sharded_parameter(embedding.weight, rows, comm, 0, self.vocab_start)

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        # Ids outside every rank's range would be masked to zero rows on all ranks: refuse them as Embedding does
        # (every TP rank holds the same ids, so every rank raises).
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"VocabParallelEmbedding: token id out of range [0, {self.num_embeddings}) "
                             f"(min: {int(ids.min())}, max: {int(ids.max())})")
        xp = get_array_module(ids)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_start + self.local)
        local = xp.where(mine, ids - self.vocab_start, 0)
        rows = F.embedding(local, self.weight) * mine[..., None].astype(self.weight.data.dtype)
        return self.row_output(rows)


@fp32_op(loss=True)  # as cross_entropy: 16-bit logits cast up exactly, computed and returned in float32
def vocab_parallel_cross_entropy(logits, target, comm, vocab_start, vocab_size, ignore_index=-100):
    """Mean next-token cross-entropy of logits sliced over the vocabulary (this rank: columns from
    ``vocab_start``; columns at or past ``vocab_size`` are padding and masked out).

    Two allreduces of one number per token (the row max; then the sum of exponentials with the target logit),
    never the logits themselves. The gradient is this rank's slice of ``softmax - onehot``, with no
    communication: the input gradient's sum over ranks happens where the logits' input entered the TP region.
    """
    z = logits.data if isinstance(logits, Tensor) else logits
    xp = get_array_module(z)
    t = xp.asarray(target).reshape(-1)
    width = z.shape[-1]
    z2 = z.reshape(-1, width)
    if z2.shape[0] != t.shape[0]:
        raise ValueError(f"vocab_parallel_cross_entropy: {z2.shape[0]} logit rows but {t.shape[0]} targets "
                         f"(logits {tuple(z.shape)}, target {tuple(np.shape(target))})")
    counted = t[t != ignore_index]
    # Every TP rank holds the same targets, so every rank raises (a target outside the vocabulary would
    # otherwise find no logit on any rank, or a masked padding column, and give a wrong or infinite loss).
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= vocab_size):
        raise IndexError(f"vocab_parallel_cross_entropy: target out of range [0, {vocab_size}) (min: "
                         f"{int(counted.min())}, max: {int(counted.max())}; ignore_index: {ignore_index})")
    real = (vocab_start + xp.arange(width)) < vocab_size
    if not bool(real.all()):
        z2 = xp.where(real, z2, -xp.inf)
    row_max = z2.max(axis=1) if width else xp.full(z2.shape[0], -xp.inf, dtype=z.dtype)
    row_max = collectives.allreduce(xp.ascontiguousarray(row_max), comm, op="max")
    e = xp.exp(z2 - row_max[:, None])
    mine = (t >= vocab_start) & (t < vocab_start + width)
    col = xp.clip(t - vocab_start, 0, max(width - 1, 0))
    rows = xp.arange(t.shape[0])
    sums = xp.stack([e.sum(axis=1), xp.where(mine, z2[rows, col], 0).astype(z.dtype)])
    sums = collectives.allreduce(xp.ascontiguousarray(sums), comm, op="sum")
    keep = t != ignore_index
    count = max(int(keep.sum()), 1)
    per_token = xp.log(sums[0]) + row_max - sums[1]
    loss = xp.asarray((per_token * keep).sum() / count, dtype=z.dtype)

    def backward(g, n):
        p = e / sums[0][:, None]
        p[rows[mine], col[mine]] -= 1
        p *= (keep[:, None] * (g / count)).astype(p.dtype)
        return (p.reshape(z.shape),)
    return make_result("VocabParallelCrossEntropy", loss, (logits,), backward)
