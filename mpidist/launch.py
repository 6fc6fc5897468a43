"""Start-up: the world communicator, who runs where, and abort-on-error.

``init()`` is what a training script calls first. It detects the silent misconfiguration where the
launcher started N processes but MPI gave each a world of one (``srun --mpi=none``, or an mpiexec
from a different MPI than mpi4py was built against), and installs an excepthook so that an uncaught
exception on one rank aborts the whole job instead of leaving the other ranks waiting forever.
"""

import dataclasses
import faulthandler
import os
import sys
import threading
import time
import traceback
import warnings

from . import guard
from .comm import check_comm, is_simulated, node_comm

__all__ = ["LaunchInfo", "LaunchError", "init", "detect_launcher", "expected_world_size", "install_abort_on_error",
           "select_device"]


class LaunchError(RuntimeError):
    """The job was started in a way that cannot work (e.g. every process is rank 0 of 1)."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """Where this process runs: ranks, node layout, launcher and MPI library."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: int
    launcher: str
    mpi_library: str
    mpi_version: str
    device: object = None  # the CUDA device index init() selected, None without cupy or a GPU

    def __str__(self):
        gpu = "" if self.device is None else f" gpu {self.device}"
        return (f"rank {self.rank}/{self.size} local {self.local_rank}/{self.local_size} nodes {self.nodes} "
                f"launcher {self.launcher} mpi {self.mpi_library} (MPI {self.mpi_version}){gpu}")


def detect_launcher(environ=None):
    """Return 'srun', 'mpiexec' or 'none' from the environment a launcher leaves in each process."""
    env = os.environ if environ is None else environ
    # Variables only an mpiexec sets come first: an mpiexec inside a Slurm allocation starts its
    # proxies with srun, so its processes see srun's variables too.
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD", "MPI_LOCALRANKID")):
        return "mpiexec"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return "srun"
    if any(k in env for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK")):
        return "mpiexec"
    return "none"


def expected_world_size(environ=None):
    """Return how many processes the launcher says it started (None when it does not say).

    The MPI launcher's own count comes first: an mpiexec inside a Slurm allocation starts its proxies
    with srun, so SLURM_STEP_NUM_TASKS then counts proxies (nodes), not MPI processes.
    """
    env = os.environ if environ is None else environ
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):
        value = env.get(key)
        if value and value.isdigit():
            return int(value)
    return None


def _check_world(size, environ=None):
    env = os.environ if environ is None else environ
    expected = expected_world_size(env)
    if expected is not None and expected > 1 and size == 1:
        launcher = detect_launcher(env)
        if launcher == "srun":
            hint = ("srun started the tasks without a process-management interface MPI understands: "
                    "launch with 'srun --mpi=pmi2' (MPICH, including the mpich wheel) or 'srun --mpi=pmix' (Open MPI), "
                    "or set MpiDefault in slurm.conf")
        else:
            hint = ("the mpiexec that started this job belongs to a different MPI library than the one mpi4py uses: "
                    "run the mpiexec of the same installation (e.g. .venv/bin/mpiexec for the mpich wheel)")
        raise LaunchError(f"mpidist.init: the launcher started {expected} processes but MPI reports a world of 1 "
                          f"(every process would be rank 0 and repeat the same work); {hint}")


# Exit status of a job ended by Ctrl-C (128 + SIGINT, as shells report it), and how long ranks other
# than 0 wait before reporting an interrupt themselves (rank 0's abort usually ends them first).
INTERRUPTED_EXIT = 130
INTERRUPT_GRACE = 1.0


def _abort(comm, code=1, grace=10.0, quiet=False):
    """Abort the job (with stderr on /dev/null when ``quiet``); end this process ``grace`` s later if Abort has not.

    MPI_Abort need not return, nor end the process, and it waits holding the GIL: a singleton under Open MPI 4
    waits there for its orted, which inherited our stderr and blocks writing its own abort message to it when
    nobody reads. faulthandler's watchdog is a C thread, so its exit (status 1) comes even then.
    """
    faulthandler.dump_traceback_later(grace, exit=True, file=open(os.devnull, "w"))
    try:
        if quiet:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    finally:
        try:
            comm.Abort(code)
        except BaseException:
            faulthandler.cancel_dump_traceback_later()  # a simulated communicator's Abort raises: no exit
            raise
        os._exit(code)  # an Abort that returned: the process must still end, not finalize and wait


def install_abort_on_error(comm, backstop=10.0):
    """Make an uncaught exception on this rank print a rank-prefixed traceback and abort every rank.

    If reporting takes longer than ``backstop`` seconds (stderr blocked), the job is aborted anyway, and
    if that abort has not ended this process ``backstop`` seconds later, it exits without MPI.
    """
    rank = comm.Get_rank()

    def report_and_abort(exc_type, exc, tb):
        # Writing can block (a launcher that stopped reading our stderr): abort from a timer then,
        # with stderr pointed at /dev/null first, as MPI_Abort writes a line there too.
        timer = threading.Timer(backstop, _abort, (comm, 1, backstop, True))
        timer.daemon = True
        timer.start()
        interrupted = isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt)
        try:
            prefix = f"[rank {rank}] "
            if interrupted:
                # Ctrl-C, which mpiexec forwards to every rank: not a bug, so no traceback, and one line
                # per job: rank 0 speaks, the others give its abort a moment to end them first.
                if rank != 0:
                    time.sleep(INTERRUPT_GRACE)
                sys.stderr.write(f"{prefix}mpidist: interrupted (KeyboardInterrupt), aborting all "
                                 f"{comm.Get_size()} ranks without saving\n")
            else:
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
                sys.stderr.write(f"{prefix}mpidist: uncaught exception, aborting all {comm.Get_size()} ranks\n")
            sys.stderr.flush()
            sys.stdout.flush()
            if not interrupted:  # Ctrl-C is the user's choice, not a failure to diagnose: no files, no extra line
                guard.dump_flight_record(f"abort: {getattr(exc_type, '__name__', exc_type)}: {exc}")
            guard.wait_until_pipes_drained((1, 2))
        finally:
            # Whatever went wrong while reporting (a closed stderr, say), the job must still end: a rank
            # that returns from here would finalize MPI while the others wait for it forever.
            # MPI's own abort line adds nothing after Ctrl-C
            _abort(comm, INTERRUPTED_EXIT if interrupted else 1, backstop, quiet=interrupted)

    sys.excepthook = report_and_abort
    threading.excepthook = lambda args: report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)


def select_device(local, local_rank):
    """Use GPU ``local_rank % visible GPUs`` (if cupy sees any); warn when ranks of a node share one.

    Collective over ``local`` (the ranks of this node). Returns the device index or None.
    """
    from . import xp

    count = xp.gpu_count()
    device, key = None, None
    if count:
        cupy = xp.get_cupy()
        device = local_rank % count
        cupy.cuda.Device(device).use()
        # The PCI bus id names the physical GPU even when each rank sees different CUDA_VISIBLE_DEVICES.
        key = str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    keys = local.allgather(key)
    sharing = [r for r, k in enumerate(keys) if k is not None and keys.count(k) > 1]
    if key is not None and local_rank in sharing:
        peers = [r for r in sharing if keys[r] == key]
        warnings.warn(f"mpidist.init: local ranks {', '.join(map(str, peers))} share GPU {key} (device {device} of {count} "
                      f"visible): NCCL cannot be used; collectives use CUDA IPC or host staging. "
                      f"Start at most one rank per GPU for full speed, or start NVIDIA MPS (nvidia-cuda-mps-control -d) "
                      f"before the job: without it the GPU time-slices between the ranks' processes (docs/gpu.md)",
                      RuntimeWarning, stacklevel=3)
    return device


def init(comm=None, *, abort_on_error=True, collective_timeout=None, checkpoint_timeout=None, watchdog_timeout=None):
    """Return ``(comm, info)``: the world communicator and where this process runs.

    Under mpiexec/srun ``comm`` is ``MPI.COMM_WORLD``; started plainly it is a world of one.
    With cupy and a GPU, selects GPU ``local_rank % visible GPUs`` (``info.device``) and warns when
    ranks of a node share a GPU.
    Raises ``LaunchError`` when the launcher started several processes but MPI sees only one.
    Starts the watchdog (``mpidist.guard``): a collective stuck longer than ``collective_timeout``
    seconds (default ``MPIDIST_COLLECTIVE_TIMEOUT`` or 300; 0: no limit; ``watchdog_timeout`` is its
    former name), or a checkpoint save/load longer than ``checkpoint_timeout`` (default
    ``MPIDIST_CHECKPOINT_TIMEOUT`` or 1800), is reported with the ranks that did and did not arrive,
    every rank writes its flight record, and the job is aborted. A rank whose program ends normally
    (``return``, ``sys.exit``, one batch fewer) tells the other ranks' watchdogs from an exit handler: a rank
    waiting in a collective it never joins reports it within about a second and the job is aborted.
    Fails on every rank when ``MPIDIST_FLIGHT_DIR`` cannot be written (docs/environment.md).
    """
    from mpi4py import MPI


    comm = MPI.COMM_WORLD if comm is None else check_comm("init", comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    # Under `mpidist sim`, mpi4py.MPI is the simulated namespace (its Comm is SimComm): the simulator itself ends
    # every rank on an uncaught exception and times waits out, and the hooks and watchdog below are per process.
    real = not is_simulated(comm)
    if real:
        # The launcher counts processes in the world, whatever communicator the caller hands in.
        _check_world(MPI.COMM_WORLD.Get_size())
    with node_comm(comm) as local:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        nodes = comm.allreduce(1 if local_rank == 0 else 0)
        device = select_device(local, local_rank)
    # replace: Open MPI 4 counts the C string's terminating NUL in the version it returns.
    library = (MPI.Get_library_version().replace("\0", "").strip().splitlines() or ["unknown"])[0] if hasattr(MPI, "Get_library_version") else "unknown"
    version = "%d.%d" % MPI.Get_version()
    info = LaunchInfo(rank, size, local_rank, local_size, nodes, detect_launcher(), library, version, device)
    if abort_on_error and size > 1 and real:
        install_abort_on_error(comm)
    guard.configure(collective_timeout=watchdog_timeout if collective_timeout is None else collective_timeout,
                    checkpoint_timeout=checkpoint_timeout)
    if size > 1 and real:
        guard.start_watchdog(comm)
    return comm, info
