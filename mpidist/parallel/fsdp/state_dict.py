"""FSDP's state dicts: the full one (gathered on rank 0) and the sharded one (this rank's shards).

They read the wrapper through its public layout only: ``FSDP.shard_layout()`` (each unit's flat layout and this
rank's shard Parameter), ``FSDP.groups`` (which rank holds which chunk) and ``FSDP.settings``.
"""

from collections import OrderedDict
from collections.abc import Mapping

from ... import collectives
from ...comm.agree import raise_if_any
from ...xp import asarray_like, copy_into, get_array_module
from .settings import ShardingStrategy

__all__ = ["full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict"]

# Point-to-point tag of state-dict transfers; far from the small tags user code tends to pick.
_STATE_TAG = 0x5D5D


def _whole(fsdp):
    """Return whether every rank holds whole units (NO_SHARD): then there is nothing to gather or scatter."""
    return fsdp.settings.strategy is ShardingStrategy.NO_SHARD


def _views(unit, flat):
    """Return ``[(name, view)]``: each parameter of ``unit`` (a ``UnitShard``) as a view of its flat parameter."""
    return [(span.name, flat[span.offset: span.offset + span.numel].reshape(span.shape)) for span in unit.params]


def full_state_dict(fsdp):
    """Gather the full state unit by unit to rank 0 and return it there (other ranks get ``{}``).

    Chunk ``i`` comes from the lowest rank holding it (under hybrid sharding several ranks hold copies).
    """
    comm = fsdp.comm
    rank = comm.Get_rank()
    groups, whole = fsdp.groups, _whole(fsdp)
    holders = [groups.holder_of(i) for i in range(groups.num_shards)]
    gathered = {}
    for u in fsdp.shard_layout():
        shard = u.parameter.data
        if whole:
            full = shard
        elif rank == 0:
            full = get_array_module(shard).empty(u.shard_numel * u.num_shards, dtype=shard.dtype)
            for i, holder in enumerate(holders):
                chunk = full[i * u.shard_numel: (i + 1) * u.shard_numel]
                copy_into(chunk, shard if holder == 0 else collectives.recv(holder, comm, tag=_STATE_TAG))
        else:
            if rank in holders:
                collectives.send(shard, 0, comm, tag=_STATE_TAG)
            continue
        if rank == 0:
            for name, view in _views(u, full):
                gathered[name] = view.copy()
    if rank != 0:
        return OrderedDict()
    out = OrderedDict((name, gathered[name]) for name, _ in fsdp.module.named_parameters())
    out.update((name, b.copy()) for name, b in fsdp.module.named_buffers())
    return out


def _validate_full(fsdp, state_dict):
    """Return what is wrong with ``state_dict`` (a message) or None."""
    fn = "FSDP.load_full_state_dict"
    if not isinstance(state_dict, Mapping):
        return f"{fn}: rank 0 must pass a mapping of name -> array (got {type(state_dict).__name__})"
    shapes = OrderedDict((span.name, tuple(span.shape)) for u in fsdp.shard_layout() for span in u.params)
    shapes.update((n, tuple(b.shape)) for n, b in fsdp.module.named_buffers())
    missing = [k for k in shapes if k not in state_dict]
    unexpected = [k for k in state_dict if k not in shapes]
    if missing or unexpected:
        return f"{fn}: keys do not match the module (missing: {missing}, unexpected: {unexpected})"
    for name, shape in shapes.items():
        got = tuple(getattr(state_dict[name], "shape", ()))
        if got != shape:
            return f"{fn}: shape mismatch for {name!r} (state_dict: {got}, model: {shape})"
    return None


def load_full_state_dict(fsdp, state_dict):
    """Load rank 0's full ``state_dict`` (other ranks may pass None) and re-shard it unit by unit."""
    comm = fsdp.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    shard_of, whole = fsdp.groups.shard_of, _whole(fsdp)  # every rank gets its chunk from rank 0, replicas included
    # Rank 0 validates; every rank raises the same ValueError (none is left waiting in a transfer).
    raise_if_any(comm, _validate_full(fsdp, state_dict) if rank == 0 else None, "")
    for u in fsdp.shard_layout():
        shard, n = u.parameter.data, u.shard_numel
        if rank == 0:
            flat = shard if whole else get_array_module(shard).zeros(n * u.num_shards, shard.dtype)
            for name, view in _views(u, flat):
                copy_into(view, state_dict[name])
        if whole:
            collectives.broadcast(shard, comm)
        elif rank == 0:
            pending = [collectives.isend(flat[shard_of[r] * n: (shard_of[r] + 1) * n], r, comm, tag=_STATE_TAG)
                       for r in range(1, size)]
            shard[...] = flat[shard_of[0] * n: (shard_of[0] + 1) * n]
            for handle in pending:
                handle.wait()
        else:
            copy_into(shard, collectives.recv(0, comm, tag=_STATE_TAG))
    for name, b in fsdp.module.named_buffers():
        if rank == 0:
            copy_into(b, state_dict[name])
        collectives.broadcast(b, comm)


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
