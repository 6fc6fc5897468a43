"""The model the planner reasons about: a GPT's shape, its parameters per layer, and this rank's slice of them.

Glossary:
- shape: what a ``mpidist.models.GPTConfig`` says (layers, hidden, heads, ffn, vocab, sequence), without building
  anything, so a 175B-parameter model costs nothing to describe.
- layer: one of ``GPT.pipeline_layers()``: ``embed``, ``blocks.i``, ``head``; FSDP units and pipeline stages cut
  along them, so every count here is kept per layer.
- local shape: a parameter's shape on one tensor-parallel rank, as ``mpidist.models.tensor_parallel`` cuts it
  (vocabulary rows and MLP hidden units padded to a multiple of the TP size, heads split, norms replicated).

``parameters(shape, layer, tp)`` lists the same names, order and (local) shapes as the real model's
``named_parameters()``; tests/test_plan.py checks that against ``GPT`` and ``tensor_parallel`` themselves.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np

from mpidist.models.gpt import POSITIONS, GPTConfig, split_layers
from mpidist.nn.layers import MLP, TransformerBlock
from mpidist.parallel.tensor.layers import padded_split

__all__ = ["ModelShape", "Param", "parameters", "layer_names", "stage_layers"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape: GPT-2 layout (pre-norm blocks, learned positions), a GELU or SwiGLU
    MLP."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: Optional[int] = None     # MLP hidden units (None: 4 * hidden)
    tie_weights: bool = True
    bias: bool = True
    dtype: str = "float32"
    kv_heads: Optional[int] = None   # grouped-query attention's k/v heads (None: heads, multi-head attention)
    dropout: float = 0.0             # GPTConfig.dropout: its masks are kept for backward, 1 byte per element
    mlp: str = "gelu"                # GPTConfig.mlp: "gelu", or "swiglu" (fc projects to gate and up: 2 ffn)
    norm: str = "layernorm"          # GPTConfig.norm: "layernorm", or "rmsnorm" (a weight, no bias; one statistic)
    positions: str = "learned"       # GPTConfig.positions: "learned" (a table, embed.wpe) or "rope" (rotary)

    def __post_init__(self):
        problems = [f"{name} must be an int >= 1 (got {getattr(self, name)!r})"
                    for name in ("layers", "hidden", "heads", "vocab", "seq")
                    if not _positive_int(getattr(self, name))]
        if self.ffn is not None and not _positive_int(self.ffn):
            problems.append(f"ffn must be an int >= 1 (got {self.ffn!r})")
        if not problems and self.hidden % self.heads:
            problems.append(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads is not None and not (_positive_int(self.kv_heads) and _positive_int(self.heads)
                                              and self.heads % self.kv_heads == 0):
            problems.append(f"kv_heads must be None or an int >= 1 dividing heads {self.heads} "
                            f"(got {self.kv_heads!r})")
        if not (isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
                and 0.0 <= self.dropout < 1.0):
            problems.append(f"dropout must be in [0, 1) (got {self.dropout!r})")
        if self.mlp not in MLP.ACTIVATIONS:
            problems.append(f"mlp must be one of {MLP.ACTIVATIONS} (got {self.mlp!r})")
        if self.norm not in TransformerBlock.NORMS:
            problems.append(f"norm must be one of {TransformerBlock.NORMS} (got {self.norm!r})")
        if self.positions not in POSITIONS:
            problems.append(f"positions must be one of {POSITIONS} (got {self.positions!r})")
        elif (self.positions == "rope" and not problems and (self.hidden // self.heads) % 2):
            problems.append(f"rotary positions need an even head size (hidden {self.hidden} / heads {self.heads} "
                            f"= {self.hidden // self.heads})")
        if problems:
            raise ValueError("ModelShape: " + "; ".join(problems))

    @classmethod
    def from_config(cls, config: GPTConfig) -> "ModelShape":
        """Return the shape of ``GPT(config)``."""
        return cls(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.block_size,
                   config.ffn_size, config.tie_weights, config.bias, config.dtype,
                   config.n_kv_head, float(config.dropout), config.mlp, config.norm, config.positions)

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def norm_bias(self) -> bool:
        """Return whether the norms have a bias (a LayerNorm of a model with biases; never an RMSNorm)."""
        return self.bias and self.norm == "layernorm"

    @property
    def fc_size(self) -> int:
        """Return the MLP's first projection's outputs: ffn, or 2 ffn under SwiGLU (gate and up fused)."""
        return 2 * self.ffn_size if self.mlp == "swiglu" else self.ffn_size

    @property
    def num_kv_heads(self) -> int:
        """Return the k/v heads (``kv_heads``, or ``heads`` for multi-head attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def qkv_size(self) -> int:
        """Return the fused q/k/v projection's outputs: hidden + 2 k/v heads x head dim (3 hidden without GQA)."""
        return self.hidden + 2 * self.num_kv_heads * (self.hidden // self.heads)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def with_seq(self, seq: int) -> "ModelShape":
        return replace(self, seq=seq)

    def num_parameters(self) -> int:
        """Count the unsplit model's parameters (a tied weight once), as ``GPT.num_parameters()``."""
        return sum(p.numel for layer in layer_names(self) for p in parameters(self, layer, 1))

    def flops_per_token(self) -> float:
        """Training matmul FLOPs per token (forward + backward), as ``GPT.flops_per_token``."""
        d, t = self.hidden, self.seq
        per_layer = 2 * (self.qkv_size * d + d * d + (self.fc_size + self.ffn_size) * d) + 4 * t * d
        return 3.0 * (self.layers * per_layer + 2 * self.vocab * d)


def _positive_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Param:
    """One parameter as a tensor-parallel rank holds it: its name, local shape, and whether TP replicates it."""

    name: str
    shape: Tuple[int, ...]
    replicated: bool   # True: every TP rank holds the whole (norms, row-parallel biases, positions)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)   # not np.prod: the planner asks millions of times


def layer_names(shape: ModelShape) -> List[str]:
    """Return the layers in model order: ``embed``, ``blocks.0`` .. ``blocks.{L-1}``, ``head``."""
    return ["embed"] + [f"blocks.{i}" for i in range(shape.layers)] + ["head"]


def parameters(shape: ModelShape, layer: str, tp: int = 1, own_head_weight: bool = False) -> List[Param]:
    """Return ``layer``'s parameters on one of ``tp`` tensor-parallel ranks, in ``named_parameters()`` order.

    ``own_head_weight``: the head holds its own copy of a tied weight (a pipeline's last stage); otherwise a tied
    head lists no weight (it reads the embedding's).
    """
    return list(_parameters(shape, layer, tp, own_head_weight))


@functools.lru_cache(maxsize=4096)   # the planner asks for the same layers for each of thousands of layouts
def _parameters(shape: ModelShape, layer: str, tp: int, own_head_weight: bool) -> Tuple[Param, ...]:
    d, s = shape.hidden, shape
    vocab_local = padded_split(s.vocab, tp, "plan (vocabulary)") if tp > 1 else s.vocab
    norm = [("weight", (d,), True)] + ([("bias", (d,), True)] if s.norm_bias else [])
    out = []

    def add(prefix, items):
        out.extend(Param(f"{layer}.{prefix}{n}", tuple(int(x) for x in shp), rep) for n, shp, rep in items)

    if layer == "embed":
        add("wte.", [("weight", (vocab_local, d), tp == 1)])
        if s.positions == "learned":
            add("wpe.", [("weight", (s.seq, d), True)])
    elif layer == "head":   # a module lists its own parameters before its children's
        if not s.tie_weights or own_head_weight:
            add("", [("weight", (vocab_local, d), tp == 1)])
        add("ln_f.", norm)
    elif layer.startswith("blocks."):
        if tp > 1 and s.heads % tp:
            raise ValueError(f"plan: {s.heads} heads do not split over {tp} tensor-parallel ranks")
        if tp > 1 and s.num_kv_heads % tp:
            raise ValueError(f"plan: {s.num_kv_heads} k/v heads do not split over {tp} tensor-parallel ranks")
        width, qkv = d // tp, s.qkv_size // tp
        if tp > 1 and s.mlp == "swiglu" and s.ffn_size % tp:
            raise ValueError(f"plan: a SwiGLU MLP's {s.ffn_size} hidden units do not split over {tp} "
                             f"tensor-parallel ranks")
        ffn = padded_split(s.ffn_size, tp, "plan (ffn)") if tp > 1 else s.ffn_size
        fc = 2 * ffn if s.mlp == "swiglu" else ffn   # SwiGLU: this rank's gate units, then its up units
        rep = tp == 1
        add("ln1.", norm)
        add("attn.qkv.", [("weight", (qkv, d), rep)] + ([("bias", (qkv,), rep)] if s.bias else []))
        add("attn.proj.", [("weight", (d, width), rep)] + ([("bias", (d,), True)] if s.bias else []))
        add("ln2.", norm)
        add("mlp.fc.", [("weight", (fc, d), rep)] + ([("bias", (fc,), rep)] if s.bias else []))
        add("mlp.proj.", [("weight", (d, ffn), rep)] + ([("bias", (d,), True)] if s.bias else []))
    else:
        raise ValueError(f"plan: unknown layer {layer!r} (expected 'embed', 'blocks.i' or 'head')")
    return tuple(out)


def stage_layers(shape: ModelShape, pp: int) -> List[List[str]]:
    """Return each pipeline stage's layers, cut as ``GPT.pipeline_stages(pp)`` cuts them."""
    return [list(stage) for stage in _stage_layers(shape.layers, pp)]


@functools.lru_cache(maxsize=256)   # the planner asks for each of thousands of layouts
def _stage_layers(num_layers: int, pp: int) -> Tuple[Tuple[str, ...], ...]:
    counts = split_layers(num_layers, pp)
    stages, start = [], 0
    for s, n in enumerate(counts):
        layers = [f"blocks.{i}" for i in range(start, start + n)]
        if s == 0:
            layers = ["embed"] + layers
        if s == pp - 1:
            layers = layers + ["head"]
        stages.append(tuple(layers))
        start += n
    return tuple(stages)
