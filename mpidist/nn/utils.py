"""Gradient utilities: clipping by global norm, also when the parameters are spread over ranks.

``clip_grad_norm_`` follows ``torch.nn.utils.clip_grad_norm_``: the norm of all gradients taken
together as one vector, and a scale of ``max_norm / (norm + 1e-6)`` applied when it is below one.
With ``comm`` the parameters given on each rank are disjoint parts of one model (FSDP shards,
pipeline stages): the ranks add up their ``|g|^p`` sums (or take the maximum for the inf-norm), so
every rank gets the same norm and the same scale as one process holding the whole model.
"""

import math
import numbers

from mpidist.xp import get_array_module

__all__ = ["clip_grad_norm_", "grad_norm"]


def _check_norm_type(fn, norm_type):
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or not norm_type > 0:
        raise ValueError(f"{fn}: norm_type must be a positive number or math.inf (got {norm_type!r})")
    return float(norm_type)


def grad_norm(parameters, norm_type=2.0, comm=None):
    """Return the ``norm_type``-norm of every gradient together (over ``comm``'s ranks when given)."""
    p = _check_norm_type("grad_norm", norm_type)
    grads = [param.grad for param in parameters if param.grad is not None]
    # Accumulate in float64 on the host: one number per gradient, whatever the gradients' dtype.
    if p == math.inf:
        peaks = [float(get_array_module(g).abs(g).max()) for g in grads if g.size]
        local = math.nan if any(math.isnan(v) for v in peaks) else max(peaks, default=0.0)
    else:
        local = 0.0
        for g in grads:
            xp = get_array_module(g)
            a = xp.abs(g.astype(xp.float64, copy=False))
            local += float(xp.sum(a * a) if p == 2.0 else xp.sum(a ** p))
    if comm is not None:
        import numpy as np

        from mpidist import collectives
        if p == math.inf:  # MAX of a NaN is not defined in MPI: carry "some rank saw NaN" as a flag
            both = collectives.allreduce(np.array([0.0 if math.isnan(local) else local, float(math.isnan(local))]),
                                         comm, op="max")
            local = math.nan if both[1] else float(both[0])
        else:
            local = float(collectives.allreduce(np.array([local]), comm, op="sum")[0])
    if p == math.inf:
        return local
    return math.sqrt(local) if p == 2.0 else local ** (1.0 / p)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, comm=None, error_if_nonfinite=False):
    """Scale gradients in place so that their global norm is at most ``max_norm``; return the norm before.

    ``comm``: the ranks over which these parameters are partitioned (each rank passes its part), or
    None when this rank holds them all (a plain model, or DDP, whose averaged gradients every rank has).
    A non-finite norm leaves the gradients as they are (or raises, with ``error_if_nonfinite``).
    """
    parameters = list(parameters)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not 0 <= max_norm < math.inf:
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number >= 0 (got {max_norm!r})")
    total = grad_norm(parameters, norm_type, comm)
    if not math.isfinite(total):
        if error_if_nonfinite:
            # Every rank has the same total, so every rank raises.
            raise FloatingPointError(f"clip_grad_norm_: the total norm of the gradients is {total} "
                                     f"(order {norm_type}); a gradient holds NaN or Inf")
        return total
    scale = float(max_norm) / (total + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                param.grad *= scale
    return total
