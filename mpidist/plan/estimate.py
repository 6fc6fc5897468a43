"""Per-rank memory and step time of one layout on one machine, and the ranked plan over every layout.

Glossary:
- position: a rank's pipeline stage index; ranks at one position hold and do the same. Memory and time are
  computed for every position and the layout's numbers are the largest (the step waits for the slowest rank).
- exposed communication: the part of a collective's time no computation hides. Tensor-parallel calls sit
  between the matmuls that need them (all exposed); pipeline messages go into the schedule simulation (which
  then also gives the bubble); data-parallel reductions overlap the backward they follow (DDP buckets, FSDP
  reduce-scatters) and FSDP's prefetched gathers overlap the unit before.
- in flight: micro-batches whose activations a rank holds at once; the schedule's own simulation
  (``simulate_schedule(...).peak_until_w``) gives it per rank, 1 without a pipeline.

Where the numbers come from: communication is ``volumes.calls_per_rank`` (the wrappers' exact calls);
parameter, gradient and optimizer bytes count the local shapes (``model.parameters``) and FSDP's shard sizes;
activation bytes and compute time are estimates (the formulas below, with the profile's constants).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional

import numpy as np

from mpidist import optim
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16, is_low_precision

from .layouts import Layout, check_grid_choices, enumerate_layouts
from .model import ModelShape, parameters, stage_layers
from .profile import Profile
from .schedule import build_schedule, in_flight as _in_flight, pipeline as _pipeline
from .volumes import Call, calls_per_rank, ddp_buckets, dtypes, fsdp_units, summarize, zero_allgather_calls

__all__ = ["Estimate", "estimate", "plan", "lower_bound", "memory_per_rank", "collective_seconds", "build_schedule", "activation_bytes", "touched_bytes",
           "attention_probs_bytes", "transient_bytes", "optimizer_work_bytes", "backward_working_bytes",
           "gradient_bytes"]

@dataclass
class Estimate:
    """What the planner predicts for one layout (largest over pipeline positions), or why it cannot run."""

    layout: Layout
    memory: Dict[str, float] = field(default_factory=dict)      # bytes per rank by component, and "total"
    comm: Dict[str, Dict[str, int]] = field(default_factory=dict)   # group -> bytes and messages per step
    calls: List[Call] = field(default_factory=list)             # the busiest position's calls
    time: Dict[str, float] = field(default_factory=dict)        # seconds: compute, tp, pp, dp, bubble, optimizer, step
    reason: str = ""                                            # non-empty: infeasible, and why
    warnings: List[str] = field(default_factory=list)           # outside the profile's validated range: why

    @property
    def feasible(self) -> bool:
        return not self.reason

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "name": self.layout.name(), "feasible": self.feasible,
                "reason": self.reason, "memory": self.memory, "comm": self.comm, "time": self.time,
                "calls": [c.__dict__ for c in self.calls], "out_of_range": self.warnings}


# -- communication time ------------------------------------------------------------------------------------
_DP_GROUPS = {"dp", "dp_shard", "dp_replicate", "tied", "dp_node", "dp_leaders"}


def _group_size(layout: Layout, group: str) -> int:
    # pp, tied, dp_node and dp_leaders (the node-aware 16-bit hooks) carry point-to-point messages: 2 ranks,
    # which also picks the oversubscribed link measured on pairs (Profile.oversubscribed_link)
    return {"tp": layout.tp, "pp": 2, "dp": layout.dp, "tied": 2, "dp_shard": layout.shard_group,
            "dp_replicate": layout.dp // max(1, layout.shard_group), "dp_node": 2, "dp_leaders": 2,
            "zero": layout.dp}[group]


def _inner_span(layout: Layout, group: str) -> int:
    """Return (consecutive ranks one group of ``group`` spans, ranks of it per such block): mesh order dp, pp, tp."""
    return {"tp": layout.tp, "pp": layout.pp * layout.tp, "tied": layout.pp * layout.tp,
            "dp": layout.ranks, "dp_shard": layout.shard_group * layout.pp * layout.tp,
            "dp_replicate": layout.ranks, "dp_node": layout.pp * layout.tp, "dp_leaders": layout.ranks,
            "zero": layout.ranks}[group]


def _link(profile: Profile, layout: Layout, group: str, ranks_per_node: int, rails: bool = False):
    """Return (tier, bandwidth share) of ``group``: inside a node when its ranks fit one, else the inter tier,
    whose link ``ranks_per_link`` ranks of a node share (1: a NIC per rank, as DGX nodes have) among the groups
    crossing the node at once (one per group, the node's ranks of a group taking turns on a ring). ``rails``
    (a collective under ``Profile.multi_rail``): the group crosses on all its ranks' links at once, so its share
    is its ranks on the node over ``ranks_per_link``, possibly above 1, up to the intra tier's bandwidth."""
    span = _inner_span(layout, group)
    if span <= ranks_per_node:
        return profile.tiers["intra"], 1.0
    tier = profile.tiers["inter"]
    # dp's leaders cross the node as dp's ring does: one per dp group with ranks on the node
    stride = (layout.tp if group in ("pp", "tied") else layout.pp * layout.tp if group == "dp_leaders"
              else span // _group_size(layout, group))
    members_per_node = max(1, ranks_per_node // max(1, stride))
    links = min(tier.ranks_per_link, ranks_per_node)
    if rails:
        intra = profile.tiers["intra"].effective_bandwidth
        return tier, min(members_per_node / links, intra / tier.effective_bandwidth)
    concurrent = max(1, links // members_per_node)
    return tier, 1.0 / concurrent


def collective_seconds(op: str, nbytes: float, n: int, latency: float, bandwidth: float) -> float:
    """Return the time of one call (ring algorithms; ``nbytes`` is the caller's input as in ``volumes``)."""
    if n <= 1 and op not in ("send", "recv"):
        return 0.0
    if op == "allreduce":
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
    if op == "allgather":
        return (n - 1) * latency + (n - 1) * nbytes / bandwidth
    if op == "reduce_scatter":
        return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth
    if op == "send":
        return latency + nbytes / bandwidth
    if op == "recv":
        return 0.0   # counted at the sender
    raise ValueError(f"collective_seconds: unknown op {op!r}")


def _calls_seconds(calls, profile, layout, ranks_per_node, groups) -> float:
    total = 0.0
    for c in calls:
        if c.group in groups:
            # multi-rail: a group's collective rings; the tied embedding's pair and the pipeline's and the
            # node-aware hooks' point-to-point messages cross on the sending rank's link
            rails = (profile.multi_rail and c.group != "tied"
                     and c.op in ("allreduce", "allgather", "reduce_scatter"))
            tier, share = _link(profile, layout, c.group, ranks_per_node, rails=rails)
            n = _group_size(layout, c.group)
            per_node = _members_per_node(layout, c.group, ranks_per_node)
            if c.op == "allreduce" and profile.halving_doubling_allreduce and tier is profile.tiers["inter"] \
                    and 1 < per_node < n:
                total += c.count * halving_doubling_allreduce_seconds(c.nbytes, n, per_node, profile.tiers["intra"],
                                                                      tier, share)
            else:
                total += c.count * collective_seconds(c.op, c.nbytes, n, tier.latency_s,
                                                      tier.effective_bandwidth * share)
    return total


def _members_per_node(layout: Layout, group: str, ranks_per_node: int) -> int:
    """Return how many ranks of one ``group`` share a node (block placement, mesh order dp, pp, tp)."""
    n = _group_size(layout, group)
    stride = _inner_span(layout, group) // n if group not in ("pp", "tied") else layout.tp
    return max(1, min(n, ranks_per_node // max(1, stride)))


def halving_doubling_allreduce_seconds(nbytes: float, n: int, per_node: int, intra, inter,
                                       share: float = 1.0) -> float:
    """Return the time of an allreduce of ``nbytes`` over ``n`` ranks, ``per_node`` consecutive ones on each node,
    by recursive halving then doubling (``Profile.halving_doubling_allreduce``: MPICH's above 2 KiB).

    Halving step k exchanges ``nbytes / 2**k`` with the rank ``2**(k - 1)`` away: the first ``log2(per_node)``
    steps stay inside the node (together ``(per_node - 1) / per_node`` of the bytes, the ring's share among
    ``per_node`` ranks), the others cross it with every rank of the node sending at once, ``per_node`` times
    ``nbytes / 2**k`` over one link: in all ``(N - 1) / N`` of the bytes for ``N = n / per_node`` nodes, what a ring
    among one rank per node moves. Doubling mirrors it. So: the ring allreduce among ``per_node`` ranks on the
    ``intra`` tier plus the ring allreduce among ``N`` on the ``inter`` tier (its bandwidth times ``share``).

    Measured on the virtual cluster (2 nodes x 2 ranks, 200 Mbit/s, docs/planner.md, 2026-11-28): an allreduce of
    DDP's two buckets (3.3 MB) takes 131-134 ms by MPICH's default and by its reduce_scatter_allgather (the bytes
    once over the link), 203 ms by its ring (1.5 times them)."""
    return (collective_seconds("allreduce", nbytes, per_node, intra.latency_s, intra.effective_bandwidth)
            + collective_seconds("allreduce", nbytes, n // per_node, inter.latency_s,
                                 inter.effective_bandwidth * share))


def _oversubscribed(profile: Profile, ranks_per_node: int) -> bool:
    return bool(profile.cores_per_node) and ranks_per_node > profile.cores_per_node


def _core_sharing(profile: Profile, ranks_per_node: int) -> float:
    """Return how many ranks share a core (ranks / cores when they outnumber the cores, else 1): the factor on a
    rank's compute, per-op and optimizer time."""
    return ranks_per_node / profile.cores_per_node if _oversubscribed(profile, ranks_per_node) else 1.0


def _sync_waits(calls, groups, profile: Profile, layout: Layout, ranks_per_node: int) -> float:
    """Return what the calls of ``groups`` inside a node add when ranks outnumber cores: their time on the
    profile's oversubscribed link for their group's size (``Profile.oversubscribed_link``: partners descheduled
    by the ranks sharing their cores) over that on the intra tier (0 when not oversubscribed or not measured)."""
    if not _oversubscribed(profile, ranks_per_node):
        return 0.0
    intra, extra = profile.tiers["intra"], 0.0
    for c in calls:
        if c.group in groups and _inner_span(layout, c.group) <= ranks_per_node:
            n = _group_size(layout, c.group)
            over = profile.oversubscribed_link(n)
            if over is None:
                continue
            extra += c.count * max(0.0, collective_seconds(c.op, c.nbytes, n, over.latency_s, over.bandwidth)
                                   - collective_seconds(c.op, c.nbytes, n, intra.latency_s,
                                                        intra.effective_bandwidth))
    return extra


# -- memory --------------------------------------------------------------------------------------------------
def attention_probs_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> float:
    """Return the bytes of the attention probabilities one micro-batch's blocks in ``layers`` keep for backward:
    what selective recompute does not keep (exact: tests/test_plan_exact.py walks the real graph).

    ``F.multi_head_attention`` keeps one (batch, heads / tp, seq, seq) array per block in the activations'
    dtype (computed in float32 under 16-bit activations, rounded once, as Megatron-LM keeps its 16-bit softmax
    output); every key counted (causal row blocks leave the unseen part unwritten, not unallocated). With
    dropout, its mask of the same shape too, as booleans (1 byte per element)."""
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    itemsize = dtypes(shape, layout).act.itemsize + (1 if shape.dropout else 0)
    return blocks * layout.micro_batch * (shape.heads // layout.tp) * shape.seq ** 2 * itemsize


def _formed_probs_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> float:
    """Return the bytes of the attention probabilities one micro-batch's blocks form (float32 under 16-bit
    activations: the softmax's dtype), whether kept or not: the compute model's traffic for them."""
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    itemsize = max(4, dtypes(shape, layout).act.itemsize)
    if shape.dropout:   # the mask (bool) and the dropped probabilities (in the softmax's dtype)
        itemsize += 1 + itemsize
    return blocks * layout.micro_batch * (shape.heads // layout.tp) * shape.seq ** 2 * itemsize


def activation_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> float:
    """Return the bytes one micro-batch leaves stored for backward in ``layers``: what the autograd graph of the
    real ops keeps (exact for the blocks: tests/test_plan_exact.py measures one block's saved arrays).

    Per block and token; ``s`` is tp under sequence parallelism, else 1; ``e`` the activations' itemsize and
    ``e32`` that of the ops computing in float32 under 16-bit activations (else ``e``):
    - ``F.layer_norm``, each of the two: its input as given (d / s, ``e``) and two statistics per row, mean and
      reciprocal standard deviation (2 / s, ``e32``); it forms the normalized input again in backward
      (``F.rms_norm``: one statistic, 1 / rms). The residual adds keep nothing;
    - the column-parallel linears (qkv, fc1) keep the norms' outputs, d / s each (under sequence parallelism
      this rank's shard, gathered again in backward); attention's projection keeps the attention output (d /
      tp), fc2 the activation's output (ffn / tp); under sequence parallelism the norms keep their weights' copies (2 d per
      block and micro-batch, not per token: ``read_replicated``);
    - ``F.multi_head_attention`` keeps its qkv as given (3 d / tp, ``e``; with grouped-query attention the
      k/v heads repeated by ``F.repeat_kv``, which keeps nothing) and reads its output from the array
      the projection keeps (d / tp, ``e``), and the probabilities rounded to ``e`` (``attention_probs_bytes``),
      which selective recompute drops;
    - ``F.gelu`` keeps its input (ffn / tp) and forms its half-tanh again in backward; ``F.swiglu`` keeps its
      input, the fused gate and up (2 ffn / tp), and forms the sigmoid again;
    - with dropout, the two dropout layers on the residual stream keep their masks as booleans (d / s each, 1
      byte), and attention its probabilities' mask (``attention_probs_bytes``).
    Full recompute keeps only each block's input (d / s). The embedding's and the head's terms are still
    estimates (the graph keeps the token indices, the head norm's input and statistics, the loss's arrays).
    """
    dt = dtypes(shape, layout)
    b, t, d, f, tp = layout.micro_batch, shape.seq, shape.hidden, shape.ffn_size, layout.tp
    e = dt.act.itemsize
    low = is_low_precision(dt.act)
    e32 = 4 if low else e
    s = tp if layout.sequence_parallel else 1
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    stats = 1 if shape.norm == "rmsnorm" else 2   # layer_norm's mean and rstd; rms_norm's 1 / rms
    per_token = (2 * (d * e + stats * e32) / s       # the norms: their input and statistics, twice
                 + 2 * d / s * e                     # qkv's and fc1's inputs (this rank's shard under sp)
                 + (3 * d + d) / tp * e              # attention: qkv and its output (the projection's input)
                 + (shape.fc_size + f) / tp * e      # the activation's input (fc's output), fc2's input
                 + (2 * d / s if shape.dropout else 0))   # the residual stream's two dropout masks (bool)
    # Under sequence parallelism the norms read their (replicated) weights through copy_to_tp as copies, which
    # they keep: 2 d per block, in the gathered parameters' dtype.
    norm_weights = 2 * d * dt.gather.itemsize if layout.sequence_parallel and tp > 1 else 0
    if layout.recompute == "full":
        stored = blocks * b * t * d / s * e
    else:
        stored = blocks * (b * t * per_token + norm_weights)
        if layout.recompute != "selective":
            stored += attention_probs_bytes(shape, layout, layers)
    if "embed" in layers:
        stored += b * t * d * e + (b * t * d / s if shape.dropout else 0)   # (its dropout's mask)
    if "head" in layers:
        stored += b * t * d * e + 2 * b * t * (shape.vocab / tp) * e   # norm input, logits, their softmax
    return stored


def touched_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> float:
    """Return the compute model's memory-traffic proxy: the bytes of the arrays one micro-batch's ops in ``layers``
    form, with recompute none (see ``activation_bytes`` for what backward keeps).

    The elementwise passes' time (``_compute_seconds``) and the micro-batch cost curve's key (``calibrate``) read
    it. It counts what the ops write, kept or not: each norm's normalized input and statistic, the linears'
    inputs, attention's float32 qkv, output and probabilities (plus the 16-bit output under 16-bit
    activations), GELU's input, half-tanh and output. (It was the stored-activation count until the ops kept
    less, on 2026-11-28; the calibrated profiles' micro-batch curves are keyed on it, so it is kept as it was.)"""
    dt = dtypes(shape, layout)
    b, t, d, f, tp = layout.micro_batch, shape.seq, shape.hidden, shape.ffn_size, layout.tp
    e = dt.act.itemsize
    low = is_low_precision(dt.act)
    e32 = 4 if low else e   # the float32 ops' dtype under 16-bit activations
    s = tp if layout.sequence_parallel else 1
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    grouped_qkv = shape.qkv_size if shape.num_kv_heads != shape.heads else 0
    per_token = (2 * (d + 1) / s * e32            # layer_norm: xhat and rstd, twice
                 + 2 * d * e                      # qkv's and fc1's inputs (whole sequence)
                 + (3 * d + d) / tp * e32         # attention: qkv and its output
                 + (d / tp * e if low else 0)     # the 16-bit copy of attention's output
                 + 3 * f / tp * e                 # gelu's input, s and output (swiglu: gate and up, output)
                 + grouped_qkv / tp * e           # GQA: the projection's qkv, before F.repeat_kv
                 + (shape.qkv_size / tp * e if shape.positions == "rope" else 0)   # F.rotary's turned qkv
                 + (2 * d / s * (1 + e) if shape.dropout else 0))   # two dropouts' masks and outputs
    norm_params = 2 * (1 + shape.norm_bias) * d * 4 if is_low_precision(dt.gather) else 0
    formed = blocks * (b * t * per_token + norm_params) + _formed_probs_bytes(shape, layout, layers)
    if "embed" in layers:
        formed += b * t * d * e + (b * t * d / s * (1 + e) if shape.dropout else 0)   # (its dropout)
    if "head" in layers:
        formed += b * t * d * e + 2 * b * t * (shape.vocab / tp) * e   # norm input, logits, their softmax
    return formed


def transient_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> float:
    """Return the bytes of working memory on top of the stored activations at a rank's peak: one logits-sized
    array of one micro-batch where ``layers`` hold the head, 0 elsewhere.

    ``F.cross_entropy`` keeps two (batch x seq, vocab / tp) arrays for backward (counted in ``activation_bytes``);
    while it forms them the logits are alive too (freed after the loss), and backward's first gradient, that of
    the logits, has their size and sits next to the two: either way one more logits-sized array, in the loss's
    dtype (float32 under 16-bit activations, an fp32 op). The blocks' own temporaries (a row block's scores,
    a block's gradients) are smaller and not counted."""
    if "head" not in layers:
        return 0.0
    itemsize = max(4, dtypes(shape, layout).act.itemsize)
    return layout.micro_batch * shape.seq * (shape.vocab / layout.tp) * itemsize


def optimizer_work_bytes(sizes: List[int], dtype, masters: bool) -> float:
    """Return the bytes of AdamW's persistent work arrays (``_Pack.scratch`` in ``mpidist/optim.py``) for a rank
    whose optimizer updates parameters of ``sizes`` elements (in the optimizer's order) in ``dtype``.

    One pack per step phase and dtype (all parameters of a float32 model), or one per 16-bit parameter updated
    through its float32 master (``masters``). Each pack keeps ``work``, ``denom`` and ``step``, of ``min(_BLOCK,
    pack size)`` elements each (AdamW's decoupled decay needs no ``decayed``), and when its blocks gather two or
    more small consecutive parameters (each under ``_BLOCK`` elements, a run spanning at most ``_BLOCK``: as
    ``_Pack.blocks`` walks them) a ``gathered grad`` and a ``gathered data`` of the same size. Parameters are
    separate arrays (no flat view over all of them): true of a model's own, a tensor-parallel slice's, a stage's
    and FSDP's shards."""
    if masters:   # a pack per parameter: no run of two, float32 scratch
        return sum(3 * min(optim._BLOCK, n) * 4 for n in sizes)
    total = sum(sizes)
    if not total:
        return 0.0
    block, itemsize = min(optim._BLOCK, total), np.dtype(dtype).itemsize
    run, start, at, gathered = 0, 0, 0, False
    for n in sizes:
        if n < optim._BLOCK:
            if run and at + n - start > optim._BLOCK:
                gathered, run = gathered or run > 1, 0
            if not run:
                start = at
            run += 1
        else:
            gathered, run = gathered or run > 1, 0
        at += n
    gathered = gathered or run > 1
    return (3 + 2 * gathered) * block * itemsize


def backward_working_bytes(shape: ModelShape, layout: Layout, layers: List[str]) -> Dict[str, float]:
    """Return, per moment of the first backward through ``layers`` (one micro-batch), what it holds beyond the
    stored activations less what it freed by then (negative: freed more): the head's norm, and the last block's
    GELU and second norm; where the block backward's working set is largest (attention's is not counted).

    ``F.layer_norm``'s backward holds its incoming gradient and forms xhat, a scratch and its gradient again (four
    arrays of its rows: the whole sequence, this rank's shard under sequence parallelism, computed in float32
    under 16-bit activations); ``F.gelu``'s the incoming gradient (fc2's input gradient), its gradient and two
    scratch rows of at most ``F._CHUNK`` elements (five float32 ones for a 16-bit input). Freed by the head's
    norm: the loss's two logits-sized arrays; by the block's GELU: the head's stored arrays and fc2's input (GELU's output); by its second norm: GELU's
    input and fc1's (the norm's output) too. The residual stream's gradient (one of its arrays) waits meanwhile.
    Under sequence parallelism also the head's projection and fc1 (``gather_sequence_linear``'s backward)."""
    dt = dtypes(shape, layout)
    b, t, d, f, tp = layout.micro_batch, shape.seq, shape.hidden, shape.ffn_size, layout.tp
    e = dt.act.itemsize
    e32 = 4 if is_low_precision(dt.act) else e
    s = tp if layout.sequence_parallel else 1
    rows = b * t // s * d                   # a residual-stream array on this rank
    n_f = b * t * f // tp                   # an MLP activation on this rank: fc2's input
    n_fc = b * t * shape.fc_size // tp      # fc's output, the activation's input (2 n_f under SwiGLU)
    # Under sequence parallelism a column-parallel linear's backward (``gather_sequence_linear``) holds the shard
    # and the whole sequence gathered again, the input's gradient (whole sequence), its copy sent to the
    # reduce-scatter and the shard that comes back
    gathered = (2 * rows + 3 * b * t * d) * e if s > 1 else None
    out = {}
    head = "head" in layers
    logits = transient_bytes(shape, layout, layers)
    if head:
        out["head_norm"] = 4 * rows * e32 - 2 * logits
        if gathered is not None:   # the head's projection, the logits' gradient coming in
            out["head_linear"] = gathered + logits - 2 * logits
    if any(layer.startswith("blocks.") for layer in layers):
        freed = activation_bytes(shape, layout, ["head"]) if head else 0.0
        product = 4 if dt.act == bfloat16 else e   # fc2's input gradient: numpy's bfloat16 matmul gives float32
        # the activation's gradient (fc's output's size) made, fc2's input freed
        out["mlp_activation"] = n_f * product + (n_fc - n_f) * e + _activation_scratch(shape, layout, n_f) + rows * e - freed
        out["block_norm"] = 4 * rows * e32 + rows * e - (n_fc + n_f + rows) * e - freed
        if gathered is not None:   # fc1, the activation's gradient coming in, its and fc2's inputs freed
            out["block_linear"] = gathered + n_fc * e + rows * e - (n_fc + n_f) * e - freed
    return out


def _activation_scratch(shape: ModelShape, layout: Layout, n_f: int) -> float:
    """Return the scratch bytes the MLP activation's backward holds besides its gradient (``F.gelu``: two rows of
    at most ``F._CHUNK`` elements, five float32 ones for a 16-bit input; ``F.swiglu``: two row blocks of about
    ``F._CHUNK`` elements, five float32 ones for a 16-bit input); ``n_f``: fc2's input's elements."""
    dt = dtypes(shape, layout)
    low = is_low_precision(dt.act)
    if shape.mlp == "swiglu":
        rows, f = layout.micro_batch * shape.seq, shape.ffn_size // layout.tp
        return min(rows, max(1, F._CHUNK // f)) * f * (5 * 4 if low else 2 * dt.act.itemsize)
    return min(n_f, F._CHUNK) * (5 * 4 if low else 2 * dt.act.itemsize)


def gradient_bytes(shape: ModelShape, layout: Layout, position: int = 0) -> float:
    """Return the gradient bytes a rank at pipeline ``position`` hands its optimizer after a step's backward: DDP's
    buckets, FSDP's shard gradients (parameters' dtype), else its parameters' gradients."""
    dt = dtypes(shape, layout)
    pp, v = layout.pp, layout.chunks
    stages = stage_layers(shape, pp * v)
    chunks = [[p for layer in stages[s] for p in parameters(
        shape, layer, layout.tp, own_head_weight=layer == "head" and pp * v > 1)] for s in range(position, pp * v, pp)]
    if layout.fsdp and layout.dp > 1:
        return sum(u["shard_numel"] for u in fsdp_units(shape, layout.tp, layout.shard_group)) * dt.param.itemsize
    if layout.dp > 1:
        return sum(sum(ddp_buckets(c, dt.param, layout.dp, layout.comm_hook)) for c in chunks)
    return sum(p.numel for c in chunks for p in c) * dt.param.itemsize


def memory_per_rank(shape: ModelShape, layout: Layout, position: int = 0, in_flight: int = 1) -> Dict[str, float]:
    """Return the bytes a rank at pipeline ``position`` holds at its peak, by component (see the module notes).

    Held throughout: parameters (FSDP: shards) in their dtype, AdamW's state per parameter as
    ``Dtypes.optimizer_bytes`` says (16-bit parameters: float32 master, exp_avg and exp_avg_sq) and its work arrays
    (``optimizer_work_bytes``). The rest is counted at each moment a step can peak, and the largest is the rank's
    peak: the loss, once ``in_flight`` micro-batches' activations are stored (the logits' working array:
    ``transient_bytes``), and the first backward's head norm, last block's GELU and second norm
    (``backward_working_bytes``; under recompute with the recomputed block's arrays). Gradients at those moments:
    DDP's buckets always; without them, every parameter's once a backward has run before (more micro-batches than
    ``in_flight``), else none at the loss and, in the first backward, the head's (the tied embedding's weight's
    too) and fc2's. FSDP: no shard gradient (the step's ``zero_grad`` dropped them, the reduce-scatters make them
    after the peak); its units' unsharded gradients (reduce dtype) under ``no_sync`` (several micro-batches), else
    the block computing and the head reducing; its gathered units (gather dtype): the head (and the tied
    embedding) at the loss, the block computing and the one prefetched in backward."""
    dt = dtypes(shape, layout)
    e = dt.param.itemsize
    pp, v = layout.pp, layout.chunks
    stages = stage_layers(shape, pp * v)
    mine = [s for s in range(pp * v) if s % pp == position]
    layers = [layer for s in mine for layer in stages[s]]
    local = [p for s in mine for layer in stages[s]
             for p in parameters(shape, layer, layout.tp, own_head_weight=layer == "head" and pp * v > 1)]
    numel = sum(p.numel for p in local)
    head, blocks = "head" in layers, [layer for layer in layers if layer.startswith("blocks.")]
    first_backward = in_flight >= layout.num_micro * v   # no backward ran before the peak: no gradients yet
    sizes = [p.numel for p in local]
    buffers = 0.0
    loss_grads = bwd_grads = 0.0
    loss_buffers = bwd_buffers = 0.0
    if layout.fsdp and layout.dp > 1:
        units = fsdp_units(shape, layout.tp, layout.shard_group)
        sizes = [u["shard_numel"] for u in units]
        numel = sum(sizes)
        padded = {u["label"]: u["shard_numel"] * layout.shard_group for u in units}
        order = [u["label"] for u in units]
        last = order[-2]   # the block backward starts with (units: embed, blocks..., head)
        if layout.num_micro > 1:   # no_sync: every unit's unsharded gradient, from the first micro-batch on
            loss_grads = bwd_grads = sum(padded.values()) * dt.reduce.itemsize
        else:
            bwd_grads = (padded[last] + padded["head"]) * dt.reduce.itemsize
            if shape.tie_weights:   # the head's gradient of the tied weight, until the embedding's unit is final
                bwd_grads += shape.vocab // layout.tp * shape.hidden * e
        loss_buffers = (padded["head"] + (padded["embed"] if shape.tie_weights else 0)) * dt.gather.itemsize
        bwd_buffers = (padded[last] + padded[order[-3]]) * dt.gather.itemsize
    elif layout.dp > 1 or not first_backward:
        loss_grads = bwd_grads = gradient_bytes(shape, layout, position)
        if layout.dp > 1 and layout.comm_hook == "powersgd":   # its error feedback: a float32 copy of every bucket
            buffers += numel * 4
    else:
        firsts = [p for p in local if p.name.startswith("head.")
                  or (blocks and p.name.startswith(blocks[-1] + ".mlp.proj."))
                  or (shape.tie_weights and head and p.name == "embed.wte.weight")]
        bwd_grads = sum(p.numel for p in firsts) * e
    param_bytes = numel * e
    optimizer = numel * dt.optimizer_bytes
    work = optimizer_work_bytes(sizes, dt.param, dt.masters)
    step_moment = None
    if layout.sharding == "zero1" and layout.dp > 1:
        # ZeroRedundancyOptimizer: the state of this rank's shard only (the first rank's, the largest), stepped
        # as the pieces of the parameters it holds; after the step, on top of every gradient, the allgather's chunk
        # sent and gathered
        pieces = [-(-n // layout.dp) for n in sizes]   # every parameter split over the dp ranks
        owned = sum(pieces)
        optimizer = owned * dt.optimizer_bytes
        work = optimizer_work_bytes(pieces, dt.param, dt.masters)
        chunk = zero_allgather_calls(owned, e)[0] + 1   # (the first carries a status element)
        step_moment = {"grads": gradient_bytes(shape, layout, position), "activations": 0.0,
                       "transient": (layout.dp + 1) * chunk * e, "comm_buffers": 0.0}
    per_mb = activation_bytes(shape, layout, layers) / max(1, len(mine))
    stored = per_mb * in_flight
    recomputed = 0.0
    if layout.recompute == "full":
        # one block's full activations while it is recomputed, and what ``F.recompute``'s backward holds until the
        # block's backward ends: the recomputed output and the parameter gradients ``autograd.grad`` returned so
        # far (at GELU: fc2's)
        recomputed = activation_bytes(shape, Layout(**{**layout.to_dict(), "recompute": "none"}), ["blocks.0"])
        recomputed += layout.micro_batch * shape.seq * shape.hidden / (
            layout.tp if layout.sequence_parallel else 1) * dt.act.itemsize
        recomputed += sum(p.numel for p in parameters(shape, "blocks.0", layout.tp)
                          if p.name.startswith("blocks.0.mlp.proj.")) * e
    elif layout.recompute == "selective":   # one block's probabilities while recomputed (at most: by slices)
        recomputed = attention_probs_bytes(shape, layout, ["blocks.0"])
    if pp > 1:   # a received activation or gradient per neighbour
        buffers += 2 * layout.micro_batch * shape.seq * shape.hidden * dt.act.itemsize / (
            layout.tp if layout.sequence_parallel else 1)
    moments = [{"grads": bwd_grads, "activations": stored, "transient": 0.0, "comm_buffers": buffers + bwd_buffers}]
    if head:
        moments.append({"grads": loss_grads, "activations": stored,
                        "transient": transient_bytes(shape, layout, layers), "comm_buffers": buffers + loss_buffers})
    for extra in backward_working_bytes(shape, layout, layers).values():
        # ``extra`` is the working set less what backward freed by then: where it freed more, the activations
        # still held are that much fewer (no component is negative; the total is the same)
        moments.append({"grads": bwd_grads, "activations": stored + recomputed + min(extra, 0.0),
                        "transient": max(extra, 0.0), "comm_buffers": buffers + bwd_buffers})
    if step_moment is not None:
        moments.append(step_moment)
    peak = max(moments, key=lambda m: sum(m.values()))
    out = {"params": param_bytes, "grads": peak["grads"], "optimizer": optimizer, "optimizer_work": work,
           "activations": peak["activations"], "transient": peak["transient"], "comm_buffers": peak["comm_buffers"]}
    out["total"] = sum(out.values())
    return out


# -- time ----------------------------------------------------------------------------------------------------
def _compute_seconds(shape, layout, layers, profile, ranks_per_node):
    """Return (forward, backward) seconds of one micro-batch through ``layers`` on one rank."""
    b, t, d, f, tp = layout.micro_batch, shape.seq, shape.hidden, shape.ffn_size, layout.tp
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    per_block = b * t * (2 * (shape.qkv_size * d + d * d + (shape.fc_size + f) * d) + 4 * t * d) / tp
    fwd = blocks * per_block + (2 * b * t * shape.vocab * d / tp if "head" in layers else 0.0)
    gemm = 2 * b * t * d * shape.fc_size / tp   # the MLP's first GEMM: the typical size
    sharing = _core_sharing(profile, ranks_per_node)
    rate = profile.flops(dtypes(shape, layout).act.name) * profile.efficiency(gemm) / sharing
    plain = Layout(**{**layout.to_dict(), "recompute": "none"})
    memory_bound = touched_bytes(shape, plain, layers) * profile.elementwise_factor / profile.memory_bandwidth * sharing
    # The measured per-sample cost at this micro-batch's size (caches), relative to the calibration's fit.
    factor = profile.microbatch_factor(touched_bytes(shape, plain, ["blocks.0"]))
    rate /= profile.compute_scale * factor
    memory_bound *= profile.compute_scale * factor
    # The fixed cost of a layer's ops (Python, dispatch), a third in forward: it does not shrink with tp or b.
    per_layer = profile.layer_overhead_s * sharing
    # A tensor-parallel rank's work on whole-sequence arrays beyond its 1/tp share (profile notes).
    per_element = profile.sp_replicated_s if layout.sequence_parallel else profile.tp_replicated_s
    replicated = blocks * b * t * d * (1 - 1 / tp) * per_element * sharing
    forward = fwd / rate + memory_bound / 3 + len(layers) * per_layer / 3 + replicated / 3
    backward = 2 * fwd / rate + 2 * memory_bound / 3 + 2 * len(layers) * per_layer / 3 + 2 * replicated / 3
    if layout.recompute == "full":
        backward += blocks * per_block / rate + memory_bound / 3 + blocks * per_layer / 3 + replicated / 3
    elif layout.recompute == "selective" and blocks:   # each block's scores product and softmax again (not x V)
        probs = _formed_probs_bytes(shape, plain, layers)
        backward += blocks * 2 * b * t * t * d / tp / rate + memory_bound / 3 * probs / touched_bytes(
            shape, plain, layers)
    return forward, backward


def estimate(shape: ModelShape, layout: Layout, profile: Profile, ranks_per_node: int) -> Estimate:
    """Return the ``Estimate`` of ``layout`` (infeasible with a reason when it cannot run or does not fit)."""
    est = Estimate(layout, reason=estimate_structure(shape, layout, ranks_per_node))
    if est.reason:
        return est
    est.warnings = profile.out_of_range(layout.ranks, _num_parameters(shape), layout, shape)
    pp, v, m = layout.pp, layout.chunks, layout.num_micro
    worst_mem, worst_time, worst_calls = None, None, None
    for position, layers, in_flight in _positions(shape, layout, _peaks(layout)):
        mem = memory_per_rank(shape, layout, position, in_flight)
        calls = calls_per_rank(shape, layout, position, ranks_per_node)
        f, b = _compute_seconds(shape, layout, layers, profile, ranks_per_node)
        tp_s = _calls_seconds(calls, profile, layout, ranks_per_node, {"tp"})
        pp_s = _calls_seconds(calls, profile, layout, ranks_per_node, {"pp"})
        dp_s = _calls_seconds(calls, profile, layout, ranks_per_node, _DP_GROUPS)
        tp_s += _sync_waits(calls, {"tp"}, profile, layout, ranks_per_node)
        pp_s += _sync_waits(calls, {"pp"}, profile, layout, ranks_per_node)
        dp_s += _sync_waits(calls, _DP_GROUPS, profile, layout, ranks_per_node)
        # ZeroRedundancyOptimizer's allgather follows the optimizer step: nothing left to overlap it with
        zero_s = (_calls_seconds(calls, profile, layout, ranks_per_node, {"zero"})
                  + _sync_waits(calls, {"zero"}, profile, layout, ranks_per_node))
        if worst_mem is None or mem["total"] > worst_mem["total"]:
            worst_mem = mem
        # AdamW streams float32 state with master weights (a third of it: the masters), else the parameters
        # (7 passes over them); ZeroRedundancyOptimizer: over its shard, plus the shard's values copied into the
        # allgather (2 passes) and every parameter written back from the gathered chunks (2 passes)
        dt = dtypes(shape, layout)
        zero = layout.dp if layout.sharding == "zero1" else 1
        updated = 7 * mem["params"] / dt.param.itemsize * (4 if dt.masters else dt.param.itemsize) / zero
        if zero > 1:
            updated += 2 * mem["params"] / zero + 2 * mem["params"]
        worst_time = _merge_time(worst_time, (f, b, tp_s, pp_s, dp_s, updated, calls, zero_s), m)
        if worst_calls is None or sum(c.nbytes * c.count for c in calls) > sum(c.nbytes * c.count for c in worst_calls):
            worst_calls = calls
    f, b, tp_s, pp_s, dp_s, param_bytes, calls, zero_s = worst_time   # param_bytes: the optimizer's streamed bytes
    compute = m * (f + b)
    bubble = pp_exposed = 0.0
    if pp > 1:
        # The schedule's own simulation, with this layout's costs: F and B carry their tensor-parallel calls,
        # a message between stages its alpha-beta time.
        tp_per_mb = tp_s / m
        fc, bc = f + tp_per_mb / 3, b + 2 * tp_per_mb / 3
        wc = bc / 2 if layout.schedule == "zb_h1" else None
        per_message = pp_s / max(1, sum(c.count for c in calls if c.group == "pp" and c.op == "send")) * 2
        args = (layout, fc / v, bc / v, None if wc is None else wc / v)
        sim = _pipeline(*args, (per_message, 0.0))   # timed with the messages, and without them
        timed, untimed = (float(t) for t in sim["makespan"])
        busy = float(sim["busy"][0])
        bubble = untimed - busy              # the schedule's own idle time
        pp_exposed = timed - untimed         # what the messages between stages add
        pipeline_time = timed
    else:
        pipeline_time = compute + tp_s
    # Data-parallel reductions: DDP inside a pipeline syncs after the schedule (exposed); otherwise they
    # overlap the last micro-batch's backward (DDP buckets, FSDP reduce-scatters) and FSDP gathers overlap
    # the compute of the unit before, leaving the first unit's gather.
    if pp > 1 or dp_s == 0 or _oversubscribed(profile, ranks_per_node):   # no idle core progresses transfers
        dp_exposed = dp_s
    else:
        dp_exposed = max(dp_s - (b if not layout.fsdp else compute), dp_s / (shape.layers + 2))
    dp_exposed += zero_s
    sharing = _core_sharing(profile, ranks_per_node)
    optimizer = param_bytes / profile.memory_bandwidth * profile.compute_scale * sharing
    step = pipeline_time + dp_exposed + optimizer
    est.memory = worst_mem
    est.calls = worst_calls
    est.comm = summarize(worst_calls)
    est.time = {"compute": compute, "tp": tp_s, "pp": pp_exposed, "bubble": bubble, "dp": dp_exposed,
                "optimizer": optimizer, "step": step}
    est.reason = _does_not_fit(worst_mem, profile)
    return est


def _does_not_fit(memory: Dict[str, float], profile: Profile) -> str:
    """Return why ``memory`` (a rank's, by component) does not fit the profile's ("" if it does)."""
    if memory["total"] > profile.memory_bytes:
        return f"needs {memory['total'] / 2**30:.2f} GiB per rank, has {profile.memory_bytes / 2**30:.2f} GiB"
    return ""


def _peaks(layout: Layout):
    """Return each pipeline position's micro-batches in flight (None without a pipeline: one)."""
    return _in_flight(layout.schedule, layout.pp, layout.num_micro, layout.chunks) if layout.pp > 1 else None


def _positions(shape: ModelShape, layout: Layout, peaks=None):
    """Yield (position, its layers, its micro-batches in flight) once per kind of pipeline position: middle
    positions with as many blocks (and as many micro-batches in flight) hold and do the same."""
    seen = set()
    for position, (layers, kind) in enumerate(_position_kinds(shape, layout.pp, layout.chunks)):
        in_flight = peaks[position] if peaks else 1
        if (kind, in_flight) not in seen:
            seen.add((kind, in_flight))
            yield position, list(layers), in_flight


@functools.lru_cache(maxsize=256)
def _position_kinds(shape: ModelShape, pp: int, v: int):
    """Return per pipeline position (its layers, its kind: per stage its blocks and whether it has the embedding
    or the head)."""
    stages = stage_layers(shape, pp * v)
    mine = [range(position, pp * v, pp) for position in range(pp)]
    return tuple((tuple(layer for s in stages_of for layer in stages[s]),
                  tuple((sum(x.startswith("blocks.") for x in stages[s]), "embed" in stages[s], "head" in stages[s])
                        for s in stages_of)) for stages_of in mine)


def _memory(shape: ModelShape, layout: Layout) -> Dict[str, float]:
    """Return ``estimate``'s memory: the largest over pipeline positions of ``memory_per_rank``.

    A position's memory grows with its micro-batches in flight, so of the positions of one kind only the first
    with the most in flight can hold the most: at pp=96 three positions are counted instead of 96."""
    peaks, most = _peaks(layout), {}
    for position, (_, kind) in enumerate(_position_kinds(shape, layout.pp, layout.chunks)):
        in_flight = peaks[position] if peaks else 1
        if kind not in most or in_flight > most[kind][1]:
            most[kind] = (position, in_flight)
    worst = None
    for position, in_flight in sorted(most.values()):
        mem = memory_per_rank(shape, layout, position, in_flight)
        if worst is None or mem["total"] > worst["total"]:
            worst = mem
    return worst


_DDP_ONLY, _FSDP_ONLY = ("comm_hook", "powersgd_rank"), ("gather_dtype", "reduce_dtype")


def _with_precision(layout: Layout, precision: dict) -> Layout:
    """Return ``layout`` with the ``precision`` fields that apply to its data-parallel kind."""
    unknown = sorted(set(precision) - {"param_dtype", "compute_dtype"} - set(_DDP_ONLY) - set(_FSDP_ONLY))
    if unknown:
        raise ValueError(f"plan: unknown precision fields {unknown}")
    if layout.fsdp:
        skip = _DDP_ONLY
    elif layout.pp > 1:   # a Pipeline averages its DDP replicas' gradients itself: no communication hooks
        skip = _FSDP_ONLY + _DDP_ONLY
    else:
        skip = _FSDP_ONLY
    fields = {k: v for k, v in precision.items() if k not in skip}
    if fields:
        dtypes(ModelShape(1, 1, 1, 1, 1), replace(layout, **fields))   # a bad dtype name raises here, once
    return replace(layout, **fields) if fields else layout


@functools.lru_cache(maxsize=64)
def _num_parameters(shape: ModelShape) -> int:
    return shape.num_parameters()


def _merge_time(worst, new, num_micro):
    """Keep the position whose step costs most: its ``num_micro`` micro-batches' compute plus its communication.

    ``f`` and ``b`` are one micro-batch's, the communication a whole step's: weighing one micro-batch against a
    step's messages picked the embedding's stage (its tied-weight reduction) over the head's at many micro-batches.
    """
    if worst is None:
        return new
    cost = lambda w: num_micro * (w[0] + w[1]) + w[2] + w[3] + w[4] + w[7]   # noqa: E731
    return new if cost(new) > cost(worst) else worst


def lower_bound(shape: ModelShape, layout: Layout, profile: Profile, ranks_per_node: int) -> float:
    """Return a lower bound of ``estimate(...).time["step"]`` without timing the schedule: the busiest position's
    compute and tensor-parallel communication (a step is never shorter than its busy time)."""
    best = 0.0
    for position, layers, _ in _positions(shape, layout):
        f, b = _compute_seconds(shape, layout, layers, profile, ranks_per_node)
        # The tensor-parallel calls do not depend on dp: counted without data parallelism, no DDP buckets are cut
        calls = calls_per_rank(shape, replace(layout, dp=1), position)
        tp_s = _calls_seconds(calls, profile, layout, ranks_per_node, {"tp"})
        best = max(best, layout.num_micro * (f + b) + tp_s)
    return best


def plan(shape: ModelShape, global_batch: int, ranks: int, ranks_per_node: int, profile: Profile,
         max_micro_batch: Optional[int] = None, keep: int = 50, precision: Optional[dict] = None,
         **choices) -> List[Estimate]:
    """Return every layout's Estimate: feasible ones fastest first, then the others with the reason.

    ``choices``: ``enumerate_layouts``'s (schedules, shardings, recompute, chunk_options; tp_sizes, pp_sizes,
    dp_sizes, micro_batches to plan only those sizes, each of which must occur: ValueError otherwise).
    ``precision``: ``Layout``'s precision fields for every layout (``param_dtype``, ``compute_dtype``; ``comm_hook``
    and ``powersgd_rank`` apply to DDP layouts without a pipeline, ``gather_dtype`` and ``reduce_dtype`` to FSDP
    ones).

    Branch and bound: layouts are estimated in the order of a cheap lower bound of their step time
    (``lower_bound``); once that bound exceeds the ``keep``-th fastest step found, the remaining layouts cannot
    enter the best ``keep`` and are listed as not ranked, with their bound, instead of simulated. Memory comes
    before time: a layout that does not fit (most of them, for large models) gets its ``memory`` and reason
    only, without the step time, calls and warnings ``estimate`` would add.
    """
    if ranks < 1 or ranks_per_node < 1 or global_batch < 1:
        raise ValueError(f"plan: ranks, ranks_per_node and global_batch must be >= 1 (ranks={ranks}, "
                         f"ranks_per_node={ranks_per_node}, global_batch={global_batch})")
    if ranks % ranks_per_node and ranks > ranks_per_node:
        raise ValueError(f"plan: {ranks} ranks do not fill nodes of {ranks_per_node}")
    ranks_per_node = min(ranks_per_node, ranks)
    check_grid_choices(ranks, global_batch, **{k: choices.get(k) for k in ("tp_sizes", "pp_sizes", "dp_sizes",
                                                                            "micro_batches")})
    out, candidates = [], []
    for layout, why in enumerate_layouts(ranks, global_batch, ranks_per_node, shape.layers,
                                         (shape.heads, shape.num_kv_heads),
                                         max_micro_batch=max_micro_batch, **choices):
        layout = _with_precision(layout, precision or {})
        if why:
            out.append(Estimate(layout, reason=why))
            continue
        quick = estimate_structure(shape, layout, ranks_per_node)
        if quick:
            out.append(Estimate(layout, reason=quick))
        else:
            candidates.append((lower_bound(shape, layout, profile, ranks_per_node), layout))
    candidates.sort(key=lambda c: c[0])
    steps: List[float] = []   # the feasible step times found so far, sorted
    for bound, layout in candidates:
        if len(steps) >= keep and bound > steps[keep - 1]:
            out.append(Estimate(layout, reason=f"not ranked: its step is at least {bound:.4g} s, slower than the "
                                               f"{keep} best layouts"))
            continue
        memory = _memory(shape, layout)
        if _does_not_fit(memory, profile):
            out.append(Estimate(layout, memory=memory, reason=_does_not_fit(memory, profile)))
            continue
        est = estimate(shape, layout, profile, ranks_per_node)
        out.append(est)
        if est.feasible:
            steps.append(est.time["step"])
            steps.sort()
    feasible = sorted((e for e in out if e.feasible), key=lambda e: (e.time["step"], e.memory["total"]))
    return feasible + [e for e in out if not e.feasible]


def estimate_structure(shape: ModelShape, layout: Layout, ranks_per_node: int) -> str:
    """Return why ``layout`` cannot run on this model and node size ("" if it can), before any estimate."""
    if layout.sequence_parallel and shape.seq % layout.tp:
        return f"sequence parallel: seq {shape.seq} does not split over tp={layout.tp}"
    if shape.heads % layout.tp:
        return f"{shape.heads} heads do not split over tp={layout.tp}"
    if shape.num_kv_heads % layout.tp:
        return f"{shape.num_kv_heads} k/v heads do not split over tp={layout.tp}"
    if shape.mlp == "swiglu" and shape.ffn_size % layout.tp:
        return f"a SwiGLU MLP's {shape.ffn_size} hidden units do not split over tp={layout.tp}"
    if layout.tp > ranks_per_node:
        return f"tp={layout.tp} spans nodes ({ranks_per_node} ranks per node)"
    return ""
