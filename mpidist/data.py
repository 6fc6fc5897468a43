"""Data loading helpers: which samples each rank reads."""

import numpy as np
from mpi4py import MPI

from .comm import check_comm

__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Split ``n_samples`` indices into disjoint per-rank shards of equal length.

    Every rank gets ``ceil(n / size)`` indices (padded by repeating the first indices of the
    permutation) or, with ``drop_last``, ``floor(n / size)`` (the tail is dropped), so every rank runs
    the same number of batches. The permutation depends only on ``(seed, epoch)``, never on the rank.
    """

    def __init__(self, n_samples, comm, shuffle=True, seed=0, drop_last=False):
        if not isinstance(n_samples, (int, np.integer)) or n_samples < 0:
            raise ValueError(f"DistributedSampler: n_samples must be a non-negative int (got {n_samples!r})")
        # No messages here: anything that says its rank and size will do, but not COMM_NULL or an intercomm.
        if isinstance(comm, MPI.Comm) or not (hasattr(comm, "Get_rank") and hasattr(comm, "Get_size")):
            check_comm("DistributedSampler", comm)
        self.n_samples = int(n_samples)
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = self.n_samples // self.size
        else:
            self.num_samples = -(-self.n_samples // self.size)
        if self.num_samples == 0 and self.n_samples > 0:
            raise ValueError(f"DistributedSampler: drop_last with {self.n_samples} samples on {self.size} ranks leaves every rank empty")

    def set_epoch(self, epoch):
        """Use the permutation of ``epoch`` on the next iteration."""
        self.epoch = int(epoch)

    def global_order(self):
        """Return the padded or truncated index order shared by all ranks."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_samples)
        else:
            order = np.arange(self.n_samples)
        total = self.num_samples * self.size
        if total > len(order):
            order = np.concatenate([order, np.resize(order, total - len(order))])
        return order[:total]

    def indices(self):
        """Return this rank's indices for the current epoch."""
        return self.global_order()[self.rank::self.size]

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self):
        return self.num_samples
