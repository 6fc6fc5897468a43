"""The generator every layer draws initial weights and dropout masks from, per thread.

``manual_seed(seed)`` seeds the calling thread's generator and sets the seed that threads which never
seeded their own start from. Per thread because simulated ranks are threads: each rank draws its own
sequence, so the same seed gives every rank the same model, as separate processes would.

Activation checkpointing replays dropout masks: inside ``track_generators()`` the first draw from each
generator records its state, so a recompute can start every generator where the forward did.
"""

import contextlib
import threading

import numpy as np

__all__ = ["manual_seed", "initial_seed", "default_generator", "get_rng_state", "set_rng_state", "generator_for_draw",
           "track_generators"]

_local = threading.local()
_process_seed = [0]


def manual_seed(seed):
    """Seed this thread's default generator (and the start of threads that never seeded their own)."""
    seed = int(seed)
    _process_seed[0] = seed
    _local.generator = np.random.default_rng(seed)


def initial_seed():
    """Return the seed of the last ``manual_seed`` (0 if none): what ``mpidist.nn.deferred()`` keys values by."""
    return _process_seed[0]


def default_generator():
    """Return this thread's default numpy Generator."""
    gen = getattr(_local, "generator", None)
    if gen is None:
        gen = _local.generator = np.random.default_rng(_process_seed[0])
    return gen


def get_rng_state():
    """Return the state of this thread's default generator (for ``set_rng_state``)."""
    return default_generator().bit_generator.state


def set_rng_state(state):
    """Restore this thread's default generator to ``state`` from ``get_rng_state``."""
    default_generator().bit_generator.state = state


def generator_for_draw(generator=None):
    """Return ``generator`` (or the default one), noting its state first if a tracker is active."""
    gen = default_generator() if generator is None else generator
    tracked = getattr(_local, "tracked", None)
    if tracked is not None and id(gen) not in tracked:
        tracked[id(gen)] = (gen, gen.bit_generator.state)
    return gen


@contextlib.contextmanager
def track_generators():
    """Yield a dict ``id -> (generator, state before its first draw in the block)``."""
    prev = getattr(_local, "tracked", None)
    tracked = {}
    _local.tracked = tracked
    try:
        yield tracked
    finally:
        _local.tracked = prev
        if prev is not None:
            for key, value in tracked.items():
                prev.setdefault(key, value)
