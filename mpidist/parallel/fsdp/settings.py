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
    """What stays sharded between the uses of a unit, and over which ranks.

    In ZeRO's terms (params P, grads G, optimizer state O; Rajbhandari et al. 2020): FULL_SHARD is ZeRO-3
    (P, G, O sharded), SHARD_GRAD_OP is ZeRO-2 (G, O sharded; P stay gathered from a unit's forward to its
    backward, sharded only between steps), NO_SHARD is DDP. The hybrid strategies do the same within shard
    groups of ``shard_size`` ranks and replicate across the groups (HSDP).
    """

    FULL_SHARD = "full_shard"        # params, grads, optimizer state sharded; re-gather in backward
    SHARD_GRAD_OP = "shard_grad_op"  # as FULL_SHARD, but gathered params live from forward to backward
    NO_SHARD = "no_shard"            # like DDP: full params everywhere, mean-allreduce of gradients
    HYBRID_SHARD = "hybrid_shard"    # FULL_SHARD within each shard group, replicas across groups
    HYBRID_SHARD_GRAD_OP = "hybrid_shard_grad_op"  # SHARD_GRAD_OP within each group (PyTorch's _HYBRID_SHARD_ZERO2)

    @classmethod
    def parse(cls, value):
        """Return the strategy named by ``value`` (a ShardingStrategy or its lowercase name)."""
        return _parse(cls, value, "strategy")

    @property
    def hybrid(self):
        """Shards within groups and replicates across them (needs a shard group size)."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_GRAD_OP)

    @property
    def keeps_params_for_backward(self):
        """A unit's gathered params stay from its training forward to its backward (ZeRO-2)."""
        return self in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_GRAD_OP)


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
    num_shards: int  # ranks per shard group: world_size, shard_size (hybrid), or 1 for NO_SHARD
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
    num_replicas: int = 1  # copies of each shard: world_size // num_shards
    # Mixed precision (FSDP2's MixedPrecisionPolicy): the shards stay in their dtype (float32 masters); None: as
    # the shard. param_dtype: what a unit is gathered and computes in; reduce_dtype: what gradients accumulate
    # and are reduce-scattered in (16-bit: a ring of 16-bit messages accumulating in float32, comm_hooks).
    param_dtype: object = None
    reduce_dtype: object = None
