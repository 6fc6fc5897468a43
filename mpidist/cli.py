"""``mpidist`` / ``python -m mpidist``: ``info``, ``bench`` and ``check`` for an installation and a launch;
``flight`` for the flight records a hung or aborted job left; ``trace summary`` for a timeline that
``MPIDIST_TRACE`` or ``mpidist.trace`` recorded.

Every command runs the same way on one process or on every rank of an ``mpiexec``/``srun`` launch.
Output and errors are printed once, by rank 0 (or, when a misconfigured launcher made every process
rank 0 of 1, by the process the launcher calls rank 0). Usage errors exit 2, failed checks 1.
"""

import argparse
import dataclasses
import importlib.metadata
import os
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

from . import bench, collectives, guard, xp
from .comm import simulate
from .comm.agree import describe_ranks, raise_if_any
from .launch import LaunchError, init
from .plan import cli as plan_cli

__all__ = ["main", "build_parser", "gpu_path_name"]

_RANK_VARS = ("SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def _is_printer():
    """Return whether this process prints: rank 0 of the world, or the launcher's rank 0 in a world of 1."""
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        return world.Get_rank() == 0
    for key in _RANK_VARS:
        if key in os.environ:
            return os.environ[key] == "0"
    return True


def _say(text="", file=None):
    if _is_printer():
        print(text, file=file or sys.stdout, flush=True)


class UsageError(Exception):
    """The command line is wrong; the message says how (printed once, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, and prints help on rank 0 only."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().rstrip()}")

    def _print_message(self, message, file=None):
        if message and _is_printer():
            super()._print_message(message, file)


def _bench_op(text):
    """Return ``text`` if it names a benchmarked op (argparse ``type=`` of ``bench OP``)."""
    if text not in bench.OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r} (expected one of {', '.join(bench.OPS)})")
    return text


def build_parser():
    """Return the argument parser of the ``mpidist`` command."""
    parser = _Parser(prog="mpidist", allow_abbrev=False,
                     description="Inspect, benchmark and self-test an mpidist installation (run under mpiexec/srun for N ranks).")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,check,flight,trace,sim,plan}", parser_class=_Parser)
    sub.add_parser("info", allow_abbrev=False, help="versions, MPI library, ranks and nodes, launcher, GPUs")
    b = sub.add_parser("bench", allow_abbrev=False, help="collective bandwidth, mpidist next to raw mpi4py",
                       description="Time collectives nccl-tests style (size, count, type, time, algbw, busbw) for "
                                   "mpidist and raw mpi4py in the same run.")
    # No OP sweeps every op. Checked by type=, not choices=: argparse (3.11) tests a positional's list default
    # against choices as one value and would refuse the default itself.
    b.add_argument("ops", nargs="*", type=_bench_op, default=list(bench.OPS), metavar="OP",
                   help=f"any of: {', '.join(bench.OPS)} (default: all of them)")
    b.add_argument("--sizes", default="8:64M", help="bytes: START:STOP doubles (8:64M), START:STOP:FACTOR, or a list 8,1K,1M (default 8:64M)")
    b.add_argument("--iters", type=int, default=None, help="timed calls per repetition (default: 1000 for small messages down to 5 at 64 MiB)")
    b.add_argument("--reps", type=int, default=5, help="repetitions; the median is reported (default 5)")
    b.add_argument("--dtype", default="float32", choices=("float32", "float64", "int32", "int64"), help="element type (default float32)")
    b.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="where the buffers live (gpu needs cupy and a GPU)")
    b.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    b.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    b.add_argument("--plot", metavar="PNG", help="draw busbw against size, mpidist next to raw mpi4py (needs matplotlib)")
    sub.add_parser("check", allow_abbrev=False, help="self-test: ranks, every collective against numpy, the GPU path")
    f = sub.add_parser("flight", allow_abbrev=False, help="read the flight records a hung or aborted job left",
                       description="Per communicator, the first call where the ranks' flight records differ and the "
                                   "ranks that never arrived (one process; no mpiexec needed).")
    f.add_argument("dir", metavar="DIR", help="a job's flight directory, or MPIDIST_FLIGHT_DIR (the newest job is read)")
    t = sub.add_parser("trace", allow_abbrev=False, help="read a trace (MPIDIST_TRACE=DIR, mpidist.trace)",
                       description="Read the per-rank timelines of a traced run (one process; no mpiexec needed).")
    tsub = t.add_subparsers(dest="trace_command", metavar="{summary,merge}", parser_class=_Parser, required=True)
    ts = tsub.add_parser("summary", allow_abbrev=False, help="compute, communication, exposed communication, "
                         "overlap, pipeline bubble and slowest calls per rank")
    ts.add_argument("dir", metavar="DIR", help="the trace directory (or a merged trace.json)")
    ts.add_argument("--plot", metavar="PNG", help="draw ranks x time colored by phase (needs matplotlib)")
    ts.add_argument("--top", type=int, default=5, help="slowest communication calls to list (default 5)")
    tm = tsub.add_parser("merge", allow_abbrev=False, help="merge the rank files of DIR into DIR/trace.json "
                         "(when the run ended before merging)")
    tm.add_argument("dir", metavar="DIR", help="the trace directory")
    s = sub.add_parser("sim", allow_abbrev=False, help="run an mpi4py program on N simulated ranks in this process",
                       description="Run PROG with N rank threads; 'from mpi4py import MPI' gives the simulated namespace. "
                       "As under mpiexec: stdin goes to rank 0, an uncaught exception or sys.exit(k) on one rank "
                       "ends every rank (status 1 or k); a deadlock prints each rank's pending call and stack.")
    s.add_argument("-n", type=int, required=True, metavar="N", help="number of simulated ranks")
    s.add_argument("--seed", type=int, default=None, help="seeded order among messages a wildcard receive may match (default FIFO)")
    s.add_argument("--explore", type=int, default=None, metavar="K", help="run PROG in FIFO order and under seeds "
                   "0..K-1; report the first seed whose exit status or a rank's stdout differs (exit 1 if one does)")
    s.add_argument("-l", "--prepend-rank", action="store_true", help="start each output line with [rank] (mpiexec -l)")
    s.add_argument("--timeout", type=float, default=None, metavar="S", help="stop a run still going after S seconds "
                   "(a rank looping forever, ranks waiting for it), print where each rank was and exit with status "
                   "124 (default: no limit; with --explore, each run's limit)")
    s.add_argument("--cpus", default=None, metavar="LIST", help="bind the rank threads to these CPUs (e.g. 0, 0-3); "
                   "one CPU cuts message latency ~3x, but numpy work no longer runs in parallel (MPIDIST_SIM_CPUS)")
    s.add_argument("prog", metavar="PROG", help="the Python file to run")
    s.add_argument("args", nargs=argparse.REMAINDER, help="PROG's arguments")
    plan_cli.add_parser(sub)
    return parser


def cmd_sim(args):
    """Run a program on simulated ranks; return its exit status as mpiexec would."""
    from .comm.sim.program import explore_program, program_file_problem, run_program
    if args.n < 1:
        raise UsageError(f"-n must be at least 1 (got {args.n})")
    problem = program_file_problem(args.prog)
    if problem:
        raise UsageError(problem)
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout S needs a number of seconds > 0 (got {args.timeout})")
    if args.explore is not None and (args.seed is not None or args.explore < 1):
        raise UsageError(f"--explore K needs K >= 1 and no --seed (got --explore {args.explore}, "
                         f"--seed {args.seed})")
    previous = os.environ.get("MPIDIST_SIM_CPUS")
    if args.cpus is not None:
        from .comm.sim.runner import parse_cpus
        try:
            parse_cpus(args.cpus)
        except ValueError as exc:
            raise UsageError(f"--cpus: {exc}") from None
        os.environ["MPIDIST_SIM_CPUS"] = args.cpus  # read by every simulated world the program starts
    try:
        if args.explore is not None:
            return explore_program(args.n, args.prog, args.args, seeds=args.explore, time_limit=args.timeout)
        return run_program(args.n, args.prog, args.args, seed=args.seed, prefix=args.prepend_rank,
                           time_limit=args.timeout)
    finally:
        if args.cpus is not None:  # main() may run in a process that goes on (tests): leave it as it was
            if previous is None:
                os.environ.pop("MPIDIST_SIM_CPUS", None)
            else:
                os.environ["MPIDIST_SIM_CPUS"] = previous


def main(argv=None):
    """Run the ``mpidist`` command line; return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        _say(str(exc), file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {"info": cmd_info, "bench": cmd_bench, "check": cmd_check, "flight": cmd_flight,
                "trace": cmd_trace, "sim": cmd_sim, "plan": plan_cli.run}[args.command](args)
    except (UsageError, bench.BenchError, LaunchError) as exc:
        _say(f"mpidist {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, LaunchError) else 2


def _init():
    """Return ``init()``'s communicator and launch info, with the MPI library name on one tidy line."""
    comm, info = init()
    return comm, dataclasses.replace(info, mpi_library=" ".join(info.mpi_library.split()))


# -- info ---------------------------------------------------------------------------------------------
def _version(name):
    """Return the installed version of distribution ``name`` (cupy: any cupy-cuda* wheel) without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    for dist in importlib.metadata.distributions():
        dist_name = dist.metadata["Name"] or ""
        if name == "cupy" and dist_name.lower().startswith("cupy"):
            return f"{dist.version} ({dist_name})"
    return "not installed"


def gpu_path_name(comm):
    """Return how collectives move GPU buffers over ``comm`` and why (collective when a GPU is present)."""
    from . import gpu
    return str(gpu.describe(comm))


def mpi_cuda_support():
    """Return what the MPI library itself says about CUDA support (a ctypes probe; never passes device memory)."""
    from .gpu import probe_mpi_cuda_support
    return str(probe_mpi_cuda_support())


def cmd_info(args):
    """Print versions, the MPI library, the rank/node layout, the launcher and the GPU path."""
    comm, info = _init()
    local_sizes = comm.allgather(info.local_size if info.local_rank == 0 else None)
    per_node = sorted({s for s in local_sizes if s is not None})
    hosts = sorted(set(comm.allgather(MPI.Get_processor_name())))
    gpus = xp.gpu_count()
    path = gpu_path_name(comm)
    lines = [
        f"mpidist      {_version('mpidist')}",
        f"mpi4py       {_version('mpi4py')}",
        f"numpy        {np.__version__}",
        f"cupy         {_version('cupy')}",
        f"python       {platform.python_version()} ({sys.executable})",
        f"MPI library  {info.mpi_library} (MPI {info.mpi_version})",
        f"ranks        {info.size}",
        f"ranks/node   {', '.join(map(str, per_node))}",
        f"nodes        {info.nodes} ({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''})",
        f"launcher     {info.launcher}",
        f"GPUs         {gpus} (visible to rank 0)",
        f"GPU path     {path}",
        f"MPI CUDA     {mpi_cuda_support()}",
    ]
    _say("\n".join(lines))
    return 0


# -- bench --------------------------------------------------------------------------------------------
def cmd_bench(args):
    """Measure the requested ops over the requested sizes; print the table and write JSON/CSV/PNG."""
    sizes = bench.parse_sizes(args.sizes)
    if args.plot:
        bench.require_matplotlib()  # fail before minutes of measuring, not after
    if args.device == "gpu":
        bench.device_module()
    comm, info = _init()
    # Rank 0 writes the files: a path it cannot write is refused now, on every rank, not after the measuring.
    problem = None if comm.Get_rank() else _unwritable(("--json", args.json), ("--csv", args.csv), ("--plot", args.plot))
    raise_if_any(comm, problem, None, error=bench.BenchError)
    _say(f"# mpidist bench: {info.size} ranks on {info.nodes} node(s), {info.mpi_library}, launcher {info.launcher}, "
         f"device {args.device}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    current = [None]

    def progress(result):
        if result.op != current[0]:
            current[0] = result.op
            _say(bench.table_header(result.op, result.ranks))
        _say(bench.table_row(result))

    results = bench.run(args.ops, sizes, comm, dtype=args.dtype, device=args.device, iters=args.iters,
                        reps=args.reps, progress=progress)
    if comm.Get_rank() == 0:
        meta = {"ranks": info.size, "nodes": info.nodes, "mpi_library": info.mpi_library, "launcher": info.launcher,
                "device": args.device, "host": platform.node(), "mpidist": _version("mpidist"),
                "mpi4py": _version("mpi4py"), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "command": " ".join(sys.argv)}
        if args.json:
            bench.write_json(args.json, results, meta)
        if args.csv:
            bench.write_csv(args.csv, results)
        if args.plot:
            bench.plot(args.plot, results, title=f"{info.size} ranks, {info.mpi_library.split(',')[0]}, {args.device}")
        for path in (args.json, args.csv, args.plot):
            if path:
                _say(f"# wrote {path}")
    return 0


def _unwritable(*paths):
    """Return why one of the (flag, path) pairs cannot be written ("--json 'x': ..."), or None (unset paths pass)."""
    for flag, path in paths:
        if not path:
            continue
        if os.path.isdir(path):
            return f"{flag} {path!r}: is a directory"
        existed = os.path.exists(path)
        try:
            with open(path, "a"):  # appending nothing leaves an existing file as it is
                pass
        except OSError as exc:
            return f"{flag} {path!r}: cannot write it ({exc.strerror})"
        if not existed:
            os.remove(path)
    return None


# -- check --------------------------------------------------------------------------------------------
def _rank_input(rank, shape, dtype):
    """Return rank ``rank``'s deterministic input; values are multiples of 1/4 so sums are exact."""
    rng = np.random.default_rng([7, rank])
    values = rng.integers(-8, 9, size=shape)
    return (values / 4 if np.dtype(dtype).kind == "f" else values).astype(dtype)


def _expect(got, want, what):
    if got.shape != want.shape or got.dtype != want.dtype or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        diff = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))) if got.shape == want.shape else "n/a"
        raise AssertionError(f"{what}: result differs from numpy (got {got.dtype} {got.shape}, "
                             f"want {want.dtype} {want.shape}, max abs diff {diff})")


def _check_ranks(comm):
    n = comm.Get_size()
    ranks = comm.allgather(comm.Get_rank())
    sizes = comm.allgather(n)
    if ranks != list(range(n)) or set(sizes) != {n}:
        raise AssertionError(f"ranks {ranks} / sizes {sizes} (want 0..{n - 1} / all {n})")
    return f"ranks 0..{n - 1} of {n}, all agree"


def _check_allreduce(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    refs = {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}
    for dtype in ("float32", "float64", "int32"):
        inputs = [_rank_input(r, (5, 3), dtype) for r in range(n)]
        for op in ("sum", "mean", "min", "max", "prod"):
            if op == "mean" and dtype == "int32":
                continue
            want = (np.mean(inputs, axis=0) if op == "mean" else refs[op](inputs, axis=0)).astype(dtype)
            _expect(collectives.allreduce(inputs[rank].copy(), comm, op), want, f"allreduce {op} {dtype}")
    strided = np.zeros((6, 4), dtype=np.float64)
    strided[::2] = _rank_input(rank, (3, 4), "float64")
    collectives.allreduce(strided[::2], comm)
    _expect(strided[::2], np.sum([_rank_input(r, (3, 4), "float64") for r in range(n)], axis=0), "allreduce of a strided view")
    big = np.full(1 << 20, rank + 1.0, dtype=np.float32)  # 4 MiB: the large-message protocol
    handle = collectives.iallreduce(big, comm)
    _expect(handle.wait(), np.full(1 << 20, n * (n + 1) / 2, dtype=np.float32), "iallreduce of 4 MiB")
    return "sum/mean/min/max/prod on float32, float64, int32; strided view; nonblocking 4 MiB"


def _check_broadcast(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    root = n - 1
    x = _rank_input(rank, (4, 2), "float64")
    _expect(collectives.broadcast(x, comm, root=root), _rank_input(root, (4, 2), "float64"), "broadcast")
    return f"from root {root}"


def _check_allgather(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    uneven = collectives.allgather(_rank_input(rank, (rank + 1, 3), "float32"), comm)
    _expect(uneven, np.concatenate([_rank_input(r, (r + 1, 3), "float32") for r in range(n)]), "allgather (uneven rows)")
    out = np.empty((2 * n, 3), dtype=np.int64)
    collectives.allgather(_rank_input(rank, (2, 3), "int64"), comm, out=out)
    _expect(out, np.concatenate([_rank_input(r, (2, 3), "int64") for r in range(n)]), "allgather (out=)")
    return "uneven rows; out= fast path"


def _check_reduce_scatter(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = 2 * n + 1  # uneven on purpose
    total = np.sum([_rank_input(r, (rows, 2), "float64") for r in range(n)], axis=0)
    start = sum(collectives.split_sizes(rows, n)[:rank])
    mine = collectives.reduce_scatter(_rank_input(rank, (rows, 2), "float64"), comm)
    _expect(mine, total[start: start + collectives.split_sizes(rows, n)[rank]], "reduce_scatter")
    return f"{rows} rows over {n} ranks"


def _check_alltoall(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    splits = [(rank + j) % 3 for j in range(n)]  # uneven, zeros included
    inputs = [_rank_input(r, (sum((r + j) % 3 for j in range(n)), 2), "float32") for r in range(n)]
    got = collectives.alltoall(inputs[rank], comm, splits=splits)
    offsets = [np.cumsum([0] + [(r + j) % 3 for j in range(n)]) for r in range(n)]
    _expect(got, np.concatenate([inputs[r][offsets[r][rank]: offsets[r][rank + 1]] for r in range(n)]), "alltoall")
    return "uneven splits"


def _check_sendrecv(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    dest, source = (rank + 1) % n, (rank - 1) % n
    handle = collectives.isend(_rank_input(rank, (3, 4), "int32"), dest, comm, tag=5)
    got = collectives.recv(source, comm, tag=5)
    handle.wait()
    _expect(got, _rank_input(source, (3, 4), "int32"), "send/recv ring")
    return "ring: shape and dtype travel with the data"


def _check_simulator(comm):
    results = simulate(3, lambda c: collectives.allreduce(np.array([c.Get_rank() + 1.0]), c)[0])
    if results != [6.0, 6.0, 6.0]:
        raise AssertionError(f"SimComm allreduce over 3 ranks gave {results} (want [6.0, 6.0, 6.0])")
    return "SimComm world of 3"


def _check_gpu(comm):
    count = xp.gpu_count()
    if count == 0:
        cupy = xp.get_cupy()
        return None, "no GPU" + (" (cupy not installed)" if cupy is None else " (cupy sees none)")
    cupy = xp.get_cupy()
    n, rank = comm.Get_size(), comm.Get_rank()
    x = cupy.asarray(_rank_input(rank, (1000,), "float32"))
    collectives.allreduce(x, comm)
    _expect(xp.to_numpy(x), np.sum([_rank_input(r, (1000,), "float32") for r in range(n)], axis=0), "GPU allreduce")
    return True, f"{count} GPU(s), path: {gpu_path_name(comm)}"


_CHECKS = (("ranks", _check_ranks), ("allreduce", _check_allreduce), ("broadcast", _check_broadcast),
           ("allgather", _check_allgather), ("reduce_scatter", _check_reduce_scatter), ("alltoall", _check_alltoall),
           ("send/recv", _check_sendrecv), ("simulator", _check_simulator), ("gpu", _check_gpu))


def cmd_check(args):
    """Run every self-test on every rank; print one line per test; return 1 if any failed on any rank."""
    started = time.perf_counter()
    comm, info = _init()
    _say(f"mpidist check: {info.size} ranks on {info.nodes} node(s), {info.mpi_library}, launcher {info.launcher}")
    counts = {"ok": 0, "FAIL": 0, "skip": 0}
    for name, check in _CHECKS:
        error, detail, ran = None, "", True
        try:
            outcome = check(comm)
            ran, detail = outcome if isinstance(outcome, tuple) else (True, outcome)
        except Exception as exc:  # noqa: BLE001 - reported below, once, with the rank it happened on
            error = f"{type(exc).__name__}: {exc}"
        errors = describe_ranks(comm.allgather(error))  # every rank reports every rank's failure
        status = "FAIL" if errors else ("ok" if ran else "skip")
        counts[status] += 1
        if errors:
            detail = errors
        _say(f"  {status:<5} {name:<15} {detail}")
    _say(f"mpidist check: {counts['ok']} ok, {counts['FAIL']} failed, {counts['skip']} skipped "
         f"in {time.perf_counter() - started:.2f} s")
    return 1 if counts["FAIL"] else 0


# -- flight -------------------------------------------------------------------------------------------
def cmd_flight(args):
    """Print the report of the flight records in ``args.dir``; 1 when there are none to read."""
    try:
        _say(guard.flight_report(args.dir))
    except (OSError, ValueError) as exc:
        _say(str(exc), file=sys.stderr)
        return 1
    return 0


# -- trace --------------------------------------------------------------------------------------------
def cmd_trace(args):
    """Print a trace's summary (drawing its timeline with --plot), or merge its rank files; 1 when unreadable."""
    from . import trace
    from .trace import analysis as trace_analysis
    try:
        if args.trace_command == "merge":
            _say(f"merged into {trace.merge(args.dir)}")
            return 0
        content = trace.load(args.dir)
        _say(trace_analysis.report(content, args.top))
        if args.plot:
            _say(f"timeline: {trace_analysis.plot(content, args.plot)}")
    except (OSError, ValueError, ImportError) as exc:
        _say(str(exc), file=sys.stderr)
        return 1
    return 0
