"""Choose the GPU path of a communicator, once, on every rank alike, and log why.

Order (the first that works wins):
1. cuda_aware  every rank's MPI says it takes CUDA buffers (MPIDIST_CUDA_AWARE=0/1 overrides the
               library's answer) and a tiny device-buffer allreduce gives the right values;
2. nccl        NCCL is usable on every rank and no two ranks of a node share a GPU;
3. ipc         all ranks on one node (GPUs may be shared) and a tiny IPC allreduce works;
4. hierarchical several nodes, each with the same number (> 1) of ranks, and IPC works within them;
5. staged      pinned host staging: always works.
A communicator of one rank uses "self" (nothing moves).

Each rank gathers facts about itself (node, GPU, what its MPI library says, NCCL) and one allgather
gives every rank all of them, so every rank takes the same decision. Self-tests end with an
agreement step, so a test that fails on one rank fails on all. Choosing is collective over the
communicator: the first device collective on a communicator does it (``attach`` does it explicitly).
"""

import dataclasses
import logging
import socket
import threading
import weakref

import numpy as np
from mpi4py import MPI

from .. import config, xp as _xp
from ..comm import is_simulated, node_comm
from ..comm.agree import describe_ranks
from .base import Op, SelfPath, Settings
from .direct import DirectPath
from .hierarchical import HierarchicalPath
from .ipc import IpcPath, IpcUnavailable
from .nccl import NcclPath
from .probe import MPIProbe, probe_mpi_cuda_support
from .staged import StagedPath

__all__ = ["Choice", "PATHS", "attach", "describe", "engine", "release", "self_test"]

log = logging.getLogger("mpidist.gpu")

PATHS = config.GPU_PATHS


@dataclasses.dataclass(frozen=True)
class Choice:
    """The path a communicator uses and the reasons, in the order they were found."""

    path: str
    reasons: tuple

    def __str__(self):
        return f"{self.path} ({'; '.join(self.reasons)})"


@dataclasses.dataclass(frozen=True)
class _Facts:
    node: int            # rank (in the communicator) of the first rank on this rank's node
    host: str
    device_key: str
    cuda_claim: object   # True / False / None (unknown) after the environment override
    cuda_source: str     # who said so
    nccl: bool
    nccl_reason: str


def _env_cuda_aware():
    return config.get("MPIDIST_CUDA_AWARE")


def _env_path():
    return config.get("MPIDIST_GPU_PATH")


def _my_facts(comm, local, device, probe):
    env = _env_cuda_aware()
    if env is not None:
        claim, source = env, f"MPIDIST_CUDA_AWARE={int(env)}"
    else:
        answer = probe_mpi_cuda_support() if probe is None else probe
        claim, source = answer.cuda_support, str(answer)
    nccl, nccl_reason = device.nccl_status()
    return _Facts(local.bcast(comm.Get_rank(), root=0), socket.gethostname(), device.device_key(),
                  claim, source, bool(nccl), nccl_reason)


def self_test(path):
    """Run a tiny allreduce on ``path``; return None if every rank got the right values, else what went wrong."""
    d, size = path.device, path.size
    n = 7  # odd, so IPC slices are uneven
    x = d.asarray(np.arange(n, dtype=np.float64) + path.rank)
    want = np.arange(n, dtype=np.float64) * size + size * (size - 1) / 2
    error = None
    try:
        path.allreduce(x, Op(MPI.SUM, "SUM"))
        got = d.to_numpy(x)
        if not np.array_equal(got, want):
            error = f"got {got.tolist()}"
    except IpcUnavailable as exc:
        return str(exc)  # raised on every rank together
    wrong = describe_ranks(path.comm.allgather(error))  # ranks that got the same values are named once
    return f"expected {want.tolist()}; {wrong}" if wrong else None


def _layout(facts):
    """Return ({node: [ranks]}, [(node, device key, [ranks])] for GPUs used by several ranks of a node)."""
    nodes, users = {}, {}
    for r, f in enumerate(facts):
        nodes.setdefault(f.node, []).append(r)
        users.setdefault((f.node, f.device_key), []).append(r)
    shared = [(node, key, ranks) for (node, key), ranks in users.items() if len(ranks) > 1]
    return nodes, shared


def _choose(comm, device, settings, facts, local, forced):
    """Return (path object, Choice); every rank computes the same from the same facts."""
    size = comm.Get_size()
    if size == 1 and forced in (None, "self"):
        return SelfPath(comm, device, settings), Choice("self", ("one rank: nothing to exchange",))
    reasons = []

    def wanted(name):
        return forced is None or forced == name

    # 1. CUDA-aware MPI. Never hand a device buffer to an MPI that has not said yes: it segfaults.
    claims = [f.cuda_claim for f in facts]
    if wanted("cuda_aware"):
        if all(c is True for c in claims):
            path = DirectPath(comm, device, settings)
            error = self_test(path)
            if error is None:
                return path, Choice("cuda_aware", tuple(reasons) + (f"{facts[0].cuda_source}; device-buffer self-test passed",))
            if any(f.cuda_source.startswith("MPIDIST_CUDA_AWARE=1") for f in facts):
                raise RuntimeError(f"mpidist.gpu: MPIDIST_CUDA_AWARE=1 but a device-buffer allreduce gave wrong values ({error}); unset it or set it to 0")
            reasons.append(f"MPI claims CUDA support but the device-buffer self-test failed ({error})")
        else:
            r = next(r for r, c in enumerate(claims) if c is not True)
            reasons.append(f"not CUDA-aware MPI (rank {r}: {facts[r].cuda_source})")
    nodes, shared = _layout(facts)

    # 2. NCCL: one GPU per rank.
    if wanted("nccl"):
        no_nccl = [r for r, f in enumerate(facts) if not f.nccl]
        if no_nccl:
            reasons.append(f"no NCCL (rank {no_nccl[0]}: {facts[no_nccl[0]].nccl_reason})")
        elif shared:
            node, key, ranks = shared[0]
            reasons.append(f"ranks {','.join(map(str, ranks))} on {facts[node].host} share GPU {key} (NCCL refuses a shared GPU)")
        else:
            return NcclPath(comm, device, settings), Choice("nccl", tuple(reasons) + ("NCCL on every rank, one GPU per rank",))

    # 3 and 4. CUDA IPC within nodes.
    local_sizes = sorted({len(ranks) for ranks in nodes.values()})
    if len(nodes) == 1 and wanted("ipc"):
        path = IpcPath(comm, device, settings)
        error = self_test(path)
        if error is None:
            return path, Choice("ipc", tuple(reasons) + (f"all {size} ranks on one node; IPC self-test passed",))
        path.close()
        reasons.append(f"CUDA IPC failed ({error})")
    elif wanted("hierarchical") and (len(nodes) > 1 or forced == "hierarchical"):
        if len(local_sizes) > 1:
            reasons.append(f"nodes have different rank counts ({', '.join(map(str, local_sizes))}): no hierarchical split")
        elif local_sizes[0] == 1:
            reasons.append("one rank per node: nothing to share within a node")
        else:
            cross = comm.Split(local.Get_rank(), comm.Get_rank())
            path = HierarchicalPath(comm, device, settings, local=local.Dup(), cross=cross)
            error = self_test(path)
            if error is None:
                return path, Choice("hierarchical", tuple(reasons) + (f"{len(nodes)} nodes x {local_sizes[0]} ranks; IPC within nodes, staged MPI between them",))
            path.close()
            reasons.append(f"CUDA IPC failed ({error})")

    if forced not in (None, "staged"):
        raise RuntimeError(f"mpidist.gpu: path {forced!r} is not possible on this communicator ({'; '.join(reasons)})")
    return StagedPath(comm, device, settings), Choice("staged", tuple(reasons) + ("pinned host staging works with any MPI",))


# -- one path per communicator ------------------------------------------------------------------------
_engines = {}
_lock = threading.Lock()  # simulated ranks are threads of one process


def _key(comm):
    # An MPI handle names the communicator in this process, whichever mpi4py object holds it.
    return ("obj", id(comm)) if is_simulated(comm) else ("mpi", comm.handle)


def _lookup(comm):
    with _lock:
        entry = _engines.get(_key(comm))
    if entry is not None and entry[0]() is comm:
        return entry
    return None


def attach(comm, device=None, *, path=None, probe=None, settings=None):
    """Choose (or force) the GPU path of ``comm`` and remember it; return the ``Choice``. Collective.

    ``device`` is a ``DeviceAPI`` (default: ``CupyDevice()`` on the current GPU); ``path`` forces one
    of ``PATHS`` (it must be possible; default: ``MPIDIST_GPU_PATH`` or the first that works);
    ``probe`` replaces the MPI library's answer (an ``MPIProbe``) in tests.
    """
    if path is not None and path not in PATHS:
        raise ValueError(f"mpidist.gpu.attach: unknown path {path!r} (expected one of {', '.join(PATHS)})")
    if probe is not None and not isinstance(probe, MPIProbe):
        raise TypeError(f"mpidist.gpu.attach: probe must be an MPIProbe (got {type(probe).__name__})")
    forced = path or _env_path()
    if device is None:
        from .device import CupyDevice
        device = CupyDevice()
    release(comm)
    settings = settings or Settings()
    with node_comm(comm) as local:
        facts = comm.allgather(_my_facts(comm, local, device, probe))
        chosen, choice = _choose(comm, device, settings, facts, local, forced)
    log.info("rank %d of %d: GPU collectives use path %s", comm.Get_rank(), comm.Get_size(), choice)
    key = _key(comm)

    def forget(ref, key=key):
        with _lock:
            if _engines.get(key, (None,))[0] is ref:
                del _engines[key]

    with _lock:
        _engines[key] = (weakref.ref(comm, forget), chosen, choice)
    return choice


def engine(comm):
    """Return the path object of ``comm``, choosing it first if needed (collective the first time)."""
    entry = _lookup(comm)
    if entry is None:
        attach(comm)
        entry = _lookup(comm)
    return entry[1]


def p2p_path(comm):
    """Return the path for a send on ``comm`` without choosing one (a send is not collective)."""
    entry = _lookup(comm)
    if entry is not None:
        return entry[1]
    from .device import CupyDevice
    return StagedPath(comm, CupyDevice())


def describe(comm):
    """Return the ``Choice`` of ``comm``: the path name and why. Collective unless already chosen or no GPU."""
    entry = _lookup(comm)
    if entry is not None:
        return entry[2]
    if _xp.get_cupy() is None:
        return Choice("none", ("cupy is not installed: device arrays cannot exist",))
    if _xp.gpu_count() == 0:
        return Choice("none", ("cupy sees no usable CUDA GPU",))
    attach(comm)
    return _lookup(comm)[2]


def release(comm):
    """Forget ``comm``'s path and release what it holds (collective when it used CUDA IPC)."""
    with _lock:
        entry = _engines.pop(_key(comm), None)
    if entry is not None and entry[0]() is comm:
        entry[1].close()
