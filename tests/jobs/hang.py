"""Make the ranks disagree in one of several ways; the watchdog must report it and end the job."""
import sys
import time

import numpy as np
from mpi4py import MPI  # noqa: F401 - initializes MPI before mpidist, as a user program does

import mpidist

kind = sys.argv[1]
comm, info = mpidist.init(watchdog_timeout=2.0)
rank = comm.Get_rank()
x = np.ones(4)
if kind == "skip":            # rank 2 never arrives at the allreduce
    if rank != 2:
        mpidist.allreduce(x, comm)
    time.sleep(60)
elif kind == "other-comm":    # rank 1 reduces over a different communicator than the others
    other = comm.Dup()
    mpidist.allreduce(x, other if rank == 1 else comm)
elif kind == "tag":           # a receive whose tag no send uses
    if rank == 0:
        mpidist.send(x, 1, comm, tag=1)
    elif rank == 1:
        mpidist.recv(0, comm, tag=2)
    time.sleep(60)
