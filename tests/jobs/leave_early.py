"""A rank leaves the training loop early while the others wait for it: python leave_early.py KIND.

The job starts with ``mpidist.init()`` (limits from MPIDIST_COLLECTIVE_TIMEOUT). The leaving rank is the last
one; every rank prints "rank R: done" when its program gets to the end.
- fewer: the last rank has one batch fewer; it falls off the end of the script after its loop.
- return: the last rank's ``train()`` returns from inside the loop at step 2.
- exit: the last rank calls ``sys.exit(0)`` inside the loop at step 2.
- split: the world splits into halves (ranks below size // 2, the others); the last rank leaves its half's
  loop after one step; the first half trains to the end and leaves normally (nobody waits for them).
- normal: no rank leaves early, but ranks end at different times: rank 0 broadcasts (a message small enough
  to leave at once) and leaves before the others join that broadcast; the last rank ends 1 s after the others.
"""

import sys
import time

import numpy as np

import mpidist

kind = sys.argv[1]
comm, info = mpidist.init()
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
    x = np.arange(3.0) if rank == 0 else np.zeros(3)
    if rank != 0:
        time.sleep(1)  # rank 0 has left by now (its watchdog polls every 0.2 s)
    mpidist.broadcast(x, comm, root=0)
    assert (x == np.arange(3.0)).all(), x
    if rank == last:
        time.sleep(1)
print(f"rank {rank}: done", flush=True)
