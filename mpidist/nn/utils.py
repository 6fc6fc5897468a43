"""Gradient utilities: clipping by global norm, also when the parameters are spread over ranks.

``clip_grad_norm_`` follows ``torch.nn.utils.clip_grad_norm_``: the norm of all gradients taken
together as one vector, and a scale of ``max_norm / (norm + 1e-6)`` applied when it is below one.
With ``comm`` the parameters given on each rank are disjoint parts of one model (FSDP shards,
pipeline stages): the ranks add up their ``|g|^p`` sums (or take the maximum for the inf-norm), so
every rank gets the same norm and the same scale as one process holding the whole model.

Tensor-parallel parameters carry a placement (``mpidist.nn.placement``): a sharded gradient's sum is added
over its communicator, and a replicated one (the same on every rank of its communicator) is counted once.
"""

import math
import numbers

import numpy as np

from mpidist.comm.agree import raise_if_any
from mpidist.nn.module import Parameter
from mpidist.nn.placement import Replicate, placement_of
from mpidist.nn.precision import is_floating
from mpidist.xp import get_array_module

__all__ = ["clip_grad_norm_", "clip_coefficient", "grad_norm", "GradParts"]


def _check_norm_type(fn, norm_type):
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
        raise ValueError(f"{fn}: norm_type must be a positive number or math.inf (got {norm_type!r})")
    return float(norm_type)


class GradParts:
    """Gradients that together make up one model's, each with its weight in a norm, and where to add the sums.

    ``grads``: this rank's gradient arrays. ``weights``: how often each counts in a norm's sum (1/n for a gradient
    every rank of an n-rank communicator holds alike, so that the n copies add up to one; 1 for a rank's own
    part). ``comms``: the communicators over which the ranks' sums are added (the max taken, for the inf-norm),
    in one order on every rank. A parallel wrapper builds these from its parameters' placements
    (``mpidist.parallel.interface.Wrapper.clip_grad_norm_``).
    """

    def __init__(self, grads, weights=None, comms=()):
        self.grads = list(grads)
        self.weights = [1.0] * len(self.grads) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.grads):
            raise ValueError(f"GradParts: {len(self.weights)} weights for {len(self.grads)} gradients")
        self.comms = tuple(comms)

    def __iter__(self):
        return iter(self.grads)


def _grads(fn, parameters, comm):
    """Return the gradients; a non-float one raises on every rank of ``comm`` (none is left waiting)."""
    params = [parameters] if isinstance(parameters, Parameter) else list(parameters)
    held = [param for param in params if param.grad is not None]
    weights, comms = [], []
    for param in held:
        where = placement_of(param)
        if isinstance(where, Replicate):
            weights.append(1.0 / where.comm.Get_size())
        else:
            weights.append(1.0)
        if where is not None and not any(where.comm is c for c in comms):
            comms.append(where.comm)
    grads = GradParts([param.grad for param in held], weights, comms + ([comm] if comm is not None else []))
    _check_float(fn, grads, comm)
    return grads


def _check_float(fn, grads, comm):
    """Raise TypeError (on every rank of ``comm`` when given) if a gradient is not floating point."""
    bad = [(i, g.dtype) for i, g in enumerate(grads) if g.dtype.kind != "c" and not is_floating(g.dtype)]
    problem = f"gradient {bad[0][0]} is {bad[0][1]}" if bad else None
    if comm is not None:
        raise_if_any(comm, problem, f"{fn}: gradients must be floating point", TypeError)
    elif problem is not None:
        raise TypeError(f"{fn}: gradients must be floating point: {problem}")


def _allreduce_scalar(value, comm, op):
    from mpidist import collectives  # nn itself needs no communication: only this optional path does
    return float(collectives.allreduce(np.array([value]), comm, op=op)[0])


def _max_abs(grads):
    """Return max |g| over all gradients (and ranks); NaN if any is NaN."""
    peaks = [float(get_array_module(g).abs(g).max()) for g in grads if g.size]
    local = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
    if not grads.comms:
        return local
    # MAX of a NaN is not defined in MPI: carry "some rank saw NaN" as a flag of its own.
    from mpidist import collectives
    both = np.array([0.0 if math.isnan(local) else local, float(math.isnan(local))])
    for c in grads.comms:
        both = collectives.allreduce(both, c, op="max")
    return math.nan if both[1] else float(both[0])


def _norm(grads, p):
    if p == math.inf:
        return _max_abs(grads)
    scale = 1.0
    if p > 2.0:
        # |g|^p overflows float64 for large p (p = 1000 and |g| = 2 already): sum (|g| / s)^p with
        # s the largest |g| of all ranks, and multiply back.
        scale = _max_abs(grads)
        if scale == 0.0 or not math.isfinite(scale):
            return scale
    local = 0.0
    for g, w in zip(grads.grads, grads.weights):  # accumulate in float64 on the host: one number per gradient
        xp = get_array_module(g)
        a = xp.abs(g).astype(xp.float64, copy=False)  # abs first: complex gradients keep their magnitude
        if scale != 1.0:
            a /= scale
        local += w * float(xp.sum(a * a) if p == 2.0 else xp.sum(a ** p))
    for c in grads.comms:
        local = _allreduce_scalar(local, c, "sum")
    return scale * (math.sqrt(local) if p == 2.0 else local ** (1.0 / p))


def grad_norm(parameters, norm_type=2.0, comm=None):
    """Return the ``norm_type``-norm of every gradient together (over ``comm``'s ranks when given)."""
    p = _check_norm_type("grad_norm", norm_type)
    return _norm(_grads("grad_norm", parameters, comm), p)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, comm=None, error_if_nonfinite=False):
    """Scale gradients in place so that their global norm is at most ``max_norm``; return the norm before.

    ``parameters``: a Parameter or an iterable of them, or ``GradParts`` (gradients with their weights and
    communicators given; then ``comm`` is added last to its communicators). ``comm``: the ranks over which these
    parameters are partitioned (each rank passes its part), or None when this rank holds them all
    (a plain model, or DDP, whose averaged gradients every rank has). A non-finite norm leaves the
    gradients as they are (or raises, with ``error_if_nonfinite``).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not 0 <= max_norm < math.inf:
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0 (got {max_norm!r})")
    p = _check_norm_type("clip_grad_norm_", norm_type)
    if isinstance(parameters, GradParts):
        extra = (comm,) if comm is not None else ()
        grads = GradParts(parameters.grads, parameters.weights, parameters.comms + extra)
        _check_float("clip_grad_norm_", grads, comm)
    else:
        grads = _grads("clip_grad_norm_", parameters, comm)
    total = _norm(grads, p)
    if not math.isfinite(total):
        if error_if_nonfinite:
            # Every rank has the same total, so every rank raises.
            raise FloatingPointError(f"clip_grad_norm_: the total norm of the gradients is {total} "
                                     f"(order {norm_type}); a gradient holds NaN or Inf")
        return total
    scale = clip_coefficient(total, max_norm)
    if scale < 1.0:
        for g in grads:
            g *= scale
    return total


def clip_coefficient(total_norm, max_norm):
    """The factor ``clip_grad_norm_`` scales gradients by for a total norm (1.0: left as they are)."""
    if not math.isfinite(total_norm):
        return 1.0
    return min(1.0, float(max_norm) / (total_norm + 1e-6))
