"""Clock alignment: each rank's offset to rank 0's clock, measured by ping-pong.

Ranks on different nodes have unrelated ``time.monotonic`` origins. Rank r sends its time t1, rank 0
answers with its time t0, r reads t2 on arrival: if the two halves of the round trip took as long,
rank 0's clock read t0 when r's read (t1 + t2) / 2, so offset = t0 - (t1 + t2) / 2, wrong by at most
half the round trip. The round with the shortest trip is kept (the least queueing in it).
Simulated ranks are threads of one process and share its clock: ``trace.stop`` does not measure theirs.
"""

import time

import numpy as np

__all__ = ["measure_offset"]

_TAG = 31_415


def measure_offset(comm, rounds=8, clock=time.monotonic):
    """Return (offset, round trip) in seconds: rank 0's clock minus this rank's (0, 0 on rank 0).

    Collective over ``comm``: rank 0 answers every other rank in turn, ``rounds`` times each.
    """
    if comm.Get_size() == 1:
        return 0.0, 0.0
    rank, size = comm.Get_rank(), comm.Get_size()
    private = comm.Dup()  # no user message can match ours, nor ours a user's receive
    try:
        buf = np.zeros(1)
        if rank == 0:
            for peer in range(1, size):
                for _ in range(rounds):
                    private.Recv(buf, source=peer, tag=_TAG)
                    buf[0] = clock()
                    private.Send(buf, dest=peer, tag=_TAG)
            return 0.0, 0.0
        best = (float("inf"), 0.0)
        for _ in range(rounds):
            t1 = clock()
            buf[0] = t1
            private.Send(buf, dest=0, tag=_TAG)
            private.Recv(buf, source=0, tag=_TAG)
            t2 = clock()
            best = min(best, (t2 - t1, float(buf[0]) - (t1 + t2) / 2))
        return best[1], best[0]
    finally:
        private.Free()
