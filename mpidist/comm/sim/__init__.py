"""The simulated communicator: mpi4py's intracommunicator surface, one thread per rank, in one process."""

from ._legacy import SimComm, SimMessage, SimRequest, simulate

__all__ = ["SimComm", "SimMessage", "SimRequest", "simulate"]
