"""mpidist.allreduce next to raw in-place comm.Allreduce, 8 B to 64 MiB of float32, in the same run.

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/collectives.py [--json PATH] [--sizes 8:64M] [--reps 9]

Prints latency, algbw and busbw (nccl-tests definitions, GB/s) of both, mpidist/raw busbw ratio and
mpidist's extra microseconds per size, then the targets: mpidist within 5% of raw busbw at >= 64 KiB
and within 10 us at 8 B. JSON rows: {"op", "bytes", "ranks", "mpidist_us", "raw_us", ...} (all of
``mpidist.bench.FIELDS``). The measurement itself is ``mpidist.bench`` (also ``mpidist bench``).
"""

import argparse
import sys

from mpidist import bench, init


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--sizes", default="8:64M", help="START:STOP (doubling) or a list, in bytes (default 8:64M)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per repetition (default: by size)")
    parser.add_argument("--reps", type=int, default=9, help="repetitions; the median is reported (default 9)")
    args = parser.parse_args()

    comm, info = init()
    rank0 = comm.Get_rank() == 0
    if rank0:
        print(f"# allreduce, float32, {info.size} ranks, {info.mpi_library}, launcher {info.launcher}")
        print(f"{'bytes':>10} | {'mpidist us':>10} {'raw us':>10} {'extra us':>9} | {'mpidist busbw':>13} "
              f"{'raw busbw':>10} | {'ratio':>5}", flush=True)

    def progress(result):
        r = result.row()
        if rank0:
            print(f"{r['bytes']:>10} | {r['mpidist_us']:>10.2f} {r['raw_us']:>10.2f} {r['mpidist_us'] - r['raw_us']:>9.2f} | "
                  f"{r['mpidist_busbw']:>13.3f} {r['raw_busbw']:>10.3f} | {r['ratio']:>5.2f}", flush=True)

    results = bench.run(["allreduce"], bench.parse_sizes(args.sizes), comm, iters=args.iters, reps=args.reps,
                        progress=progress)
    if not rank0:
        return 0
    rows = [r.row() for r in results]
    large = [r for r in rows if r["bytes"] >= 64 << 10]
    small = [r for r in rows if r["bytes"] == 8]
    if large:
        worst = min(large, key=lambda r: r["ratio"])
        print(f"# target busbw >= 0.95 x raw at >= 64 KiB: worst {worst['ratio']:.3f} at {worst['bytes']} B "
              f"-> {'met' if worst['ratio'] >= 0.95 else 'MISSED'}")
    if small:
        extra = small[0]["mpidist_us"] - small[0]["raw_us"]
        print(f"# target within 10 us of raw at 8 B: {extra:+.2f} us -> {'met' if extra <= 10 else 'MISSED'}")
    if args.json:
        bench.write_json(args.json, results, {"ranks": info.size, "mpi_library": info.mpi_library,
                                              "command": " ".join(sys.argv)})
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
