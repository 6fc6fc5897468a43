"""Parameters that several pipeline stages hold copies of, kept identical (Megatron's embedding group).

A GPT with a tied head reads the token embedding's weight in its first stage (the look-up) and its last stage
(the vocabulary projection). Each of those ranks holds its own copy; the true gradient of the one shared weight
is the sum of both copies' gradients, so after every step the holders add their gradients over a communicator
of their own, and equal copies with equal gradients stay equal under any optimizer. Copies are frozen
(``requires_grad=False``) all alike or not at all; a frozen weight's copies exchange nothing.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpidist import collectives
from mpidist.comm.agree import describe_ranks, raise_if_any
from mpidist.nn.deferred import deferred_key, is_deferred

__all__ = ["TiedParameters"]


class TiedParameters:
    """This rank's copies (maybe none) of one shared weight; ``allreduce_grads()`` makes their gradient the total.

    Collective over ``comm`` (the pipeline comm) at construction: the ranks check the copies have one shape, dtype
    and ``requires_grad`` (raising on every rank otherwise), the holders get a communicator of their own and take
    the first holder's values.
    """

    def __init__(self, comm, params, name="tied"):
        self.name = name
        self.params = list(params)
        shapes = {(tuple(p.data.shape), str(p.data.dtype), "trainable" if p.requires_grad else "frozen")
                  for p in self.params}
        error = None
        if len(shapes) > 1:
            error = f"Pipeline: the copies of tied parameter {name!r} on rank {comm.Get_rank()} differ: {sorted(shapes)}"
        raise_if_any(comm, error, "Pipeline")
        rank = self.rank = comm.Get_rank()
        # Every rank learns every holder's copies, so a difference raises on every rank, holders or not.
        copies = comm.allgather(sorted(shapes)[0] if self.params else None)
        self.holders = [r for r, c in enumerate(copies) if c is not None]
        if len({c for c in copies if c is not None}) > 1:
            raise ValueError(f"Pipeline: the copies of tied parameter {name!r} differ between ranks (shape, dtype, "
                             f"requires_grad): {describe_ranks(copies)}")
        # Deferred copies (mpidist.nn.deferred) draw the same values under one name and seed: nothing to send,
        # provided every holder deferred them under the same seed (not manual_seed(base + rank)).
        keys = comm.allgather(deferred_key(name, self.params[0]) if self.params else None)
        if len({k for k in keys if k is not None}) > 1:
            raise ValueError(f"Pipeline: the copies of tied parameter {name!r} would not start equal (draw name and "
                             f"deferred seed, or 'materialized'): {describe_ranks(keys)}")
        self.group = comm.Split(0 if self.params else MPI.UNDEFINED, rank)
        if self.params and not is_deferred(self.params[0]):
            first = self.params[0].data
            if self.group.Get_size() > 1:
                first[...] = collectives.broadcast(first.copy(), self.group, root=0)  # bfloat16: its bits (wire)
            for p in self.params[1:]:
                p.data[...] = first

    @property
    def frozen(self):
        """Whether the shared weight is frozen (``requires_grad=False``, alike on every copy: checked at construction)."""
        return bool(self.params) and not self.params[0].requires_grad

    def allreduce_grads(self):
        """Set every copy's gradient to the sum of all copies' gradients on all holders (None counts as zero).

        A frozen weight has no gradient: nothing is sent and every copy's gradient stays None."""
        if not self.params or self.frozen:
            return
        like = self.params[0].data
        total = None
        for p in self.params:
            if p.grad is not None:
                total = p.grad.copy() if total is None else total + p.grad
        if total is None:
            total = np.zeros_like(like) if isinstance(like, np.ndarray) else like * 0
        if self.group.Get_size() > 1:
            # bfloat16: summed in float32, rounded once (mpidist.wire), as DDP's buckets
            total = collectives.allreduce(total, self.group, op="sum")
        for p in self.params:
            if p.grad is None:
                p.grad = total.copy()
            else:  # in place: a wrapper may hold the gradient array (a DDP bucket view)
                p.grad[...] = total

    def communicators(self):
        """Return the holders' communicator, on a holder; () elsewhere."""
        return (self.group,) if self.params else ()

    def free(self):
        if self.params:
            self.group.Free()
