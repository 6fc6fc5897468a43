"""Phases: named stretches of a program with a time limit of their own.

A collective that legitimately waits long (every rank writing a large checkpoint, then meeting) needs
a longer limit than a collective in the training loop, where a wait of minutes means a desync. Inside
a phase the innermost phase's limit applies to every call in flight, and the phase itself is watched
with it (a write stuck on a file system, with no collective in flight, is reported too).
Phases belong to the thread that opened them (simulated ranks are threads of one process).
"""

import contextlib
import math
import threading
import time

__all__ = ["phase", "active_phases", "innermost_limit"]

_settings = None  # the package's current Settings (set by configure)
_phases = {}      # thread id -> [name, start, limit] of the phases that thread is in, outermost first


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
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not math.isfinite(limit) or limit < 0:
        raise ValueError(f"guard.phase: timeout must be a finite number of seconds >= 0 (got {limit!r})")
    item = [name, time.monotonic(), float(limit)]
    me = threading.get_ident()
    stack = _phases.setdefault(me, [])
    stack.append(item)
    try:
        yield
    finally:
        stack.remove(item)
        if not stack:
            _phases.pop(me, None)


def active_phases(every_thread=False):
    """Return [(name, seconds in it, limit)] of this thread's open phases (or every thread's), outermost first."""
    now = time.monotonic()
    if every_thread:
        items = [item for stack in list(_phases.values()) for item in list(stack)]
    else:
        items = list(_phases.get(threading.get_ident(), ()))
    return [(name, now - start, limit) for name, start, limit in items]


def innermost_limit():
    """Return the limit that applies to calls in flight now: the largest of the threads' innermost
    phases' limits (None outside every phase; 0 means no limit)."""
    limits = [stack[-1][2] for stack in list(_phases.values()) if stack]
    if not limits:
        return None
    return 0.0 if 0 in limits else max(limits)
