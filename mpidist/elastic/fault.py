"""Fault injection (``MPIDIST_FAULT``) and the failing rank's side of a failure (end so the others are told).

``MPIDIST_FAULT="rank=R,step=S[,how=sigkill|exit|raise][,at=step|update|commit|save|start]"`` makes rank R (of the world it
started in) fail at step S (several faults: separate them with ``;``, e.g. ``rank=1,step=3;rank=2,step=8``):

- ``at=step`` (default): at the start of step S.
- ``at=update``: in step S right after this rank's ``optimizer.step()`` (``Elastic.train`` hooks every
  optimizer's step): the others lose it after their own updates, in a collective later in the step (the
  example's allgather of sample ids), so they all stepped past their latest commit.
- ``at=commit``: in the middle of the commit taken once S steps are done, between the first and second buddy
  exchanges of a split ``State`` (``replicas >= 3``): some ranks complete that commit, others do not (S = 0: the
  first commit, after FSDP took the module apart, so the survivors start again).
- ``at=start``: before the wrappers are first built (S must be 0): the others lose it while building them,
  before the first commit.
- ``at=save``: in the middle of the disk checkpoint save of step S, the one written once S steps are done
  (``State(checkpoint=...)`` saves every ``checkpoint_every`` steps; ``Elastic.train`` refuses a step
  with no save): the rank dies while writing its rank file, which it leaves partly written under its
  temporary name, so the save never commits (no manifest). Only ``sigkill`` and ``exit``: an exception
  inside a save is not a lost rank, the checkpoint turns it into the same ``CheckpointError`` on every rank.

How the rank fails:

- ``sigkill`` (default): the process kills itself with SIGKILL, as a node or an OOM killer would.
- ``exit``: ``os._exit(1)`` without a signal. Open MPI notices it only with its heartbeat detector
  (``--mca mpi_ft_detector true``; about 10 s, or 0.5 s with ``--mca mpi_ft_detector_period 0.1
  --mca mpi_ft_detector_timeout 0.5``).
- ``raise``: an uncaught ``InjectedFault`` exception, handled like any bug on that rank (below).

Why a failing rank kills itself: under ``mpiexec --with-ft ulfm`` an uncaught Python exception leaves the
process alive inside mpi4py's exit-time ``MPI_Finalize`` while the others wait for it forever (measured).
``install_kill_on_error`` prints the traceback once and ends the process with SIGKILL, which the others see
within milliseconds and survive.

``MPIDIST_FAULT_STAMP=path``: the failing rank writes the wall-clock time of its failure there first, so that
the survivors (same clock on one node) can report the detection time.
"""

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback

from .. import checkpoint

from .. import config

__all__ = ["Fault", "InjectedFault", "parse_fault", "parse_faults", "faults_from_env", "failing_save",
           "install_kill_on_error", "kill_self"]

HOWS = ("sigkill", "exit", "raise")
ATS = ("step", "update", "commit", "save", "start")
KEYS = ("rank", "step", "how", "at")
SYNTAX = f"rank=R,step=S[,how={'|'.join(HOWS)}][,at={'|'.join(ATS)}]"


class InjectedFault(RuntimeError):
    """The failure ``MPIDIST_FAULT`` asked for (``how=raise``)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """Rank ``rank`` fails by ``how`` at the start of step ``step`` (``at="step"``) or in its checkpoint save."""

    rank: int
    step: int
    how: str = "sigkill"
    at: str = "step"

    def maybe_fail(self, world_rank, step, stamp_path=None, at="step"):
        """Fail now if this is the rank, the step and the point (``at``); otherwise return."""
        if world_rank != self.rank or step != self.step or at != self.at:
            return
        self.fail(stamp_path)

    def fail(self, stamp_path=None):
        """Fail now (stamp the time first), by ``how``."""
        world_rank = self.rank
        stamp_path = config.get("MPIDIST_FAULT_STAMP") if stamp_path is None else stamp_path
        if stamp_path:
            with open(stamp_path, "w") as f:
                f.write(f"{time.time():.6f}\n")
        where = {"step": f"at step {self.step}", "update": f"after its optimizer step in step {self.step}",
                 "commit": f"in the commit after step {self.step}",
                 "save": f"in the checkpoint save of step {self.step}",
                 "start": "before the wrappers are built"}[self.at]
        sys.stderr.write(f"[rank {world_rank}] mpidist.elastic: MPIDIST_FAULT: failing {where} ({self.how})\n")
        sys.stderr.flush()
        if self.how == "sigkill":
            kill_self()
        if self.how == "exit":
            os._exit(1)
        raise InjectedFault(f"MPIDIST_FAULT: rank {self.rank} fails {where}")


def parse_fault(text):
    """Return the ``Fault`` that ``text`` ("rank=R,step=S[,how=...][,at=...]") describes, or None for an empty text."""
    text = (text or "").strip()
    if not text:
        return None
    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in KEYS or key in fields:
            raise ValueError(f"MPIDIST_FAULT: cannot read {part.strip()!r} in {text!r} (expected {SYNTAX}, each once)")
        fields[key] = value
    missing = [k for k in ("rank", "step") if k not in fields]
    if missing:
        raise ValueError(f"MPIDIST_FAULT: {' and '.join(missing)} missing in {text!r} (expected {SYNTAX})")
    numbers = {}
    for key in ("rank", "step"):
        try:
            numbers[key] = int(fields[key])
        except ValueError:
            raise ValueError(f"MPIDIST_FAULT: {key} must be an integer (got {fields[key]!r} in {text!r})") from None
        if numbers[key] < 0:
            raise ValueError(f"MPIDIST_FAULT: {key} must be >= 0 (got {numbers[key]} in {text!r})")
    how = fields.get("how", "sigkill")
    if how not in HOWS:
        raise ValueError(f"MPIDIST_FAULT: how must be one of {', '.join(HOWS)} (got {how!r} in {text!r})")
    at = fields.get("at", "step")
    if at not in ATS:
        raise ValueError(f"MPIDIST_FAULT: at must be one of {', '.join(ATS)} (got {at!r} in {text!r})")
    if at == "start" and numbers["step"] != 0:
        raise ValueError(f"MPIDIST_FAULT: at=start fails before the first step, so step must be 0 (got "
                         f"{numbers['step']} in {text!r})")
    if at == "save" and how == "raise":
        raise ValueError(f"MPIDIST_FAULT: how=raise cannot be combined with at=save (in {text!r}): an exception "
                         f"inside a checkpoint save is not a lost rank, the save turns it into the same "
                         f"CheckpointError on every rank; use how=sigkill or how=exit")
    return Fault(numbers["rank"], numbers["step"], how, at)


def parse_faults(text):
    """Return the tuple of ``Fault``s in ``text`` (faults separated by ``;``; empty for an empty text)."""
    faults = tuple(f for f in (parse_fault(part) for part in (text or "").split(";")) if f is not None)
    clashes = {(f.rank, f.step, f.at) for f in faults
               if sum((g.rank, g.step, g.at) == (f.rank, f.step, f.at) for g in faults) > 1}
    if clashes:
        raise ValueError(f"MPIDIST_FAULT: rank, step and at given twice ({sorted(clashes)}) in {text!r}")
    return faults


def faults_from_env(environ=None):
    """Return the ``Fault``s of ``MPIDIST_FAULT`` (empty when unset or empty)."""
    return config.get("MPIDIST_FAULT", environ, parse=parse_faults) or ()


@contextlib.contextmanager
def failing_save(faults, world_rank, step):
    """Around the checkpoint save of step ``step``: this rank's ``at=save`` fault for it fires inside the save.

    The rank fails while writing its rank file (through ``checkpoint.file_operation_hook``): once the first
    part of the file's bytes is in its temporary name, as a rank killed mid-write leaves it (a rank with
    nothing to write fails once its empty file is in place); either way before the manifest, so the save
    never commits. Only this thread is affected (in a SimComm world the other ranks are threads that write
    as usual). Without a matching fault the block runs untouched.
    """
    fault = next((f for f in faults if f.at == "save" and f.rank == world_rank and f.step == step), None)
    if fault is None:
        yield
        return

    def fail_in_rank_file(operation, path):
        # A save's first write (or rename, for an empty file) is this rank's own file: the manifest comes later.
        if operation in ("write", "rename"):
            fault.fail()

    with checkpoint.file_operation_hook(fail_in_rank_file):
        yield


def kill_self():
    """End this process with SIGKILL now (no MPI_Finalize, no atexit: the others are told at once)."""
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_on_error(rank):
    """Make an uncaught exception (main thread or any other) print its traceback once, then SIGKILL this rank."""
    lock = threading.Lock()

    def report_and_die(exc_type, exc, tb):
        # One report even if two threads fail at once; the second waits here until the kill ends both.
        with lock:
            try:
                prefix = f"[rank {rank}] "
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))
                sys.stderr.write(f"{prefix}mpidist.elastic: uncaught exception: this rank ends (SIGKILL) and "
                                 f"the others continue without it\n")
                sys.stderr.flush()
                sys.stdout.flush()
            finally:
                kill_self()

    sys.excepthook = report_and_die
    threading.excepthook = lambda args: report_and_die(args.exc_type, args.exc_value, args.exc_traceback)
