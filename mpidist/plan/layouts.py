"""Layouts the planner considers: (dp, tp, pp), data-parallel sharding, micro-batches, schedule, recompute.

Glossary:
- layout: one way to run a step: ``dp`` replicas of a ``pp``-stage pipeline of ``tp``-way tensor-parallel
  layers, over ``dp * pp * tp`` ranks arranged as ``mpidist.parallel.mesh(dp=, pp=, tp=)`` arranges them (tp
  innermost, so a TP group stays on a node when tp divides the ranks per node).
- sharding: how the data-parallel ranks hold the model: ``ddp`` (every replica whole; DDP), ``zero1`` (every
  replica's parameters and gradients whole, AdamW's state split over the dp ranks: ``ZeroRedundancyOptimizer``,
  also over a Pipeline's replicas), ``fsdp`` (FSDP
  FULL_SHARD over the dp ranks), ``hybrid`` (FSDP HYBRID_SHARD: shard within a node, replicate across nodes).
- micro-batch: ``micro_batch`` samples; each replica runs ``num_micro`` of them per step (a pipeline's
  micro-batches, or gradient accumulation under ``no_sync`` without one), so the global batch is
  ``dp * micro_batch * num_micro``.
- schedule: a name from ``mpidist.parallel.pipeline.schedules`` (``chunks`` stages per rank for the interleaved
  one); ``none`` without a pipeline.
- recompute: ``GPT.checkpoint_blocks(mode=)``: ``full`` keeps each block's input and runs the block again in
  backward; ``selective`` (Korthikanti et al.) keeps all but the attention probabilities, which backward
  recomputes from q and k.
- precision: ``param_dtype`` and ``compute_dtype`` are an ``nn.precision.Policy`` applied to the model before
  wrapping (16-bit parameters, gradients and DDP buckets; AdamW's float32 master weights and moments);
  ``comm_hook`` is DDP's ``register_comm_hook`` (``mpidist.parallel.comm_hooks``); ``gather_dtype`` and
  ``reduce_dtype`` are FSDP's own mixed precision (FSDP2's policy: shards kept as they are, units gathered and
  gradients reduce-scattered in those dtypes). Empty: the model's one dtype (``ModelShape.dtype``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, List, Tuple

__all__ = ["Layout", "SCHEDULES", "SHARDINGS", "COMM_HOOKS", "enumerate_layouts", "divisors", "check_grid_choices"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")   # the names Pipeline takes
SHARDINGS = ("ddp", "zero1", "fsdp", "hybrid")
RECOMPUTE = ("none", "selective", "full")   # GPT.checkpoint_blocks(mode=...)
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")   # DDP hooks (mpidist.parallel.comm_hooks)


@dataclass(frozen=True)
class Layout:
    """One layout of a training step (see the module notes)."""

    dp: int
    tp: int
    pp: int
    sharding: str = "ddp"
    micro_batch: int = 1
    num_micro: int = 1
    schedule: str = "none"
    chunks: int = 1
    recompute: str = "none"      # none; selective (each block's attention probabilities); full (whole blocks)
    sequence_parallel: bool = False
    shard_size: int = 0     # hybrid: ranks per shard group (0: all dp ranks)
    # Mixed precision (see the module notes); "" keeps the model's one dtype for everything.
    param_dtype: str = ""        # nn.precision.Policy: parameters stored in it (16-bit: AdamW keeps float32 masters)
    compute_dtype: str = ""      # the Policy's activation dtype ("": the parameters')
    comm_hook: str = "none"      # DDP's communication hook: none, fp16, bf16, powersgd
    gather_dtype: str = ""       # FSDP(param_dtype=): units gathered and computed in it, shards stay as they are
    reduce_dtype: str = ""       # FSDP(reduce_dtype=): gradients accumulated and reduce-scattered in it
    powersgd_rank: int = 1       # PowerSGD's matrix_approximation_rank (comm_hook="powersgd", after its warm-up)

    @property
    def shard_group(self) -> int:
        """Ranks one FSDP unit is sharded over (dp, or the shard group under hybrid)."""
        return self.shard_size if self.sharding == "hybrid" and self.shard_size else self.dp

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def fsdp(self) -> bool:
        return self.sharding in ("fsdp", "hybrid")

    def name(self) -> str:
        """Return a short label, e.g. ``dp4 tp2 pp2 fsdp mb2x8 1f1b rc`` (``rc-sel``: selective recompute)."""
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("sp" if self.sequence_parallel else ""), f"pp{self.pp}",
                 self.sharding, f"mb{self.micro_batch}x{self.num_micro}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"v{self.chunks}" if self.chunks > 1 else ""))
        if self.recompute != "none":
            parts.append("rc" if self.recompute == "full" else "rc-sel")
        if self.param_dtype or self.compute_dtype:
            parts.append(_short(self.param_dtype or "model") + ("/" + _short(self.compute_dtype)
                                                                 if self.compute_dtype else ""))
        if self.comm_hook != "none":
            parts.append(f"hook-{self.comm_hook}" + (f"{self.powersgd_rank}" if self.comm_hook == "powersgd" else ""))
        if self.gather_dtype or self.reduce_dtype:
            parts.append(f"mp-{_short(self.gather_dtype or 'shard')}/{_short(self.reduce_dtype or 'shard')}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        # every field is a scalar: a flat copy is asdict's, without its recursion (the planner calls it per layout)
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _short(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(ranks: int, global_batch: int, ranks_per_node: int, layers: int, heads,
                      schedules=SCHEDULES, shardings=SHARDINGS, recompute=RECOMPUTE,
                      max_micro_batch=None, chunk_options=(2,), tp_sizes=None, pp_sizes=None, dp_sizes=None,
                      micro_batches=None) -> Iterator[Tuple[Layout, str]]:
    """Yield (layout, reason) for every layout of ``ranks`` ranks and ``global_batch`` samples; reason is "" when
    the layout is structurally possible, else why not (checked here: divisibility only; memory comes later).
    ``heads``: the attention heads, or (heads, k/v heads) under grouped-query attention: tp must split both.
    ``tp_sizes``, ``pp_sizes``, ``dp_sizes``, ``micro_batches``: only these values (None: every one); a grid
    or micro-batch outside them is not yielded at all (``plan`` checks each value can occur)."""
    heads, kv_heads = heads if isinstance(heads, tuple) else (heads, heads)
    for tp in divisors(ranks):
        if tp_sizes is not None and tp not in tp_sizes:
            continue
        for pp in divisors(ranks // tp):
            dp = ranks // (tp * pp)
            if (pp_sizes is not None and pp not in pp_sizes) or (dp_sizes is not None and dp not in dp_sizes):
                continue
            why_grid = ""
            if heads % tp:
                why_grid = f"{heads} heads do not split over tp={tp}"
            elif kv_heads % tp:
                why_grid = f"{kv_heads} k/v heads do not split over tp={tp}"
            elif pp > layers:
                why_grid = f"pp={pp} stages for {layers} layers"
            elif global_batch % dp:
                why_grid = f"global batch {global_batch} does not split over dp={dp}"
            per_replica = global_batch // dp if not why_grid else 0
            sizes = divisors(per_replica) if per_replica else [1]
            if max_micro_batch is not None:
                sizes = [b for b in sizes if b <= max_micro_batch]
            if micro_batches is not None:
                sizes = [b for b in sizes if b in micro_batches] if per_replica else [min(micro_batches)]
            for sharding in shardings:
                why_shard = why_grid
                if not why_shard and sharding not in ("ddp", "zero1") and pp > 1:
                    why_shard = f"{sharding} with a pipeline (pp={pp}): mpidist's Pipeline takes DDP replicas"
                elif not why_shard and sharding != "ddp" and dp == 1:
                    why_shard = f"{sharding} needs dp > 1 (dp={dp})"
                elif not why_shard and sharding == "hybrid" and (ranks_per_node % tp or dp % max(
                        1, ranks_per_node // tp) or ranks_per_node // tp in (1, dp)):
                    why_shard = (f"hybrid shards within a node: {ranks_per_node} ranks per node / tp={tp} give no "
                                 f"proper shard group of dp={dp}")
                scheds = [("none", 1)] if pp == 1 else [(s, v) for s in schedules
                                                         for v in ((1,) if s != "interleaved" else chunk_options)]
                for schedule, v in scheds:
                    for b in sizes:
                        m = per_replica // b if per_replica else 1
                        why = why_shard
                        if not why and v > 1 and (layers < pp * v or m % pp):
                            why = (f"interleaved v={v} needs layers >= pp*v ({layers} < {pp * v})" if layers < pp * v
                                   else f"interleaved needs micro-batches divisible by pp ({m} % {pp})")
                        for rc in recompute:
                            for sp in ((False, True) if tp > 1 else (False,)):
                                shard = ranks_per_node // tp if sharding == "hybrid" and not why else 0
                                yield Layout(dp, tp, pp, sharding, b, m, schedule, v, rc, sp, shard), why


def check_grid_choices(ranks: int, global_batch: int, tp_sizes=None, pp_sizes=None, dp_sizes=None,
                       micro_batches=None) -> None:
    """Raise ValueError, with the values, when a requested tp, pp, dp or micro-batch size cannot occur in any
    layout of ``ranks`` ranks and ``global_batch`` samples, or when no (dp, tp, pp) grid takes all of them: a
    filter that silently matched nothing would read as "no layout fits"."""
    for name, values in (("tp", tp_sizes), ("pp", pp_sizes), ("dp", dp_sizes), ("micro-batch", micro_batches)):
        if values is None:
            continue
        if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
            raise ValueError(f"plan: {name} sizes must be ints >= 1 (got {values!r})")
        whole = ranks if name != "micro-batch" else global_batch
        what = f"{ranks} ranks" if name != "micro-batch" else f"the global batch of {global_batch}"
        bad = [v for v in values if whole % v]
        if bad:
            raise ValueError(f"plan: {name}={', '.join(map(str, bad))} does not divide {what}")
    grids = [(dp, tp, ranks // (dp * tp)) for tp in divisors(ranks) for dp in divisors(ranks // tp)
             if (tp_sizes is None or tp in tp_sizes) and (dp_sizes is None or dp in dp_sizes)
             and (pp_sizes is None or ranks // (dp * tp) in pp_sizes)]
    if not grids:
        def allowed(values):
            return "any" if values is None else "/".join(map(str, values))
        raise ValueError(f"plan: no dp x tp x pp = {ranks} ranks has tp {allowed(tp_sizes)}, pp {allowed(pp_sizes)} "
                         f"and dp {allowed(dp_sizes)}")
    if micro_batches is not None and not any(global_batch % dp == 0 and (global_batch // dp) % b == 0
                                             for dp, _, _ in grids for b in micro_batches):
        raise ValueError(f"plan: micro-batch {', '.join(map(str, micro_batches))} does not divide the per-replica "
                         f"batch (global batch {global_batch} / dp) of any allowed grid "
                         f"{', '.join(f'dp{d} tp{t} pp{p}' for d, t, p in grids)}")
