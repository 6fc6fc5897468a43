"""GPU allreduce bus bandwidth per path (staged, ipc, nccl, cuda_aware, hierarchical) next to host MPI.

Run (on a GPU machine; ranks may share one GPU):
    mpiexec -n 2 python benchmarks/gpu_collectives.py --json gpu.json
    mpiexec -n 4 --oversubscribe python benchmarks/gpu_collectives.py --sizes 1M,64M

Rows: {"path", "ranks", "bytes", "us", "busbw_gbs"}; path "host" is numpy arrays through the same
MPI in the same run. busbw = bytes / time * 2(n-1)/n (nccl-tests). Time per call: median over
repetitions of the slowest rank. Targets (64 MiB float32, 2 ranks on one H100): staged >= 0.8x host,
ipc >= 100 GB/s (met on an H100 only with NVIDIA MPS running: docs/gpu.md has the numbers). Without cupy or a
GPU it says so and exits with status 0.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist import gpu
from mpidist.bench import parse_sizes
from mpidist.xp import get_cupy, gpu_count

PATHS = ("staged", "ipc", "nccl", "cuda_aware", "hierarchical")
TARGET_BYTES = 64 << 20


def busbw(nbytes, seconds, n):
    return nbytes / seconds * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0


def time_calls(call, sync, comm, iters, reps=5):
    """Return the median over ``reps`` of the slowest rank's seconds per call."""
    call()
    sync()
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        samples.append(comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))
    return statistics.median(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64K,1M,4M,16M,64M", help="message sizes in bytes (K/M/G suffixes)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    ap.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    cupy = get_cupy()
    if cupy is None or gpu_count() == 0:
        why = "cupy is not installed" if cupy is None else "cupy sees no usable CUDA GPU"
        if rank == 0:
            print(f"gpu_collectives: {why}; nothing to measure (run on a GPU machine, see docs/gpu.md)")
        return 0
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"--paths: unknown path(s) {', '.join(unknown)} (expected {', '.join(PATHS)})")
    mpidist.init(comm)  # selects GPU local_rank % visible GPUs
    sizes = parse_sizes(args.sizes)
    rows = []

    def record(path, nbytes, seconds):
        row = {"path": path, "ranks": n, "bytes": nbytes, "us": seconds * 1e6, "busbw_gbs": busbw(nbytes, seconds, n)}
        rows.append(row)
        if rank == 0:
            print(f"{path:>13} {n:>3} ranks {nbytes:>11} B {row['us']:>12.1f} us {row['busbw_gbs']:>8.2f} GB/s", flush=True)

    for nbytes in sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        iters = max(5, min(200, (64 << 20) // max(nbytes, 1)))
        record("host", nbytes, time_calls(lambda: comm.Allreduce(MPI.IN_PLACE, x), lambda: None, comm, iters))
    stream_sync = cupy.cuda.get_current_stream().synchronize
    for path in paths:
        try:
            choice = gpu.attach(comm, path=path)
        except RuntimeError as exc:  # the same on every rank
            if rank == 0:
                print(f"{path:>13}: not possible here ({exc})")
            continue
        if rank == 0:
            print(f"{path:>13}: {choice}")
        for nbytes in sizes:
            x = cupy.ones(nbytes // 4, dtype=cupy.float32)
            iters = max(5, min(200, (64 << 20) // max(nbytes, 1)))
            record(path, nbytes, time_calls(lambda: mpidist.allreduce(x, comm), stream_sync, comm, iters))
        gpu.release(comm)

    if rank == 0:
        at = {r["path"]: r["busbw_gbs"] for r in rows if r["bytes"] == TARGET_BYTES}
        if n == 2 and "host" in at:
            if "staged" in at:
                verdict = "PASS" if at["staged"] >= 0.8 * at["host"] else "FAIL"
                print(f"target staged >= 0.8 x host at 64 MiB: {at['staged']:.2f} vs {0.8 * at['host']:.2f} GB/s: {verdict}")
            if "ipc" in at:
                print(f"target ipc >= 100 GB/s at 64 MiB: {at['ipc']:.2f} GB/s: {'PASS' if at['ipc'] >= 100 else 'FAIL'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
