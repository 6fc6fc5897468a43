"""Run an unmodified mpi4py program on N simulated ranks in this process (``mpidist sim -n N prog.py``)."""

import runpy
import sys
import traceback

__all__ = ["run_program"]


def run_program(n, path, argv=(), seed=None):
    """Run ``path`` as ``__main__`` on ``n`` rank threads with ``from mpi4py import MPI`` simulated; return the exit status.

    Each rank runs the file with its own globals; imported modules are shared. The first rank that raises
    ends the run with its traceback on stderr and status 1; ``SystemExit(k)`` gives status k (the largest).
    """
    import mpi4py

    from . import MPI
    from .runner import rank_threads

    real = sys.modules.get("mpi4py.MPI")
    saved_argv = sys.argv
    mpi4py.MPI = MPI
    sys.modules["mpi4py.MPI"] = MPI
    sys.argv = [path, *argv]
    codes = [0] * n

    def body(rank, comm):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
            codes[rank] = code if isinstance(code, int) else (0 if code is None else 1)
    try:
        _, errors, universe = rank_threads(n, body, seed=seed)
    finally:
        mpi4py.MPI = real
        sys.modules["mpi4py.MPI"] = real
        sys.argv = saved_argv
    if universe.failure is not None:
        rank, exc = universe.failure
        sys.stderr.write(f"mpidist sim: rank {rank} of {n} raised an uncaught exception:\n")
        traceback.print_exception(exc, file=sys.stderr)
        return getattr(exc, "errorcode", 1) or 1
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, exc = failed[0]
        sys.stderr.write(f"mpidist sim: rank {rank} of {n}: {type(exc).__name__}: {exc}\n")
        return 1
    return max(codes)
