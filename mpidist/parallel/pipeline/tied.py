"""Parameters that several pipeline stages hold copies of, kept identical (Megatron's embedding group).

A GPT with a tied head reads the token embedding's weight in its first stage (the look-up) and its last stage
(the vocabulary projection). Each of those ranks holds its own copy; the true gradient of the one shared weight
is the sum of both copies' gradients, so after every step the holders add their gradients over a communicator
of their own, and equal copies with equal gradients stay equal under any optimizer.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpidist import collectives
from mpidist.comm.agree import check_same, raise_if_any

__all__ = ["TiedParameters"]


class TiedParameters:
    """This rank's copies (maybe none) of one shared weight; ``allreduce_grads()`` makes their gradient the total.

    Collective over ``comm`` (the pipeline comm) at construction: the holders get a communicator of their own,
    check their copies have one shape and dtype, and take the first holder's values.
    """

    def __init__(self, comm, params, name="tied"):
        self.name = name
        self.params = list(params)
        shapes = {(tuple(p.data.shape), str(p.data.dtype)) for p in self.params}
        error = None
        if len(shapes) > 1:
            error = f"Pipeline: the copies of tied parameter {name!r} on rank {comm.Get_rank()} differ: {sorted(shapes)}"
        raise_if_any(comm, error, "Pipeline")
        rank = self.rank = comm.Get_rank()
        holders = comm.allgather(rank if self.params else None)
        self.holders = [r for r in holders if r is not None]
        self.group = comm.Split(0 if self.params else MPI.UNDEFINED, rank)
        if self.params:
            check_same(self.group, sorted(shapes)[0], f"Pipeline: the copies of tied parameter {name!r} differ "
                       f"between ranks {self.holders}", what="shape and dtype")
            first = self.params[0].data
            if self.group.Get_size() > 1:
                first[...] = collectives.broadcast(first.copy(), self.group, root=0)
            for p in self.params[1:]:
                p.data[...] = first

    @property
    def counts_in_norm(self):
        """The copies whose gradient a global norm counts: the first holder's first copy, the others are equal."""
        return self.params[:1] if self.holders and self.holders[0] == self.rank else []

    def allreduce_grads(self):
        """Set every copy's gradient to the sum of all copies' gradients on all holders (None counts as zero)."""
        if not self.params:
            return
        like = self.params[0].data
        total = None
        for p in self.params:
            if p.grad is not None:
                total = p.grad.copy() if total is None else total + p.grad
        if total is None:
            total = np.zeros_like(like) if isinstance(like, np.ndarray) else like * 0
        if self.group.Get_size() > 1:
            total = collectives.allreduce(total, self.group, op="sum")
        for p in self.params:
            if p.grad is None:
                p.grad = total.copy()
            else:  # in place: a wrapper may hold the gradient array (a DDP bucket view)
                p.grad[...] = total

    def free(self):
        if self.params:
            self.group.Free()
