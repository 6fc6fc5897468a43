"""The public shard layout: where each parameter of a unit lies in the flat parameter and in this rank's shard.

Glossary:
- flat parameter: a unit's own parameters concatenated in ``named_parameters()`` order into one 1-D array,
  zero-padded to ``shard_numel * num_shards`` elements.
- shard: this rank's chunk ``[shard_index * shard_numel, (shard_index + 1) * shard_numel)`` of the flat parameter,
  held as one ``Parameter`` (the one the optimizer sees). Under hybrid sharding ``num_replicas`` ranks (one per
  shard group) hold equal copies of each chunk; ``replica_index`` tells them apart.
- piece: the part of one parameter that falls into this rank's shard: ``count`` elements starting at element
  ``start`` of the flattened parameter and at element ``offset`` of the shard.

Other tools read shards through this layout (``FSDP.shard_layout()``) or through the ``Wrapper`` interface built
from it (``FSDP.placed_parameters()``: a ``FlatShard`` per piece; checkpoints read that), never through FSDP's
internals.
"""

from dataclasses import dataclass

__all__ = ["ParamSpan", "ShardPiece", "UnitShard"]


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's place in its unit's flat parameter."""

    name: str      # the parameter's name in the wrapped module's ``named_parameters()``
    shape: tuple
    offset: int    # first element in the flat parameter
    numel: int


@dataclass(frozen=True)
class ShardPiece:
    """The elements of one parameter held by this rank's shard."""

    name: str
    shape: tuple   # the full parameter's shape
    start: int     # first element, in the flattened full parameter
    offset: int    # where it lies in the shard
    count: int


@dataclass(frozen=True, eq=False)
class UnitShard:
    """One unit's flat layout and this rank's shard of it."""

    label: str
    params: tuple       # ParamSpan per parameter the unit owns, in flat order
    numel: int          # unpadded flat size
    shard_numel: int    # elements per shard: ceil(numel / num_shards)
    num_shards: int     # ranks per shard group: the world size, shard_size (hybrid), or 1 for NO_SHARD
    shard_index: int    # which chunk this rank holds (0 when num_shards is 1)
    parameter: object   # the shard Parameter (``parameter.data`` has shard_numel elements)
    num_replicas: int = 1   # ranks holding a copy of this chunk (hybrid: the shard groups; NO_SHARD: the world)
    replica_index: int = 0  # which copy this rank holds

    @property
    def shard_start(self):
        """First element of this rank's shard in the flat parameter."""
        return self.shard_index * self.shard_numel

    def pieces(self):
        """Return the ``ShardPiece`` of every parameter that overlaps this rank's shard, in flat order."""
        lo_shard, hi_shard = self.shard_start, self.shard_start + self.shard_numel
        out = []
        for span in self.params:
            lo, hi = max(span.offset, lo_shard), min(span.offset + span.numel, hi_shard)
            if lo < hi:
                out.append(ShardPiece(span.name, span.shape, lo - span.offset, lo - lo_shard, hi - lo))
        return tuple(out)
