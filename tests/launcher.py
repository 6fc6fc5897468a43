"""The one MPI launcher every test that starts processes uses (``make test`` configures it).

- ``MPIDIST_MPIEXEC``: the mpiexec to run (default: the one next to this Python, i.e. the venv's wheel
  MPI, else ``mpiexec`` on PATH).
- ``MPIEXEC_FLAGS``: extra launcher flags, split like a shell would (e.g. ``--oversubscribe`` for Open MPI).
"""

import os
import shlex
import shutil
import sys

_BESIDE_PYTHON = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MPIEXEC = os.environ.get("MPIDIST_MPIEXEC") or (
    _BESIDE_PYTHON if os.path.exists(_BESIDE_PYTHON) else shutil.which("mpiexec"))
FLAGS = shlex.split(os.environ.get("MPIEXEC_FLAGS", ""))


def available():
    """Return whether a launcher was found."""
    return bool(MPIEXEC) and (os.path.exists(MPIEXEC) or shutil.which(MPIEXEC) is not None)


def mpiexec(n, *command):
    """Return the argv that starts ``command`` on ``n`` ranks with the configured launcher and flags."""
    return [MPIEXEC, *FLAGS, "-n", str(n), *command]
