"""Rank 2 raises while the others wait in a collective: the whole job must end, with rank 2's traceback."""
import time

import mpidist

comm, info = mpidist.init()
if comm.Get_rank() == 2:
    time.sleep(0.2)
    raise ValueError("rank two broke on purpose")
comm.Barrier()
