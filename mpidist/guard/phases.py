"""Phases: named stretches of a program with a time limit of their own.

A collective that legitimately waits long (every rank writing a large checkpoint, then meeting) needs
a longer limit than a collective in the training loop, where a wait of minutes means a desync. Inside
a phase the innermost phase's limit applies to every call in flight, and the phase itself is watched
with it (a write stuck on a file system, with no collective in flight, is reported too).
"""

import contextlib
import time

__all__ = ["phase", "active_phases", "phases_now"]

_settings = None  # the package's current Settings (set by configure)
_phases = []      # [name, start, limit] of the phases this process is in, outermost first


def use_settings(settings):
    global _settings
    _settings = settings


@contextlib.contextmanager
def phase(name, timeout=None):
    """Give the calls inside a time limit of their own: ``timeout`` seconds (0: none).

    Without ``timeout`` the phase's default applies (``checkpoint``: ``checkpoint_timeout``); other
    names need one. Usable as a decorator (``@guard.phase("checkpoint")``); the limit is read at each call.
    """
    limit = _settings.phase_timeout(name) if timeout is None else timeout
    if limit is None:
        raise ValueError(f"guard.phase: phase {name!r} has no default time limit; pass timeout= (seconds, 0 for none)")
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"guard.phase: timeout must be a number of seconds >= 0 (got {limit!r})")
    item = [name, time.monotonic(), float(limit)]
    _phases.append(item)
    try:
        yield
    finally:
        _phases.remove(item)


def phases_now():
    """Return the [name, start, limit] items of the open phases, outermost first (a copy)."""
    return list(_phases)


def active_phases():
    """Return [(name, seconds in it, limit)] of the phases this process is in, outermost first."""
    now = time.monotonic()
    return [(name, now - start, limit) for name, start, limit in list(_phases)]
