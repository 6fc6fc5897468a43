"""Per-rank memory (bytes per parameter) and step time of DDP vs FSDP strategies, next to the ZeRO formulas.

Run from the repo root (spawns ``mpiexec -n N`` for each N, one worker per rank):

    .venv/bin/python benchmarks/fsdp_memory.py --json fsdp_memory.json

The launcher is the one ``make`` configures, as for the tests (tests/launcher.py): ``MPIDIST_MPIEXEC``
(default: the mpiexec next to this Python, else the one on PATH) with ``MPIEXEC_FLAGS`` (e.g.
``--oversubscribe`` for -n 4 on fewer cores under Open MPI).
The training step is ``crit(wrapper(x), y).backward(); opt.step(); opt.zero_grad(set_to_none=False)``: FSDP gathers, frees
and reduce-scatters from the hooks it put on the model.

Memory is counted exactly from the arrays each wrapper owns (not RSS): FSDP from ``memory_stats(optimizer)``;
DDP as module parameters + its flat gradient buckets + Adam state. Two numbers per row:
- persistent: what stays allocated between steps (param shards + grad shards + Adam's two moments);
- peak: persistent plus the largest amount of transient gathered parameters and full-size gradient buffers
  alive at once during the last step (activations are not counted).
Both are also given per parameter of the model (bytes / Psi) next to the ZeRO formula of the strategy, all in
float32 with Adam (no mixed precision): params 4 + grads 4 + moments 8 = 16 bytes per parameter unsharded,
ZeRO-1 4 + 4 + 8/d, ZeRO-2 4 + (4 + 8)/d, ZeRO-3 16/d, with d the ranks one copy is sharded over (N; the
shard group size k for the hybrid strategies). Step time (forward, backward, Adam step) is the median over
timed steps of the slowest rank.
"""

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

STRATEGIES = ("ddp", "no_shard", "shard_grad_op", "full_shard", "full_shard_post", "hybrid_shard",
              "hybrid_shard_grad_op")
# The ZeRO stage each strategy corresponds to (0: replicated, like DDP).
ZERO_STAGE = {"ddp": 0, "no_shard": 0, "shard_grad_op": 2, "hybrid_shard_grad_op": 2, "full_shard": 3,
              "full_shard_post": 3, "hybrid_shard": 3}


def zero_bytes_per_param(stage, d):
    """ZeRO's bytes per parameter for float32 params, grads and two Adam moments, sharded over ``d`` ranks."""
    return {0: 16.0, 1: 4 + 4 + 8 / d, 2: 4 + (4 + 8) / d, 3: 16 / d}[stage]


def hybrid_shard_size(ranks, requested):
    """The shard group size of the hybrid rows: ``requested``, else half the ranks (2 x 2 on 4), at least 1."""
    return requested if requested else max(1, ranks // 2)


def shard_group_size(strategy, ranks, requested):
    """The ranks one copy of the model is split over (d in the ZeRO formulas)."""
    if ZERO_STAGE[strategy] == 0:
        return 1
    return hybrid_shard_size(ranks, requested) if strategy.startswith("hybrid") else ranks


def build_model(width, layers, seed=0):
    import mpidist.nn as nn
    rng = np.random.default_rng(seed)
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width, rng=rng, dtype=np.float32))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def optimizer_state_bytes(opt):
    return sum(int(v.nbytes) for s in opt.state.values() for v in s.values() if hasattr(v, "nbytes"))


def ddp_wrapper(model, comm):
    """Return (DDP wrapper, a function giving the gradient bytes it owns: its flat buckets)."""
    from mpidist.parallel.ddp import DDP
    wrapper = DDP(model, comm)
    return wrapper, lambda: sum(b.flat.nbytes for b in wrapper.buckets)


def run_worker(args):
    from mpi4py import MPI

    import mpidist.nn as nn
    from mpidist.optim import Adam
    from mpidist.parallel.fsdp import FSDP

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng([1, rank])
    x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, args.width, args.batch)
    rows = []
    for strategy in args.strategies:
        model = build_model(args.width, args.layers)
        psi = sum(p.data.size for p in model.parameters())
        unit_sizes = [sum(p.data.size for p in m.parameters()) for m in model]
        if strategy == "ddp":
            wrapper, grad_bytes = ddp_wrapper(model, comm)
            opt = Adam(list(model.parameters()), lr=1e-4)
        else:
            # "full_shard_post": FULL_SHARD with backward_prefetch="post" (2 units peak instead of 3).
            post = strategy.endswith("_post")
            hybrid = {"shard_size": hybrid_shard_size(size, args.shard_size)} if strategy.startswith("hybrid") else {}
            wrapper = FSDP(model, comm, strategy=strategy.removesuffix("_post"), backward_prefetch="post" if post else "pre",
                           **hybrid)
            opt = Adam(wrapper.parameters(), lr=1e-4)
        crit = nn.CrossEntropyLoss()
        times = []
        for step in range(args.warmup + args.steps):
            comm.Barrier()
            start = time.perf_counter()
            crit(wrapper(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # shard grads stay allocated, as before: comparable persistent bytes
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= args.warmup:
                times.append(elapsed)
        if strategy == "ddp":
            persistent = sum(p.data.nbytes for p in model.parameters()) + grad_bytes() + optimizer_state_bytes(opt)
            peak = persistent  # replicas never gather; grads live in the persistent buckets
            peak_gathered = 0
        else:
            stats = wrapper.memory_stats(opt)
            persistent, peak, peak_gathered = stats["persistent_bytes"], stats["peak_bytes"], stats["peak_gathered_bytes"]
        # Memory is per rank and equal across ranks up to padding: report the largest.
        persistent, peak = comm.allreduce(persistent, op=MPI.MAX), comm.allreduce(peak, op=MPI.MAX)
        shards = shard_group_size(strategy, size, args.shard_size)
        largest_two = sorted(math.ceil(s / shards) * shards * 4 for s in unit_sizes)[-2:]
        stage = ZERO_STAGE[strategy]
        rows.append({"strategy": strategy, "ranks": size, "shard_group_size": shards, "zero_stage": stage,
                     "persistent_bytes": int(persistent), "peak_bytes": int(peak),
                     "step_ms": 1e3 * float(np.median(times)), "params": int(psi),
                     "zero_formula_bytes_per_param": zero_bytes_per_param(stage, shards),
                     "persistent_bytes_per_param": persistent / psi, "peak_bytes_per_param": peak / psi,
                     "peak_gathered_bytes": int(peak_gathered), "two_largest_units_bytes": int(sum(largest_two))})
        del wrapper, opt, model
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def launch_command(n):
    """Return the launcher and its flags for ``n`` ranks, chosen as tests/launcher.py chooses them."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = os.environ.get("MPIDIST_MPIEXEC") or (beside if os.path.exists(beside) else shutil.which("mpiexec"))
    if not mpiexec or not (os.path.isfile(mpiexec) or shutil.which(mpiexec)):
        sys.exit(f"fsdp_memory: no launcher (MPIDIST_MPIEXEC={os.environ.get('MPIDIST_MPIEXEC', '')!r}, "
                 f"no mpiexec next to {sys.executable} or on PATH): set MPIDIST_MPIEXEC")
    return [mpiexec, *shlex.split(os.environ.get("MPIEXEC_FLAGS", "")), "-n", str(n)]


def run_driver(args):
    here = os.path.abspath(__file__)
    rows = []
    for n in args.ranks:
        cmd = [*launch_command(n), sys.executable, here, "--worker", "--width", str(args.width),
               "--layers", str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--strategies", *args.strategies,
               *(["--shard-size", str(args.shard_size)] if args.shard_size else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"fsdp_memory: {shlex.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        out = proc.stdout
        rows += json.loads(next(line[5:] for line in out.splitlines() if line.startswith("ROWS ")))
    mib = 1024 * 1024
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) float32, Psi = {rows[0]['params'] / 1e6:.2f}M "
          f"params, Adam, batch {args.batch} per rank")
    print("| strategy | ranks N | shard group d | ZeRO stage | ZeRO formula B/param | persistent B/param | "
          "peak B/param | persistent MiB | peak MiB | peak gathered params MiB | 2 largest units MiB | step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['ranks']} | {r['shard_group_size']} | {r['zero_stage']} | "
              f"{r['zero_formula_bytes_per_param']:.2f} | {r['persistent_bytes_per_param']:.2f} | "
              f"{r['peak_bytes_per_param']:.2f} | {r['persistent_bytes'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | "
              f"{r['peak_gathered_bytes'] / mib:.1f} | {r['two_largest_units_bytes'] / mib:.1f} | {r['step_ms']:.0f} |")
    print()
    print("ZeRO formulas, bytes per parameter (float32 params 4 + grads 4 + Adam moments 8), sharded over d ranks:")
    print("| d | DDP | ZeRO-1 4+4+8/d | ZeRO-2 4+(4+8)/d | ZeRO-3 16/d |")
    print("|---|---|---|---|---|")
    for d in sorted({r["ranks"] for r in rows}):
        print(f"| {d} | " + " | ".join(f"{zero_bytes_per_param(stage, d):.2f}" for stage in range(4)) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--shard-size", type=int, default=None,
                        help="shard group size of the hybrid strategies (default: half the ranks, at least 1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    (run_worker if args.worker else run_driver)(args)


if __name__ == "__main__":
    main()
