"""``mpidist.plan``: predict per-rank memory, communication and step time of every training layout before a run.

``plan(shape, global_batch, ranks, ranks_per_node, profile)`` ranks the layouts (dp x tp x pp, DDP/FSDP/hybrid,
micro-batches, schedule, recompute, sequence parallelism) of a GPT-shaped model; ``python -m mpidist plan`` is
its command line. Communication comes from the wrappers' own rules and is checked to be exactly what they do
(tests/test_plan_exact.py); see docs/planner.md for what is estimated and the measured validation.
"""
from .estimate import Estimate, estimate, memory_per_rank, plan
from .layouts import Layout, enumerate_layouts
from .model import ModelShape
from .profile import Profile, Tier, load_profile, profile_names
from .report import format_table, to_json
from .volumes import Call, calls_per_rank

__all__ = ["plan", "estimate", "Estimate", "memory_per_rank", "Layout", "enumerate_layouts", "ModelShape",
           "Profile", "Tier", "load_profile", "profile_names", "format_table", "to_json", "Call", "calls_per_rank"]
