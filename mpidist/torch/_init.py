"""Registration and rendezvous: ``dist.init_process_group("mpidist")`` under mpiexec/srun, no address needed.

Glossary:
- MPI store: a ``torch.distributed.TCPStore`` served by world rank 0 whose host and port every rank learns
  over MPI (one broadcast), so nobody sets MASTER_ADDR/MASTER_PORT. torch keeps its bookkeeping there,
  and other backends meet in it: ``new_group(backend="gloo")`` beside an ``mpidist`` default group works.
- rendezvous: what turns ``init_method`` into (store, rank, world size). ``mpi://`` always comes from MPI;
  ``env://`` (torch's default) too when MASTER_ADDR is unset, and torch's own otherwise.
"""

import os
import socket
import urllib.parse
from datetime import timedelta

import torch.distributed as dist
import importlib
from mpi4py import MPI

from .. import config
from ..comm import node_comm
from . import _c10d, _work
from ._backend import BACKEND_NAME, ProcessGroupMPI

__all__ = ["mpi_store", "register"]

_stores = {}


def mpi_store(timeout=timedelta(minutes=5)):
    """Return this job's MPI store (see the glossary); collective over COMM_WORLD the first time."""
    world = MPI.COMM_WORLD
    if "store" in _stores:
        return _stores["store"]
    host = config.get("MPIDIST_STORE_HOST") or ""
    names = world.allgather(socket.gethostname())
    if not host:
        # One node: loopback always works; several: rank 0's host name, which a cluster resolves.
        host = "127.0.0.1" if len(set(names)) == 1 else names[0]
    if world.Get_rank() == 0:
        try:
            store = dist.TCPStore(host, 0, world.Get_size(), True, timeout, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # noqa: BLE001 - every rank must learn that it failed
            store, port = None, f"{type(exc).__name__}: {exc}"
        world.bcast(port, root=0)
    else:
        port = world.bcast(None, root=0)
        store = None
    if not isinstance(port, int):
        raise RuntimeError(f"mpidist: rank 0 could not start the MPI store on {host!r} ({port}); "
                           f"set MPIDIST_STORE_HOST to an address of rank 0's node that the other nodes reach")
    if store is None:
        store = dist.TCPStore(host, port, world.Get_size(), False, timeout)
    _stores["store"] = store
    return store


def _mpi_rendezvous(url, timeout=timedelta(minutes=5), **kwargs):
    """Yield (MPI store, rank, world size) with rank and size from MPI, refusing other given values."""
    world = MPI.COMM_WORLD
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    rank, size = world.Get_rank(), world.Get_size()
    for key, mine in (("rank", rank), ("world_size", size)):
        if key in query and int(query[key]) != mine:
            raise ValueError(f"mpidist rendezvous: {key}={query[key]} was given but MPI says {mine}; "
                             f"leave {key} out under mpiexec/srun (MPI decides it)")
    yield mpi_store(timeout), rank, size
    raise RuntimeError("mpidist rendezvous: cannot rendezvous twice in one job")


def _env_rendezvous(original):
    def handler(url, **kwargs):
        if os.environ.get("MASTER_ADDR"):
            return original(url, **kwargs)
        return _mpi_rendezvous(url, **kwargs)
    handler.mpidist = True
    return handler


def _create(options, backend_options=None):
    """torch's creator hook: the group communicator for this process group (see _backend)."""
    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group)
    if not ranks:
        comm = world.Dup()
    else:
        if dist.is_initialized() and dist.get_rank() != world.Get_rank():
            raise RuntimeError(f"mpidist new_group: torch's global rank {dist.get_rank()} is MPI world rank "
                               f"{world.Get_rank()}; initialise the default group from MPI (init_process_group with no rank)")
        everyone = world.Get_group()
        members = everyone.Incl(ranks)
        comm = world.Create_group(members)
        members.Free()
        everyone.Free()
    comm.Set_name(f"torch:{options.group_id}")
    if _work.PROGRESS == "auto":  # the first mpidist group decides (collective over its members)
        with node_comm(comm) as node:
            _work.decide_progress(node.Get_size(), os.cpu_count() or 1)
    return ProcessGroupMPI(comm, options.group_rank, options.group_size, name=str(options.group_id),
                           store=options.store, timeout=options.timeout)


def register():
    """Register the backend and the rendezvous handlers (once; importing mpidist.torch does it)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if "mpi" not in handlers:
        dist.register_rendezvous_handler("mpi", _mpi_rendezvous)
    # torch's default init_method is env://, which needs MASTER_ADDR and MASTER_PORT; under MPI they are
    # unknown, so env:// without MASTER_ADDR rendezvouses over MPI instead (there is no public way to
    # change the default, hence the handler table; with MASTER_ADDR set torch's own handler runs).
    if "env" in handlers and not getattr(handlers["env"], "mpidist", False):
        handlers["env"] = _env_rendezvous(handlers["env"])
    _c10d.install()
