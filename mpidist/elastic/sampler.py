"""Which samples each live rank takes at each step, so that a lost rank loses no sample and repeats none.

The epoch's order is a permutation that depends only on ``(seed, epoch)``; step ``k`` of the epoch takes the
global batch ``order[k*B:(k+1)*B]`` (the tail shorter than ``B`` is dropped, as with ``drop_last``). That
global batch is split over however many ranks are alive at that step, in contiguous pieces whose sizes differ
by at most one, so the global batch, and with it the learning rate's meaning, is kept when ranks are lost:
each survivor's batch grows (4 ranks x 6 samples become 3 x 8). After a rollback the position is the
committed one, so the rest of the epoch is re-partitioned over the survivors.

Unequal pieces (a global batch of 8 on 3 ranks: 3, 3, 2) would bias DDP's plain mean over ranks; ``shard``
returns each rank's ``weight`` (its share times the number of ranks): scaling the rank's mean loss by it makes
the averaged gradient the mean over the global batch.

Two ways to keep the global batch on fewer ranks (``max_micro_batch``):

- ``None`` (default): the per-rank batch grows (4 x 6 -> 3 x 8): one forward and backward per step.
- ``m``: no rank runs more than ``m`` samples in one forward; a larger share is cut into micro-batches and the
  gradients are accumulated (``micro_batches``; the wrapper's ``no_sync`` for all but the last). Every rank
  gets the same number of micro-batches, ``ceil(largest share / m)``, so FSDP's per-forward collectives
  match across ranks; each micro-batch's ``weight`` (its size x ranks / global batch) makes the accumulated,
  averaged gradient the mean over the global batch again. Activation memory stays that of ``m`` samples;
  the price is one more forward/backward per extra micro-batch.
"""

import numpy as np

from ..partition import displacements, split_sizes

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Global batches of ``global_batch`` samples from ``n_samples``, shuffled per epoch, split over live ranks.

    ``max_micro_batch``: None (a larger share runs as one batch) or the most samples per forward, above which
    ``micro_batches`` cuts a share for gradient accumulation (module docstring).
    """

    def __init__(self, n_samples, global_batch, seed=0, shuffle=True, max_micro_batch=None):
        if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
            raise ValueError(f"ElasticSampler: global_batch must be a positive int (got {global_batch!r})")
        if not isinstance(n_samples, (int, np.integer)) or n_samples < global_batch:
            raise ValueError(f"ElasticSampler: n_samples must be an int >= global_batch (got n_samples={n_samples!r}, "
                             f"global_batch={global_batch})")
        if max_micro_batch is not None and (isinstance(max_micro_batch, bool)
                                            or not isinstance(max_micro_batch, (int, np.integer))
                                            or max_micro_batch < 2):
            # With 1, shares of 3 and 2 samples would need 3 micro-batches each: one rank would have an empty one.
            raise ValueError(f"ElasticSampler: max_micro_batch must be None (grow the per-rank batch) or an int >= 2 "
                             f"(got {max_micro_batch!r})")
        self.n_samples, self.global_batch = int(n_samples), int(global_batch)
        self.max_micro_batch = None if max_micro_batch is None else int(max_micro_batch)
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = self.n_samples // self.global_batch
        self.epoch = 0
        self.position = 0  # steps of the current epoch already taken

    def order(self, epoch=None):
        """Return the sample order of ``epoch`` (the current one by default)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.n_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)

    def global_batch_indices(self):
        """Return the sample ids of the next step's global batch."""
        start = self.position * self.global_batch
        return self.order()[start:start + self.global_batch]

    def remaining(self):
        """Return the sample ids of the current epoch not yet taken."""
        return self.order()[self.position * self.global_batch:self.steps_per_epoch * self.global_batch]

    def shard(self, rank, size):
        """Return ``(indices, weight)``: rank ``rank`` of ``size`` live ranks' part of the next global batch."""
        if not 0 <= rank < size:
            raise ValueError(f"ElasticSampler.shard: rank {rank} is not in [0, {size})")
        if size > self.global_batch:
            raise ValueError(f"ElasticSampler.shard: {size} ranks cannot share a global batch of "
                             f"{self.global_batch} samples (every rank needs at least one)")
        counts = split_sizes(self.global_batch, size)
        start = displacements(counts)[rank]
        indices = self.global_batch_indices()[start:start + counts[rank]]
        return indices, counts[rank] * size / self.global_batch

    def micro_batches(self, rank, size):
        """Return ``[(indices, weight), ...]``: rank ``rank``'s share of the next global batch, in micro-batches.

        One micro-batch (``shard``'s) unless the share exceeds ``max_micro_batch``; then every rank gets
        ``ceil(largest share / max_micro_batch)`` micro-batches of near-equal sizes. Weight each micro-batch's mean
        loss by its ``weight`` and accumulate (no_sync on all but the last): the averaged gradient is the mean
        over the global batch.
        """
        indices, _ = self.shard(rank, size)
        count = 1
        if self.max_micro_batch is not None:
            largest = -(-self.global_batch // size)
            count = -(-largest // self.max_micro_batch)
        sizes = split_sizes(len(indices), count)
        return [(indices[start:start + n], n * size / self.global_batch)
                for start, n in zip(displacements(sizes), sizes)]

    def advance(self):
        """Move past the step just taken (into the next epoch after the last one)."""
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
