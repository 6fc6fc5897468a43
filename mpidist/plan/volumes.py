"""Communication per step, per rank: every collective and message a layout's real wrappers issue, with its bytes.

Glossary:
- call: one collective or point-to-point call as ``mpidist.collectives`` sees it: the group it runs over
  (``tp``, ``pp``, ``dp``, ``dp_shard``, ``dp_replicate``, ``tied``, ``zero``), the operation (``allreduce``,
  ``allgather``, ``reduce_scatter``, ``send``, ``recv``) and ``nbytes``: the bytes of the array this rank passes
  in (an allgather's own part, a reduce-scatter's whole input), which is what the guard and ``mpidist.trace``
  record. Wire bytes follow from the algorithm (see ``estimate.py``).
- position: a rank's pipeline stage index (0 .. pp-1); ranks at one position make the same calls.

What each wrapper issues (the wrappers' own rules; tests/test_plan_exact.py runs the wrappers on counting
communicators and asserts these lists EQUAL what they did):
- tensor parallel (``mpidist.parallel.tensor``): per micro-batch and block, Megatron's f/g pairs; with sequence
  parallelism an allgather + reduce-scatter pair instead of each allreduce, one more allgather in backward per
  column-parallel input (its shard gathered again for the weight's gradient: ``gather_sequence_linear``), and
  one allreduce per replicated parameter read through ``copy_to_tp`` in backward; the vocabulary-parallel loss
  adds two per-token allreduces.
- DDP: one allreduce per gradient bucket per step (buckets cut as ``DDP._build_buckets`` cuts them: reverse
  parameter order, 1 MiB first, then 25 MiB), the step stamp riding in the last bucket where its dtype holds the
  sums exactly (else, and under a hook, an allreduce of its own); a hook reduces each bucket its way (the 16-bit
  ring's point-to-point steps; PowerSGD's rest, P and Q). The 16-bit hooks' default ``algorithm="auto"``
  (``collectives_hier.HierarchicalAllreduce16``) goes node-aware when dp spans several nodes of which some hold
  several of its ranks: ``dp_node`` messages to and from the node's leader (intra-node), the 16-bit ring among
  the leaders over ``dp_leaders`` (inter-node).
- dtypes (``Dtypes``): what a layout's precision fields make of each array; bytes are counted in them.
- FSDP: an allgather of every unit's shard before its forward and again before its backward (FULL_SHARD frees
  after forward), a unit using a tied weight gathering the owner unit too; one reduce-scatter per unit per step.
- ZeroRedundancyOptimizer (``zero1``): after the optimizer step, the rank's parameters (one bucket: one dtype, one
  group) allgathered over ``zero`` (the dp group) in chunks of at most ``parallel.zero.CHUNK_BYTES`` per rank,
  ``sum(ceil(numel / dp))`` over the parameters per rank in all (``parallel.zero.shard_width``,
  ``allgather_calls``), the first with one status element more, on top of DDP's calls.
- Pipeline: per micro-batch one send and one receive of the activation (forward) and its gradient (backward)
  between neighbouring stages; DDP per chunk over dp; the tied embedding's gradient summed over its holders.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from mpidist import wire
from mpidist.nn.precision import as_dtype, bfloat16, is_low_precision
from mpidist.parallel.agreement import StepStamp
from mpidist.parallel.zero import allgather_calls as zero_allgather_calls, shard_width as zero_shard_width

from .layouts import Layout
from .model import ModelShape, parameters, stage_layers

__all__ = ["Call", "Dtypes", "dtypes", "calls_per_rank", "summarize", "ddp_buckets", "bucket_params", "fsdp_units",
           "summed_itemsize"]

_MB = 1024 * 1024
_MANIFEST_BYTES = 8                    # the pipeline's per-message manifest: one int64 per array
_STAMP_BYTES = StepStamp.SLOTS * 8     # FSDP's step stamp: float64 slots, one allreduce per forward and backward


@dataclass(frozen=True)
class Call:
    """One collective or message: its group, operation, input bytes, and how often a step issues it."""

    group: str
    op: str
    nbytes: int
    count: int = 1


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of one layout's arrays (``Layout``'s precision fields resolved against the model's dtype)."""

    param: np.dtype    # parameters, their gradients, DDP's buckets, FSDP's shards
    act: np.dtype      # activations between blocks (tensor-parallel calls, pipeline messages, the loss)
    gather: np.dtype   # FSDP's gathered units
    reduce: np.dtype   # FSDP's unsharded gradients and their reduce-scatter

    @property
    def masters(self) -> bool:
        """Whether AdamW keeps float32 master weights (16-bit parameters)."""
        return is_low_precision(self.param)

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's state per parameter: exp_avg and exp_avg_sq (float32 with masters, which add a third)."""
        return 12 if self.masters else 2 * self.param.itemsize


def _dtype(name: str, what: str) -> np.dtype:
    if name in ("float16", "fp16", "bfloat16", "bf16", "float32", "fp32"):
        return as_dtype(name, f"plan: {what}")
    try:
        found = np.dtype(name)
    except TypeError:
        found = None
    if found is None or found.kind != "f":
        raise ValueError(f"plan: {what} must be a floating dtype: float16, bfloat16, float32, float64 (got {name!r})")
    return found


def dtypes(shape: ModelShape, layout: Layout) -> Dtypes:
    """Return ``layout``'s dtypes: a Policy's param and compute dtypes, else FSDP's gather dtype for the
    activations (its units compute in it), else the model's.

    One exception, measured on the real graph (test_fsdp_gathered_in_16_bit_keeps_activations_in_its_ops_dtype):
    FSDP gathering bfloat16 without a Policy computes in float32, because numpy's bfloat16 matmul (ml_dtypes)
    returns float32 and nothing rounds it back, while float16's stays float16."""
    param = _dtype(layout.param_dtype or shape.dtype, "param_dtype")
    gather = _dtype(layout.gather_dtype, "gather_dtype") if layout.gather_dtype and layout.fsdp else param
    if layout.compute_dtype:
        act = _dtype(layout.compute_dtype, "compute_dtype")
    elif gather == np.dtype(bfloat16) and not layout.param_dtype:
        act = np.dtype(np.float32)
    else:
        act = gather
    reduce = _dtype(layout.reduce_dtype, "reduce_dtype") if layout.reduce_dtype and layout.fsdp else param
    return Dtypes(param, act, gather, reduce)


def summed_itemsize(dtype: np.dtype) -> int:
    """Bytes per element the collectives are handed to sum ``dtype``: its own, where ``mpidist.wire`` reduces it
    (16-bit floats accumulate in float32 inside the collective); else float32, which the callers widen to."""
    return dtype.itemsize if dtype in wire.SUPPORTED_DTYPES else 4



def bucket_params(params, itemsize, bucket_cap_mb=25, first_bucket_mb=1) -> List[list]:
    """Return DDP's buckets as lists of ``params`` (given in model order), cut as ``DDP._build_buckets`` cuts."""
    buckets, current, size, cap_first, cap = [], [], 0, first_bucket_mb * _MB, bucket_cap_mb * _MB
    for p in reversed(params):
        nbytes = p.numel * itemsize
        limit = cap_first if not buckets else cap
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _stamp_in_bucket(dtype, dp, hook: str) -> bool:
    """Whether DDP's step stamp rides in its last bucket (else: an allreduce of its own, 8 int64)."""
    return hook == "none" and StepStamp.modulus(dtype, dp) is not None


def ddp_buckets(params, dtype, dp, hook="none", bucket_cap_mb=25, first_bucket_mb=1) -> List[int]:
    """Return DDP's bucket sizes in bytes (what it allocates) for ``params`` (in model order) of ``dtype``."""
    dtype = np.dtype(dtype)
    buckets = [sum(p.numel for p in b) * dtype.itemsize
               for b in bucket_params(params, dtype.itemsize, bucket_cap_mb, first_bucket_mb)]
    if buckets and _stamp_in_bucket(dtype, dp, hook):
        buckets[-1] += StepStamp.SLOTS * dtype.itemsize
    return buckets


def _ring_16(group: str, numel: int, n: int, gather: bool) -> List[Call]:
    """The 16-bit ring of ``mpidist.ring16`` over ``n`` ranks on ``numel`` elements: n - 1 steps, each one send and
    one receive of a ``ceil(numel / n)``-element chunk (the reduce-scatter), and (``gather``) n - 1 more that
    forward the finished chunks (the allgather)."""
    chunk, steps = -(-numel // n) * 2, (n - 1) * (2 if gather else 1)
    return [Call(group, "send", chunk, steps), Call(group, "recv", chunk, steps)]


def _dp_per_node(layout: Layout, ranks_per_node: int, position: int) -> List[int]:
    """Return how many ranks of a position's dp group each node it spans holds, in node order (block placement,
    mesh order dp, pp, tp: dp's ranks ``pp * tp`` apart; the group of tensor-parallel rank 0)."""
    stride, first = layout.pp * layout.tp, position * layout.tp
    nodes = Counter((first + i * stride) // ranks_per_node for i in range(layout.dp))
    return [nodes[k] for k in sorted(nodes)]


def _hier_16(numel: int, per_node: List[int], node_rank: int) -> List[Call]:
    """``HierarchicalAllreduce16``'s messages of one ``numel``-element 16-bit sum on a rank of the first node: a
    non-leader (``node_rank`` > 0) sends its array to the leader and receives the result; the leader receives the
    node's other arrays, runs the 16-bit ring among the node leaders, and sends the result to each of them."""
    full = numel * 2
    if node_rank:
        return [Call("dp_node", "send", full), Call("dp_node", "recv", full)]
    others = per_node[0] - 1
    return ([Call("dp_node", "recv", full, others), Call("dp_node", "send", full, others)]
            + _ring_16("dp_leaders", numel, len(per_node), gather=True))


def _powersgd(bucket, rank: int, min_rate: float = 2.0) -> List[Call]:
    """PowerSGD's allreduces of one bucket after its warm-up (``comm_hooks.powerSGD_hook``): the uncompressed
    gradients in float32, then P and Q of the compressed matrices (rows x r and cols x r, float32)."""
    plain = ps = qs = 0
    for p in bucket:
        if len(p.shape) >= 2:
            rows, cols = p.shape[0], p.numel // p.shape[0]
            r = min(rank, rows, cols)
            if rows * cols >= min_rate * (rows + cols) * r:
                ps, qs = ps + rows * r, qs + cols * r
                continue
        plain += p.numel
    out = [Call("dp", "allreduce", plain * 4)]
    return out + ([Call("dp", "allreduce", ps * 4), Call("dp", "allreduce", qs * 4)] if ps else [])


def _ddp_calls(params, dt: Dtypes, layout: Layout, per_node: List[int], node_rank: int) -> List[Call]:
    """DDP's calls of one synchronization over ``params`` (model order): one per bucket, as its hook reduces it
    (``per_node``: dp's ranks on each node it spans; ``node_rank``: this rank's index among them on its node)."""
    dp, hook = layout.dp, layout.comm_hook
    buckets = bucket_params(params, dt.param.itemsize)
    node_aware = 1 < len(per_node) < dp   # the 16-bit hooks' "auto": HierarchicalAllreduce16's own rule
    out = []
    for k, b in enumerate(buckets):
        numel = sum(p.numel for p in b)
        if hook in ("fp16", "bf16"):
            out += _hier_16(numel, per_node, node_rank) if node_aware else _ring_16("dp", numel, dp, gather=True)
        elif hook == "powersgd":
            out += _powersgd(b, layout.powersgd_rank)
        else:
            stamp = StepStamp.SLOTS if k == len(buckets) - 1 and _stamp_in_bucket(dt.param, dp, hook) else 0
            out.append(Call("dp", "allreduce", (numel + stamp) * summed_itemsize(dt.param)))
    if buckets and not _stamp_in_bucket(dt.param, dp, hook):
        out.append(Call("dp", "allreduce", _STAMP_BYTES))   # the step stamp's own message
    return out


def fsdp_units(shape: ModelShape, tp: int, shards: int) -> List[dict]:
    """Return each FSDP unit (one per layer, ``GPT.fsdp_units()``): label, numel, shard_numel, units it uses."""
    units = []
    for layer in ["embed"] + [f"blocks.{i}" for i in range(shape.layers)] + ["head"]:
        numel = sum(p.numel for p in parameters(shape, layer, tp))
        uses = ("embed",) if layer == "head" and shape.tie_weights else ()
        units.append({"label": layer, "numel": numel, "shard_numel": -(-numel // shards), "uses": uses})
    return units


def _tp_calls(shape: ModelShape, layout: Layout, layers: List[str], dt: Dtypes) -> List[Call]:
    """Tensor-parallel calls of one micro-batch's forward and backward through ``layers``.

    Activations are in ``dt.act``, except the embedding's output (its lookup of the parameters as computed,
    ``dt.gather``, reduced inside the embedding before a Policy casts it). Under sequence parallelism the
    replicated parameters' gradients are summed in the dtype their op gives them: the norms' (fp32 ops, which
    cast their gradient back) in the parameters', the biases' (added to the matmuls' outputs) and the position
    table's (added to the embedding's) in the wider of the two; the gathers of a norm's output carry the activation
    dtype, the matmuls' outputs float32 where the activations are bfloat16 (see below)."""
    tp, b, t, d = layout.tp, layout.micro_batch, shape.seq, shape.hidden
    if tp == 1:
        return []
    # Inside a block the calls carry the matmuls' outputs, before a Policy casts the module's output: numpy
    # multiplies bfloat16 into float32 (ml_dtypes accumulates in float32), so bfloat16 activations travel as float32.
    act = np.dtype(np.float32) if dt.act == bfloat16 else dt.act
    e, ep = act.itemsize, summed_itemsize(dt.gather)
    full, part = b * t * d * e, b * (t // tp) * d * e
    normed = b * (t // tp) * d * dt.act.itemsize   # a norm's output (an fp32 op rounding back to the activation)
    added = act if act.itemsize >= dt.gather.itemsize else dt.gather
    table = dt.act if dt.act.itemsize >= dt.gather.itemsize else dt.gather
    norm_grad, added_grad = summed_itemsize(dt.gather), summed_itemsize(added)
    sp = layout.sequence_parallel
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    passes = 2 if layout.recompute == "full" else 1   # a recomputed block runs its forward again in backward
    out = []
    norms = 4 if shape.norm_bias else 2              # ln1, ln2 weights (and LayerNorm biases)
    if sp:   # the column inputs (qkv's, fc's) gathered in forward and again in backward, for the weights' gradients
        out += [Call("tp", "allgather", normed, 2 * blocks * (passes + 1)),
                Call("tp", "reduce_scatter", full, 2 * blocks * passes),
                Call("tp", "reduce_scatter", full, 2 * blocks), Call("tp", "allgather", part, 2 * blocks),
                Call("tp", "allreduce", d * norm_grad, norms * blocks)]
        if shape.bias:   # the row-parallel projections' biases
            out.append(Call("tp", "allreduce", d * added_grad, 2 * blocks))
    else:
        out += [Call("tp", "allreduce", full, 2 * blocks * passes), Call("tp", "allreduce", full, 2 * blocks)]
    if "embed" in layers:
        if sp:
            out += [Call("tp", "reduce_scatter", b * t * d * dt.gather.itemsize),
                    Call("tp", "allgather", b * (t // tp) * d * dt.gather.itemsize)]   # scatter_sequence's backward
            if shape.positions == "learned":   # the position table via copy_to_tp
                out.append(Call("tp", "allreduce", t * d * summed_itemsize(table)))
        else:
            out.append(Call("tp", "allreduce", b * t * d * ep))
    if "head" in layers:
        if sp:
            out += [Call("tp", "allreduce", d * norm_grad, 2 if shape.norm_bias else 1),
                    Call("tp", "allgather", normed, 2), Call("tp", "reduce_scatter", full)]
        else:
            out.append(Call("tp", "allreduce", full))
        loss = 4 if is_low_precision(dt.act) else e   # the vocabulary-parallel loss is an fp32 op
        out += [Call("tp", "allreduce", b * t * loss), Call("tp", "allreduce", 2 * b * t * loss)]
    return out


def calls_per_rank(shape: ModelShape, layout: Layout, position: int = 0, ranks_per_node: int = 0,
                   node_rank: int = 0) -> List[Call]:
    """Return every call a rank at pipeline ``position`` makes in one training step of ``layout``.

    ``ranks_per_node``: the node size (0: one node holds every rank); ``node_rank``: the rank's index among its dp
    group's ranks on its node (0: the leader, whose calls the node-aware 16-bit hooks make longest)."""
    dt = dtypes(shape, layout)
    m = layout.num_micro
    pp, v = layout.pp, layout.chunks
    stages = stage_layers(shape, pp * v)
    mine = [s for s in range(pp * v) if s % pp == position]
    out = []
    for s in mine:
        for c in _tp_calls(shape, layout, stages[s], dt):
            out.append(Call(c.group, c.op, c.nbytes, c.count * m))
    if pp > 1:
        t_local = shape.seq // layout.tp if layout.sequence_parallel else shape.seq
        act = layout.micro_batch * t_local * shape.hidden * dt.act.itemsize
        # Each message is a manifest (one int64 per array: a GPT stage passes one) and then the array.
        manifest = _MANIFEST_BYTES
        for s in mine:
            for neighbour in ([s + 1] if s < pp * v - 1 else []) + ([s - 1] if s > 0 else []):
                if neighbour % pp != position:   # out: activation (or gradient); in: its gradient (activation)
                    out += [Call("pp", "send", act, m), Call("pp", "send", manifest, m),
                            Call("pp", "recv", act, m), Call("pp", "recv", manifest, m)]
        tied = shape.tie_weights and (0 in mine or pp * v - 1 in mine)
        if tied:
            vocab = parameters(shape, "embed", layout.tp)[0]
            out.append(Call("tied", "allreduce", vocab.numel * summed_itemsize(dt.param)))
        if layout.dp > 1 and pp * v - 1 in mine:
            out.append(Call("dp", "allreduce", 8))   # the replicas' mean loss (one float64)
    if layout.dp > 1:
        if layout.fsdp:
            out += _fsdp_calls(shape, layout, dt)
        else:
            per_node = _dp_per_node(layout, ranks_per_node or layout.ranks, position)
            for s in mine:
                out += _ddp_calls([p for layer in stages[s] for p in parameters(
                    shape, layer, layout.tp, own_head_weight=layer == "head" and pp * v > 1)], dt, layout,
                    per_node, node_rank)
        if layout.sharding == "zero1":   # ZeroRedundancyOptimizer: the new values, chunk by chunk, after the step
            sizes = [p.numel for s in mine for layer in stages[s] for p in parameters(
                shape, layer, layout.tp, own_head_weight=layer == "head" and pp * v > 1)]
            for k, count in enumerate(zero_allgather_calls(zero_shard_width(sizes, layout.dp), dt.param.itemsize)):
                # (the first carries each rank's status element too)
                out.append(Call("zero", "allgather", (count + (k == 0)) * dt.param.itemsize))
    return _merge(out)


def _fsdp_calls(shape: ModelShape, layout: Layout, dt: Dtypes) -> List[Call]:
    """FSDP's calls: units gathered in ``dt.gather``; gradients reduce-scattered in ``dt.reduce`` (16-bit: the
    ``ring16`` ring, point to point), then averaged over the replicas in the shards' dtype."""
    m = layout.num_micro
    shards = layout.dp if layout.sharding == "fsdp" else layout.shard_group
    group = "dp_shard" if layout.sharding == "hybrid" else "dp"
    units = fsdp_units(shape, layout.tp, shards)
    by_label = {u["label"]: u for u in units}
    out = []
    for u in units:   # each unit gathers itself and the units whose (tied) weights it uses, forward and backward
        for label in (u["label"],) + u["uses"]:
            out.append(Call(group, "allgather", by_label[label]["shard_numel"] * dt.gather.itemsize, 2 * m))
        if dt.reduce.itemsize == 2:
            out += _ring_16(group, u["shard_numel"] * shards, shards, gather=False)
        else:
            out.append(Call(group, "reduce_scatter", u["shard_numel"] * shards * dt.reduce.itemsize))
        if layout.sharding == "hybrid":
            out.append(Call("dp_replicate", "allreduce", u["shard_numel"] * summed_itemsize(dt.param)))
    out.append(Call("dp", "allreduce", _STAMP_BYTES, 2 * m))
    return out


def _merge(calls: List[Call]) -> List[Call]:
    counts: Dict[tuple, int] = Counter()
    for c in calls:
        counts[(c.group, c.op, c.nbytes)] += c.count
    return [Call(g, op, n, k) for (g, op, n), k in sorted(counts.items()) if k]


def summarize(calls: List[Call]) -> Dict[str, Dict[str, int]]:
    """Return {group: {"bytes": input bytes per step, "messages": calls per step}}."""
    out: Dict[str, Dict[str, int]] = {}
    for c in calls:
        g = out.setdefault(c.group, {"bytes": 0, "messages": 0})
        g["bytes"] += c.nbytes * c.count
        g["messages"] += c.count
    return out
