"""A rank leaves the training loop early while the others wait for it: python leave_early.py KIND.

The job starts with ``mpidist.init()`` (limits from MPIDIST_COLLECTIVE_TIMEOUT). The leaving rank is the last
one; every rank prints "rank R: done" when its program gets to the end.
- fewer: the last rank has one batch fewer; it falls off the end of the script after its loop.
- return: the last rank's ``train()`` returns from inside the loop at step 2.
- exit: the last rank calls ``sys.exit(0)`` inside the loop at step 2.
- split: the world splits into halves (ranks below size // 2, the others); the last rank leaves its half's
  loop after one step; the first half trains to the end and leaves normally (nobody waits for them).
- normal: no rank leaves early, but ranks end at different times: the others start a nonblocking allreduce and
  wait for it 1.5 s later (overlapping it with work), while rank 0 joins it, waits and leaves at once; so its
  record stays in flight on them after rank 0 left (rank 0's count says it joined). The last rank ends 1 s after
  the others.
"""

import sys
import time

import numpy as np

import mpidist
from mpidist import guard

kind = sys.argv[1]
comm, info = mpidist.init()
guard.watchdog.running().reply_wait = 30  # the tests read every rank's answer in the report, also under load
rank, size = comm.Get_rank(), comm.Get_size()
last = size - 1
STEPS = 4


def step(on):
    mpidist.allreduce(np.ones(8), on)  # the gradient allreduce of one batch


def train(on, leave_at=None):
    for i in range(STEPS):
        if i == leave_at and rank == last:
            if kind == "exit":
                print(f"rank {rank}: done", flush=True)
                sys.exit(0)
            return
        step(on)


if kind == "fewer":
    for _ in range(STEPS - 1 if rank == last else STEPS):
        step(comm)
elif kind in ("return", "exit"):
    train(comm, leave_at=2)
elif kind == "split":
    half = comm.Split(0 if rank < size // 2 else 1, key=rank)
    half.Set_name(f"half{0 if rank < size // 2 else 1}")
    train(half, leave_at=1)
elif kind == "normal":
    for _ in range(STEPS):
        step(comm)
    handle = mpidist.iallreduce(np.full(3, float(rank)), comm)
    if rank != 0:
        time.sleep(1.5)  # rank 0 has left by now (the watchdogs' MPI calls moved the allreduce on)
    total = handle.wait()
    assert (total == sum(range(size))).all(), total
    if rank == last:
        time.sleep(1)
print(f"rank {rank}: done", flush=True)
