"""Errors raised by communicators (simulated and real) and by mpidist's checks on them."""

__all__ = ["CommError", "CollectiveMismatchError", "RankFailedError", "DeadlockError", "SimAbort", "WatchdogTimeout"]


class CommError(RuntimeError):
    """Base class of mpidist communication errors."""


class CollectiveMismatchError(CommError):
    """Ranks of one communicator called collectives that do not match (op, count, dtype or root)."""


class RankFailedError(CommError):
    """Another rank failed; this rank was released from a wait that could never complete."""


class DeadlockError(CommError):
    """Every live simulated rank waits for something no other rank can provide."""


class SimAbort(CommError):
    """A simulated rank called ``Abort``."""


class WatchdogTimeout(CommError):
    """A simulated rank waited longer than the watchdog timeout; the message says what every rank was doing."""
