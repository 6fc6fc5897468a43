"""Measured bubble fraction and peak activations of each pipeline schedule, next to the formulas.

Run: .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/pipeline.py --json pipeline.json
(or --sim to run the 4 ranks as threads of one process).

Every stage costs a known time: forward sleeps f, backward 2f around a tiny real Linear, written as an autograd op
whose backward sleeps f for the input gradient and f for the weight gradients; under zb_h1 the executor's generic
B/W split (nn.backward_input, then DeferredWeightGrads.run()) puts the first half in B and the second in W.
Sleeping instead of computing makes 4 ranks on a 2-core, shared machine measure the schedule rather than CPU
contention; interleaved chunks hold half a stage each (f/2, f).
bubble_measured = mean over ranks of 1 - compute / makespan, makespan = the slowest rank's step (all ranks start
at a barrier); the median over --steps steps after one warm-up step is reported.
"""
import argparse
import json
import os
import sys
import time

# MPICH busy-polls in blocking receives; with 4 ranks on 2 cores the spinners delay a rank waking from its
# stage's sleep. Yielding the core on every poll keeps that delay small. Set before MPI initializes on import.
os.environ.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")

import numpy as np  # noqa: E402

from mpidist import collectives, simulate  # noqa: E402
from mpidist.nn import Linear, Module, MSELoss  # noqa: E402
from mpidist.nn.autograd import make_result  # noqa: E402
from mpidist.parallel.pipeline import (  # noqa: E402
    Pipeline, gpipe, interleaved_1f1b, one_f_one_b, simulate_schedule, zero_bubble_h1)

WIDTH = 8


def sleepy_linear(x, weight, bias, f):
    """Return ``x @ W.T + b``; its backward sleeps f for the input gradient and f for the weight gradients."""
    out = x.data @ weight.data.T + bias.data
    input_needs_grad = x.requires_grad

    def backward_fn(g, needs):
        weights = needs[1] or needs[2]
        # The first stage's input needs no gradient, so autograd never asks for it; its input half is charged
        # with the weight half instead, keeping every stage's backward at 2f as the formulas assume. Under zb_h1
        # that stage's B is then empty and its W costs 2f: on rank 0 each W directly follows its B, so the
        # timing is the same.
        input_half = needs[0] or (weights and not input_needs_grad)
        time.sleep(f * (input_half + weights))
        return (g @ weight.data if needs[0] else None,
                g.T @ x.data if needs[1] else None,
                g.sum(axis=0) if needs[2] else None)

    return make_result("SleepyLinear", out, (x, weight, bias), backward_fn)


class SleepStage(Module):
    """A Linear whose forward takes f seconds and backward 2f (f for B, f for W when split)."""

    def __init__(self, f, seed):
        super().__init__()
        self.f = f
        self.lin = Linear(WIDTH, WIDTH, rng=np.random.default_rng(seed), dtype=np.float64)

    def forward(self, x):
        time.sleep(self.f)
        return sleepy_linear(x, self.lin.weight, self.lin.bias, self.f)


def bubble_formula(schedule, p, m, v):
    """Closed-form bubble fraction (idle / makespan) with F = f, B + W = 2f (B = W = f when split)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":  # bubble time / compute = (1/v)(p-1)/m (m a multiple of p)
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb_h1":  # idle (p-1)(F+B-W) per rank against compute m(F+B+W)
        return (p - 1) / (3 * m + p - 1)
    raise ValueError(f"bubble_formula: unknown schedule {schedule!r}")


def peak_formula(schedule, p, m, v, rank):
    """Micro-batches (chunk activations for interleaved) a rank holds at most."""
    if schedule == "gpipe":
        return m
    if schedule in ("1f1b", "zb_h1"):
        return min(p - rank, m)
    # Megatron's warm-up count plus the one forward of the first 1F1B pair (m a multiple of p).
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


def run(comm, args):
    p, rank = comm.Get_size(), comm.Get_rank()
    rows = []
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        for m in args.m:
            chunks = [SleepStage(args.f / v, seed=c * p + rank) for c in range(v)]
            pipe = Pipeline(chunks if v > 1 else chunks[0], comm, m, schedule=schedule, loss_fn=MSELoss())
            rng = np.random.default_rng(0)
            x, y = rng.normal(size=(2 * m, WIDTH)), rng.normal(size=(2 * m, WIDTH))
            bubbles, peaks = [], []
            for step in range(args.steps + 1):
                for c in chunks:
                    c.zero_grad()
                collectives.barrier(comm)
                pipe.step(x, y)
                s = pipe.stats
                stats = collectives.allgather(np.array([[s.compute_s, s.wall_s, s.peak_activations,
                                                         s.peak_pending_w]]), comm, out=np.empty((p, 4)))
                if step > 0:  # the first step warms up allocations and MPI connections
                    makespan = stats[:, 1].max()
                    bubbles.append(float(np.mean(1 - stats[:, 0] / makespan)))
                    peaks.append(([int(k) for k in stats[:, 2]], [int(k) for k in stats[:, 3]]))
            row = {
                "schedule": schedule, "p": p, "m": m, "v": v, "f_s": args.f,
                "bubble_measured": float(np.median(bubbles)),
                "bubble_formula": bubble_formula(schedule, p, m, v),
                "peak_activations": peaks[-1][0],
                "peak_pending_w": peaks[-1][1],  # backwards whose W (and its kept inputs) is still to run
                "peak_formula": [peak_formula(schedule, p, m, v, r) for r in range(p)],
            }
            row["relative_error"] = abs(row["bubble_measured"] - row["bubble_formula"]) / row["bubble_formula"]
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
    return rows


def format_row(row):
    return (f"| {row['schedule']:<11} | {row['p']} | {row['m']:>2} | {row['bubble_measured']:.3f} "
            f"| {row['bubble_formula']:.3f} | {100 * row['relative_error']:4.1f}% "
            f"| {row['peak_activations']} | {row['peak_formula']} |")


HEADER = ("| schedule    | p |  m | bubble measured | bubble formula | rel. err | peak activations (rank 0..p-1) "
          "| peak formula |\n|---|---|---|---|---|---|---|---|")


def check_formulas_match_simulation(p, ms):
    """The closed forms above must equal the schedule simulator's numbers (catches a wrong formula)."""
    builders = {"gpipe": lambda m: (gpipe(p, m), 1), "1f1b": lambda m: (one_f_one_b(p, m), 1),
                "zb_h1": lambda m: (zero_bubble_h1(p, m), 1),
                "interleaved": lambda m: (interleaved_1f1b(p, m, 2), 2)}
    for name, build in builders.items():
        for m in ms:
            if name == "interleaved" and m % p:
                continue  # the closed forms above assume Megatron's order, used only when p divides m
            schedule, v = build(m)
            sim = simulate_schedule(schedule, 1.0 / v, 2.0 / v)
            assert abs(sim.bubble_fraction - bubble_formula(name, p, m, v)) < 1e-12, (name, m)
            assert list(sim.peak_activations) == [peak_formula(name, p, m, v, r) for r in range(p)], (name, m)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--f", type=float, default=0.2, help="forward time of one stage in seconds")
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved", "zb_h1"])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per row (after one warm-up)")
    parser.add_argument("--sim", type=int, default=0, metavar="P", help="run P simulated ranks as threads")
    args = parser.parse_args(argv)

    if args.sim:
        results = simulate(args.sim, run, args)
        rows, rank = results[0], 0
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        if rank == 0:
            print(HEADER, flush=True)
        rows = run(comm, args)
    if rank == 0:
        check_formulas_match_simulation(rows[0]["p"], sorted({r["m"] for r in rows}))
        if args.sim:
            print(HEADER)
            print("\n".join(format_row(r) for r in rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
