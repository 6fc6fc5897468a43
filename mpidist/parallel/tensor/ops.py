"""The communication steps of tensor and sequence parallelism, as autograd ops.

Each op's backward is the conjugate of its forward (Megatron's f/g pairs), so a model written with them
differentiates correctly without any hand-written gradient exchange:

    copy_to_tp        forward: identity            backward: allreduce     (before a column-parallel layer)
    reduce_from_tp    forward: allreduce           backward: identity      (after a row-parallel layer)
    gather_sequence   forward: allgather along t   backward: reduce-scatter along t   (sequence parallel: into
    scatter_sequence  forward: reduce-scatter      backward: allgather                 and out of a TP region)
    gather_last       forward: allgather along the last axis     backward: this rank's slice (full logits)

``gather_sequence_linear`` fuses ``gather_sequence`` with the column-parallel linear that reads it: the same
products and collectives, but backward keeps this rank's sequence shard instead of the gathered input and
gathers it again for the weight's gradient (Megatron-LM's sequence parallelism, Korthikanti et al. 2022, 4.2.2):
a column-parallel linear keeps 1/tp of its input, for one more allgather per backward.

Sequence parallelism replaces each allreduce of plain tensor parallelism by a reduce-scatter plus an allgather
of the same total bytes, and keeps the activations between blocks (norms, dropout, residuals) split along the
sequence. A replicated parameter used on a sequence shard gets only its shard's share of the gradient, so it
is read through ``copy_to_tp`` as well: its backward adds the shares.

16-bit activations (a ``Policy("bf16")`` model) take the collectives' rule (``mpidist.wire``): the gathers move
their bits, the sums (allreduce, reduce-scatter) accumulate in float32 and round once.
"""
from __future__ import annotations

from mpidist import collectives
from mpidist.nn import functional as F
from mpidist.nn.autograd import Tensor, make_result
from mpidist.nn.functional import linear_input_grad, linear_param_grads
from mpidist.xp import get_array_module

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_sequence", "scatter_sequence", "gather_last",
           "gather_sequence_linear"]


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def _allreduce(a, comm):
    return collectives.allreduce(get_array_module(a).array(a, copy=True, order="C"), comm, op="sum")


def _to_front(a, axis):
    xp = get_array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, axis, 0))


def _from_front(a, axis):
    xp = get_array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, 0, axis))


def _allgather_axis(a, comm, axis):
    return _from_front(collectives.allgather(_to_front(a, axis), comm), axis)


def _start_allgather_axis(a, comm, axis):
    """Start ``_allgather_axis``; return a function that waits for its result."""
    handle = collectives.iallgather(_to_front(a, axis), comm)
    return lambda: _from_front(handle.wait(), axis)


def _check_splits(a, comm, axis, what):
    size = comm.Get_size()
    if a.shape[axis] % size:
        raise ValueError(f"{what}: axis {axis} of length {a.shape[axis]} does not split evenly over {size} "
                         f"tensor-parallel ranks (shape {tuple(a.shape)})")


def _reduce_scatter_axis(a, comm, axis, what):
    _check_splits(a, comm, axis, what)
    return _from_front(collectives.reduce_scatter(_to_front(a, axis), comm), axis)


def _local_slice(a, comm, axis):
    n = a.shape[axis] // comm.Get_size()
    index = [slice(None)] * a.ndim
    index[axis] = slice(comm.Get_rank() * n, (comm.Get_rank() + 1) * n)
    return get_array_module(a).ascontiguousarray(a[tuple(index)])


def copy_to_tp(x, comm):
    """Identity forward; backward adds the gradient over ``comm`` (every TP rank used the same input)."""
    return make_result("CopyToTP", _data(x), (x,), lambda g, n: (_allreduce(g, comm),))


def reduce_from_tp(x, comm):
    """Sum of every TP rank's partial result forward; the gradient passes through unchanged."""
    return make_result("ReduceFromTP", _allreduce(_data(x), comm), (x,), lambda g, n: (g,))


def gather_sequence(x, comm, axis=1):
    """Concatenate the sequence shards along ``axis``; backward reduce-scatters (adds, then keeps this shard)."""
    return make_result("GatherSequence", _allgather_axis(_data(x), comm, axis), (x,),
                       lambda g, n: (_reduce_scatter_axis(g, comm, axis, "gather_sequence backward"),))


def scatter_sequence(x, comm, axis=1):
    """Add the partial results over ``comm`` and keep this rank's sequence shard; backward allgathers."""
    out = _reduce_scatter_axis(_data(x), comm, axis, "scatter_sequence")
    return make_result("ScatterSequence", out, (x,), lambda g, n: (_allgather_axis(g, comm, axis),))


def gather_last(x, comm):
    """Concatenate the TP ranks' slices along the last axis (e.g. full logits); backward keeps this slice."""
    a = _data(x)
    return make_result("GatherLast", _allgather_axis(a, comm, a.ndim - 1), (x,),
                       lambda g, n: (_local_slice(g, comm, g.ndim - 1),))


def gather_sequence_linear(x, weight, bias, comm, axis=1):
    """Return ``F.linear(gather_sequence(x, comm, axis), weight, bias)``, keeping only the shard ``x`` for backward.

    The gathered input is let go after the product; backward gathers ``x`` again for the weight's gradient,
    overlapping that allgather with the input gradient's product (as Megatron-LM does). The input gradient's
    reduce-scatter is the blocking one ``gather_sequence``'s backward calls: a nonblocking reduce-scatter may add
    the ranks' parts in another order (Open MPI's do), and then the gradients would not be the unfused pair's.
    Outputs and gradients equal those of the unfused pair bit for bit under any MPI: the gather is a copy, and the
    products and the reduce-scatter are the same.
    """
    full = _allgather_axis(_data(x), comm, axis)
    # Backward reduce-scatters an input gradient of the gathered length: say now, on every rank (they all see the
    # gathered length), that it cannot split, before backward posts its allgather.
    _check_splits(full, comm, axis, "gather_sequence_linear")
    out = F.linear(full, _data(weight), None if bias is None else _data(bias))
    del full

    def backward(g, n):
        # The weight is read now, not at forward: FSDP may have freed and gathered it again (autograd's glossary).
        gathered = _start_allgather_axis(_data(x), comm, axis) if n[1] else None
        gx = None
        if n[0]:
            gx = _reduce_scatter_axis(linear_input_grad(g, _data(weight)), comm, axis, "gather_sequence_linear backward")
        gw, gb = linear_param_grads(g, gathered() if gathered else None, bias is not None and n[2])
        return gx, gw, gb
    return make_result("GatherSequenceLinear", out.data, (x, weight, bias), backward)
