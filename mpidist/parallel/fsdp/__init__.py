"""FSDP: fully sharded data parallel training over mpidist collectives, attached to models through hooks.

One module per concept: ``api`` (the FSDP wrapper and its hooks), ``lifecycle`` (a unit's gather/free and
gradient states), ``selection`` (which modules form units; who owns tied parameters), ``state_dict`` (full
and sharded state dicts), ``memory`` (byte accounting), ``layout`` (the public shard layout, from which
``FSDP.placed_parameters()`` is built), ``groups`` (which ranks shard and which replicate: hybrid sharding),
``settings`` (strategy enums and the frozen settings).
"""

from .api import FSDP, UnitInfo
from .groups import ShardGroups
from .layout import ParamSpan, ShardPiece, UnitShard
from .lifecycle import GradState, ParamState
from .settings import BackwardPrefetch, FSDPSettings, ShardingStrategy

__all__ = ["FSDP", "ShardingStrategy", "BackwardPrefetch", "FSDPSettings", "UnitInfo", "UnitShard", "ParamSpan",
           "ShardPiece", "ParamState", "GradState", "ShardGroups"]
