"""FSDP's state dicts: the full one (gathered on rank 0) and the sharded one (this rank's shards).

The full one is ``mpidist.parallel.full_state``'s gather and load over FSDP's communicator, of the module as FSDP's
ranks hold it: a parameter's tensor-parallel slice (FSDP over the data-parallel ranks of tensor-parallel blocks)
counts as the whole tensor, so rank 0 of ``fsdp.comm`` gets the slices of its own tensor-parallel rank, as it
always did. For the unsplit model across the tensor-parallel ranks too, call ``mpidist.full_state_dict(fsdp,
comm=<the world communicator>)``. The sharded one reads ``FSDP.shard_layout()`` only.
"""

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping

from ...xp import asarray_like, copy_into
from .. import full_state
from ..interface import Wrapper

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict"]


class _OwnRanks(Wrapper):
    """``fsdp``'s layout seen over its own ranks: each parameter's tensor-parallel block taken as the whole tensor."""

    def __init__(self, fsdp):
        self.fsdp, self.mesh = fsdp, fsdp.mesh

    def placed_parameters(self):
        return tuple(dataclasses.replace(p, placement=dataclasses.replace(p.placement, block=None))
                     for p in self.fsdp.placed_parameters())

    def named_buffers_global(self):
        return self.fsdp.named_buffers_global()

    def communicators(self):
        return self.fsdp.communicators()

    def grad_norm_comms(self):
        return ()

    def no_sync(self):
        return self.fsdp.no_sync()

    def sync_gradients(self):
        self.fsdp.sync_gradients()

    def remove(self):
        pass


def full_state_dict(fsdp):
    """Gather the full state one tensor at a time to rank 0 of ``fsdp.comm`` and return it there (``{}`` elsewhere).

    Keys and order are the wrapped module's ``state_dict()``'s; values numpy arrays (each chunk from the lowest
    rank holding it: under hybrid sharding several ranks hold copies).
    """
    return full_state.full_state_dict(_OwnRanks(fsdp), fsdp.comm, rank=0)


def load_full_state_dict(fsdp, state_dict):
    """Load rank 0's full ``state_dict`` (other ranks may pass None) and re-shard it one tensor at a time.

    Bad keys, shapes or dtypes raise ValueError on every rank before anything is written.
    """
    full_state.load_full_state_dict(_OwnRanks(fsdp), state_dict, fsdp.comm, rank=0,
                                    context="FSDP.load_full_state_dict")


def sharded_state_dict(fsdp):
    """Return this rank's shards, no communication: ``{unit label: {"shard", "params", "numel", "num_shards", "rank"}}``."""
    return OrderedDict((s.label, {"shard": s.parameter.data.copy(), "params": tuple(p.name for p in s.params),
                                  "numel": s.numel, "num_shards": s.num_shards, "rank": s.shard_index})
                       for s in fsdp.shard_layout())


def load_sharded_state_dict(fsdp, state_dict):
    """Load shards saved by ``sharded_state_dict()`` with the same units, shard group size and shard index."""
    fn = "FSDP.load_sharded_state_dict"
    layout = fsdp.shard_layout()
    labels = [s.label for s in layout]
    if not isinstance(state_dict, Mapping) or list(state_dict) != labels:
        got = list(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"{fn}: units do not match (expected: {labels}, got: {got})")
    for s in layout:
        entry = state_dict[s.label]
        mine = {"params": tuple(p.name for p in s.params), "numel": s.numel, "num_shards": s.num_shards,
                "rank": s.shard_index}
        saved = {k: (tuple(entry.get(k, ())) if k == "params" else entry.get(k)) for k in mine}
        if saved != mine:
            raise ValueError(f"{fn}: unit {s.label!r} was saved with a different layout (saved: {saved}, here: {mine})")
        if tuple(entry["shard"].shape) != (s.shard_numel,):
            raise ValueError(f"{fn}: shard of unit {s.label!r} has shape {tuple(entry['shard'].shape)} "
                             f"(expected ({s.shard_numel},))")
    for s in layout:
        copy_into(s.parameter.data, asarray_like(state_dict[s.label]["shard"], s.parameter.data))
