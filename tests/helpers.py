"""What several test modules share (tests import this module, never each other)."""
import numpy as np

from mpidist.nn.placement import boxes, global_shape


def reassemble(comm, placed, read):
    """Return {name: global array} from every rank's ``read(parameter)``, cut into boxes by ``boxes()`` alone.

    ``placed``: this rank's ``PlacedParameter``s (pass the primary copies only where a tied weight has others).
    Collective over ``comm`` (one allgather), which must span every rank holding a part. Elements several ranks
    hold (replicas) must agree exactly; an element no rank holds stays NaN.
    """
    mine = []
    for p in placed:
        local = np.asarray(read(p.parameter))
        mine.append((p.name, global_shape(p.placement, local.shape),
                     [(b.offsets, b.sizes, b.view(local).copy()) for b in boxes(p.placement, local.shape, name=p.name)]))
    full = {}
    for items in comm.allgather(mine):
        for name, shape, pieces in items:
            out = full.setdefault(name, np.full(shape, np.nan))
            for offsets, sizes, data in pieces:
                region = out[tuple(slice(a, a + n) for a, n in zip(offsets, sizes))]
                held = ~np.isnan(region)
                np.testing.assert_array_equal(region[held], data[held], err_msg=f"{name}: replicas differ")
                region[...] = data
    return full


def assert_reassembles(comm, placed, read, expected, atol=0.0):
    """Assert that ``reassemble(comm, placed, read)`` equals ``expected`` ({name: array}), names and values.

    ``atol`` 0 asks for equality; every element must be held by some rank (NaN fails the comparison).
    """
    full = reassemble(comm, placed, read)
    assert sorted(full) == sorted(expected), "the placed names are not the unsplit model's"
    for name, want in expected.items():
        np.testing.assert_allclose(full[name], want, rtol=0, atol=atol, err_msg=name)
