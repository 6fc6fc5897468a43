"""Communication per step, per rank: every collective and message a layout's real wrappers issue, with its bytes.

Glossary:
- call: one collective or point-to-point call as ``mpidist.collectives`` sees it: the group it runs over
  (``tp``, ``pp``, ``dp``, ``dp_shard``, ``dp_replicate``, ``tied``), the operation (``allreduce``,
  ``allgather``, ``reduce_scatter``, ``send``, ``recv``) and ``nbytes``: the bytes of the array this rank passes
  in (an allgather's own part, a reduce-scatter's whole input), which is what the guard and ``mpidist.trace``
  record. Wire bytes follow from the algorithm (see ``estimate.py``).
- position: a rank's pipeline stage index (0 .. pp-1); ranks at one position make the same calls.

What each wrapper issues (the wrappers' own rules; tests/test_plan_exact.py runs the wrappers on counting
communicators and asserts these lists EQUAL what they did):
- tensor parallel (``mpidist.parallel.tensor``): per micro-batch and block, Megatron's f/g pairs; with sequence
  parallelism an allgather + reduce-scatter pair instead of each allreduce, and one allreduce per replicated
  parameter read through ``copy_to_tp`` in backward; the vocabulary-parallel loss adds two per-token allreduces.
- DDP: one allreduce per gradient bucket per step (buckets cut as ``DDP._build_buckets`` cuts them: reverse
  parameter order, 1 MiB first, then 25 MiB), the step stamp riding in the last bucket.
- FSDP: an allgather of every unit's shard before its forward and again before its backward (FULL_SHARD frees
  after forward), a unit using a tied weight gathering the owner unit too; one reduce-scatter per unit per step.
- Pipeline: per micro-batch one send and one receive of the activation (forward) and its gradient (backward)
  between neighbouring stages; DDP per chunk over dp; the tied embedding's gradient summed over its holders.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List

from mpidist.parallel.agreement import StepStamp

from .layouts import Layout
from .model import ModelShape, parameters, stage_layers

__all__ = ["Call", "calls_per_rank", "summarize", "ddp_buckets", "fsdp_units"]

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


def ddp_buckets(params, itemsize, dp, bucket_cap_mb=25, first_bucket_mb=1) -> List[int]:
    """Return DDP's bucket sizes in bytes for parameters ``params`` (in model order), as DDP cuts them."""
    buckets, size, cap_first, cap = [], 0, first_bucket_mb * _MB, bucket_cap_mb * _MB
    current = False
    for p in reversed(params):
        nbytes = p.numel * itemsize
        limit = cap_first if not buckets else cap
        if current and size + nbytes > limit:
            buckets.append(size)
            size, current = 0, False
        size += nbytes
        current = True
    if current:
        buckets.append(size)
    if buckets and StepStamp.modulus(_dtype_of(itemsize), dp) is not None:
        buckets[-1] += StepStamp.SLOTS * itemsize   # the step stamp rides in the last bucket
    return buckets


def _dtype_of(itemsize):
    return {2: "float16", 4: "float32", 8: "float64"}[itemsize]


def fsdp_units(shape: ModelShape, tp: int, shards: int) -> List[dict]:
    """Return each FSDP unit (one per layer, ``GPT.fsdp_units()``): label, numel, shard_numel, units it uses."""
    units = []
    for layer in ["embed"] + [f"blocks.{i}" for i in range(shape.layers)] + ["head"]:
        numel = sum(p.numel for p in parameters(shape, layer, tp))
        uses = ("embed",) if layer == "head" and shape.tie_weights else ()
        units.append({"label": layer, "numel": numel, "shard_numel": -(-numel // shards), "uses": uses})
    return units


def _tp_calls(shape: ModelShape, layout: Layout, layers: List[str]) -> List[Call]:
    """Tensor-parallel calls of one micro-batch's forward and backward through ``layers``."""
    tp, e, b, t, d = layout.tp, shape.itemsize, layout.micro_batch, shape.seq, shape.hidden
    if tp == 1:
        return []
    full, part = b * t * d * e, b * (t // tp) * d * e
    sp = layout.sequence_parallel
    blocks = sum(layer.startswith("blocks.") for layer in layers)
    passes = 2 if layout.recompute == "full" else 1   # a recomputed block runs its forward again in backward
    out = []
    replicated = 4 if shape.bias else 2              # ln1, ln2 weights (and biases); proj biases below
    if shape.bias:
        replicated += 2
    if sp:
        out += [Call("tp", "allgather", part, 2 * blocks * passes), Call("tp", "reduce_scatter", full, 2 * blocks * passes),
                Call("tp", "reduce_scatter", full, 2 * blocks), Call("tp", "allgather", part, 2 * blocks),
                Call("tp", "allreduce", d * e, replicated * blocks)]
    else:
        out += [Call("tp", "allreduce", full, 2 * blocks * passes), Call("tp", "allreduce", full, 2 * blocks)]
    if "embed" in layers:
        out.append(Call("tp", "reduce_scatter" if sp else "allreduce", full))
        if sp:
            out += [Call("tp", "allreduce", t * d * e),   # the position table read through copy_to_tp
                    Call("tp", "allgather", part)]           # scatter_sequence's backward
    if "head" in layers:
        if sp:
            out += [Call("tp", "allreduce", d * e, 2 if shape.bias else 1),
                    Call("tp", "allgather", part), Call("tp", "reduce_scatter", full)]
        else:
            out.append(Call("tp", "allreduce", full))
        out += [Call("tp", "allreduce", b * t * e), Call("tp", "allreduce", 2 * b * t * e)]   # vocab-parallel loss
    return out


def calls_per_rank(shape: ModelShape, layout: Layout, position: int = 0) -> List[Call]:
    """Return every call a rank at pipeline ``position`` makes in one training step of ``layout``."""
    e, m = shape.itemsize, layout.num_micro
    pp, v = layout.pp, layout.chunks
    stages = stage_layers(shape, pp * v)
    mine = [s for s in range(pp * v) if s % pp == position]
    out = []
    for s in mine:
        for c in _tp_calls(shape, layout, stages[s]):
            out.append(Call(c.group, c.op, c.nbytes, c.count * m))
    if pp > 1:
        t_local = shape.seq // layout.tp if layout.sequence_parallel else shape.seq
        act = layout.micro_batch * t_local * shape.hidden * e
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
            out.append(Call("tied", "allreduce", vocab.numel * e))
        if layout.dp > 1 and pp * v - 1 in mine:
            out.append(Call("dp", "allreduce", 8))   # the replicas' mean loss (one float64)
    if layout.dp > 1:
        if layout.fsdp:
            out += _fsdp_calls(shape, layout)
        else:
            for s in mine:
                params = [p for layer in stages[s] for p in parameters(
                    shape, layer, layout.tp, own_head_weight=layer == "head" and pp * v > 1)]
                out += [Call("dp", "allreduce", nbytes) for nbytes in ddp_buckets(params, e, layout.dp)]
    return _merge(out)


def _fsdp_calls(shape: ModelShape, layout: Layout) -> List[Call]:
    e, m = shape.itemsize, layout.num_micro
    shards = layout.dp if layout.sharding == "fsdp" else layout.shard_group
    units = fsdp_units(shape, layout.tp, shards)
    by_label = {u["label"]: u for u in units}
    out = []
    for u in units:   # each unit gathers itself and the units whose (tied) weights it uses
        for label in (u["label"],) + u["uses"]:
            out.append(Call("dp_shard" if layout.sharding == "hybrid" else "dp", "allgather",
                            by_label[label]["shard_numel"] * e, m))
        out.append(Call("dp_shard" if layout.sharding == "hybrid" else "dp", "reduce_scatter",
                        u["shard_numel"] * shards * e))
        if layout.sharding == "hybrid":
            out.append(Call("dp_replicate", "allreduce", u["shard_numel"] * e))
    out.append(Call("dp", "allreduce", _STAMP_BYTES, 2 * m))
    fwd_bwd = []
    for c in out:   # gathers happen in forward and in backward
        fwd_bwd.append(Call(c.group, c.op, c.nbytes, c.count * (2 if c.op == "allgather" else 1)))
    return fwd_bwd


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
