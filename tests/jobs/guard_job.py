"""Jobs for the guard's tests under a real mpiexec: python guard_job.py KIND [ARGS].

- straddle LARGE: rank LARGE passes 1M float32 (above MPIDIST_CHECK_BYTES), the others 10 elements.
- straddle-caught LARGE: the same, and rank LARGE catches the DesyncError and goes on to the end.
- phase-limit / phase-ok: inside guard.phase("checkpoint"), rank 0 sleeps 3 s while the others wait in
  a barrier; the job's limits come from MPIDIST_COLLECTIVE_TIMEOUT / MPIDIST_CHECKPOINT_TIMEOUT.
- skip: after 3 agreed allreduces on a duplicate of the world, the last rank skips the 4th and sleeps.
- abort: the last rank raises after 3 agreed allreduces (init()'s excepthook aborts the job).
- sigusr2 DIR: every rank writes DIR/pidN; rank 0 then waits in an allreduce that the others join
  only once DIR/go exists.
Every rank prints "rank R: done" when it gets to the end.
"""

import os
import sys
import time

import numpy as np

import mpidist
from mpidist import guard

kind = sys.argv[1]
comm, info = mpidist.init()
rank, size = comm.Get_rank(), comm.Get_size()

if kind == "straddle":
    large = int(sys.argv[2])
    mpidist.allreduce(np.ones(4), comm)
    x = np.full(1 << 20 if rank == large else 10, rank + 1, dtype=np.float32)
    mpidist.allreduce(x, comm)
    print(f"rank {rank}: returned {x[:3].tolist()}", flush=True)
elif kind == "straddle-caught":
    large = int(sys.argv[2])
    x = np.full(1 << 20 if rank == large else 10, rank + 1, dtype=np.float32)
    try:
        mpidist.allreduce(x, comm)
    except guard.DesyncError:
        print(f"rank {rank}: caught DesyncError", flush=True)
elif kind in ("phase-limit", "phase-ok"):
    with guard.phase("checkpoint"):
        if rank == 0:
            time.sleep(3)
        mpidist.barrier(comm)
elif kind == "skip":
    work = comm.Dup()
    for _ in range(3):
        mpidist.allreduce(np.ones(16), work)
    if rank != size - 1:
        mpidist.allreduce(np.ones(16), work)
    time.sleep(60)
elif kind == "abort":
    for _ in range(3):
        mpidist.allreduce(np.ones(16), comm)
    if rank == size - 1:
        raise RuntimeError(f"bad batch on rank {rank}")
    mpidist.allreduce(np.ones(16), comm)
elif kind == "sigusr2":
    folder = sys.argv[2]
    mpidist.barrier(comm)
    with open(os.path.join(folder, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank != 0:
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
    mpidist.allreduce(np.ones(8), comm)
print(f"rank {rank}: done", flush=True)
