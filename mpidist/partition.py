"""How elements split over ranks, and the reductions every layer names the same way.

Below both ``collectives`` and ``gpu`` (and everything above them), so neither imports the other for
these, and an op name (or whether this MPI reduces float16) means the same thing in validation,
fingerprints, host and device paths.
"""

import functools
import itertools

import numpy as np

__all__ = ["split_sizes", "displacements", "REDUCTIONS", "mpi_reduces_float16"]

# Reduction names the collectives accept, in the order the desync fingerprint encodes them (1-based).
REDUCTIONS = ("sum", "mean", "min", "max", "prod")


def split_sizes(n, parts):
    """Return how ``n`` rows split over ``parts`` ranks: the first ``n % parts`` get one row more."""
    base, extra = divmod(int(n), parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def displacements(counts):
    """Return where each of ``counts`` consecutive blocks starts (MPI's ``displs``)."""
    return [0, *itertools.accumulate(counts)][:-1] if len(counts) else []


@functools.cache
def mpi_reduces_float16():
    """Return whether this MPI can sum float16 buffers (it has a datatype for them and SUM takes it).

    MPI 3.1 has no float16 datatype: Open MPI 4.1's mpi4py raises ``KeyError: 'e'`` on such a buffer,
    where MPICH has MPIX_C_FLOAT16.
    """
    from mpi4py import MPI

    ones = np.ones(2, dtype=np.float16)
    try:
        MPI.SUM.Reduce_local(ones[:1], ones[1:])
    except (KeyError, ValueError, NotImplementedError, MPI.Exception):
        return False
    return bool(ones[1] == 2)
