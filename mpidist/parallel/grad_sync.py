"""What data-parallel wrappers share around gradient reduction: no_sync mode, the step stamp, and the reports.

``GradSync`` holds, for one wrapper over one communicator: whether backwards synchronize now (``no_sync``), the
step stamp (``agreement.StepStamp``) the wrapper starts and finishes at its own check points, and the two reports
raised on every rank after a reduction, naming parameters and ranks:

- non-finite gradients: each rank flags the parameters whose gradient it produced held NaN or Inf *before*
  the reduction (after it, averaging has spread them to every rank), and the flags are allgathered.
- unused parameters: each rank flags the parameters that got no gradient in its backward; a MAX-allreduce
  tells every rank which ones some rank missed.

Both are collective, so every rank of ``comm`` must call them at the same point (after the same reduction).
"""

import contextlib

import numpy as np

from .. import collectives
from .agreement import StepStamp

__all__ = ["GradSync"]


class GradSync:
    """The no_sync mode, step stamp and non-finite/unused reports of one wrapper over ``comm``.

    ``owner``: the wrapper's name in messages ("DDP"); ``names``: the parameters the flags passed to the
    reports refer to, in one order on every rank.
    """

    def __init__(self, comm, owner, names):
        self.comm, self.owner, self.names = comm, owner, list(names)
        self.stamp = StepStamp(comm, owner)
        self.syncing = True  # False inside no_sync()

    @contextlib.contextmanager
    def no_sync(self):
        """Clear ``syncing`` inside the block (restored after, also when nested)."""
        previous = self.syncing
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = previous

    def raise_if_nonfinite(self, local_flags, where, reduced_nonfinite=False):
        """Raise FloatingPointError on every rank if any rank flagged a parameter (or ``reduced_nonfinite``).

        ``local_flags[i]``: this rank's gradient of ``names[i]`` held NaN or Inf before the reduction.
        ``reduced_nonfinite``: the reduced gradients are not finite (the same on every rank), which with no rank
        flagging anything means the reduction itself overflowed. Collective (one small allgather).
        """
        local = np.asarray(local_flags, dtype=np.int8).reshape(1, len(self.names))
        everyone = np.empty((self.comm.Get_size(), len(self.names)), dtype=np.int8)
        collectives.allgather(local, self.comm, out=everyone)
        bad = np.flatnonzero(everyone.any(axis=0))
        if not bad.size and not reduced_nonfinite:
            return
        culprits = "; ".join(f"{self.names[i]!r} on rank(s) {np.flatnonzero(everyone[:, i]).tolist()}" for i in bad)
        raise FloatingPointError(f"{self.owner}: non-finite gradient (NaN or Inf) at {where}: "
                                 f"{culprits or 'produced by the reduction itself (overflow)'}; "
                                 f"the optimizer step must not be taken")

    def raise_if_unused(self, local_flags):
        """Raise RuntimeError on every rank naming the parameters some rank flagged as unused in its backward.

        ``local_flags[i]``: ``names[i]`` got no gradient in this rank's backward. Collective (one allreduce).
        """
        flags = np.array(local_flags, dtype=np.int32).reshape(len(self.names))
        collectives.allreduce(flags, self.comm, op="max")
        if flags.any():
            missing = [n for n, f in zip(self.names, flags) if f]
            raise RuntimeError(f"{self.owner}: parameters received no gradient in this backward on at least one "
                               f"rank: {missing} (use unused_parameters='zero' to treat them as zero)")
