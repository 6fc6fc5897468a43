"""What the collective guards cost: allreduce latency with tracking off, watchdog tracking, and desync checks.

Run:  OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/guard_cost.py [--json PATH]

Modes are interleaved in blocks; each number is the median over blocks of the mean time per call
(slowest rank), next to a raw ``comm.Allreduce``.
"""

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist import guard


def time_block(fn, x, comm, calls):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    rows = []
    for nbytes in (8, 65536, 1 << 20):
        x = np.zeros(nbytes // 4, dtype=np.float32)
        calls = max(20, args.calls * 8 // max(nbytes // 1024, 8))
        modes = {
            "raw": lambda a: comm.Allreduce(MPI.IN_PLACE, a),
            "mpidist": lambda a: mpidist.allreduce(a, comm),
            "mpidist+watchdog": lambda a: mpidist.allreduce(a, comm),
            "mpidist+desync": lambda a: mpidist.allreduce(a, comm),
        }
        times = {m: [] for m in modes}
        for _ in range(args.blocks):
            for mode, fn in modes.items():
                guard.configure(desync=mode.endswith("desync"))
                # tracking() is true when the watchdog runs; emulate one without its thread.
                guard._watchdog = object() if mode.endswith("watchdog") else None
                times[mode].append(time_block(fn, x, comm, calls))
        guard._watchdog = None
        guard.configure(desync=False)
        row = {"bytes": nbytes, "ranks": comm.Get_size(), **{f"{m}_us": float(np.median(t)) * 1e6 for m, t in times.items()}}
        rows.append(row)
    if comm.Get_rank() == 0:
        print(f"{'bytes':>9} {'raw us':>9} {'mpidist':>9} {'+watchdog':>10} {'+desync':>9}")
        for r in rows:
            print(f"{r['bytes']:>9} {r['raw_us']:>9.2f} {r['mpidist_us']:>9.2f} {r['mpidist+watchdog_us']:>10.2f} {r['mpidist+desync_us']:>9.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
