"""``dist.split_group`` and ``dist.monitored_barrier`` for ``mpidist`` groups, where torch itself refuses.

Glossary:
- torch's route: ``dist.split_group`` splits only when an accelerator is available and the default group
  has a bound device (``init_process_group(device_id=...)``); then it calls the parent group's
  ``split_group`` (ours: ``ProcessGroupMPI.split_group``, one ``MPI_Comm_split``). On a CPU-only job it
  raises before reaching the backend. ``dist.monitored_barrier`` raises for any backend but gloo.
- our route: for an ``mpidist`` group where torch would refuse, the same steps as torch's (checks, the
  hashed group name, registration in torch's tables) around the same backend method; for every other
  group (other backends, or torch's route available), torch's own function runs unchanged.

``install()`` puts the two wrappers where callers find them (``torch.distributed`` and
``torch.distributed.distributed_c10d``), as ``_init`` does for the ``env://`` handler; importing
``mpidist.torch`` calls it. Code that imported torch's functions by name before that keeps torch's.
"""

import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from ._backend import BACKEND_NAME, ProcessGroupMPI

__all__ = ["split_group", "monitored_barrier", "install"]

_c10d = dist.distributed_c10d
_torch_split_group = _c10d.split_group
_torch_monitored_barrier = _c10d.monitored_barrier


def _torch_route_splits(default):
    """Whether torch's own split_group reaches the backend (see the glossary)."""
    if _c10d._use_torchcomms_enabled():
        return True
    return default.bound_device_id is not None and torch.accelerator.is_available()


@functools.wraps(_torch_split_group)
def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None):
    default = _c10d._get_default_group()
    parent = parent_pg or default
    if not isinstance(parent, ProcessGroupMPI) or _torch_route_splits(default):
        return _torch_split_group(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    if backend is not None and str(backend).lower() != BACKEND_NAME:
        raise ValueError(f"mpidist split_group: the parent group's backend is {BACKEND_NAME!r}, backend={backend!r} was asked")
    world = _c10d._world
    if parent not in world.pg_group_ranks:
        raise ValueError(f"Group {parent} is not registered")
    to_group = world.pg_group_ranks[parent]
    global_rank = default.rank()
    if global_rank not in to_group:
        raise ValueError(f"Global rank {global_rank} is not part of the parent group {parent}")
    me = to_group[global_rank]
    seen = set()
    for split in split_ranks:
        if len(split) == 0:
            raise ValueError("the split group cannot be empty")
        if len(split) != len(set(split)):
            raise ValueError(f"the split group cannot have duplicate ranks (got {list(split)})")
        bad = [r for r in split if not 0 <= r < parent.size()]
        if bad:
            raise ValueError(f"split {list(split)} names ranks {bad} outside the parent group of {parent.size()}")
        if seen & set(split):
            raise ValueError(f"splits {[list(s) for s in split_ranks]} overlap in ranks {sorted(seen & set(split))}")
        seen |= set(split)
    mine = next((sorted(s) for s in split_ranks if me in s), sorted(split_ranks[0]))
    name = _c10d._process_group_name(mine, use_hashed_name=True)
    if timeout is None:
        timeout = _c10d._get_default_timeout(dist.Backend(BACKEND_NAME))
    group = parent.split_group(mine, timeout=timeout, group_name=name, group_desc=group_desc)
    if group is None:
        return None
    to_global = {g: w for w, g in to_group.items()}
    _c10d._register_pg_in_world(group, backend_name=dist.Backend(BACKEND_NAME), store=group.get_group_store(),
                                group_name=name, backend_config=str(_c10d.BackendConfig(dist.Backend(BACKEND_NAME))),
                                rank_mapping={to_global[r]: i for i, r in enumerate(mine)})
    return group


@functools.wraps(_torch_monitored_barrier)
def monitored_barrier(group=_c10d.GroupMember.WORLD, timeout=None, wait_all_ranks=False):
    pg = _c10d._get_default_group() if group is None and dist.is_initialized() else group
    if _c10d._rank_not_in_group(group) or not isinstance(pg, ProcessGroupMPI):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is None:
        timeout = _c10d._get_default_timeout(dist.Backend(BACKEND_NAME))
    elif isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)  # torch converts a float the same way (with a warning)
    _c10d._check_valid_timeout(timeout)
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def install():
    for module in (dist, _c10d):
        module.split_group = split_group
        module.monitored_barrier = monitored_barrier
