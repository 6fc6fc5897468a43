"""MPI's own exception for errors MPI reports, so callers catch the same class under mpiexec and here."""

from mpi4py import MPI

__all__ = ["SimMPIError", "mpi_error", "rc_errhandler"]


class SimMPIError(MPI.Exception, ValueError):
    """``MPI.Exception`` with MPI's error class and our explanation of the values that caused it.

    Also a ValueError: argument errors (a bad root or rank) raised ValueError before they carried MPI's
    error class, and callers written against that keep working.
    """

    def __init__(self, error_class, message):
        super().__init__(error_class)
        self.message = message

    def __str__(self):
        return f"{MPI.Get_error_string(self.Get_error_class())}: {self.message}"

    def __reduce__(self):
        return (SimMPIError, (self.Get_error_class(), self.message))


def rc_errhandler():
    """Return the error handler ``mpi4py.rc.errors`` gives COMM_WORLD, COMM_SELF and sessions, read now.

    A program sets ``mpi4py.rc`` before its ``from mpi4py import MPI``, which under the simulator comes after
    the simulated namespace exists: read at the first query, it is what the program asked for.
    """
    import mpi4py
    errors = getattr(getattr(mpi4py, "rc", None), "errors", "exception")
    if errors == "exception":
        return MPI.ERRORS_RETURN
    if errors == "abort" and MPI.ERRORS_ABORT != MPI.ERRHANDLER_NULL:
        return MPI.ERRORS_ABORT
    return MPI.ERRORS_ARE_FATAL   # "fatal", and MPI's own default ("default")


def mpi_error(error_class, message):
    """Return an ``MPI.Exception`` of ``error_class`` whose text also says ``message``."""
    if MPI.Get_error_class(error_class) != error_class:
        # An MPI-4 class (ERR_ERRHANDLER, ...) that an MPI-3.1 library lacks: mpi4py gives it a number that Open
        # MPI 4 reports as ERR_UNKNOWN. That library reports such bad arguments as ERR_ARG, and so do we.
        error_class = MPI.ERR_ARG
    return SimMPIError(error_class, message)
