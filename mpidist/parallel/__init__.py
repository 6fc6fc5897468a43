"""Parallel training wrappers built on mpidist.collectives and mpidist.nn."""

from .ddp import DDP
from .fsdp import FSDP, ShardingStrategy

__all__ = ["DDP", "FSDP", "ShardingStrategy"]
