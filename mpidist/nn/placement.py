"""Where a parameter's values live across ranks, written on the parameter itself (``param.placement``).

Tensor parallelism splits layers: a parameter is then either *sharded* (each rank of a communicator holds a
block of one global tensor along one dimension) or *replicated* (every rank of that communicator holds the
same values, e.g. a LayerNorm gain beside sharded matrices). Everything that looks at parameters across ranks
reads this instead of guessing from shapes:

- ``clip_grad_norm_`` adds a sharded gradient's square sum over its communicator and counts a replicated one
  once, not once per rank that holds it.
- data-parallel wrappers refuse a communicator that would average different shards with each other.
- checkpoints store each shard as an N-dimensional chunk of the global tensor (``Shard.chunk``), so a run can
  load into any other layout, or into a plain model.

A parameter without a placement is an ordinary one: whole on the rank that holds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

__all__ = ["Shard", "Replicate", "placement_of", "set_placement"]


@dataclass(frozen=True, eq=False)
class Shard:
    """This rank holds rows ``start .. start + local length`` along ``dim`` of a ``global_shape`` tensor.

    The local block may run past ``global_shape[dim]`` (padding so that the split is even, e.g. a vocabulary
    of 250 over 4 ranks): those rows belong to no global index, stay zero, and are left out of checkpoints.

    ``pieces``, when given, replaces the single block: ``((global_start, local_start, length), ...)`` along
    ``dim``, for a shard made of several runs of the global tensor (an attention's fused q/k/v projection
    split by heads holds its heads' rows of q, of k and of v). ``start`` is then the first piece's start.
    """

    dim: int
    comm: Any
    global_shape: Tuple[int, ...]
    start: int
    pieces: Optional[Tuple[Tuple[int, int, int], ...]] = None

    def chunks(self, local_shape):
        """Return ``[(global offsets, sizes, local offsets)]``: where each real block of this rank's array lies
        in the global tensor (padding left out; empty when this rank holds only padding)."""
        pieces = self.pieces if self.pieces is not None else ((self.start, 0, local_shape[self.dim]),)
        out = []
        for global_start, local_start, length in pieces:
            length = max(0, min(length, self.global_shape[self.dim] - global_start))
            if length == 0:
                continue
            offsets, sizes, local = [0] * len(self.global_shape), list(self.global_shape), [0] * len(self.global_shape)
            offsets[self.dim], sizes[self.dim], local[self.dim] = global_start, length, local_start
            out.append((tuple(offsets), tuple(sizes), tuple(local)))
        return out

    def chunk(self, local_shape):
        """Return ``(offsets, sizes)`` of this rank's real (unpadded) block in the global tensor, or None.

        For a single-block shard only; a shard of several pieces has ``chunks``.
        """
        if self.pieces is not None and len(self.pieces) > 1:
            raise ValueError(f"{self.describe()}: a shard of {len(self.pieces)} pieces has no single chunk; "
                             f"use chunks()")
        found = self.chunks(local_shape)
        return (found[0][0], found[0][1]) if found else None

    def describe(self):
        extra = "" if self.pieces is None else f", pieces={self.pieces}"
        return f"Shard(dim={self.dim}, global_shape={self.global_shape}, start={self.start}{extra})"


@dataclass(frozen=True, eq=False)
class Replicate:
    """Every rank of ``comm`` holds the same values (and, after backward, the same gradient)."""

    comm: Any

    def describe(self):
        return f"Replicate(over {self.comm.Get_size()} ranks)"


def placement_of(param):
    """Return ``param``'s placement, or None for an ordinary parameter."""
    return getattr(param, "placement", None)


def set_placement(param, placement):
    """Attach ``placement`` to ``param`` (a Shard, a Replicate or None); return the parameter."""
    object.__setattr__(param, "placement", placement)
    return param
