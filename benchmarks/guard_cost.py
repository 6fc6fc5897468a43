"""What the collective guards cost: the flight recorder on every call, and the desync check by message size.

Run:  OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/guard_cost.py [--json PATH]

Modes, interleaved in blocks so that every mode sees the same machine (each time is the median over
blocks of the mean time per call on the slowest rank; the order of the modes rotates from block to block):
- raw: mpi4py's own call on the same buffer (Allreduce, Bcast, Reduce_scatter_block)
- untracked: mpidist with the guard's recording switched off (``record.enabled = False``; a benchmark
  switch, not a setting: recording is always on)
- recorded: mpidist as it runs below ``check_bytes``: every call recorded (flight recorder), no check
- checked: mpidist with the fingerprint check, as every call at or above ``check_bytes`` runs
- raw+sync: the raw call preceded by a raw 14-int MAX-allreduce on another communicator: what any
  check costs that must hear from every rank before the data moves, with no Python in it
The watchdog thread runs, as after ``mpidist.init()``, so checks wait the way they do in a job.

Printed and written (``--json``): per op and size the four times; the check's cost as the median over
blocks of (checked / recorded - 1), both measured in the same block; the recording's cost per call
(in the run, and of ``enter``+``leave`` alone in a loop); and the threshold: the smallest size from
which the check costs under ``--budget`` (2%) for every op, at that size and every larger one.
"""

import argparse
import json
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist import guard
from mpidist.guard import record

OPS = ("allreduce", "broadcast", "reduce_scatter")
SIZES = (8, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)


def calls_for(comm, fn, x, target):
    """Return how many calls make a block of about ``target`` seconds (the same number on every rank)."""
    fn(x)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(3):
        fn(x)
    per_call = comm.allreduce((time.perf_counter() - start) / 3, op=MPI.MAX)
    return max(10, min(20000, int(target / max(per_call, 1e-7))))


def time_block(comm, fn, x, calls):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX)


def functions(op, comm):
    size = comm.Get_size()
    if op == "allreduce":
        return (lambda a: comm.Allreduce(MPI.IN_PLACE, a)), (lambda a: mpidist.allreduce(a, comm))
    if op == "broadcast":
        return (lambda a: comm.Bcast(a, root=0)), (lambda a: mpidist.broadcast(a, comm))
    out = {}

    def raw_reduce_scatter(a):
        buf = out.get(a.size)
        if buf is None:
            buf = out[a.size] = np.empty(a.size // size, dtype=a.dtype)
        comm.Reduce_scatter_block(a, buf)
    return raw_reduce_scatter, (lambda a: mpidist.reduce_scatter(a, comm))


def set_mode(mode):
    record.enabled = mode != "untracked"
    guard.configure(desync=mode == "checked", check_bytes=0)


def measure(comm, op, nbytes, blocks, target):
    elements = max(nbytes // 4, comm.Get_size())
    elements -= elements % comm.Get_size()  # reduce_scatter: equal rows per rank
    x = np.zeros(elements, dtype=np.float32)
    raw, ours = functions(op, comm)
    set_mode("recorded")
    calls = calls_for(comm, ours, x, target)
    other = comm.Dup()
    probe = np.zeros(14, dtype=np.int64)

    def raw_sync(a):
        other.Allreduce(MPI.IN_PLACE, probe, op=MPI.MAX)
        raw(a)
    modes = {"raw": raw, "untracked": ours, "recorded": ours, "checked": ours, "raw+sync": raw_sync}
    times = {m: [] for m in modes}
    order = list(modes)
    for block in range(blocks):
        # The order rotates from block to block (the same on every rank): no mode always follows another.
        for mode in order[block % len(order):] + order[:block % len(order)]:
            set_mode(mode)
            times[mode].append(time_block(comm, modes[mode], x, calls))
    set_mode("recorded")
    other.Free()
    sync_us = [(s - r) * 1e6 for s, r in zip(times["raw+sync"], times["raw"])]
    check_ratio = [c / r - 1 for c, r in zip(times["checked"], times["recorded"])]
    check_us = [(c - r) * 1e6 for c, r in zip(times["checked"], times["recorded"])]
    record_ratio = [r / u - 1 for r, u in zip(times["recorded"], times["untracked"])]
    return {"op": op, "bytes": int(x.nbytes), "ranks": comm.Get_size(), "calls_per_block": calls, "blocks": blocks,
            **{f"{m}_us": float(np.median(t)) * 1e6 for m, t in times.items()},
            "recording_ns": float(np.median([r - u for r, u in zip(times["recorded"], times["untracked"])])) * 1e9,
            "recording_pct": float(np.median(record_ratio)) * 100,
            "check_us": float(np.median(check_us)), "sync_us": float(np.median(sync_us)),
            "check_us_iqr": [float(v) for v in np.percentile(check_us, [25, 75])], "check_pct": float(np.median(check_ratio)) * 100}


def recording_alone(comm, repeats=7, calls=200_000):
    """Return the median ns of one ``enter``+``leave`` pair (no check, no MPI): the recorder's own cost."""
    set_mode("recorded")
    x = np.zeros(2, dtype=np.float32)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            record.leave(record.enter(comm, "allreduce", x, 8, 1, 2, -1, "sum"))
        samples.append((time.perf_counter() - start) / calls)
    return float(np.median(samples)) * 1e9


def threshold(rows, budget):
    """Return the smallest size from which every op's check costs under ``budget`` % (None if none does)."""
    sizes = sorted({r["bytes"] for r in rows})
    worst = {s: max(r["check_pct"] for r in rows if r["bytes"] == s) for s in sizes}
    ok = [s for i, s in enumerate(sizes) if all(worst[t] < budget for t in sizes[i:])]
    return (ok[0] if ok else None), worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write every number as JSON")
    parser.add_argument("--blocks", type=int, default=31, help="blocks per mode (default 31); medians over them")
    parser.add_argument("--block-seconds", type=float, default=0.03, help="length of one block (default 0.03)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    parser.add_argument("--budget", type=float, default=2.0, help="what the check may cost, in %% (default 2)")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown op {unknown[0]!r} (expected some of {', '.join(OPS)})")
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    guard.start_watchdog(MPI.COMM_WORLD, 600)
    alone_ns = recording_alone(comm)
    rows = []
    if rank == 0:
        print(f"{'op':>15} {'bytes':>9} {'raw us':>9} {'untracked':>10} {'recorded':>9} {'checked':>9} "
              f"{'record ns':>9} {'check us':>8} {'sync us':>8} {'check %':>8}", flush=True)
    for op in ops:
        for nbytes in map(int, args.sizes.split(",")):
            row = measure(comm, op, nbytes, args.blocks, args.block_seconds)
            rows.append(row)
            if rank == 0:
                print(f"{op:>15} {row['bytes']:>9} {row['raw_us']:>9.2f} {row['untracked_us']:>10.2f} "
                      f"{row['recorded_us']:>9.2f} {row['checked_us']:>9.2f} {row['recording_ns']:>9.0f} "
                      f"{row['check_us']:>8.2f} {row['sync_us']:>8.2f} {row['check_pct']:>8.2f}", flush=True)
    smallest, worst = threshold(rows, args.budget)
    small = [r for r in rows if r["op"] == "allreduce" and r["bytes"] == min(x["bytes"] for x in rows)]
    summary = {
        "recording_alone_ns": alone_ns,
        "recording_in_run_ns": small[0]["recording_ns"] if small else None,
        "recording_pct_of_smallest_allreduce": small[0]["recording_pct"] if small else None,
        "smallest_allreduce_untracked_us": small[0]["untracked_us"] if small else None,
        "check_budget_pct": args.budget,
        "check_threshold_bytes": smallest,
        "check_us_median_over_rows": float(np.median([r["check_us"] for r in rows])),
        "worst_check_pct_by_size": {str(s): w for s, w in worst.items()},
    }
    if rank == 0:
        print(f"recording: {alone_ns:.0f} ns per call alone (enter+leave); in the run "
              f"{summary['recording_in_run_ns']:.0f} ns = {summary['recording_pct_of_smallest_allreduce']:.1f}% of a "
              f"{small[0]['bytes']} B allreduce ({small[0]['untracked_us']:.2f} us untracked)" if small else
              f"recording: {alone_ns:.0f} ns per call alone (enter+leave)")
        print(f"check: under {args.budget:g}% for every op from {smallest} B on" if smallest else
              f"check: over {args.budget:g}% at some size up to the largest measured")
        if args.json:
            meta = {"host": platform.node(), "ranks": comm.Get_size(), "mpi": MPI.Get_library_version().splitlines()[0],
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "blocks": args.blocks}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=2)
    guard.stop_watchdog()
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
