"""Every rank waits in Python until Ctrl-C (no Preemption installed): the job must end with one line, not tracebacks.

Usage: interrupted.py DIR; each rank writes DIR/pid.<rank>, then rank 0 writes DIR/ready.
"""
import os
import sys
import time

import mpidist

comm, info = mpidist.init()
with open(os.path.join(sys.argv[1], f"pid.{comm.Get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
comm.Barrier()
if comm.Get_rank() == 0:
    open(os.path.join(sys.argv[1], "ready"), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # interruptible: Python runs the SIGINT handler between sleeps
    time.sleep(0.05)
sys.exit("interrupted.py: no Ctrl-C arrived within 60 s")
