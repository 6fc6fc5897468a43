"""Run an unmodified mpi4py program on N simulated ranks in this process (``mpidist sim -n N prog.py``).

Glossary:
- rank stream: what ``sys.stdin``/``sys.stdout``/``sys.stderr`` are while the program runs: each rank thread
  sees its own (stdin: the real one on rank 0, end of file elsewhere, as under ``mpiexec``; stdout/stderr:
  whole lines written to the real stream, optionally prefixed ``[rank] `` as ``mpiexec -l`` does).
- rank module: each rank's ``__main__``; ``sys.modules["__main__"]`` resolves to the calling rank's, so
  classes and functions defined in the program pickle between ranks.
- outcome: the exit status and every rank's stdout lines of one run (what ``--explore`` compares).
"""

import builtins
import dataclasses
import io
import os
import re
import shlex
import stat
import sys
import threading
import traceback
import types

from ..errors import DeadlockError, RankFailedError, SimAbort, WatchdogTimeout

from .runner import TimeLimitExceeded, inherit_thread_local, rank_threads

__all__ = ["run_program", "explore_program", "install_mpi4py", "program_file_problem", "Outcome",
           "TIMED_OUT_STATUS"]

_SIM_DIR = os.path.dirname(os.path.abspath(__file__))
_local = threading.local()   # .rank: the world rank of a rank thread running the program (or of one it started)
inherit_thread_local(_local, "rank")
TIMED_OUT_STATUS = 124         # the exit status of a run past its time limit, as timeout(1) gives


def _rank():
    return getattr(_local, "rank", None)


class _RankOutput:
    """``sys.stdout``/``sys.stderr`` of the rank threads: whole lines, in the order ranks finish them."""

    def __init__(self, real, lock, prefix, size, capture=None):
        self._real, self._lock, self._prefix = real, lock, prefix
        self._partial = [""] * size
        self._capture = capture   # per-rank list of lines, or None

    def write(self, text):
        rank = _rank()
        if rank is None:        # a thread the program started: not a rank, write through
            return self._real.write(text)
        *lines, self._partial[rank] = (self._partial[rank] + text).split("\n")
        if lines:
            self._emit(rank, [line + "\n" for line in lines])
        return len(text)

    def _emit(self, rank, lines):
        if self._capture is not None:
            self._capture[rank].extend(lines)
        with self._lock:
            self._real.write("".join(f"[{rank}] {line}" if self._prefix else line for line in lines))
            self._real.flush()

    def flush(self, rank=None):
        """Write the calling rank's unfinished line (``print(..., flush=True)`` before ``input()``)."""
        rank = _rank() if rank is None else rank
        if rank is not None and self._partial[rank]:
            line, self._partial[rank] = self._partial[rank], ""
            self._emit(rank, [line])
        with self._lock:
            self._real.flush()

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def isatty(self):
        return False

    def __getattr__(self, name):   # encoding, errors, fileno, buffer...: the real stream's
        return getattr(self._real, name)


class _RankInput:
    """``sys.stdin`` of the rank threads: the real input on rank 0, end of file on the others."""

    def __init__(self, real):
        self._real = real
        self._empty = io.StringIO("")

    def _target(self):
        rank = _rank()
        return self._real if rank in (None, 0) else self._empty

    def __iter__(self):
        return iter(self._target())

    def __next__(self):
        return next(self._target())

    def __getattr__(self, name):
        return getattr(self._target(), name)


class _MainModule(types.ModuleType):
    """``sys.modules["__main__"]`` while the program runs: the calling rank's module (pickle looks classes up here)."""

    def __init__(self, original, modules):
        super().__init__("__main__")
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_modules", modules)

    def _module(self):
        rank = _rank()
        modules = object.__getattribute__(self, "_modules")
        return object.__getattribute__(self, "_original") if rank is None else modules[rank]

    def __getattribute__(self, name):
        if name in ("_module", "__class__"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_module")(), name)

    def __setattr__(self, name, value):
        setattr(self._module(), name, value)

    def __delattr__(self, name):
        delattr(self._module(), name)


@dataclasses.dataclass
class Outcome:
    """What one run gave: the exit status and each rank's stdout lines."""

    status: int
    stdout: list


def install_mpi4py():
    """Make ``from mpi4py import MPI`` give the simulated namespace; return the function that undoes it.

    It also puts back the ``mpi4py.rc`` settings the program changes (they are process-wide).
    """
    import mpi4py

    from . import MPI

    saved = sys.modules.get("mpi4py.MPI"), getattr(mpi4py, "MPI", None)
    rc = sys.modules.get("mpi4py.rc"), getattr(mpi4py, "rc", None)
    settings = dict(vars(rc[1])) if rc[1] is not None else None
    sys.modules["mpi4py.MPI"] = mpi4py.MPI = MPI

    def restore():
        sys.modules["mpi4py.MPI"], mpi4py.MPI = saved
        if rc[1] is not None:
            sys.modules["mpi4py.rc"], mpi4py.rc = rc
            vars(rc[1]).clear()
            vars(rc[1]).update(settings)
    return restore


def program_file_problem(path):
    """Return what keeps ``path`` from being run as a program ('no such file', 'a directory'...), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot run {path!r}: {'no such program file' if exc.errno == 2 else exc.strerror}"
    if stat.S_ISDIR(mode):
        return f"cannot run {path!r}: it is a directory, not a Python file"
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        return f"cannot run {path!r}: it is {kind}, not a Python file"
    if not os.access(path, os.R_OK):
        return f"cannot run {path!r}: it is not readable (permission denied)"
    return None


def run_program(n, path, argv=(), seed=None, prefix=False, stdin=None, stdout=None, stderr=None, capture=False,
                time_limit=None):
    """Run ``path`` as ``__main__`` on ``n`` rank threads with ``from mpi4py import MPI`` simulated; return the exit status.

    Each rank runs the file with its own globals; imported modules are shared. As under ``mpiexec`` with
    ``python -m mpi4py``: stdin goes to rank 0 (the other ranks read end of file); the first rank that
    raises ends every rank, with its traceback on stderr and status 1; ``sys.exit(k)`` with k != 0 (or
    ``Abort(k)``) ends every rank with status k; a deadlock prints each rank's pending call and stack and
    gives status 1. ``prefix`` starts each output line with ``[rank] `` (``mpiexec -l``). A program that does not
    compile prints the error as python does (status 1). ``time_limit`` (seconds): a run still going after this
    long is stopped, printing where each rank was (status ``TIMED_OUT_STATUS``).
    A thread that a rank starts runs as that rank (an ``MPI_THREAD_MULTIPLE`` program's threads).
    With ``capture``, return an ``Outcome`` (status and each rank's stdout lines) instead of the status.
    """
    path = os.path.abspath(path)
    real_out = stdout or sys.stdout
    real_err = stderr or sys.stderr
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    except OSError as exc:
        raise FileNotFoundError(f"mpidist sim: cannot read the program {path!r} ({exc.strerror})") from None
    except (SyntaxError, ValueError) as exc:  # as python prints it: the program's line, none of ours
        real_err.write("".join(traceback.format_exception_only(type(exc), exc)))
        return Outcome(1, [[] for _ in range(n)]) if capture else 1
    lock = threading.Lock()
    lines = [[] for _ in range(n)]
    out = _RankOutput(real_out, lock, prefix, n, lines if capture else None)
    err = _RankOutput(real_err, lock, prefix, n)
    modules = [types.ModuleType("__main__") for _ in range(n)]
    codes = [0] * n

    def body(rank, comm):
        _local.rank = rank
        module = modules[rank]
        module.__dict__.update(__file__=path, __builtins__=builtins, __loader__=None, __spec__=None,
                               __cached__=None, __package__=None)
        try:
            exec(code, module.__dict__)
        except SystemExit as exc:
            codes[rank] = _exit_status(exc, err)
            if codes[rank]:
                raise   # like python -m mpi4py: a non-zero exit aborts every rank
        finally:
            out.flush(rank)
            err.flush(rank)
            _local.rank = None

    saved = sys.modules.get("__main__"), sys.argv, sys.path[0], sys.stdin, sys.stdout, sys.stderr
    restore_mpi4py = install_mpi4py()
    sys.modules["__main__"] = _MainModule(saved[0], modules)
    sys.argv = [path, *argv]
    sys.path[0] = os.path.dirname(path)   # as python does for a script: its folder comes first
    sys.stdin = _RankInput(stdin if stdin is not None else sys.stdin)
    sys.stdout, sys.stderr = out, err
    try:
        _, errors, universe = rank_threads(n, body, seed=seed, abandon_after=2.0, time_limit=time_limit)
    finally:
        restore_mpi4py()
        sys.modules["__main__"], sys.argv, sys.path[0], sys.stdin, sys.stdout, sys.stderr = saved
    status = _report(n, errors, universe, codes, real_err)
    return Outcome(status, lines) if capture else status


def _exit_status(exc, err):
    """The status ``SystemExit`` gives, as the interpreter computes it (a message goes to stderr: status 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=err)
    return 1


def _report(n, errors, universe, codes, err):
    """Print (on the real stderr) why the run ended early, if it did; return the exit status."""
    if universe.failure is not None:
        rank, exc = universe.failure
        if isinstance(exc, SystemExit):
            err.write(f"mpidist sim: rank {rank} of {n} exited with status {codes[rank]}; every rank was stopped\n")
            return codes[rank]
        if isinstance(exc, SimAbort):
            status = getattr(exc, "errorcode", 1)
            err.write(f"mpidist sim: rank {rank} of {n} called Abort({status}); every rank was stopped\n")
            return status & 0xFF if isinstance(status, int) else 1
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, TimeLimitExceeded):
            _print_timed_out(n, exc, err)
            return TIMED_OUT_STATUS
        if isinstance(exc, WatchdogTimeout):
            err.write(f"mpidist sim: rank {rank} of {n} timed out ({exc}); every rank was stopped\n")
            err.write(f"rank {rank} was in:\n{''.join(_program_stack(exc))}")
            _print_stacks(errors, skip=rank, file=err)
            return 1
        err.write(f"mpidist sim: rank {rank} of {n} raised an uncaught exception; every rank was stopped\n")
        traceback.print_exception(type(exc), exc, _skip_runner(exc.__traceback__), file=err)
        return 1
    if universe.deadlock is not None:   # also when only threads that ranks started were left blocked
        _print_deadlock(universe.deadlock, errors, universe.helper_errors, err)
        return 1
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, exc = failed[0]
        err.write(f"mpidist sim: rank {rank} of {n}: {type(exc).__name__}: {exc}\n")
        return 1
    return max(codes)


def _internal(filename):
    return filename.startswith(_SIM_DIR) or "runpy" in filename


def _skip_runner(tb):
    """The traceback from the program's first frame on (the rank thread's own frames dropped)."""
    while tb is not None and _internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _program_stack(exc):
    """The program's frames of the stack ``exc`` was raised from (the simulator's own frames dropped)."""
    return _program_frames(traceback.extract_tb(exc.__traceback__))


def _program_frames(stack):
    """Format the program's frames of ``stack`` (a list of FrameSummary), dropping the simulator's and threading's."""
    frames = [(fs.filename, fs.lineno, fs.name, fs.line) for fs in stack
              if not _internal(fs.filename) and fs.filename != threading.__file__]
    return traceback.format_list(traceback.StackSummary.from_list(frames))


def _print_timed_out(n, exc, err):
    """Print that the run passed its time limit, and where each rank (and each thread a rank started) was."""
    err.write(f"mpidist sim: {exc}; every rank was stopped\n")
    for rank in range(n):
        threads = sorted((key for key in exc.stacks if key[0] == rank), key=lambda key: (key[1] is not None, key[1]))
        if (rank, None) not in exc.stacks:
            err.write(f"rank {rank} finished{' (it waits for the threads it started)' if threads else ''}\n")
        for key in threads:
            who = f"rank {rank}" if key[1] is None else f"rank {rank} (its thread {key[1]})"
            what = exc.waits.get(key)
            err.write(f"{who} {'waits in ' + what if what else 'computes (not in a communication call)'}:\n")
            err.write("".join(_program_frames(exc.stacks[key])))


def _print_deadlock(message, errors, helper_errors, err):
    """Print every rank's pending call (from the engine's report) and its stack, then those of its threads."""
    pending = {(int(r), thread or None): what for r, thread, what in re.findall(
        r"rank (\d+)(?: \(its thread ([^)]*)\))? waits in (.*?)(?=; rank \d+ (?:\(its thread [^)]*\) )?waits in |$)",
        message)}
    head = message.split(":", 2)
    err.write(f"mpidist sim: {head[0]}: {head[1].strip() if len(head) > 1 else ''}\n")
    for rank, exc in enumerate(errors):
        if isinstance(exc, DeadlockError):
            err.write(f"rank {rank} waits in {pending.get((rank, None), '(see above)')}\n")
            err.write("".join(_program_stack(exc)))
        elif exc is None:
            err.write(f"rank {rank} finished\n")
        else:
            err.write(f"rank {rank}: {type(exc).__name__}: {exc}\n")
    for rank, thread, exc in helper_errors:
        if isinstance(exc, DeadlockError):
            err.write(f"rank {rank} (its thread {thread}) waits in {pending.get((rank, thread), '(see above)')}\n")
            err.write("".join(_program_stack(exc)))
    if not pending:
        err.write(message + "\n")


def _print_stacks(errors, skip, file):
    for rank, exc in enumerate(errors):
        if rank != skip and isinstance(exc, (RankFailedError, DeadlockError, WatchdogTimeout)):
            file.write(f"rank {rank} was in:\n{''.join(_program_stack(exc))}")


def explore_program(n, path, argv=(), seeds=20, prefix=False, out=None, err=None, time_limit=None):
    """Run ``path`` once in FIFO order and then under seeds 0..seeds-1, stopping at the first run that fails or
    differs; return the exit status.

    A run that fails (exit status k != 0) has its report printed on ``err`` and the command that replays it on
    ``out``: return k. A seeded run whose exit status or any rank's stdout differs from the FIFO run's (a race)
    is reported on ``out``: return 1. Otherwise 0.
    """
    out, err = out or sys.stdout, err or sys.stderr
    data = sys.stdin.read() if not sys.stdin.isatty() else ""
    replay = " ".join(shlex.quote(word) for word in [path, *argv])

    def run(seed):
        report = io.StringIO()
        outcome = run_program(n, path, argv, seed=seed, stdin=io.StringIO(data), stdout=io.StringIO(),
                              stderr=report, capture=True, time_limit=time_limit)
        if outcome.status:
            err.write(report.getvalue())
            which = "the FIFO run" if seed is None else f"seed {seed}"
            out.write(f"mpidist sim --explore: {which} failed with exit status {outcome.status}\n"
                      f"reproduce with: mpidist sim -n {n}{'' if seed is None else f' --seed {seed}'} {replay}\n")
        return outcome
    reference = run(None)
    if reference.status:
        return reference.status
    for seed in range(seeds):
        got = run(seed)
        if got.status:
            return got.status
        difference = _difference(reference, got)
        if difference:
            out.write(f"mpidist sim --explore: seed {seed} differs from the FIFO run: {difference}\n"
                      f"reproduce with: mpidist sim -n {n} --seed {seed} {replay}\n")
            return 1
    out.write(f"mpidist sim --explore: {seeds} seeds give the FIFO run's output and exit status {reference.status}\n")
    return 0


def _difference(reference, got):
    if got.status != reference.status:
        return f"exit status {got.status} (FIFO: {reference.status})"
    for rank, (want, have) in enumerate(zip(reference.stdout, got.stdout)):
        for i in range(max(len(want), len(have))):
            a = want[i].rstrip("\n") if i < len(want) else "(no line)"
            b = have[i].rstrip("\n") if i < len(have) else "(no line)"
            if a != b:
                return f"rank {rank} stdout line {i + 1}: {b!r} (FIFO: {a!r})"
    return ""
