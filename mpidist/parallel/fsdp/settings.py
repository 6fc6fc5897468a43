"""FSDP's settings: what stays sharded, when backward prefetches, frozen in one dataclass."""

import enum
from dataclasses import dataclass

__all__ = ["ShardingStrategy", "BackwardPrefetch", "FSDPSettings"]


def _parse(cls, value, what):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.lower():
                return member
    valid = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"FSDP: unknown {what} {value!r} (expected a {cls.__name__} or one of {valid})")


class ShardingStrategy(enum.Enum):
    """What stays sharded between the uses of a unit."""

    FULL_SHARD = "full_shard"        # params, grads, optimizer state sharded; re-gather in backward
    SHARD_GRAD_OP = "shard_grad_op"  # as FULL_SHARD, but gathered params live from forward to backward
    NO_SHARD = "no_shard"            # like DDP: full params everywhere, mean-allreduce of gradients

    @classmethod
    def parse(cls, value):
        """Return the strategy named by ``value`` (a ShardingStrategy or its lowercase name)."""
        return _parse(cls, value, "strategy")


class BackwardPrefetch(enum.Enum):
    """When backward starts gathering the unit that runs next (the previous one in forward order)."""

    PRE = "pre"    # when this unit's backward starts: overlaps the gather with this unit's backward
                   # (peak: 2 gathered units + 1 unit of gradients)
    POST = "post"  # after this unit's gradients are reduced and freed (peak: 2 units in all)

    @classmethod
    def parse(cls, value):
        """Return the mode named by ``value`` (a BackwardPrefetch or "pre"/"post")."""
        if not isinstance(value, (cls, str)):
            raise ValueError(f"FSDP: backward_prefetch must be 'pre' or 'post' (got {value!r})")
        try:
            return _parse(cls, value, "backward_prefetch")
        except ValueError:
            raise ValueError(f"FSDP: backward_prefetch must be 'pre' or 'post' (got {value!r})") from None


@dataclass(frozen=True)
class FSDPSettings:
    """How an FSDP instance shards and communicates."""

    strategy: ShardingStrategy
    prefetch: bool
    world_size: int
    num_shards: int  # world_size, or 1 for NO_SHARD
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
