"""How elements split over ranks, and the reductions every layer names the same way.

Below both ``collectives`` and ``gpu`` (and everything above them), so neither imports the other for
these, and an op name means the same thing in validation, fingerprints, host and device paths (how MPI
carries each reduction is ``mpidist.wire``).
"""

import itertools

__all__ = ["split_sizes", "displacements", "REDUCTIONS"]

# Reduction names the collectives accept, in the order the desync fingerprint encodes them (1-based).
REDUCTIONS = ("sum", "mean", "min", "max", "prod")


def split_sizes(n, parts):
    """Return how ``n`` rows split over ``parts`` ranks: the first ``n % parts`` get one row more."""
    base, extra = divmod(int(n), parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def displacements(counts):
    """Return where each of ``counts`` consecutive blocks starts (MPI's ``displs``)."""
    return [0, *itertools.accumulate(counts)][:-1] if len(counts) else []

