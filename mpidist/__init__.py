"""mpidist: distributed training over mpi4py communicators (or a simulated one) on numpy and CuPy arrays."""

from . import config as _config

_config.check()  # a bad MPIDIST_* value ends the program here, naming it (docs/environment.md)

from .comm import (CollectiveMismatchError, CommError, DeadlockError, RankFailedError, SimAbort, SimComm,
                   simulate)
from .collectives import (allgather, allreduce, alltoall, barrier, broadcast, iallgather, iallreduce, ibroadcast,
                          irecv, ireduce_scatter, isend, recv, reduce_scatter, send)
from .launch import LaunchError, LaunchInfo, init
from .nn.random import manual_seed
from .parallel import DDP, FSDP, DeviceMesh, Pipeline, ShardingStrategy, mesh
from .parallel import full_optimizer_state_dict, full_state_dict, iter_full_state, load_full_state_dict

__version__ = "0.1.0"

__all__ = [
    "SimComm", "simulate", "init", "manual_seed", "LaunchInfo", "LaunchError",
    "CommError", "CollectiveMismatchError", "RankFailedError", "DeadlockError", "SimAbort",
    "allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "send", "recv", "isend", "irecv", "barrier",
    "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "DDP", "FSDP", "ShardingStrategy", "Pipeline", "mesh",
    "DeviceMesh", "full_state_dict", "iter_full_state", "load_full_state_dict", "full_optimizer_state_dict",
]

if _config.get("MPIDIST_TRACE"):  # MPIDIST_TRACE=DIR traces any program that imports mpidist
    from . import trace as _trace  # noqa: F401,E402
