"""What the ranks of a parallel wrapper must agree on, checked where it costs (almost) nothing.

Glossary:
- structure: a model's parameters as ``(name, shape, dtype)`` in ``named_parameters()`` order, and which of
  them are frozen (``requires_grad=False``). Every data-parallel rank must hold the same structure; at
  construction digests are compared (small object allgathers) and a difference raises on every rank naming
  the first differing parameter and which ranks hold which value. A parameter frozen on some ranks only
  would train there with the others' gradients, or keep a gradient slot the others lack.
- frozen at construction: wrappers decide at construction which parameters get gradient storage,
  communication and optimizer updates (the trainable ones); changing ``requires_grad`` afterwards is an
  error the next backward reports (``TrainableAtBuild``), never silently half-applied.
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
from ..comm.agree import check_same, describe_ranks
from ..guard import DesyncError

__all__ = ["check_same_structure", "check_same_shards", "structure", "frozen_flags", "TrainableAtBuild",
           "StepStamp"]


def check_same_shards(comm, named, who):
    """Raise on every rank unless every rank of ``comm`` holds the same slice of every sharded parameter.

    A data-parallel wrapper averages gradients and broadcasts values over its communicator: given ranks that
    hold different tensor-parallel slices (the world instead of the mesh's dp communicator), it would
    overwrite every slice with rank 0's and average unrelated numbers. Collective (one digest allgather).
    """
    from mpidist.nn.placement import Shard, placement_of
    items = []
    for name, param in named:
        where = placement_of(param)
        if isinstance(where, Shard):
            items.append((name, where.dim, where.start, tuple(param.data.shape)))
    check_same(comm, items, f"{who}: the ranks of its communicator hold different tensor-parallel slices of a "
                            f"parameter, so averaging over them would mix unrelated numbers; pass the data-parallel "
                            f"communicator of the mesh (mesh(comm, dp=, tp=, pp=).dp_comm), not one that spans the "
                            f"tensor-parallel ranks", what="(parameter, shard dim, shard start, local shape)")


def structure(named_parameters):
    """Return ``[(name, shape, dtype name)]`` of ``(name, Parameter)`` pairs, in their order."""
    return [(name, tuple(p.data.shape), str(p.data.dtype)) for name, p in named_parameters]


def frozen_flags(named_parameters):
    """Return ``[(name, "frozen" or "trainable")]`` of ``(name, Parameter)`` pairs, in their order."""
    return [(name, "trainable" if p.requires_grad else "frozen") for name, p in named_parameters]


def check_same_structure(comm, named_parameters, context):
    """Raise ValueError on every rank unless all ranks hold parameters of the same names, shapes and dtypes,
    frozen (``requires_grad=False``) alike."""
    named = list(named_parameters)
    check_same(comm, structure(named), f"{context}: ranks hold different models (parameter name, "
               f"shape, dtype)", what="parameter")
    check_same(comm, frozen_flags(named), f"{context}: a parameter is frozen (requires_grad=False) on some ranks "
               f"only; freeze the same parameters on every rank before wrapping", what="parameter")


class TrainableAtBuild:
    """Which parameters required grad when a wrapper was built; ``check()`` raises if that changed since.

    A wrapper gives gradient storage, communication and optimizer updates to the parameters trainable at
    construction only: a parameter frozen later would keep a gradient slot (and move under weight decay), one
    unfrozen later would train on this rank's gradient alone. ``check()`` costs one attribute read per parameter.
    """

    def __init__(self, named_parameters, owner):
        named = list(named_parameters)
        self.owner = owner
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.trainable = [bool(p.requires_grad) for p in self.params]

    def check(self):
        """Raise RuntimeError on this rank naming every parameter whose ``requires_grad`` changed."""
        now = [bool(p.requires_grad) for p in self.params]
        if now == self.trainable:
            return
        changed = [f"{name!r} ({'trainable' if was else 'frozen'} -> {'trainable' if is_ else 'frozen'})"
                   for name, was, is_ in zip(self.names, self.trainable, now) if was != is_]
        raise RuntimeError(f"{self.owner}: requires_grad changed after the wrapper was built: {', '.join(changed)}; "
                           f"the wrapper decides at construction which parameters get gradients, communication and "
                           f"optimizer updates. Set requires_grad (alike on every rank) before wrapping, or build "
                           f"the wrapper again")


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

    # -- the stamp carried inside a summed message (DDP's last gradient bucket) -----------------------------
    SLOTS = 8  # (count mod M, (count mod M)^2) for each of the four counts

    @staticmethod
    def modulus(dtype, size):
        """The largest M with size * M^2 exact in ``dtype``, or None when too small to tell counts apart."""
        bits = {2: 11, 4: 24, 8: 53}.get(np.dtype(dtype).itemsize) if np.dtype(dtype).kind == "f" else None
        if bits is None:
            return None
        m = int((2.0 ** bits / size) ** 0.5)
        return min(m, 1 << 20) if m >= 16 else None

    def encode(self, params, m):
        """Record this rank's counts and return them as the 8 values to add into a summed message.

        Summed over N ranks, each count's pair gives S1 = sum c and S2 = sum c^2, and S1^2 == N * S2 exactly
        when every rank has the same c (Cauchy-Schwarz). Counts are taken mod m so the sums stay exact in
        the message's dtype; ranks apart by a multiple of m steps would pass, but a desync is caught at the
        first synchronization after it happens, one or two steps apart.
        """
        self._mine = (self.forwards, self.backwards, self.syncs, _updates(params) - self._base_updates)
        out = []
        for c in self._mine:
            c %= m
            out += [c, c * c]
        return np.array(out, dtype=np.float64)

    def check_sums(self, sums, where):
        """Raise DesyncError on every rank if the summed stamp of ``encode`` shows ranks at different counts."""
        size = self.comm.Get_size()
        values = [int(round(float(v))) for v in sums]
        if all(values[k] * values[k] == size * values[k + 1] for k in range(0, len(values), 2)):
            return
        self._raise(where)

    def finish(self, where):
        """Wait for the check; raise DesyncError on every rank, naming each rank's counts, if ranks differ."""
        if self._handle is None:
            return
        both, self._handle = self._handle.wait(), None
        n = len(both) // 2
        if (both[:n] == -both[n:]).all():
            return
        self._raise(where)

    def _raise(self, where):
        # Every rank saw the same reduced values, so every rank is here: the gather below matches.
        stamps = self.comm.allgather(self._mine)
        parts = describe_ranks([f"{f} training forwards, {b} backwards ({n} synchronizing), {v} optimizer steps"
                                for f, b, n, v in stamps])
        raise DesyncError(f"{self.owner}: ranks are at different steps at {where} ({parts}); a rank skipped or "
                          f"repeated a forward, backward or optimizer step, so its gradients would be combined with "
                          f"another step's. Run the same steps on every rank (evaluation forwards belong under "
                          f".eval(), which is not counted)")
