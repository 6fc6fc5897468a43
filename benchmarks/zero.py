"""ZeRO-1 against plain AdamW under DDP: optimizer state per rank, step and optimizer time, same results.

Run from the repo root (the driver starts ``mpiexec -n N`` for each N in --ranks, one worker per rank):

    .venv/bin/python benchmarks/zero.py --json docs/zero_bench.json

Model: ``GPT(GPTConfig())`` (3,257,856 parameters, float32; ``bf16`` rows: an ``nn.precision.Policy("bf16")``,
bfloat16 parameters with AdamW's float32 masters), DDP over all ranks, 8 sequences of 128 random tokens per rank.
Both optimizers step twin models built from one seed; their steps are timed interleaved (one plain step, one
sharded step, repeated), medians over steps of the slowest rank (each step's time is the max over ranks). Rows:
- ``state_bytes_per_rank``: what ``memory_stats(optimizer)`` counts (AdamW's arrays: for the sharded one its
  shard's), the largest over ranks; ``planned_state_bytes``: the planner's
  ``optimizer`` component for the same layout (``zero1`` or ``ddp``), which must be equal;
- ``step_ms`` and ``optimizer_ms`` (``opt.step()`` alone: the sharded one includes its allgather);
- ``same_parameters``: whether the twins' parameters are bit for bit equal after the timed steps.
At 4 ranks on a 2-core machine the ranks outnumber the cores: its times are not comparable to the 2-rank ones
(oversubscribed), only its memory and the equality are.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _mpiexec():
    flags = os.environ.get("MPIEXEC_FLAGS", "").split()
    launcher = os.environ.get("MPIDIST_MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(launcher):
        launcher = "mpiexec"
    return [launcher] + flags


def worker(steps):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import numpy as np
    from mpi4py import MPI

    from mpidist import optim
    from mpidist.models.gpt import GPT, GPTConfig
    from mpidist.nn.precision import Policy, apply_policy
    from mpidist.parallel import DDP, ZeroRedundancyOptimizer
    from mpidist.plan import Layout, ModelShape
    from mpidist.plan.estimate import memory_per_rank

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    config = GPTConfig()
    per_rank = 8
    rng = np.random.default_rng(100 + rank)
    x = rng.integers(0, config.vocab_size, (per_rank, config.block_size))
    y = rng.integers(0, config.vocab_size, (per_rank, config.block_size))
    rows = []
    for precision in ("fp32", "bf16"):
        runs = {}
        for kind in ("plain", "zero1"):
            model = GPT(config, rng=np.random.default_rng(0))
            if precision == "bf16":
                apply_policy(model, Policy("bf16"))
            ddp = DDP(model, comm)
            params = list(ddp.parameters())
            opt = (ZeroRedundancyOptimizer(params, optim.AdamW, comm, lr=1e-3) if kind == "zero1"
                   else optim.AdamW(params, lr=1e-3))
            runs[kind] = {"model": model, "ddp": ddp, "opt": opt, "step": [], "optimizer": []}

        def one_step(run):
            comm.Barrier()
            began = time.perf_counter()
            run["opt"].zero_grad()
            run["model"].loss(run["ddp"](x), y).backward()
            mid = time.perf_counter()
            run["opt"].step()
            end = time.perf_counter()
            return comm.allreduce(end - began, op=MPI.MAX), comm.allreduce(end - mid, op=MPI.MAX)

        for i in range(steps + 2):
            for kind in ("plain", "zero1"):
                total, opt_s = one_step(runs[kind])
                if i >= 2:   # the first steps allocate the state
                    runs[kind]["step"].append(total)
                    runs[kind]["optimizer"].append(opt_s)
        same = all(bool(np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)))
                   for a, b in zip(runs["plain"]["ddp"].parameters(), runs["zero1"]["ddp"].parameters()))
        same = all(comm.allgather(same))
        shape = ModelShape(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.block_size)
        for kind in ("plain", "zero1"):
            run = runs[kind]
            state = max(comm.allgather(run["ddp"].memory_stats(run["opt"])["optimizer_state_bytes"]))
            layout = Layout(size, 1, 1, "zero1" if kind == "zero1" else "ddp", micro_batch=per_rank,
                            param_dtype="bfloat16" if precision == "bf16" else "")
            rows.append({"ranks": size, "precision": precision, "optimizer": kind,
                         "state_bytes_per_rank": state,
                         "planned_state_bytes": memory_per_rank(shape, layout)["optimizer"],
                         "step_ms": 1e3 * statistics.median(run["step"]),
                         "optimizer_ms": 1e3 * statistics.median(run["optimizer"]),
                         "steps_timed": steps, "same_parameters": same,
                         "oversubscribed": size > (os.cpu_count() or 1)})
    if rank == 0:
        print("ROWS " + json.dumps(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return
    rows = []
    for n in (int(r) for r in args.ranks.split(",")):
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        out = subprocess.run(_mpiexec() + ["-n", str(n), sys.executable, os.path.abspath(__file__), "--worker",
                                           "--steps", str(args.steps)], env=env, capture_output=True, text=True,
                             timeout=1800, cwd=ROOT)
        if out.returncode:
            sys.exit(f"zero.py: mpiexec -n {n} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        rows += json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROWS "))[5:])
    by = {(r["ranks"], r["precision"], r["optimizer"]): r for r in rows}
    print(f"{'ranks':>5} {'prec':<5} {'optimizer':<9} {'state MiB/rank':>14} {'planned':>9} {'step ms':>9} "
          f"{'opt ms':>8} {'same':>5}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['precision']:<5} {r['optimizer']:<9} {r['state_bytes_per_rank'] / 2**20:>14.2f} "
              f"{r['planned_state_bytes'] / 2**20:>9.2f} {r['step_ms']:>9.1f} {r['optimizer_ms']:>8.1f} "
              f"{str(r['same_parameters']):>5}" + ("  (oversubscribed)" if r["oversubscribed"] else ""))
    summary = {}
    for (n, prec, kind), r in by.items():
        if kind == "zero1":
            plain = by[(n, prec, "plain")]
            summary[f"{n}_{prec}"] = {"state_ratio": r["state_bytes_per_rank"] / plain["state_bytes_per_rank"],
                                      "step_ratio": r["step_ms"] / plain["step_ms"],
                                      "optimizer_ratio": r["optimizer_ms"] / plain["optimizer_ms"]}
    for k, v in summary.items():
        print(k, ", ".join(f"{a} {b:.3f}" for a, b in v.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "benchmarks/zero.py " + " ".join(sys.argv[1:]), "when": time.strftime(
                "%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows, "summary": summary}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
