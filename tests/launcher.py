"""The one MPI launcher every test that starts processes uses (``make test`` configures it).

- ``MPIDIST_MPIEXEC``: the mpiexec to run; ``make`` exports the one of its ``MPI=`` choice. Unset (plain
  ``pytest``): the one next to this Python, i.e. the venv's wheel MPI, else ``mpiexec`` on PATH.
- ``MPIEXEC_FLAGS``: extra launcher flags, split like a shell would (``make`` puts Open MPI's
  ``--oversubscribe`` there, followed by the user's own).

A test that starts processes carries the :data:`needed` mark, builds its command with :func:`mpiexec` and
passes ``env=env()``. With no launcher at all it is skipped; but when ``MPIDIST_MPIEXEC`` names a launcher that
cannot be found it fails, so that ``make test`` with a broken launcher cannot pass by skipping every launch.
"""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

_BESIDE_PYTHON = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def configured():
    """Return the launcher named by ``MPIDIST_MPIEXEC``, or '' when it is unset."""
    return os.environ.get("MPIDIST_MPIEXEC", "")


def launcher():
    """Return the mpiexec to run: the configured one, else the venv's, else the one on PATH (or None)."""
    if configured():
        return configured()
    return _BESIDE_PYTHON if os.path.exists(_BESIDE_PYTHON) else shutil.which("mpiexec")


def flags():
    """Return the extra launcher flags from ``MPIEXEC_FLAGS`` as a list."""
    return shlex.split(os.environ.get("MPIEXEC_FLAGS", ""))


def available():
    """Return whether the launcher exists (a path, or a name found on PATH)."""
    path = launcher()
    return bool(path) and (os.path.isfile(path) or shutil.which(path) is not None)


def env(**extra):
    """Return the environment for a launched job: this process's environment as it started, plus ``extra``.

    The test session has imported mpi4py, so it is an MPI singleton, and Open MPI 4 (Debian's, for one) then
    writes its PMIx contact (``PMIX_*``, ``OMPI_MCA_ess=singleton``, ...) into the C environment. A child
    started with the inherited environment (``env=None``) takes itself for part of that singleton: its mpiexec
    exits 1 without a word, its ``MPI_Init`` hangs. ``os.environ`` was read before MPI started, so it is clean.
    """
    return dict(os.environ, **extra)


# What a launcher prints when it could not start at all: Open MPI's PMIx listener failed once in a CI run
# (test-launch, 1 of 326 launches), before any rank ran. Not the job's doing: such a launch is tried once more.
STARTUP_FAILURES = ("The PMIx server's listener thread failed to start",)


def run(argv, **kwargs):
    """Return ``subprocess.run(argv, **kwargs)``; a launch that failed to start the launcher itself (``STARTUP_FAILURES``
    in its output) is run once more. Pass ``capture_output=True`` (or pipes) for the check to see the output."""
    proc = subprocess.run(argv, **kwargs)
    output = f"{proc.stdout or ''}{proc.stderr or ''}"   # text, or the bytes' repr: the message shows in either
    if proc.returncode != 0 and any(failure in output for failure in STARTUP_FAILURES):
        proc = subprocess.run(argv, **kwargs)
    return proc


def mpiexec(n, *command):
    """Return the argv that starts ``command`` on ``n`` ranks with the configured launcher and flags."""
    if not available():
        if configured():
            pytest.fail(f"MPIDIST_MPIEXEC={configured()!r}: no such launcher (neither a file nor a command on PATH); "
                        f"`make` sets it from MPI=: check that MPI= matches the installed MPI, or unset it",
                        pytrace=False)
        pytest.skip(f"no mpiexec next to {sys.executable} or on PATH (set MPIDIST_MPIEXEC, or run `make test`)")
    return [launcher(), *flags(), "-n", str(n), *command]


# Decided once at collection: skip only when nothing is configured and nothing is found. A configured launcher
# that is missing makes the test run and fail in mpiexec() instead.
needed = pytest.mark.skipif(not configured() and not available(),
                            reason=f"no mpiexec next to {sys.executable} or on PATH (set MPIDIST_MPIEXEC, or run `make test`)")
