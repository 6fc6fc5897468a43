"""How much of an allreduce of DDP's buckets hides behind computation, on the virtual cluster or one node.

    .venv/bin/python benchmarks/allreduce_overlap.py --vcluster 200mbit --ppn 2 --matmuls 600   # as root
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/allreduce_overlap.py --worker --matmuls 600

Every rank times, interleaved over ``--rounds`` rounds (the slowest rank's time, the median over rounds):
``compute``, a loop of ``--matmuls`` 128 x 128 float32 matmuls; ``allreduce``, blocking allreduces of DDP's two
buckets of the 4-layer, 128-wide GPT of ``plan_validate.py`` (794624 and 2542624 bytes); ``overlap``, the two
posted as ``Iallreduce`` before the loop and waited for after it; ``overlap_test``, the same with
``MPI.Request.Testall`` every 20 matmuls (DDP and FSDP test their pending requests between layers). What the
overlap exposes is its time minus the compute's. MPI's algorithm can be chosen with its environment
(``MPIR_CVAR_ALLREDUCE_DEVICE_COLLECTIVE=0 MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring``: MPICH's ring).
"""
import argparse
import json
import os
import subprocess
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"   # one BLAS thread per rank (before numpy loads)

import numpy as np  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BUCKETS = (794624, 2542624)   # DDP's buckets of plan_validate's model, float32 bytes
MODES = ("compute", "allreduce", "overlap", "overlap_test")


def worker(matmuls, rounds, test_every=20):
    """Time ``MODES`` interleaved on ``MPI.COMM_WORLD``; rank 0 prints one JSON line."""
    import time

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    bufs = [np.ones(n // 4, np.float32) for n in BUCKETS]
    a = np.ones((128, 128), np.float32)

    def compute(reqs=None):
        for i in range(matmuls):
            a @ a
            if reqs and i % test_every == 0:
                MPI.Request.Testall(reqs)

    def run(mode):
        comm.Barrier()
        t0 = time.perf_counter()
        if mode == "compute":
            compute()
        elif mode == "allreduce":
            for b in bufs:
                comm.Allreduce(MPI.IN_PLACE, b)
        else:
            reqs = [comm.Iallreduce(MPI.IN_PLACE, b) for b in bufs]
            compute(reqs if mode == "overlap_test" else None)
            MPI.Request.Waitall(reqs)
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    for mode in MODES:
        run(mode)   # warm-up
    times = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            times[mode].append(run(mode))
    if comm.Get_rank() == 0:
        median = {mode: float(np.median(t)) for mode, t in times.items()}
        print("RESULT " + json.dumps({
            "ranks": comm.Get_size(), "matmuls": matmuls, "rounds": rounds, "buckets_bytes": list(BUCKETS),
            "median_s": median, "rounds_s": times, "library": MPI.Get_library_version().splitlines()[0],
            "exposed_s": {m: median[m] - median["compute"] for m in ("overlap", "overlap_test")},
            "mpi_env": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR")}}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vcluster", metavar="RATE", help="2 nodes of the virtual cluster, links at RATE (root)")
    parser.add_argument("--ppn", type=int, default=2, help="ranks per node on the virtual cluster")
    parser.add_argument("--matmuls", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help="run the timing (under mpiexec)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.matmuls, args.rounds)
    if not args.vcluster:
        parser.error("give --vcluster RATE, or run --worker under mpiexec")
    sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
    import vcluster
    why = vcluster.unavailable()
    if why:
        sys.exit(f"allreduce_overlap: {why}")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--matmuls", str(args.matmuls),
           "--rounds", str(args.rounds)]
    with vcluster.VirtualCluster(nodes=2, rate=args.vcluster) as cluster:
        done = subprocess.run(cluster.mpiexec(cmd, ppn=args.ppn), capture_output=True, text=True, timeout=600,
                              cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"allreduce_overlap: failed ({done.returncode}): {done.stderr[-2000:]}")
    result = dict(json.loads(lines[-1][len("RESULT "):]), vcluster=args.vcluster, ppn=args.ppn)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
