"""The guard's settings: one frozen record, read from the environment once, replaced by ``configure``."""

import dataclasses
import math

from .. import config as environment

__all__ = ["Settings", "from_environment"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the guard checks and when it gives up.

    - ``desync``: check the fingerprint of every collective (debug mode, ``MPIDIST_DEBUG=1``).
    - ``check_bytes``: without debug mode, check collectives whose message has at least this many
      bytes (``MPIDIST_CHECK_BYTES``; 0 turns the always-on check off). See ``fingerprint``.
    - ``collective_timeout``: seconds a collective or receive may stay in flight outside a phase before
      the watchdog reports and aborts (``MPIDIST_COLLECTIVE_TIMEOUT``, formerly ``MPIDIST_WATCHDOG_TIMEOUT``;
      0: no limit).
    - ``checkpoint_timeout``: the limit of the ``checkpoint`` phase (``MPIDIST_CHECKPOINT_TIMEOUT``).
    - ``desync_grace``: seconds a rank waits in a check before the watchdog asks the other ranks whether
      they went ahead without one (their messages are below ``check_bytes`` while this one is not).
    - ``flight_size``: calls the flight recorder keeps per process (``MPIDIST_FLIGHT_SIZE``, at least 16).
    - ``flight_dir``: where flight records are written (``MPIDIST_FLIGHT_DIR``).
    """

    desync: bool = False
    check_bytes: int = 32 << 20  # measured: docs/reliability.md, benchmarks/guard_cost.py
    collective_timeout: float = 300.0
    checkpoint_timeout: float = 1800.0
    desync_grace: float = 1.0
    flight_size: int = 2000
    flight_dir: str = "mpidist-flight"

    def __post_init__(self):
        for name in ("check_bytes", "collective_timeout", "checkpoint_timeout", "desync_grace"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"guard settings: {name} must be a finite number >= 0 (got {value!r})")
        if not isinstance(self.flight_size, int) or self.flight_size < 16:
            raise ValueError(f"guard settings: flight_size must be an int >= 16 (got {self.flight_size!r})")

    def phase_timeout(self, name):
        """Return the default time limit of phase ``name`` (None when the phase has no default)."""
        return {"checkpoint": self.checkpoint_timeout}.get(name)


def from_environment(env=None):
    """Return the settings the ``MPIDIST_*`` environment variables ask for (parsed by ``mpidist.config``)."""
    base = Settings()

    def value(name, default):
        found = environment.get(name, env)
        return default if found is None else found

    return Settings(
        desync=value("MPIDIST_DEBUG", base.desync),
        check_bytes=value("MPIDIST_CHECK_BYTES", base.check_bytes),
        collective_timeout=value("MPIDIST_COLLECTIVE_TIMEOUT", base.collective_timeout),
        checkpoint_timeout=value("MPIDIST_CHECKPOINT_TIMEOUT", base.checkpoint_timeout),
        desync_grace=value("MPIDIST_DESYNC_GRACE", base.desync_grace),
        flight_size=value("MPIDIST_FLIGHT_SIZE", base.flight_size),
        flight_dir=value("MPIDIST_FLIGHT_DIR", base.flight_dir),
    )
