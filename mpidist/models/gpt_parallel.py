"""``tensor_parallel(model, tp_comm)``: split a GPT built from a seed into this rank's tensor-parallel slice.

It lives with the model, not in ``mpidist.parallel``: the conversion knows the GPT's layout, and parallel never
imports models (it provides the layers, ``mpidist.parallel.tensor``; the model says how it is cut).

Every TP rank builds the same unsharded GPT (same config, same seed) and converts it in place; each keeps its
slice, so a TP run starts from exactly the weights of the single-process model it is compared with. The
converted model keeps the GPT's layout (``embed``, ``blocks``, ``head``; parameter names unchanged), so FSDP
units, pipeline stages and activation checkpointing cut it as before, and ``model.loss`` is the vocab-parallel
cross-entropy.

Under sequence parallelism the residual stream between blocks is split along the sequence (each rank holds
t / tp positions), so the context length must divide by the TP size.
"""
from __future__ import annotations

import numpy as np

from mpidist.comm import check_comm
from mpidist.comm.agree import raise_if_any
from mpidist.nn import functional as F
from mpidist.nn.autograd import Tensor
from mpidist.nn.deferred import deferred_like, is_deferred
from mpidist.nn.module import Module, ModuleList, Parameter
from mpidist.nn.placement import placement_of, set_placement
from mpidist.parallel.agreement import check_same_structure
from mpidist.parallel.tensor import (ParallelAttention, ParallelLayerNorm, ParallelMLP, TensorParallelModule,
                                     VocabParallelEmbedding, gather_last, padded_rows, replicated_parameter,
                                     sharded_parameter, vocab_parallel_cross_entropy)
from mpidist.xp import asarray_like

from .gpt import GPT

__all__ = ["tensor_parallel", "ParallelBlock", "ParallelGPTEmbedding", "ParallelGPTHead"]


class ParallelBlock(TensorParallelModule):
    """A pre-norm transformer block whose attention and MLP are split over the TP ranks."""

    def __init__(self, block, comm, sequence_parallel):
        super().__init__(comm, sequence_parallel)
        self.ln1 = ParallelLayerNorm(block.ln1, comm, sequence_parallel)
        self.attn = ParallelAttention(block.attn, comm, sequence_parallel)
        self.drop = block.drop
        self.ln2 = ParallelLayerNorm(block.ln2, comm, sequence_parallel)
        self.mlp = ParallelMLP(block.mlp, comm, sequence_parallel)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class ParallelGPTEmbedding(TensorParallelModule):
    """Vocab-parallel token embedding plus the (replicated) position embedding of this rank's positions (none under
    rotary positions)."""

    def __init__(self, embed, comm, sequence_parallel):
        super().__init__(comm, sequence_parallel)
        self.block_size = embed.block_size
        self.wte = VocabParallelEmbedding(embed.wte, comm, sequence_parallel)
        if hasattr(embed, "wpe"):   # none under rotary positions
            self.wpe = Module()
            self.wpe.weight = replicated_parameter(embed.wpe.weight, comm)
        self.drop = embed.drop

    def forward(self, idx):
        ids = idx.data if isinstance(idx, Tensor) else idx
        if getattr(ids, "ndim", 0) != 2:
            raise ValueError(f"GPT: token ids must be a (batch, time) integer array (got shape "
                             f"{getattr(ids, 'shape', None)})")
        t, size = ids.shape[1], self.comm.Get_size()
        if t > self.block_size:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than block_size {self.block_size}")
        if self.sequence_parallel and t % size:
            raise ValueError(f"GPT (sequence parallel): sequence of {t} tokens does not split over {size} "
                             f"tensor-parallel ranks; use a length divisible by {size} or sequence_parallel=False")
        x = self.wte(ids)
        if not hasattr(self, "wpe"):
            return self.drop(x)
        if self.sequence_parallel:
            n = t // size
            positions = np.arange(self.comm.Get_rank() * n, (self.comm.Get_rank() + 1) * n)
        else:
            positions = np.arange(t)
        if not isinstance(ids, np.ndarray):
            positions = asarray_like(positions, ids)
        return self.drop(x + F.embedding(positions, self.read_replicated(self.wpe.weight)))


class ParallelGPTHead(TensorParallelModule):
    """Final norm and the vocabulary projection, vocabulary-parallel: logits come out as this rank's slice."""

    def __init__(self, head, comm, sequence_parallel, vocab_size, vocab_start, weight):
        super().__init__(comm, sequence_parallel)
        self.vocab_size, self.vocab_start = vocab_size, vocab_start
        self.ln_f = ParallelLayerNorm(head.ln_f, comm, sequence_parallel)
        self.weight = weight

    def forward(self, x):
        return self.column_linear(self.ln_f(x), self.weight)

    def loss(self, logits, targets, ignore_index=-100):
        """Mean next-token cross-entropy of this rank's logit slice (see ``vocab_parallel_cross_entropy``)."""
        return vocab_parallel_cross_entropy(logits, targets, self.comm, self.vocab_start, self.vocab_size,
                                            ignore_index)

    def full_logits(self, logits):
        """Gather the vocabulary slices into the full logits (batch, t, vocab) on every TP rank."""
        full = gather_last(logits, self.comm)
        return full[..., :self.vocab_size] if full.shape[-1] != self.vocab_size else full

    def with_own_weight(self):
        """A copy of this head with its own copy of the (tied) weight, for a pipeline's last stage."""
        twin = ParallelGPTHead.__new__(ParallelGPTHead)
        TensorParallelModule.__init__(twin, self.comm, self.sequence_parallel)
        twin.vocab_size, twin.vocab_start = self.vocab_size, self.vocab_start
        twin.ln_f = self.ln_f
        data = self.weight.data  # a deferred weight stays deferred: the copy draws the same values by name
        copy = deferred_like(data, data.shape) if is_deferred(data) else data.copy()
        twin.weight = set_placement(Parameter(copy, requires_grad=self.weight.requires_grad),
                                    placement_of(self.weight))
        return twin


def tensor_parallel(model, tp_comm, sequence_parallel=True):
    """Convert ``model`` (a ``mpidist.models.GPT``) in place to this rank's tensor-parallel slice; return it.

    Collective over ``tp_comm`` (a size mismatch, or models differing between the ranks in a parameter's shape,
    dtype or ``requires_grad``, raises on every rank). Parameter names stay those of the unsharded model; each
    parameter's ``placement`` says whether it is a slice or replicated; a slice of a frozen parameter is frozen.
    """
    check_comm("tensor_parallel", tp_comm)
    if not isinstance(model, GPT):
        raise TypeError(f"tensor_parallel: model must be an mpidist.models.GPT (got {type(model).__name__})")
    if any(placement_of(p) is not None for p in model.parameters()):
        raise ValueError("tensor_parallel: the model is already split (its parameters have placements)")
    c, size = model.config, tp_comm.Get_size()
    problem = None
    if c.n_head % size:
        problem = (f"{c.n_head} heads do not split over {size} tensor-parallel ranks; use a number of heads "
                   f"divisible by the TP size")
    elif c.kv_heads % size:
        problem = (f"{c.kv_heads} k/v heads (n_kv_head) do not split over {size} tensor-parallel ranks; use a "
                   f"number of k/v heads divisible by the TP size")
    elif c.mlp == "swiglu" and c.ffn_size % size:
        problem = (f"a SwiGLU MLP's {c.ffn_size} hidden units (ffn_hidden) do not split over {size} tensor-parallel "
                   f"ranks; use a number of hidden units divisible by the TP size")
    elif sequence_parallel and c.block_size % size:
        problem = (f"sequence parallelism splits the context over the TP ranks: block_size {c.block_size} is not "
                   f"divisible by {size} (use sequence_parallel=False or another block_size)")
    raise_if_any(tp_comm, problem, "tensor_parallel", ValueError)
    # Every TP rank slices the same model: a parameter frozen on some ranks only would train in some slices.
    check_same_structure(tp_comm, model.named_parameters(), "tensor_parallel")
    embed = ParallelGPTEmbedding(model.embed, tp_comm, sequence_parallel)
    blocks = ModuleList([ParallelBlock(b, tp_comm, sequence_parallel) for b in model.blocks])
    if c.tie_weights:
        weight = embed.wte.weight
    else:
        full = model.head.weight.data
        local = embed.wte.local
        start = tp_comm.Get_rank() * local
        weight = sharded_parameter(model.head.weight, padded_rows(full, start, local), tp_comm, 0, start)
    head = ParallelGPTHead(model.head, tp_comm, sequence_parallel, c.vocab_size, embed.wte.vocab_start, weight)
    model.embed, model.blocks, model.head = embed, blocks, head
    object.__setattr__(model, "tp_comm", tp_comm)
    return model
