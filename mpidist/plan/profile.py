"""Hardware profiles: what the planner knows about a machine, kept as data (``mpidist/plan/profiles/*.json``).

Glossary:
- peak FLOP/s: per rank and dtype (``{"float32": ..., "float16": ...}``), from the vendor or measured.
- matmul efficiency curve: ``[[gemm_flops, efficiency], ...]`` sorted by size: the share of peak a GEMM of that
  many FLOPs reaches (interpolated in log size, clamped at the ends).
- tier: a class of link, ``intra`` (ranks of one node) or ``inter`` (between nodes), each with ``latency_s``
  (alpha), ``bandwidth`` (bytes/s of one link, beta = 1 / bandwidth), ``efficiency`` (share of it the
  collectives reach) and ``ranks_per_link`` (ranks of a node sharing one link: 1 with a NIC per GPU, the ranks
  per node with one NIC per node).
- fitted knobs: at most two numbers per profile fitted on declared runs (listed under ``fit``); everything else
  comes from specifications or from ``mpidist plan --calibrate``. ``compute_scale`` is one: measured over
  modelled time of real one-rank training steps, multiplying compute and optimizer time (on a CPU it carries
  numpy autograd's per-op overhead and the share of a core the ranks really get). ``layer_overhead_s`` is the
  other (``--calibrate`` fits both on its declared runs): a fixed time per layer (embedding, block, head) and
  micro-batch for forward and backward, whatever the sizes: the Python and dispatch cost of the ops, which
  dominates small models on a CPU.
- micro-batch cost curve (``microbatch_cost``): ``[[activation_bytes, factor], ...]`` sorted by size, measured by
  ``--calibrate`` on one rank: the factor multiplies a micro-batch's arithmetic and memory time, keyed on the
  activation bytes one block of that micro-batch stores on a rank (interpolated in log size, clamped at the ends;
  empty: 1). On a CPU a sample costs more once a micro-batch's activations outgrow the caches, which the matmul
  curve (larger is cheaper) does not say.
- ``tp_replicated_s`` and ``sp_replicated_s`` (measured by ``--calibrate``; 0 in profiles built from
  specifications): seconds per element of (tokens x hidden) per block, forward and backward, that a
  tensor-parallel rank spends beyond what the compute model gives it, without and with sequence parallelism.
  The model already counts the norms' and dropouts' bytes whole on every rank, at memory bandwidth; what it
  misses on a CPU is their real cost there, each allreduce's input copy and the extra autograd nodes (the f/g
  ops) without sequence parallelism, and with it the whole-sequence arrays each gather and reduce-scatter
  forms and copies (backward gathers again): about as much. ``--calibrate`` times one rank of tp = 2 and 4
  stepping alone (``OneRankOfMany``: its group's collectives local, their own copying time taken out) beside
  its one-rank runs and fits each number to its runs' excess over the model; the planner charges it per block on
  ``tokens x hidden x (1 - 1/tp)`` elements.
- ``oversubscribed_tier``: the intra-node link as twice as many ranks as cores see it (``--calibrate`` times
  allreduces of several sizes between equal work, with ``2 x cores`` ranks): a transfer moves only while both
  partners hold a core, and a waiting rank busy-polls (MPICH) on its own share; used for the groups inside a node
  when ranks outnumber cores (absent: the intra tier). ``oversubscribed_groups`` (``{group size: tier}``, measured
  the same way on groups of that size, all stepping at once): the link as a group of that size sees it, used
  for calls over groups of that size in place of ``oversubscribed_tier``; every 2-rank group takes the pairs'
  link, the point-to-point ones (pipeline stages, the tied embedding's pair, the node-aware hooks) included. The
  ring formula fitted at 4 ranks gives a pair a third of the latency steps and two thirds of the bytes; what a
  pair costs under oversubscription is measured instead (two calibrations on this machine, 2026-11-28: 37% and
  75% of 4 ranks' at 8 bytes, 38% and 48% at 256 KiB).
- ``halving_doubling_allreduce``: the MPI library's allreduce is recursive halving (reduce-scatter) then
  recursive doubling (allgather), as MPICH's is above 2 KiB: over a group with several ranks on each of several
  nodes (block placement) the steps between nodes come last in the halving, at the smallest pieces, so a node's
  link carries what a ring among one rank per node would (``calibrate --inter`` records whether the library is
  MPICH); false: one ring over all the group's ranks (NCCL's), 1.5 times those bytes at 2 ranks on each of 2 nodes.
- ``multi_rail``: the collective library spreads a group's ring over the links of all its ranks on a node (NCCL
  builds several rings, channels, and routes each one's node crossing through another GPU's NIC), so a group with
  ``m`` ranks on a node crosses it at ``m / ranks_per_link`` links' bandwidth (at most the intra tier's); false:
  the group's ring crosses each node once, on one link (a ring among MPI processes).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["Profile", "Tier", "load_profile", "profile_names", "PROFILE_DIR"]

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def _interpolate(curve, x: float) -> float:
    """Return ``curve`` (``[[x, y], ...]``, increasing x) at ``x``: linear in log x, clamped at the ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return curve[-1][1]


@dataclass(frozen=True)
class Tier:
    """One class of link: alpha (seconds), bandwidth (bytes/s per rank), efficiency (share reached)."""

    latency_s: float
    bandwidth: float
    efficiency: float = 1.0
    ranks_per_link: int = 1   # ranks of a node sharing one such link (one NIC per node: the ranks per node)

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Profile:
    """A machine as the planner sees it (see the module notes); ``load_profile`` builds one from JSON."""

    name: str
    peak_flops: Dict[str, float]
    matmul_efficiency: Tuple[Tuple[float, float], ...]
    memory_bytes: float
    memory_bandwidth: float
    tiers: Dict[str, Tier]
    elementwise_factor: float = 3.0       # passes over the activation bytes per F+B, memory-bound work
    cores_per_node: Optional[int] = None  # CPU ranks beyond this share cores (compute slows by ranks / cores)
    compute_scale: float = 1.0            # fitted knob: measured / modelled time of real steps (overheads, load)
    source: str = ""
    fit: dict = field(default_factory=dict)
    layer_overhead_s: float = 0.0         # fitted knob: fixed seconds per layer per micro-batch (F+B; per-op cost)
    validated: dict = field(default_factory=dict)   # the range compared with measurements (see out_of_range)
    microbatch_cost: Tuple[Tuple[float, float], ...] = ()   # [[block activation bytes, factor]], measured
    oversubscribed_tier: Optional[Tier] = None   # measured: the intra link when ranks outnumber cores
    halving_doubling_allreduce: bool = False   # allreduce: recursive halving then doubling (MPICH), not a ring
    multi_rail: bool = False   # a group's collectives cross a node on all its ranks' links at once (NCCL)
    tp_replicated_s: float = 0.0   # measured: a TP rank's replicated work, seconds per token x hidden per block
    sp_replicated_s: float = 0.0   # measured: the same under sequence parallelism (its gathers' whole arrays)
    oversubscribed_groups: Tuple[Tuple[int, Tier], ...] = ()   # measured: ((group size, tier), ...) when oversubscribed

    def oversubscribed_link(self, group_size: int) -> Optional[Tier]:
        """Return the intra link as an oversubscribed group of ``group_size`` ranks sees it: the tier measured on
        groups of that size, else ``oversubscribed_tier`` (None when neither was measured)."""
        return dict(self.oversubscribed_groups).get(group_size, self.oversubscribed_tier)

    def efficiency(self, gemm_flops: float) -> float:
        """Return the share of peak a GEMM of ``gemm_flops`` FLOPs reaches (log-linear interpolation)."""
        return _interpolate(self.matmul_efficiency, gemm_flops)

    def microbatch_factor(self, block_bytes: float) -> float:
        """Return the factor on a micro-batch's compute time whose blocks each store ``block_bytes``."""
        return _interpolate(self.microbatch_cost, block_bytes) if self.microbatch_cost else 1.0

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"profile {self.name}: no peak FLOP/s for dtype {dtype!r} (has {sorted(self.peak_flops)})")
        return self.peak_flops[dtype]

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "peak_flops": dict(self.peak_flops),
                "matmul_efficiency": [list(p) for p in self.matmul_efficiency], "memory_bytes": self.memory_bytes,
                "memory_bandwidth": self.memory_bandwidth, "elementwise_factor": self.elementwise_factor,
                "compute_scale": self.compute_scale, "layer_overhead_s": self.layer_overhead_s,
                "cores_per_node": self.cores_per_node,
                "tiers": {k: {"latency_s": t.latency_s, "bandwidth": t.bandwidth, "efficiency": t.efficiency,
                              "ranks_per_link": t.ranks_per_link}
                          for k, t in self.tiers.items()}, "fit": self.fit, "validated": self.validated,
                "microbatch_cost": [list(p) for p in self.microbatch_cost],
                "oversubscribed_tier": None if self.oversubscribed_tier is None else _measured_dict(
                    self.oversubscribed_tier),
                "halving_doubling_allreduce": self.halving_doubling_allreduce, "multi_rail": self.multi_rail,
                **{k: getattr(self, k) for k in ("tp_replicated_s", "sp_replicated_s") if getattr(self, k)},
                **({"oversubscribed_groups": {str(n): _measured_dict(t) for n, t in self.oversubscribed_groups}}
                   if self.oversubscribed_groups else {})}

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> "Profile":
        required = ("name", "peak_flops", "matmul_efficiency", "memory_bytes", "memory_bandwidth", "tiers")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{where}: missing keys {missing} (a profile needs {list(required)})")
        curve = tuple((float(x), float(y)) for x, y in data["matmul_efficiency"])
        if not curve or any(b[0] <= a[0] for a, b in zip(curve, curve[1:])) or not all(0 < y <= 1 for _, y in curve):
            raise ValueError(f"{where}: matmul_efficiency must be [[gemm_flops, efficiency in (0, 1]], ...] with "
                             f"increasing sizes (got {data['matmul_efficiency']!r:.200})")
        mb_cost = tuple((float(x), float(y)) for x, y in data.get("microbatch_cost") or ())
        if any(b[0] <= a[0] for a, b in zip(mb_cost, mb_cost[1:])) or not all(y > 0 for _, y in mb_cost):
            raise ValueError(f"{where}: microbatch_cost must be [[activation_bytes, factor > 0], ...] with "
                             f"increasing sizes (got {data['microbatch_cost']!r:.200})")
        over = data.get("oversubscribed_tier")
        if over is not None:
            over = _measured_tier(over, f"{where}: oversubscribed_tier")
        groups = data.get("oversubscribed_groups") or {}
        if not isinstance(groups, dict):
            raise ValueError(f"{where}: oversubscribed_groups must be {{group size: {{latency_s, bandwidth}}}} "
                             f"(got {groups!r:.200})")
        by_size = {}
        for size, tier in groups.items():
            text = str(size)
            if not (text.isdecimal() and text == str(int(text)) and int(text) >= 2):
                raise ValueError(f"{where}: oversubscribed_groups keys are group sizes >= 2 written as integers "
                                 f"(got {size!r})")
            if int(text) in by_size:
                raise ValueError(f"{where}: oversubscribed_groups has group size {int(text)} twice (keys "
                                 f"{sorted(map(str, groups))})")
            by_size[int(text)] = _measured_tier(tier, f"{where}: oversubscribed_groups[{size}]")
        tiers = {}
        for name in ("intra", "inter"):
            t = data["tiers"].get(name)
            if t is None:
                raise ValueError(f"{where}: tiers needs 'intra' and 'inter' (got {sorted(data['tiers'])})")
            tiers[name] = Tier(float(t["latency_s"]), float(t["bandwidth"]), float(t.get("efficiency", 1.0)),
                               int(t.get("ranks_per_link", 1)))
        known = set(required) | {"elementwise_factor", "cores_per_node", "compute_scale", "layer_overhead_s",
                                 "source", "fit", "validated", "description", "microbatch_cost",
                                 "oversubscribed_tier", "halving_doubling_allreduce", "multi_rail", "tp_replicated_s",
                                 "sp_replicated_s", "oversubscribed_groups"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
        halving, rails = data.get("halving_doubling_allreduce", False), data.get("multi_rail", False)
        for key, value in (("halving_doubling_allreduce", halving), ("multi_rail", rails)):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be true or false (got {value!r})")
        if halving and rails:
            raise ValueError(f"{where}: halving_doubling_allreduce (MPICH's allreduce) and multi_rail (NCCL's rings) "
                             f"describe two libraries: set one")
        replicated = []
        for key in ("tp_replicated_s", "sp_replicated_s"):
            value = data.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{where}: {key} must be a number of seconds >= 0 (got {value!r})")
            replicated.append(float(value))
        by_sharding = dict(data.get("validated") or {}).get("ranks_by_sharding", {})
        if not isinstance(by_sharding, dict) or not all(
                isinstance(v, (list, tuple)) and len(v) == 2 and 1 <= v[0] <= v[1] for v in by_sharding.values()):
            raise ValueError(f"{where}: validated.ranks_by_sharding must be {{sharding: [low, high]}} with "
                             f"1 <= low <= high (got {by_sharding!r})")
        return cls(data["name"], {k: float(v) for k, v in data["peak_flops"].items()}, curve,
                   float(data["memory_bytes"]), float(data["memory_bandwidth"]), tiers,
                   float(data.get("elementwise_factor", 3.0)), data.get("cores_per_node"),
                   float(data.get("compute_scale", 1.0)), data.get("source", ""), dict(data.get("fit", {})),
                   float(data.get("layer_overhead_s", 0.0)), dict(data.get("validated", {})), mb_cost, over,
                   halving, rails, *replicated, oversubscribed_groups=tuple(sorted(by_size.items())))

    def out_of_range(self, ranks: int, parameters: int, layout, shape=None) -> List[str]:
        """Return why a plan of ``layout`` (a ``Layout``) on ``ranks`` ranks of a ``parameters``-parameter model is
        outside what this profile was compared with (``validated``: ``[low, high]`` for ``ranks``, ``parameters``,
        ``tp``, ``pp``; the lists ``sharding``, ``recompute``, ``schedule`` of kinds seen, and of the model kinds
        ``mlp``, ``norm``, ``positions`` and ``attention`` ("mha", or "gqa" with fewer k/v heads) of ``shape``
        (a ``ModelShape``); ``ranks_by_sharding``: ``{kind: [low, high]}`` where a kind was compared on fewer ranks
        than the whole; ``source``); empty when inside. A profile without a range is unvalidated everywhere."""
        v = self.validated
        if not v:
            return [f"profile {self.name} was never compared with measured runs: the numbers are the model's"]
        out = []
        for key, value in (("ranks", ranks), ("parameters", parameters), ("tp", layout.tp), ("pp", layout.pp)):
            if key in v and not v[key][0] <= value <= v[key][1]:
                out.append(f"{key} {value:.4g} outside the validated {v[key][0]:.4g}..{v[key][1]:.4g}")
        for key in ("sharding", "recompute", "schedule"):
            if key in v and getattr(layout, key) not in v[key]:
                out.append(f"{key} {getattr(layout, key)!r} never validated (validated: {', '.join(v[key])})")
        if shape is not None:
            kinds = {"mlp": shape.mlp, "norm": shape.norm, "positions": shape.positions,
                     "attention": "gqa" if shape.num_kv_heads != shape.heads else "mha"}
            for key, kind in kinds.items():
                if key in v and kind not in v[key]:
                    out.append(f"{key} {kind!r} never validated (validated: {', '.join(v[key])})")
        low_high = v.get("ranks_by_sharding", {}).get(layout.sharding)   # a kind compared on fewer ranks only
        if low_high and not low_high[0] <= ranks <= low_high[1]:
            out.append(f"ranks {ranks} outside the validated {low_high[0]}..{low_high[1]} for {layout.sharding}")
        if out and v.get("source"):
            out.append(f"validated on: {v['source']}")
        return out


def _measured_dict(tier: Tier) -> dict:
    """Return a measured tier as its profile entry (``_measured_tier`` reads it back)."""
    return {"latency_s": tier.latency_s, "bandwidth": tier.bandwidth}


def _measured_tier(data, where: str) -> Tier:
    """Return the ``Tier`` of a measured ``{latency_s, bandwidth}`` (clear error on anything else)."""
    try:
        latency, bandwidth = float(data["latency_s"]), float(data["bandwidth"])
    except (TypeError, KeyError, ValueError):
        latency = bandwidth = float("nan")
    if not (latency >= 0 and bandwidth > 0):
        raise ValueError(f"{where} needs latency_s >= 0 and bandwidth > 0 (got {data!r:.200})")
    return Tier(latency, bandwidth)


def profile_names() -> List[str]:
    """Return the names of the profiles shipped with mpidist."""
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name (``h100-ib``) or any profile JSON file by path."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise ValueError(f"plan: no profile {name_or_path!r} (shipped: {profile_names()}; or give a JSON file path)")
    with open(path) as f:
        return Profile.from_dict(json.load(f), where=path)
