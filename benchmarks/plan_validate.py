"""Planner vs measurement on this machine: per-rank peak memory and step time of dp/fsdp/tp/pp layouts at 2 and 4 ranks.

Run from the repo root (spawns ``mpiexec -n N`` for each N, one worker per rank):

    .venv/bin/python benchmarks/plan_validate.py --json docs/plan_validate.json [--profile local] [--steps 4]

Each layout is built for real (``mpidist.plan.execute.LayoutRun``: a GPT, the mesh, tensor parallel,
DDP/FSDP/Pipeline, AdamW) and stepped: one warm-up step, then ``--steps`` timed steps (median of the slowest
rank). Peak memory per rank is the arrays' bytes: the wrapper's persistent bytes (``memory_stats``: parameters,
gradients, optimizer state) plus the most ``tracemalloc`` saw allocated on top during a step (activations,
gathered parameters, buffers); the largest over ranks is compared with the planner's per-rank total.
Prediction: ``mpidist.plan.estimate`` with the profile (default ``local``, written by
``python -m mpidist plan --calibrate``). Reported: signed errors per layout, their median, and Kendall's tau
between predicted and measured step times (on an oversubscribed machine the ranking is what counts).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpidist.plan import Layout, ModelShape, estimate, load_profile  # noqa: E402

SHAPE = ModelShape(layers=4, hidden=128, heads=4, vocab=256, seq=64)
BATCH = 16
LAYOUTS = {
    2: [Layout(2, 1, 1, micro_batch=8), Layout(2, 1, 1, micro_batch=4, num_micro=2), Layout(2, 1, 1, "fsdp", micro_batch=8),
        Layout(1, 2, 1, micro_batch=16), Layout(1, 2, 1, micro_batch=16, sequence_parallel=True),
        Layout(1, 1, 2, micro_batch=4, num_micro=4, schedule="1f1b"),
        Layout(1, 1, 2, micro_batch=2, num_micro=8, schedule="gpipe"),
        Layout(2, 1, 1, micro_batch=8, recompute="full")],
    4: [Layout(4, 1, 1, micro_batch=4), Layout(4, 1, 1, "fsdp", micro_batch=4),
        Layout(2, 2, 1, micro_batch=8), Layout(1, 4, 1, micro_batch=16),
        Layout(2, 1, 2, micro_batch=4, num_micro=2, schedule="1f1b"),
        Layout(1, 1, 4, micro_batch=2, num_micro=8, schedule="1f1b"),
        Layout(1, 2, 2, micro_batch=4, num_micro=4, schedule="1f1b")],
}


def worker(n, steps):
    from mpi4py import MPI

    from mpidist.plan.execute import LayoutRun
    comm = MPI.COMM_WORLD
    rows = []
    for layout in LAYOUTS[n]:
        run = LayoutRun(SHAPE, layout, comm)
        run.step()
        times = []
        for _ in range(steps):
            comm.Barrier()
            seconds = run.step()
            times.append(comm.allreduce(seconds, op=MPI.MAX))
        stats = run.interface.memory_stats(run.opt)
        persistent = stats["persistent_bytes"]
        comm.Barrier()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        run.step()
        transient = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        peak = comm.allreduce(persistent + transient, op=MPI.MAX)
        rows.append({"layout": layout.to_dict(), "name": layout.name(), "step_s": statistics.median(times),
                     "peak_bytes": peak})
        del run
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(rows))


def kendall_tau(a, b):
    """Kendall's tau-a of two equal-length sequences (pairs tied in either count as neither)."""
    concordant = discordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += s > 0
            discordant += s < 0
    pairs = len(a) * (len(a) - 1) / 2
    return (concordant - discordant) / pairs if pairs else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--profile", default="local")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    profile = load_profile(args.profile)
    mpiexec = os.environ.get("MPIDIST_MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    report = {"model": SHAPE.__dict__, "global_batch": BATCH, "profile": profile.name, "cores": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    for n in [int(x) for x in args.ranks.split(",")]:
        done = subprocess.run([mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", str(n),
                               "--steps", str(args.steps)], capture_output=True, text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"plan_validate: mpiexec -n {n} failed ({done.returncode}): {done.stderr[-2000:]}")
        rows = json.loads(lines[-1][len("RESULT "):])
        for row in rows:
            est = estimate(SHAPE, Layout(**row["layout"]), profile, n)
            row["predicted_step_s"] = est.time["step"]
            row["predicted_peak_bytes"] = est.memory["total"]
            row["predicted_time"] = est.time
            row["predicted_memory"] = est.memory
            row["step_error"] = est.time["step"] / row["step_s"] - 1
            row["memory_error"] = est.memory["total"] / row["peak_bytes"] - 1
        measured = [r["step_s"] for r in rows]
        predicted = [r["predicted_step_s"] for r in rows]
        best_measured = min(measured)
        chosen = rows[predicted.index(min(predicted))]
        summary = {"kendall_tau": kendall_tau(predicted, measured),
                   "median_abs_step_error": statistics.median(abs(r["step_error"]) for r in rows),
                   "median_abs_memory_error": statistics.median(abs(r["memory_error"]) for r in rows),
                   "chosen": chosen["name"], "chosen_vs_best": chosen["step_s"] / best_measured - 1,
                   "oversubscribed": n > (os.cpu_count() or 1)}
        report["runs"][str(n)] = {"rows": rows, "summary": summary}
        print(f"-- {n} ranks on {os.cpu_count()} cores (profile {profile.name})")
        print(f"{'layout':<36} {'meas ms':>8} {'pred ms':>8} {'err':>7} {'meas MiB':>9} {'pred MiB':>9} {'err':>7}")
        for r in rows:
            print(f"{r['name']:<36} {r['step_s'] * 1e3:>8.1f} {r['predicted_step_s'] * 1e3:>8.1f} "
                  f"{r['step_error']:>+7.0%} {r['peak_bytes'] / 2**20:>9.2f} {r['predicted_peak_bytes'] / 2**20:>9.2f} "
                  f"{r['memory_error']:>+7.0%}")
        print(f"Kendall tau {summary['kendall_tau']:.2f}; median |step error| {summary['median_abs_step_error']:.0%}; "
              f"median |memory error| {summary['median_abs_memory_error']:.0%}; chosen {summary['chosen']} "
              f"({summary['chosen_vs_best']:+.0%} vs the measured best)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
