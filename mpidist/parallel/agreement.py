"""What the ranks of a parallel wrapper must agree on, checked where it costs (almost) nothing.

Glossary:
- structure: a model's parameters as ``(name, shape, dtype)`` in ``named_parameters()`` order. Every
  data-parallel rank must hold the same structure; at construction a digest is compared (one small
  object allgather) and a difference raises on every rank naming the first differing parameter.
- step stamp: ``(training forwards, backwards, synchronizing backwards, optimizer updates)`` of this
  rank at a check point. Forwards count calls of the wrapper in training mode since construction,
  backwards its backward calls (and those outside ``no_sync``); optimizer updates count how often an mpidist optimizer updated the wrapper's parameters
  (``Parameter.version``). A rank that accumulated a different number of micro-batches, ran a
  forward without its backward, or skipped or repeated an optimizer step differs in its stamp. The
  stamp travels in one nonblocking 8-integer MAX-allreduce started before the point's first
  collective and waited for after its last, so it overlaps the computation in between. DDP checks
  at each gradient synchronization; FSDP, whose forwards and backwards all communicate, at each
  training forward and backward (a rank one forward ahead would pair its gathers with the others'
  reduce-scatters). Cost: benchmarks/ddp_step.py.

What a stamp cannot see: a rank that skips a whole iteration (forward, backward and optimizer step)
computes the same parameters as the others, one batch behind; it is one collective short at the end,
which the collective timeout and the flight recorder report (docs/reliability.md).
"""

import numpy as np

from .. import collectives
from ..comm.agree import check_same
from ..guard import DesyncError

__all__ = ["check_same_structure", "structure", "StepStamp"]


def structure(named_parameters):
    """Return ``[(name, shape, dtype name)]`` of ``(name, Parameter)`` pairs, in their order."""
    return [(name, tuple(p.data.shape), str(p.data.dtype)) for name, p in named_parameters]


def check_same_structure(comm, named_parameters, context):
    """Raise ValueError on every rank unless all ranks hold parameters of the same names, shapes and dtypes."""
    check_same(comm, structure(named_parameters), f"{context}: ranks hold different models (parameter name, "
               f"shape, dtype)", what="parameter")


def _updates(params):
    return max((getattr(p, "version", 0) for p in params), default=0)


class StepStamp:
    """Count this rank's training forwards and backwards; check at agreed points that all ranks match."""

    def __init__(self, comm, owner):
        self.comm, self.owner = comm, owner
        self.forwards = self.backwards = self.syncs = 0
        self._base_updates = 0
        self._mine = None
        self._handle = None

    def count_forward(self, training):
        """Record a forward of the wrapper (only training-mode forwards count: evaluation may differ by rank)."""
        if training:
            self.forwards += 1

    def count_backward(self, sync):
        """Record a backward of the wrapper, and whether it synchronizes gradients."""
        self.backwards += 1
        self.syncs += bool(sync)

    def rebase(self, params):
        """Count from zero again (after a phase in which ranks legitimately ran different step counts)."""
        self.forwards = self.backwards = self.syncs = 0
        self._base_updates = _updates(params)

    def start(self, params):
        """Start a check (every rank at the same point, before that point's first collective)."""
        mine = (self.forwards, self.backwards, self.syncs, _updates(params) - self._base_updates)
        self._mine = mine
        self._handle = collectives.iallreduce(np.array(mine + tuple(-v for v in mine), dtype=np.int64),
                                              self.comm, op="max")

    def finish(self, where):
        """Wait for the check; raise DesyncError on every rank, naming each rank's counts, if ranks differ."""
        if self._handle is None:
            return
        both, self._handle = self._handle.wait(), None
        n = len(both) // 2
        if (both[:n] == -both[n:]).all():
            return
        # Every rank saw the same reduced vector, so every rank is here: the gather below matches.
        stamps = self.comm.allgather(self._mine)
        groups = {}
        for rank, stamp in enumerate(stamps):
            groups.setdefault(stamp, []).append(rank)
        parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {f} training forwards, "
                          f"{b} backwards ({n} synchronizing), {v} optimizer steps" for (f, b, n, v), rs in groups.items())
        raise DesyncError(f"{self.owner}: ranks are at different steps at {where} ({parts}); a rank skipped or "
                          f"repeated a forward, backward or optimizer step, so its gradients would be combined with "
                          f"another step's. Run the same steps on every rank (evaluation forwards belong under "
                          f".eval(), which is not counted)")
