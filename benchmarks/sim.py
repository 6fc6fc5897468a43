"""SimComm point-to-point and Allreduce next to real MPI (mpiexec -n 2), measured in the same run.

    python benchmarks/sim.py [--json PATH] [--rounds 3] [--suite]

Measures, with 2 ranks: one-way latency (ping-pong of Send/Recv halved) and bandwidth (bytes / one-way
time) at a few sizes, and Allreduce (SUM, float64) of 8 B and 1 MiB; first on SimComm (two rank threads
of ``simulate``), then on two MPI processes started with ``mpiexec -n 2`` of this script in worker mode.
The two alternate for ``--rounds`` rounds (the machine may be shared) and each number is the median over
rounds of the per-round median over repetitions. ``--suite`` also times ``pytest tests/test_collectives.py
tests/test_ddp.py`` on SimComm (no mpiexec). The load average is printed with the numbers.
Each SimComm round also times the floor under any thread-based simulator: a bare handoff between two Python
threads (a ping-pong on two ``threading.Lock``s, halved), since a simulated message wakes the receiving
rank thread, which must then take the GIL.
Each round measures SimComm twice: rank threads free (the default) and bound to one core (``simulate(...,
cpus=...)``, ``mpidist sim --cpus``, ``MPIDIST_SIM_CPUS``), where a handoff is a switch on that core instead
of waking another.
Targets (issue 17): 8-byte one-way latency under 15 us, 1 MiB Allreduce within 2x of MPI.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINGPONG_SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
ALLREDUCE_SIZES = [8, 1 << 20]
SUITE = ["tests/test_collectives.py", "tests/test_ddp.py"]


def _iters(nbytes):
    return 2000 if nbytes <= 1024 else 200 if nbytes <= (1 << 20) else 20


def measure(comm, reps):
    """Rows of this rank's measurements on ``comm`` (2 ranks): {"what", "bytes", "us"} (median of ``reps``)."""
    from mpi4py import MPI
    rank = comm.Get_rank()
    peer = 1 - rank
    rows = []
    for nbytes in PINGPONG_SIZES:
        buf = np.zeros(nbytes, np.uint8)
        n = _iters(nbytes)
        times = []
        for rep in range(reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    comm.Send(buf, peer, 1)
                    comm.Recv(buf, peer, 1)
                else:
                    comm.Recv(buf, peer, 1)
                    comm.Send(buf, peer, 1)
            if rep:  # the first repetition warms up
                times.append((time.perf_counter() - t0) / n / 2 * 1e6)
        us = statistics.median(times)
        rows.append({"what": "one-way latency", "bytes": nbytes, "us": us, "MB/s": nbytes / us})
    for nbytes in ALLREDUCE_SIZES:
        send = np.ones(nbytes // 8, np.float64)
        recv = np.empty_like(send)
        n = _iters(nbytes)
        times = []
        for rep in range(reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                comm.Allreduce(send, recv, op=MPI.SUM)
            if rep:
                times.append((time.perf_counter() - t0) / n * 1e6)
        assert recv[0] == comm.Get_size()
        rows.append({"what": "Allreduce", "bytes": nbytes, "us": statistics.median(times)})
    return rows


def thread_handoff(reps, n=2000, cpus=None):
    """One-way time (us) of a bare handoff between two Python threads: the median of ``reps`` ping-pongs
    of ``n`` round trips on two locks, halved. ``cpus``: both threads bound to these CPUs."""
    import threading
    if cpus is not None:  # in a bound thread of its own (its peer inherits the binding); this one stays free
        result = []

        def bound():
            os.sched_setaffinity(0, cpus)
            result.append(thread_handoff(reps, n))
        t = threading.Thread(target=bound)
        t.start()
        t.join()
        return result[0]
    times = []
    for rep in range(reps + 1):
        ping, pong = threading.Lock(), threading.Lock()
        ping.acquire()
        pong.acquire()

        def peer():
            for _ in range(n):
                ping.acquire()
                pong.release()
        thread = threading.Thread(target=peer)
        thread.start()
        t0 = time.perf_counter()
        for _ in range(n):
            ping.release()
            pong.acquire()
        if rep:
            times.append((time.perf_counter() - t0) / n / 2 * 1e6)
        thread.join()
    return statistics.median(times)


def sim_round(reps, cpus=None):
    sys.path.insert(0, ROOT)
    from mpidist.comm.sim import simulate
    handoff = thread_handoff(reps, cpus=cpus)
    return simulate(2, measure, reps, cpus=cpus)[0], handoff


def mpi_round(reps):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--worker", out,
                        "--reps", str(reps)], check=True, env=env, cwd=ROOT)
        with open(out) as f:
            return json.load(f)


def worker(path, reps):
    from mpi4py import MPI
    rows = measure(MPI.COMM_WORLD, reps)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def time_suite():
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=300", *SUITE],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--rounds", type=int, default=3, help="alternating SimComm/MPI rounds (default 3)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per round (default 5)")
    parser.add_argument("--suite", action="store_true", help=f"also time pytest {' '.join(SUITE)} on SimComm")
    parser.add_argument("--worker", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.reps)
        return 0
    load = [os.getloadavg()[0]]
    one_core = {min(os.sched_getaffinity(0))}
    sims, mpis, handoffs, bound_sims, bound_handoffs = [], [], [], [], []
    for _ in range(args.rounds):
        rows, handoff = sim_round(args.reps)
        sims.append(rows)
        handoffs.append(handoff)
        rows, handoff = sim_round(args.reps, cpus=one_core)  # MPIDIST_SIM_CPUS / mpidist sim --cpus
        bound_sims.append(rows)
        bound_handoffs.append(handoff)
        mpis.append(mpi_round(args.reps))
        load.append(os.getloadavg()[0])
    rows = []
    print(f"# 2 ranks, {args.rounds} alternating rounds x {args.reps} reps, medians; "
          f"load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores")
    print(f"# SimComm: rank threads free (the default); 1 core: bound to CPU {min(one_core)} (--cpus)")
    print(f"{'what':>16} {'bytes':>9} | {'SimComm us':>10} {'1 core us':>9} {'MPI us':>9} {'ratio':>6} | "
          f"{'SimComm MB/s':>12} {'MPI MB/s':>9}")
    for i, base in enumerate(sims[0]):
        sim_us = statistics.median(r[i]["us"] for r in sims)
        bound_us = statistics.median(r[i]["us"] for r in bound_sims)
        mpi_us = statistics.median(r[i]["us"] for r in mpis)
        row = {"what": base["what"], "bytes": base["bytes"], "sim_us": sim_us, "sim_one_core_us": bound_us,
               "mpi_us": mpi_us, "ratio": sim_us / mpi_us}
        bw = ""
        if base["what"] == "one-way latency":
            row["sim_MBps"], row["mpi_MBps"] = base["bytes"] / sim_us, base["bytes"] / mpi_us
            bw = f"{row['sim_MBps']:>12.1f} {row['mpi_MBps']:>9.1f}"
        rows.append(row)
        print(f"{row['what']:>16} {row['bytes']:>9} | {sim_us:>10.2f} {bound_us:>9.2f} {mpi_us:>9.2f} "
              f"{row['ratio']:>6.2f} | {bw}")
    handoff = statistics.median(handoffs)
    bound_handoff = statistics.median(bound_handoffs)
    lat = next(r for r in rows if r["what"] == "one-way latency" and r["bytes"] == 8)
    big = next(r for r in rows if r["what"] == "Allreduce" and r["bytes"] == 1 << 20)
    print(f"# bare thread handoff (floor of a simulated message): {handoff:.2f} us "
          f"(rounds: {', '.join(f'{h:.1f}' for h in handoffs)}); 8-byte latency is {lat['sim_us'] / handoff:.2f}x it")
    print(f"# bound to one core: handoff {bound_handoff:.2f} us (rounds: {', '.join(f'{h:.1f}' for h in bound_handoffs)})")
    print(f"# target 8-byte one-way latency < 15 us: {lat['sim_us']:.1f} us -> {'met' if lat['sim_us'] < 15 else 'MISSED'}"
          f"; bound to one core: {lat['sim_one_core_us']:.1f} us -> {'met' if lat['sim_one_core_us'] < 15 else 'MISSED'}")
    print(f"# target 1 MiB Allreduce <= 2x MPI: {big['ratio']:.2f}x -> {'met' if big['ratio'] <= 2 else 'MISSED'}")
    result = {"rows": rows, "rounds": args.rounds, "reps": args.reps, "load": load, "cores": os.cpu_count(),
              "thread_handoff_us": handoff, "thread_handoff_rounds_us": handoffs,
              "one_core_cpus": sorted(one_core), "thread_handoff_one_core_us": bound_handoff,
              "thread_handoff_one_core_rounds_us": bound_handoffs,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    if args.suite:
        result["suite_s"] = time_suite()
        result["suite"] = SUITE
        print(f"# pytest {' '.join(SUITE)} on SimComm: {result['suite_s']:.1f} s (load {os.getloadavg()[0]:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
