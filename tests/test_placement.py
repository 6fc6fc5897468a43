"""Placements: which elements of a global tensor each rank holds, and where in its memory.

Local arrays are built here by hand with numpy slicing of a known global tensor (as tensor parallelism and
FSDP lay them out); ``boxes()`` of every rank must put them back together into exactly that tensor, read
through ``Box.view`` and written through it.
"""

import math

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.placement import (Box, FlatShard, Replicate, Shard, boxes, check_tiling, flat_boxes, global_shape,
                                  placement_of)

PAD = -1.0  # what padding holds in the hand-built local arrays: never part of a box


def numbered(shape):
    return np.arange(1, math.prod(shape) + 1, dtype=np.float64).reshape(shape)


def region(offsets, sizes):
    """Return the index of box ``(offsets, sizes)`` (``...`` for a 0-d tensor, so that it is a view)."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes)) or ...


def rebuild(shape, holdings):
    """Return the global tensor made of every (placement, local array)'s boxes; equal boxes must agree."""
    out = np.full(shape, np.nan)
    for placement, local in holdings:
        assert global_shape(placement, local.shape) == tuple(shape)
        for box in boxes(placement, local.shape):
            target = out[region(box.offsets, box.sizes)]
            values = box.view(local)
            assert values.shape == box.sizes
            assert np.isnan(target).all() or (target == values).all(), f"{box} overlaps a different box"
            target[...] = values
    return out


def check_round_trip(full, holdings):
    """The boxes rebuild ``full``, and writing ``full`` through them into zeroed copies gives the local arrays
    back wherever they are not padding (a checkpoint load)."""
    np.testing.assert_array_equal(rebuild(full.shape, holdings), full)
    for placement, local in holdings:
        fresh = np.zeros_like(local)
        for box in boxes(placement, local.shape):
            box.view(fresh)[...] = full[region(box.offsets, box.sizes)]
        np.testing.assert_array_equal(np.where(local == PAD, 0, local), fresh)


def row_shards(full, dim, ranks):
    """Return (Shard, local block) per rank: even blocks along ``dim``, the last ones padded with PAD."""
    per = -(-full.shape[dim] // ranks)
    out = []
    for r in range(ranks):
        block = np.full(full.shape[:dim] + (per,) + full.shape[dim + 1:], PAD)
        real = full.take(np.arange(r * per, min((r + 1) * per, full.shape[dim])), axis=dim)
        block[tuple(slice(0, n) for n in real.shape)] = real
        out.append((Shard(dim, None, full.shape, r * per), block))
    return out


def flat_shards(placement, block, ranks, offset=3):
    """Return (FlatShard, flat local buffer) per FSDP rank: ``block`` flattened, padded, cut in ``ranks`` equal
    ranges; each rank's range sits at ``offset`` of a buffer with junk around it."""
    flat = block.reshape(-1)
    per = -(-flat.size // ranks)
    out = []
    for r in range(ranks):
        start, stop = min(r * per, flat.size), min((r + 1) * per, flat.size)
        buffer = np.full(offset + per + 2, PAD)
        buffer[offset: offset + stop - start] = flat[start:stop]
        out.append((FlatShard(placement, block.shape, start, stop - start, offset, comm=None), buffer))
    return out


@pytest.mark.parametrize("shape,dim,ranks", [((10, 3), 0, 4), ((5, 2), 0, 4), ((3, 7), 1, 3), ((2, 5, 3), 1, 2)])
def test_shards_with_padding_rebuild_the_tensor(shape, dim, ranks):
    """(5, 2) over 4 ranks: the last rank holds only padding and has no box."""
    full = numbered(shape)
    holdings = row_shards(full, dim, ranks)
    check_round_trip(full, holdings)
    if shape == (5, 2):
        assert boxes(*(lambda p, a: (p, a.shape))(*holdings[3])) == []


def qkv_shards(full, ranks, dim=0):
    """Return (Shard with pieces, local block) per rank: a fused q/k/v tensor split by heads, as tensor
    parallelism's attention holds it (its heads' rows of q, then of k, then of v)."""
    d = full.shape[dim] // 3
    width = d // ranks
    out = []
    for r in range(ranks):
        pieces = tuple((which * d + r * width, which * width, width) for which in range(3))
        take = np.concatenate([np.arange(g, g + n) for g, _, n in pieces])
        out.append((Shard(dim, None, full.shape, r * width, pieces), full.take(take, axis=dim)))
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_of_pieces_rebuilds_a_fused_qkv_tensor(dim):
    full = numbered((12, 5) if dim == 0 else (5, 12))
    holdings = qkv_shards(full, 2, dim)
    assert [len(boxes(p, a.shape)) for p, a in holdings] == [3, 3]
    check_round_trip(full, holdings)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fsdp_ranks", [1, 3, 5])
def test_flat_shards_of_tensor_parallel_blocks_rebuild_the_tensor(fsdp_ranks, dim):
    """FSDP over tensor parallelism: each TP block (the last one padded) flattened and cut mid-row; padding
    along dimension 1 leaves a gap at the end of every row of the flat buffer."""
    full = numbered((5, 4) if dim == 0 else (4, 5))
    holdings = [flat for shard, block in row_shards(full, dim, 2) for flat in flat_shards(shard, block, fsdp_ranks)]
    check_round_trip(full, holdings)


def test_flat_shards_of_a_fused_qkv_block_rebuild_the_tensor():
    full = numbered((12, 3))
    holdings = [flat for shard, block in qkv_shards(full, 2) for flat in flat_shards(shard, block, 4, offset=1)]
    check_round_trip(full, holdings)


@pytest.mark.parametrize("shape,ranks", [((3, 4, 5), 7), ((7,), 3), ((2, 9), 4), ((), 1)])
def test_flat_shards_crossing_rows_rebuild_the_tensor(shape, ranks):
    """Ranges that start and end mid-row (and mid-plane) of a whole tensor, at an offset of the local buffer."""
    full = numbered(shape)
    for block in (None, Replicate(None)):
        holdings = flat_shards(block, full, ranks)
        check_round_trip(full, holdings)
        for placement, local in holdings:  # each box a contiguous run of the buffer, at most 2 * ndim - 1
            assert len(boxes(placement, local.shape)) <= max(1, 2 * len(shape) - 1)


def test_whole_tensors_are_one_box_and_empty_ones_none():
    full = numbered((3, 2))
    for placement in (None, Replicate(None)):
        check_round_trip(full, [(placement, full.copy()), (placement, full.copy())])
        assert boxes(placement, (4, 0, 3)) == []
    scalar = np.array(7.0)
    (box,) = boxes(None, ())
    assert box.offsets == () and box.sizes == () and box.view(scalar) == 7.0
    box.view(scalar)[...] = 8.0
    assert scalar == 8.0


def test_global_shape_of_every_placement():
    shard = Shard(1, None, (4, 9), 3)
    assert global_shape(None, (2, 3)) == (2, 3)
    assert global_shape(Replicate(None), (2, 3)) == (2, 3)
    assert global_shape(shard, (4, 3)) == (4, 9)
    assert global_shape(FlatShard(shard, (4, 3), 2, 5, 0), (5,)) == (4, 9)
    assert global_shape(FlatShard(None, (6, 2), 0, 12, 0), (12,)) == (6, 2)


def test_a_parameter_has_no_placement_until_given_one():
    p = nn.Parameter(np.zeros(3))
    assert p.placement is None and placement_of(p) is None
    nn.placement.set_placement(p, Replicate(None))
    assert isinstance(placement_of(p), Replicate)


def test_placements_that_do_not_fit_the_local_array_are_refused():
    with pytest.raises(ValueError, match=r"'w' holds a block of shape \(6, 5\) that does not fit its placement "
                                         r"Shard\(dim=0, global_shape=\(11, 7\), start=0\)"):
        boxes(Shard(0, None, (11, 7), 0), (6, 5), name="w")
    with pytest.raises(ValueError, match=r"placement: a local array holds a block of shape \(4, 3\) whose placement "
                                         r".* has the piece \(8, 2, 3\) outside it along dimension 0"):
        boxes(Shard(0, None, (12, 3), 0, ((0, 0, 2), (8, 2, 3))), (4, 3))
    with pytest.raises(ValueError, match=r"'w' holds a flat local array of shape \(4,\) that does not fit"):
        boxes(FlatShard(None, (3, 3), 2, 4, 1), (4,), name="w")
    with pytest.raises(ValueError, match=r"'w' holds a flat local array of shape \(20,\) .* inside the block"):
        boxes(FlatShard(None, (3, 3), 6, 4, 0), (20,), name="w")
    with pytest.raises(ValueError, match=r"only pieces along dimension 0 \(runs of whole rows\) can be flat-sharded"):
        boxes(FlatShard(Shard(1, None, (3, 12), 0, ((0, 0, 2), (4, 2, 2))), (3, 4), 0, 12, 0), (12,), name="w")
    with pytest.raises(TypeError, match=r"'w' has placement 'rows', which is not a Shard, Replicate or FlatShard"):
        boxes("rows", (3,), name="w")


def test_check_tiling_accepts_a_tiling_with_replicas():
    shard_boxes = [[(b.offsets, b.sizes) for b in boxes(p, a.shape)] for p, a in row_shards(numbered((10, 3)), 0, 4)]
    assert check_tiling("w", (10, 3), shard_boxes + shard_boxes) is None  # a second replica of each box
    assert check_tiling("w", (10, 3), [boxes(None, (10, 3))]) is None
    assert check_tiling("s", (), [[((), ())]]) is None


def test_check_tiling_names_an_overlap_a_hole_and_a_box_outside():
    overlap = check_tiling("w", (11, 7), [[((0, 0), (6, 7))], [((4, 0), (6, 7))], [((0, 0), (6, 7))]])
    assert overlap == ("'w' has overlapping chunks that are not the same chunk: (chunk at offsets (0, 0) of sizes "
                       "(6, 7) in shape (11, 7)) on ranks 0,2, (chunk at offsets (4, 0) of sizes (6, 7) in shape "
                       "(11, 7)) on rank 1; the placements of its blocks must split it the same way on every rank")
    hole = check_tiling("w", (11, 7), [[((0, 0), (4, 7))], [((4, 0), (4, 7))]])
    assert hole == ("the chunks of 'w' cover 56 of its 77 elements (shape (11, 7)); every row of a sharded parameter "
                    "must be on some rank")
    outside = check_tiling("w", (4, 3), [[((0, 0), (4, 3))], [((3, 0), (2, 3))]])
    assert outside == ("'w' has a chunk outside its shape: (chunk at offsets (3, 0) of sizes (2, 3) in shape (4, 3)) "
                       "on rank 1")


def test_boxes_of_every_rank_tile_the_tensor_across_a_communicator(comm):
    """Each rank holds its padded shard of rows; the allgathered boxes tile the tensor and rebuild it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    full = numbered((2 * size + 1, 3))
    placement, local = row_shards(full, 0, size)[rank]
    mine = [(b.offsets, b.sizes, np.ascontiguousarray(b.view(local))) for b in boxes(placement, local.shape)]
    gathered = comm.allgather(mine)
    assert check_tiling("w", full.shape, [[(o, s) for o, s, _ in held] for held in gathered]) is None
    out = np.full(full.shape, np.nan)
    for held in gathered:
        for offsets, sizes, data in held:
            out[region(offsets, sizes)] = data
    np.testing.assert_array_equal(out, full)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (3, 1, 5, 2), (4, 0, 3)])
def test_a_flat_range_is_a_union_of_contiguous_boxes(shape):
    """Every flat range of a row-major array equals its boxes' elements in order, each box contiguous."""
    numbers = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    rng = np.random.default_rng(len(shape))
    n = numbers.size
    for start, stop in [(0, n), (0, 0)] + [tuple(sorted(rng.integers(0, n + 1, 2))) for _ in range(40)]:
        count = stop - start
        found = flat_boxes(start, count, shape)
        assert len(found) <= max(1, 2 * len(shape) - 1)
        pieces = [numbers[tuple(slice(o, o + s) for o, s in zip(lo, sizes))].reshape(-1) for lo, sizes in found]
        for piece in pieces:
            assert (np.diff(piece) == 1).all()
        got = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        np.testing.assert_array_equal(got, np.arange(start, start + count))


def test_a_box_is_a_view_of_the_flat_buffer():
    """Writing through a FlatShard's box writes the buffer elements that hold it (no copy)."""
    buffer = np.zeros(10)
    (first, second) = boxes(FlatShard(None, (3, 4), 2, 4, 5), buffer.shape)  # a row's end, the next row's start
    assert (first.offsets, first.sizes, second.offsets, second.sizes) == ((0, 2), (1, 2), (1, 0), (1, 2))
    first.view(buffer)[...] = 1
    second.view(buffer)[...] = 2
    np.testing.assert_array_equal(buffer, [0, 0, 0, 0, 0, 1, 1, 2, 2, 0])
    assert isinstance(first, Box)
