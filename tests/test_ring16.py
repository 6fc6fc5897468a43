"""The 16-bit ring called directly (mpidist.ring16): pending rings and the caller's own messages on one
communicator never match each other's; explicit tags are checked against MPI_TAG_UB.

Reference: the ring emulated in numpy on every rank's input (helpers.ring_reference), bitwise."""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import ring_reference
from mpidist.nn.precision import bfloat16, float16
from mpidist.ring16 import iring_allreduce_16, iring_reduce_scatter_16, ring_allreduce_16, ring_reduce_scatter_16

OLD_TAG = 7301  # the one tag every direct ring used on the caller's communicator before rings had their own


def inputs_of(comm, seed, n, dtype):
    return [np.random.default_rng([seed, r, n]).standard_normal(n).astype(dtype) for r in range(comm.Get_size())]


def chunk_of(full, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    chunk = -(-full.size // size)
    return full[rank * chunk: (rank + 1) * chunk]


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("traffic", ["sent_first_with_the_old_tag", "any_tag_receive_pending"])
def test_the_callers_messages_on_the_comm_never_match_a_rings(comm, op, traffic):
    """The caller's note to its right neighbour, sent before the ring with the tag the ring once used (or
    received by an MPI.ANY_TAG receive posted before it), arrives intact, and the ring's result is the numpy
    ring's. The note has a ring message's size: a ring on the caller's communicator took it for its own."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    inputs = inputs_of(comm, 1, 4 * size, float16)  # chunks of 4 elements: 8 bytes, as the note
    note, got = np.full(4, 1000 + rank, np.uint16), np.zeros(4, np.uint16)
    if traffic == "sent_first_with_the_old_tag":
        pending = comm.Isend(note, right, OLD_TAG)
    else:
        pending = comm.Irecv(got, left, MPI.ANY_TAG)
    if op == "allreduce":
        result, want = ring_allreduce_16(inputs[rank].copy(), comm), ring_reference(inputs, float16)
    else:
        result = ring_reduce_scatter_16(inputs[rank].copy(), comm, mean=True)
        want = chunk_of(ring_reference(inputs, float16, mean=True), comm)
    if traffic == "sent_first_with_the_old_tag":
        comm.Recv(got, left, OLD_TAG)
    else:
        comm.Send(note, right, 5)
    pending.Wait()
    np.testing.assert_array_equal(got, np.full(4, 1000 + left, np.uint16))
    np.testing.assert_array_equal(result.view(np.uint16), want.view(np.uint16))


def test_rings_pending_at_once_on_one_comm_finish_in_any_order(comm):
    """Three rings started before any is waited for (two allreduces of different dtypes, a reduce-scatter),
    tested and waited for in another order: each is the numpy ring of its own inputs, bitwise."""
    rank = comm.Get_rank()
    a_in, b_in, c_in = inputs_of(comm, 2, 37, float16), inputs_of(comm, 3, 37, float16), inputs_of(comm, 4, 9, bfloat16)
    a = iring_allreduce_16(a_in[rank], comm)
    b = iring_reduce_scatter_16(b_in[rank], comm, mean=True)
    c = iring_allreduce_16(c_in[rank], comm)
    c_out = c.wait()
    b.test()
    a_out, b_out = a.wait(), b.wait()
    np.testing.assert_array_equal(a_out.view(np.uint16), ring_reference(a_in, float16).view(np.uint16))
    np.testing.assert_array_equal(b_out.view(np.uint16),
                                  chunk_of(ring_reference(b_in, float16, mean=True), comm).view(np.uint16))
    np.testing.assert_array_equal(c_out.view(np.uint16), ring_reference(c_in, bfloat16).view(np.uint16))


@pytest.mark.world_sizes(2, 4)
def test_a_private_duplicate_is_made_once_per_comm_and_freed_with_it(comm):
    """Rings without a tag run on one duplicate of the caller's communicator, each with a tag of its own; freeing
    the communicator frees the duplicate (its handle becomes COMM_NULL)."""
    sub = comm.Dup()
    x = inputs_of(comm, 5, 8, float16)[comm.Get_rank()]
    first, second = iring_allreduce_16(x, sub), iring_reduce_scatter_16(x, sub)
    first.wait(), second.wait()
    assert first.comm is second.comm and first.comm is not sub and first.comm != MPI.COMM_NULL
    assert first.tag != second.tag
    sub.Free()
    assert first.comm == MPI.COMM_NULL


def test_an_explicit_tag_runs_on_the_comm_itself_within_mpi_tag_ub(comm):
    """A caller's tag puts the ring on its communicator with that tag; a tag past MPI_TAG_UB (the attribute's
    value; Open MPI sets it on COMM_WORLD only), negative or not an int is refused on every rank."""
    rank = comm.Get_rank()
    inputs = inputs_of(comm, 6, 10, bfloat16)
    ring = iring_allreduce_16(inputs[rank], comm, tag=11)
    assert ring.comm is comm and ring.tag == 11
    np.testing.assert_array_equal(ring.wait().view(np.uint16), ring_reference(inputs, bfloat16).view(np.uint16))
    ub = comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
    for bad in (ub + 1, -1, "3", 2.0):
        with pytest.raises(ValueError, match=rf"ring_allreduce_16: tag must be an int in 0\.\.{ub} \(MPI_TAG_UB "
                                             rf"of the communicator\), or None for a private duplicate "
                                             rf"\(got {bad!r}\)"):
            ring_allreduce_16(inputs[rank], comm, tag=bad)
    with pytest.raises(ValueError, match=r"ring_reduce_scatter_16: needs a 1-D array \(got shape \(2, 5\)\)"):
        ring_reduce_scatter_16(inputs[rank].reshape(2, 5), comm)


def test_ranks_that_are_threads_agree_on_the_private_duplicates_key(monkeypatch):
    """SimComm's ranks are threads sharing one communicator class: making the attribute key was check-then-set,
    so with a thread switch inside Create_keyval each rank could make its own key, the last one stored won, and the
    next ring had some ranks calling Dup() again while the others waited in the ring (a hang). Widen that window."""
    import time

    import mpidist
    from mpidist import ring16
    from mpidist.comm.sim.comm import SimComm

    made = []
    create = SimComm.Create_keyval.__func__

    def slow_create_keyval(cls, *args, **kwargs):
        time.sleep(0.05)   # every rank reaches the check before the first key is stored
        made.append(1)
        return create(cls, *args, **kwargs)

    monkeypatch.setattr(SimComm, "Create_keyval", classmethod(slow_create_keyval))
    monkeypatch.setattr(ring16, "_keyvals", {})

    def run(comm):
        data = np.arange(8, dtype=np.float32).astype(float16) + comm.Get_rank()
        first = ring_allreduce_16(data, comm)
        second = ring_allreduce_16(data, comm)
        return first, second

    results = mpidist.simulate(4, run, timeout=60)
    expected = ring_reference([np.arange(8, dtype=np.float32).astype(float16) + r for r in range(4)], float16)
    for first, second in results:
        np.testing.assert_array_equal(first, expected)
        np.testing.assert_array_equal(second, expected)
    assert len(made) == 1
