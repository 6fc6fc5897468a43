"""How elements split over ranks.

Below both ``collectives`` and ``gpu`` (and everything above them), so neither imports the other for
these. The reductions every layer names the same way are ``mpidist.wire.OPS``.
"""

import itertools

__all__ = ["split_sizes", "displacements"]


def split_sizes(n, parts):
    """Return how ``n`` rows split over ``parts`` ranks: the first ``n % parts`` get one row more."""
    base, extra = divmod(int(n), parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def displacements(counts):
    """Return where each of ``counts`` consecutive blocks starts (MPI's ``displs``)."""
    return [0, *itertools.accumulate(counts)][:-1] if len(counts) else []

