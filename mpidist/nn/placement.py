"""Where a parameter's values live across ranks, written on the parameter itself (``param.placement``).

Glossary:
- global tensor: the parameter as the unsplit model holds it (``global_shape``).
- placement: which elements of the global tensor this rank holds, and where in its memory:
  ``None`` (an ordinary parameter: the whole tensor), ``Replicate`` (the whole tensor, the same on every rank
  of a communicator), ``Shard`` (a block along one dimension, tensor parallelism), ``FlatShard`` (a flat range
  of such a block, packed into a flat local buffer: FSDP).
- box (or chunk): an N-dimensional box of the global tensor, ``offsets`` and ``sizes`` per dimension.
  ``boxes(placement, local_shape)`` answers the question above as a list of ``Box``: each a box of the global
  tensor and a view of the local array holding it. Padding (local rows past the global tensor, so that a
  split is even) belongs to no box.

Everything that looks at parameters across ranks reads this instead of guessing from shapes:

- ``clip_grad_norm_`` adds a sharded gradient's square sum over its communicator and counts a replicated one
  once, not once per rank that holds it.
- data-parallel wrappers refuse a communicator that would average different shards with each other.
- checkpoints store each box as a chunk of the global tensor, so a run can load into any other layout, or into
  a plain model; ``check_tiling`` says whether the boxes of all ranks make the tensor exactly once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from mpidist.comm.agree import name_ranks

__all__ = ["Shard", "Replicate", "FlatShard", "Box", "boxes", "global_shape", "check_tiling", "flat_boxes",
           "intersect", "first_overlap", "describe_box", "placement_of", "set_placement"]


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

    def describe(self):
        extra = "" if self.pieces is None else f", pieces={self.pieces}"
        return f"Shard(dim={self.dim}, global_shape={self.global_shape}, start={self.start}{extra})"


@dataclass(frozen=True, eq=False)
class Replicate:
    """Every rank of ``comm`` holds the same values (and, after backward, the same gradient)."""

    comm: Any

    def describe(self):
        return f"Replicate(over {self.comm.Get_size()} ranks)"


@dataclass(frozen=True, eq=False)
class FlatShard:
    """This rank holds ``count`` elements of a block flattened row-major, from ``start``, at ``offset`` of a flat array.

    The block is what a rank would hold without the flat sharding: the whole tensor (``block`` None or a
    ``Replicate``) or a tensor-parallel ``Shard`` of it, of shape ``block_shape``. FSDP flattens its units'
    blocks into one buffer and gives each rank of ``comm`` (the shard group) a disjoint range of it; a range
    may start and end mid-row. A block's ``Shard.pieces`` must run along dimension 0 (runs of whole rows).
    """

    block: Optional[Union[Shard, Replicate]]
    block_shape: Tuple[int, ...]
    start: int
    count: int
    offset: int
    comm: Any = None  # the shard group; None for flat pieces no group holds (a checkpoint file's)

    def describe(self):
        inner = "the whole tensor" if self.block is None else self.block.describe()
        return (f"FlatShard(elements {self.start}..{self.start + self.count} of a block of shape {self.block_shape} "
                f"at offset {self.offset}; block: {inner})")


@dataclass(frozen=True)
class Box:
    """One box of a global tensor that this rank holds: where in the tensor, and where in its local array.

    ``local`` is an index (a tuple of slices) into the local array, or, for a flat local array (``FlatShard``),
    the flat position where a row-major contiguous run of shape ``run`` starts whose leading corner of shape
    ``sizes`` is the box (the rest of the run is padding).
    """

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    local: Union[Tuple[slice, ...], int]
    run: Optional[Tuple[int, ...]] = None

    def view(self, array):
        """Return this box's elements of ``array`` (the local array, or one shaped like it), shaped ``sizes``.

        A view when ``array`` is contiguous, so writing into it writes into ``array``.
        """
        # ``...`` for a 0-d box: indexing with ``()`` would return a scalar, not a view.
        if isinstance(self.local, tuple):
            return array[self.local or ...]
        run = array.reshape(-1)[self.local: self.local + math.prod(self.run)].reshape(self.run)
        return run[tuple(slice(0, n) for n in self.sizes) or ...]


def placement_of(param):
    """Return ``param``'s placement, or None for an ordinary parameter."""
    return param.placement


def set_placement(param, placement):
    """Attach ``placement`` to ``param`` (a Shard, a Replicate, a FlatShard or None); return the parameter."""
    object.__setattr__(param, "placement", placement)
    return param


def _who(name):
    """Return the subject of an error message: the tensor's name, or what ``boxes`` was given."""
    return f"{name!r}" if name is not None else "placement: a local array"


def _check_shard(shard, local_shape, name):
    """Raise ValueError unless a block of ``local_shape`` fits ``shard``."""
    shape, dim = tuple(shard.global_shape), shard.dim
    if (not 0 <= dim < len(shape) or len(shape) != len(local_shape) or shard.start < 0
            or any(n != m for d, (n, m) in enumerate(zip(shape, local_shape)) if d != dim)):
        raise ValueError(f"{_who(name)} holds a block of shape {tuple(local_shape)} that does not fit its placement "
                         f"{shard.describe()}: a shard keeps every dimension but {dim} of the global shape and "
                         f"starts at a row >= 0")
    for global_start, local_start, length in shard.pieces or ():
        if global_start < 0 or local_start < 0 or length < 0 or local_start + length > local_shape[dim]:
            raise ValueError(f"{_who(name)} holds a block of shape {tuple(local_shape)} whose placement "
                             f"{shard.describe()} has the piece {(global_start, local_start, length)} outside it "
                             f"along dimension {dim}")


def _check_placement(placement, name):
    if placement is not None and not isinstance(placement, (Replicate, Shard, FlatShard)):
        raise TypeError(f"{_who(name)} has placement {placement!r}, which is not a Shard, Replicate or FlatShard of "
                        f"mpidist.nn.placement")


def global_shape(placement, local_shape):
    """Return the global shape a local array of ``local_shape`` under ``placement`` belongs to."""
    _check_placement(placement, None)
    if isinstance(placement, FlatShard):
        return global_shape(placement.block, placement.block_shape)
    if isinstance(placement, Shard):
        return tuple(int(n) for n in placement.global_shape)
    return tuple(int(n) for n in local_shape)


def boxes(placement, local_shape, name=None) -> List[Box]:
    """Return the boxes of the global tensor held under ``placement`` by a local array of ``local_shape``.

    Padding is left out; boxes with no element are too (a rank holding only padding has none). The boxes of
    one array never overlap. Raises ValueError (TypeError for an unknown placement) when ``local_shape`` does
    not fit the placement; ``name``, the tensor's name, is its subject.
    """
    _check_placement(placement, name)
    local_shape = tuple(int(n) for n in local_shape)
    if isinstance(placement, FlatShard):
        return _flat_shard_boxes(placement, local_shape, name)
    if isinstance(placement, Shard):
        _check_shard(placement, local_shape, name)
        return [Box(offsets, sizes, tuple(slice(lo, lo + n) for lo, n in zip(local, sizes)))
                for offsets, sizes, local in placement.chunks(local_shape) if math.prod(sizes)]
    if not math.prod(local_shape):
        return []
    return [Box((0,) * len(local_shape), local_shape, tuple(slice(0, n) for n in local_shape))]


def _sub_blocks(block, block_shape, name):
    """Return ``[(flat start in the block, shape, global origin, real sizes)]``: the block as runs of whole rows.

    A ``Shard`` of several pieces along dimension 0 is one run per piece; anything else is one run, the block.
    Of each run only the first ``real`` rows along each dimension are real, the rest is padding.
    """
    if block is None or isinstance(block, Replicate):
        return [(0, block_shape, (0,) * len(block_shape), block_shape)]
    if not isinstance(block, Shard):
        raise TypeError(f"{_who(name)} has a FlatShard over {block!r}, which is not a Shard or Replicate (or None)")
    _check_shard(block, block_shape, name)
    shape, dim = tuple(int(n) for n in block.global_shape), block.dim
    pieces = block.pieces if block.pieces is not None else ((block.start, 0, block_shape[dim]),)
    if len(pieces) > 1 and dim != 0:
        raise ValueError(f"{_who(name)} has a FlatShard over {block.describe()}: a flat range of a shard of "
                         f"{len(pieces)} pieces along dimension {dim} is no union of boxes of the pieces; only pieces "
                         f"along dimension 0 (runs of whole rows) can be flat-sharded")
    if len(pieces) == 1:
        global_start, local_start, length = pieces[0]
        if local_start != 0 or length != block_shape[dim]:  # one piece is a plain shard at its start
            pieces = ((global_start, 0, block_shape[dim]),)
    row, runs = math.prod(block_shape[dim + 1:]), []
    for global_start, local_start, length in pieces:
        run_shape = block_shape[:dim] + (int(length),) + block_shape[dim + 1:]
        origin = tuple(int(global_start) if d == dim else 0 for d in range(len(shape)))
        real = tuple(max(0, min(int(length), shape[d] - int(global_start))) if d == dim else n
                     for d, n in enumerate(run_shape))
        runs.append((int(local_start) * row, run_shape, origin, real))
    return runs


def _flat_shard_boxes(shard, local_shape, name):
    """Return the boxes of a ``FlatShard``: its range cut into contiguous runs of each sub-block, padding cut off."""
    block_shape = tuple(int(n) for n in shard.block_shape)
    start, count, offset = int(shard.start), int(shard.count), int(shard.offset)
    if start < 0 or count < 0 or offset < 0 or start + count > math.prod(block_shape) \
            or offset + count > math.prod(local_shape):
        raise ValueError(f"{_who(name)} holds a flat local array of shape {local_shape} that does not fit its "
                         f"placement {shard.describe()}: the range must lie inside the block and the local array")
    out = []
    for block_start, run_shape, origin, real in _sub_blocks(shard.block, block_shape, name):
        lo, hi = max(start, block_start), min(start + count, block_start + math.prod(run_shape))
        for corner, sizes in flat_boxes(lo - block_start, hi - lo, run_shape):
            # Padding lies at the end of every dimension, so what is real of a contiguous box is its leading corner.
            cut = tuple(max(0, min(c + n, r) - c) for c, n, r in zip(corner, sizes, real))
            if not math.prod(cut):
                continue
            flat = block_start + _flat_index(corner, run_shape)
            out.append(Box(tuple(o + c for o, c in zip(origin, corner)), cut, offset + flat - start, sizes))
    return out


def _flat_index(index, shape):
    """Return the row-major flat position of ``index`` in ``shape``."""
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def flat_boxes(start, count, shape):
    """Return ``[(offsets, sizes)]``: boxes whose union is the flat range ``[start, start + count)`` of ``shape``.

    Each box is itself contiguous in row-major order and they come in flat order: a partial first row,
    the whole rows, a partial last row (recursively along the trailing dimensions), so at most
    ``2 * ndim - 1`` of them.
    """
    if count <= 0:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    stop, found = start + count, []
    if start % inner:  # a partial first row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        found += [((row,) + lo, (1,) + sz) for lo, sz in flat_boxes(start - row * inner, end - start, shape[1:])]
        start = end
    if stop // inner > start // inner and start < stop:  # whole rows
        first, last = start // inner, stop // inner
        found.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
        start = last * inner
    if start < stop:  # a partial last row
        row = start // inner
        found += [((row,) + lo, (1,) + sz) for lo, sz in flat_boxes(0, stop - start, shape[1:])]
    return found


def intersect(offsets_a, sizes_a, offsets_b, sizes_b):
    """Return (offsets, sizes) of the overlap of two boxes, or None."""
    lo = tuple(max(a, b) for a, b in zip(offsets_a, offsets_b))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(offsets_a, sizes_a, offsets_b, sizes_b))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def first_overlap(box_list):
    """Return the indices ``(i, j)`` of two overlapping boxes of ``[(offsets, sizes)]``, or None."""
    order = sorted(range(len(box_list)), key=lambda i: (tuple(box_list[i][0]), tuple(box_list[i][1]), i))
    for n, i in enumerate(order):
        offsets, sizes = box_list[i]
        for j in order[n + 1:]:
            other_offsets, other_sizes = box_list[j]
            if offsets and other_offsets[0] >= offsets[0] + sizes[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if intersect(offsets, sizes, other_offsets, other_sizes) is not None:
                return i, j
    return None


def describe_box(shape, offsets, sizes):
    """Return "(the whole tensor, shape (4, 3))" or "(chunk at offsets (2, 0) of sizes (2, 3) in shape (4, 3))"."""
    if tuple(sizes) == tuple(shape):
        return f"(the whole tensor, shape {tuple(shape)})"
    return f"(chunk at offsets {tuple(offsets)} of sizes {tuple(sizes)} in shape {tuple(shape)})"


def check_tiling(name, shape, boxes_by_rank: Sequence) -> Optional[str]:
    """Return what is wrong (a box outside, an overlap, a hole) with boxes meant to tile ``shape``, or None.

    ``boxes_by_rank[r]`` lists rank r's boxes (``Box`` or ``(offsets, sizes)``). Equal boxes on several ranks
    are one box held by each (replicas); distinct boxes must not overlap and must cover every element.
    """
    shape, holders = tuple(shape), {}
    for rank, held in enumerate(boxes_by_rank):
        for box in held:
            offsets, sizes = (box.offsets, box.sizes) if isinstance(box, Box) else box
            holders.setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
    distinct = list(holders)
    for offsets, sizes in distinct:
        if len(offsets) != len(shape) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
            return (f"{name!r} has a chunk outside its shape: {describe_box(shape, offsets, sizes)} on "
                    f"{name_ranks(holders[offsets, sizes])}")
    pair = first_overlap(distinct)
    if pair is not None:
        (a_offsets, a_sizes), (b_offsets, b_sizes) = distinct[pair[0]], distinct[pair[1]]
        return (f"{name!r} has overlapping chunks that are not the same chunk: "
                f"{describe_box(shape, a_offsets, a_sizes)} on {name_ranks(holders[a_offsets, a_sizes])}, "
                f"{describe_box(shape, b_offsets, b_sizes)} on {name_ranks(holders[b_offsets, b_sizes])}; "
                f"the placements of its blocks must split it the same way on every rank")
    covered, total = sum(math.prod(sizes) for _, sizes in distinct), math.prod(shape)
    if covered != total:
        return (f"the chunks of {name!r} cover {covered} of its {total} elements (shape {shape}); every row of a "
                f"sharded parameter must be on some rank")
    return None
