"""A GPT language model written as forward code on ``mpidist.nn``: byte-level by default, GPT-2 shaped.

``GPT(GPTConfig(...))`` is token embedding + learned positions, ``n_layer`` pre-norm blocks (causal
multi-head attention, GELU MLP), a final LayerNorm and a language-model head that by default shares the
token embedding's weight; or Llama's blocks (``n_kv_head``, ``mlp="swiglu"``, ``norm="rmsnorm"``,
``positions="rope"``: grouped-query attention, a gated MLP, RMSNorm, rotary positions and no position table). Initialisation follows GPT-2: weights N(0, 0.02), biases zero, and the two
projections that write into the residual stream (attention output, MLP output) N(0, 0.02 / sqrt(2 n_layer)),
so the residual's variance does not grow with depth. Built inside ``mpidist.nn.deferred()`` it allocates nothing
and records these initializers; ``mpidist.nn.materialize`` (or a parallel wrapper) draws them by parameter name.

The model is three kinds of layer in a row, ``pipeline_layers() == [embed, block_0, ..., block_{L-1}, head]``,
which is what the parallel wrappers cut along: FSDP takes one unit per layer (``fsdp_units()``), a pipeline
takes contiguous runs of layers (``pipeline_stages(num_stages)``), activation checkpointing recomputes one
block at a time (``checkpoint_blocks()``; ``mode="selective"``: only each block's attention probabilities).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from mpidist.nn import functional as F
from mpidist.nn.autograd import Tensor, no_grad
from mpidist.nn.deferred import deferred_like, is_deferred, new_parameter, set_initializer
from mpidist.nn.init import Constant, Normal
from mpidist.nn.layers import MLP, Dropout, Embedding, TransformerBlock, make_norm
from mpidist.nn.module import Module, ModuleList, Parameter, Sequential
from mpidist.nn.random import default_generator
from mpidist.xp import asarray_like

__all__ = ["GPTConfig", "GPT", "GPTEmbedding", "GPTHead", "GPTStage", "split_layers", "lm_loss"]


POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT. ``vocab_size=256`` is one token per byte, so any text needs no tokenizer."""

    vocab_size: int = 256
    block_size: int = 128      # context length: the most tokens the model attends over
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True   # the LM head reads the token embedding's weight (GPT-2 does)
    dtype: str = "float32"
    n_kv_head: Optional[int] = None   # grouped-query attention: k/v heads, each serving n_head / n_kv_head q heads
    mlp: str = "gelu"          # the MLP's activation: "gelu" (GPT-2's) or "swiglu" (gated, Llama's: nn.MLP)
    ffn_hidden: Optional[int] = None   # the MLP's hidden units (None: mlp_ratio * n_embd; Llama-7B: 11008)
    norm: str = "layernorm"    # the blocks' and head's norms: "layernorm" (GPT-2's) or "rmsnorm" (Llama's)
    positions: str = "learned"  # "learned" (GPT-2's table, embed.wpe) or "rope" (rotary q and k, Llama's)
    rope_base: float = 10000.0  # rotary positions' base (Llama 2: 10000, Llama 3: 500000)

    @property
    def kv_heads(self) -> int:
        """Return the k/v heads (``n_kv_head``, or ``n_head`` when None: multi-head attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_size(self) -> int:
        """Return the MLP's hidden units (``ffn_hidden``, or ``mlp_ratio * n_embd`` when None)."""
        return self.mlp_ratio * self.n_embd if self.ffn_hidden is None else self.ffn_hidden

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an int >= 1 (got {value!r})")
        if not problems and self.n_embd % self.n_head:
            problems.append(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        kv = self.n_kv_head
        if kv is not None and (not isinstance(kv, (int, np.integer)) or isinstance(kv, bool) or kv < 1
                               or (isinstance(self.n_head, (int, np.integer)) and self.n_head % kv)):
            problems.append(f"n_kv_head must be None or an int >= 1 dividing n_head {self.n_head} (got {kv!r})")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout must be in [0, 1) (got {self.dropout!r})")
        if self.positions not in POSITIONS:
            problems.append(f"positions must be one of {POSITIONS} (got {self.positions!r})")
        elif self.positions == "rope" and isinstance(self.n_embd, (int, np.integer)) and isinstance(
                self.n_head, (int, np.integer)) and self.n_head and (self.n_embd // self.n_head) % 2:
            problems.append(f"rotary positions need an even head size (n_embd {self.n_embd} / n_head "
                            f"{self.n_head} = {self.n_embd // self.n_head})")
        if not F.valid_rope_base(self.rope_base):
            problems.append(f"rope_base must be a finite number > 0 (got {self.rope_base!r})")
        elif self.positions == "learned" and self.rope_base != 10000.0:
            problems.append(f"rope_base {self.rope_base!r} is set but positions is 'learned' (use positions='rope')")
        if self.norm not in TransformerBlock.NORMS:
            problems.append(f"norm must be one of {TransformerBlock.NORMS} (got {self.norm!r})")
        if self.mlp not in MLP.ACTIVATIONS:
            problems.append(f"mlp must be one of {MLP.ACTIVATIONS} (got {self.mlp!r})")
        ffn = self.ffn_hidden
        if ffn is not None and (not isinstance(ffn, (int, np.integer)) or isinstance(ffn, bool) or ffn < 1):
            problems.append(f"ffn_hidden must be None or an int >= 1 (got {ffn!r})")
        try:
            kind = np.dtype(self.dtype).kind
        except TypeError:
            kind = None
        if kind != "f":
            problems.append(f"dtype must be a floating-point dtype name (got {self.dtype!r})")
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems))

    def to_dict(self):
        return asdict(self)


class GPTEmbedding(Module):
    """Token plus position embedding of integer token ids (batch, t) -> (batch, t, n_embd); tokens alone under
    rotary positions (``positions="rope"``: attention turns q and k instead, there is no ``wpe``)."""

    def __init__(self, config: GPTConfig, rng):
        super().__init__()
        dtype = np.dtype(config.dtype)
        self.block_size = config.block_size
        self.wte = Embedding(config.vocab_size, config.n_embd, rng=rng, dtype=dtype, std=0.02)
        if config.positions == "learned":
            self.wpe = Embedding(config.block_size, config.n_embd, rng=rng, dtype=dtype, std=0.02)
        self.drop = Dropout(config.dropout)

    def forward(self, idx):
        ids = idx.data if isinstance(idx, Tensor) else idx
        if getattr(ids, "ndim", 0) != 2:
            raise ValueError(f"GPT: token ids must be a (batch, time) integer array (got shape "
                             f"{getattr(ids, 'shape', None)})")
        t = ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than block_size {self.block_size}")
        if not hasattr(self, "wpe"):
            return self.drop(self.wte(ids))
        positions = np.arange(t)
        if not isinstance(ids, np.ndarray):  # device token ids: the positions go to the same device
            positions = asarray_like(positions, ids)
        return self.drop(self.wte(ids) + self.wpe(positions))


class GPTHead(Module):
    """Final LayerNorm and the vocabulary projection: (batch, t, n_embd) -> logits (batch, t, vocab)."""

    def __init__(self, config: GPTConfig, rng, weight=None):
        super().__init__()
        dtype = np.dtype(config.dtype)
        self.ln_f = make_norm(config.norm, config.n_embd, dtype, bias=config.bias)
        # A tied head registers the embedding's own Parameter: modules that share it (FSDP units, checkpoints)
        # see one weight, named once, under the embedding (the first to register it).
        self.weight = weight if weight is not None else new_parameter(
            (config.vocab_size, config.n_embd), Normal(0.0, 0.02), dtype, rng)

    def forward(self, x):
        return F.linear(self.ln_f(x), self.weight)

    def loss(self, logits, targets, ignore_index=-100):
        """Mean next-token cross-entropy of this head's logits (``lm_loss``)."""
        return lm_loss(logits, targets, ignore_index)

    def with_own_weight(self):
        """A head sharing this one's norm but holding its own copy of the weight (a pipeline's last stage
        when the weight is tied to the first stage's embedding)."""
        twin = GPTHead.__new__(GPTHead)
        Module.__init__(twin)
        twin.ln_f = self.ln_f
        data = self.weight.data
        # A deferred weight stays deferred: the copy draws the same values under the same name.
        copy = deferred_like(data, data.shape) if is_deferred(data) else data.copy()
        twin.weight = Parameter(copy, requires_grad=self.weight.requires_grad)  # frozen alike
        return twin


class GPTStage(Sequential):
    """A run of consecutive GPT layers: one pipeline stage. ``names`` are the layers' names in the unsplit GPT
    ("embed", "blocks.3", "head"), by which a pipeline names their parameters. ``tied`` lists this stage's copies
    of the token embedding weight that another stage also holds (the first stage's embedding, the last stage's
    head)."""

    def __init__(self, layers, first_layer, tied=(), names=None):
        super().__init__(*layers, names=names)
        object.__setattr__(self, "first_layer", first_layer)
        object.__setattr__(self, "tied", list(tied))


class GPT(Module):
    """A decoder-only transformer LM; ``model(idx)`` returns logits (batch, t, vocab_size)."""

    def __init__(self, config: GPTConfig = GPTConfig(), *, rng=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig (got {type(config).__name__})")
        object.__setattr__(self, "config", config)
        rng = default_generator() if rng is None else rng
        dtype = np.dtype(config.dtype)
        self.embed = GPTEmbedding(config, rng)
        self.blocks = ModuleList([TransformerBlock(config.n_embd, config.n_head, mlp_hidden=config.ffn_size,
                                                   causal=True, dropout=config.dropout, rng=rng, dtype=dtype,
                                                   num_kv_heads=config.n_kv_head, mlp=config.mlp,
                                                   norm=config.norm, rope=config.positions == "rope",
                                                   rope_base=config.rope_base)
                                  for _ in range(config.n_layer)])
        if not config.bias:  # TransformerBlock always builds biases; bias=False means none anywhere in the model
            for block in self.blocks:
                for layer in (block.ln1, block.ln2, block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj):
                    if hasattr(layer, "bias"):   # an RMSNorm has none
                        layer.bias = None
        self.head = GPTHead(config, rng, weight=self.embed.wte.weight if config.tie_weights else None)
        self._init_gpt2(rng)

    def _init_gpt2(self, rng):
        """GPT-2's initialisation; the residual projections are scaled by 1/sqrt(2 n_layer)."""
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for linear, s in ((block.attn.qkv, std), (block.attn.proj, resid_std),
                              (block.mlp.fc, std), (block.mlp.proj, resid_std)):
                set_initializer(linear.weight, Normal(0.0, s), rng)
                if linear.bias is not None:
                    set_initializer(linear.bias, Constant(0.0), rng)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, logits, targets, ignore_index=-100):
        """Mean next-token cross-entropy of ``self(idx)``'s logits against ``targets`` (batch, t).

        The head decides how: plain cross-entropy, or the vocab-parallel one after ``tensor_parallel``.
        """
        return self.head.loss(logits, targets, ignore_index)

    # -- sizes and cost ------------------------------------------------------------------------------------
    def num_parameters(self, non_embedding=False):
        """Count parameters (a tied weight once); ``non_embedding`` leaves out the position table."""
        n = sum(int(p.data.size) for p in self.parameters())
        wpe = getattr(self.embed, "wpe", None)   # none under rotary positions
        return n - int(wpe.weight.data.size) if non_embedding and wpe is not None else n

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token (forward + backward = 3x forward) of the matmuls, at context ``seq_len``.

        Per layer and token the forward does 2 * 12 d^2 in the four weight matmuls (qkv 3d^2, output d^2,
        MLP 2 f d with f = ffn_size, 4 d^2 at the default ratio) and 2 * 2 * t * d in attention (scores and the weighted sum, every key counted:
        the causal mask does not skip work here); the head adds 2 * vocab * d. With grouped-query attention the
        qkv product is d (d + 2 kv_heads head_dim); a SwiGLU MLP of f units does 3 f d (gate, up, down). Embedding look-ups, norms and elementwise work are not
        counted, as in the usual MFU convention.
        """
        c = self.config
        t = c.block_size if seq_len is None else seq_len
        d = c.n_embd
        qkv = d * (d + 2 * c.kv_heads * (d // c.n_head))
        mlp = (3 if c.mlp == "swiglu" else 2) * c.ffn_size * d
        per_layer = 2 * (qkv + d * d + mlp) + 4 * t * d
        return 3 * (c.n_layer * per_layer + 2 * c.vocab_size * d)

    # -- how the wrappers cut the model ---------------------------------------------------------------------
    def pipeline_layers(self):
        """Return ``[embed, block_0, ..., block_{n_layer-1}, head]``: the model as a row of layers."""
        return [self.embed, *self.blocks, self.head]

    def fsdp_units(self):
        """FSDP units, in execution order: the embedding, each block, the head (the tied weight is shared)."""
        return self.pipeline_layers()

    def checkpoint_blocks(self, enabled=True, *, mode="full"):
        """Recompute activations in backward instead of keeping them, block by block; return self.

        ``mode="full"``: keep each block's input only and run its whole forward again in backward.
        ``mode="selective"`` (Korthikanti et al., arXiv 2205.05198): keep everything but the attention core's
        (batch, heads, seq, seq) probabilities and dropout mask, which backward recomputes from the kept q, k
        (``MultiheadAttention.recompute_probs``): the largest activations at seq >> hidden / heads, for the
        cost of the scores' product. ``enabled=False`` turns both off. Works per block, so it composes with
        DDP, FSDP, pipeline stages and tensor/sequence parallelism (before or after ``tensor_parallel``).
        """
        if mode not in ("full", "selective"):
            raise ValueError(f"GPT.checkpoint_blocks: mode must be 'full' or 'selective' (got {mode!r})")
        for block in self.blocks:
            object.__setattr__(block, "activation_checkpointing", bool(enabled) and mode == "full")
            # Under full recompute the probabilities live only inside the block's recompute: nothing to drop.
            block.attn.recompute_probs = bool(enabled) and mode == "selective"
        return self

    def pipeline_stages(self, num_stages, layers_per_stage=None):
        """Cut the model into ``num_stages`` GPTStage modules of consecutive layers.

        The embedding goes to the first stage and the head to the last; ``layers_per_stage`` (a list of block
        counts, one per stage, summing to n_layer) sets an uneven split, else blocks are spread evenly with the
        remainder on the middle stages (the ends also carry the embedding and the head). With tied weights and
        more than one stage, the last stage gets its own copy of the embedding weight for the head; both copies
        are listed in their stage's ``tied`` so the pipeline can add their gradients (``Pipeline(...,
        tied_parameters=...)``) and keep them equal, as Megatron does for its embedding group.
        """
        counts = split_layers(self.config.n_layer, num_stages, layers_per_stage)
        blocks = list(self.blocks)
        stages, start = [], 0
        for s, n in enumerate(counts):
            layers = blocks[start:start + n]
            names = [f"blocks.{i}" for i in range(start, start + n)]
            tied = []
            if s == 0:
                layers, names = [self.embed] + layers, ["embed"] + names
                if self.config.tie_weights and num_stages > 1:
                    tied.append(self.embed.wte.weight)
            if s == num_stages - 1:
                head = self.head
                if self.config.tie_weights and num_stages > 1:
                    # The pipeline names this copy as the embedding's weight (a further copy of a tied weight).
                    head = self.head.with_own_weight()
                    tied.append(head.weight)
                layers, names = layers + [head], names + ["head"]
            stages.append(GPTStage(layers, first_layer=start + (0 if s == 0 else 1), tied=tied, names=names))
            start += n
        return stages

    # -- sampling ---------------------------------------------------------------------------------------------
    def generate(self, idx, n, temperature=1.0, top_k=None, rng=None):
        """Append ``n`` sampled tokens to ``idx`` (batch, t) and return the (batch, t + n) int64 array.

        Each step feeds the last ``block_size`` tokens, divides the last position's logits by ``temperature``
        (0 picks the most likely token) and samples from the ``top_k`` most likely (all when None).
        """
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"GPT.generate: n must be an int >= 0 (got {n!r})")
        if temperature < 0:
            raise ValueError(f"GPT.generate: temperature must be >= 0 (got {temperature!r})")
        if top_k is not None and not (isinstance(top_k, (int, np.integer)) and top_k >= 1):
            raise ValueError(f"GPT.generate: top_k must be None or an int >= 1 (got {top_k!r})")
        rng = default_generator() if rng is None else rng
        out = np.array(idx, dtype=np.int64, copy=True)
        if out.ndim == 1:
            out = out[None]
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                for _ in range(n):
                    logits = self(out[:, -self.config.block_size:])
                    if hasattr(self.head, "full_logits"):  # tensor parallel: gather the vocabulary slices
                        logits = self.head.full_logits(logits)
                    logits = np.asarray(_host(logits.data[:, -1, :]), dtype=np.float64)
                    if temperature == 0:
                        nxt = logits.argmax(axis=-1)
                    else:
                        logits = logits / temperature
                        if top_k is not None and top_k < logits.shape[-1]:
                            kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]
                            logits = np.where(logits < kth, -np.inf, logits)
                        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
                        p /= p.sum(axis=-1, keepdims=True)
                        nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
                    out = np.concatenate([out, nxt[:, None].astype(np.int64)], axis=1)
        finally:
            self.train(was_training)
        return out


def _host(a):
    get = getattr(a, "get", None)
    return get() if callable(get) and not isinstance(a, np.ndarray) else a


def split_layers(n_layer, num_stages, layers_per_stage=None):
    """Return the number of blocks per stage: ``layers_per_stage`` checked, or an even split of n_layer."""
    if not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise ValueError(f"GPT.pipeline_stages: num_stages must be an int >= 1 (got {num_stages!r})")
    if layers_per_stage is not None:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != num_stages or sum(counts) != n_layer or min(counts) < 0:
            raise ValueError(f"GPT.pipeline_stages: layers_per_stage {list(layers_per_stage)} must have "
                             f"{num_stages} non-negative counts summing to n_layer={n_layer}")
        return counts
    base, extra = divmod(n_layer, num_stages)
    # The remainder goes to the middle stages: the first and last also run the embedding and the head.
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    counts = [base] * num_stages
    for s in order[:extra]:
        counts[s] += 1
    return counts


def lm_loss(logits, targets, ignore_index=-100):
    """Mean next-token cross-entropy (nats) of logits (batch, t, vocab) against token ids (batch, t)."""
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)
