"""The torch.distributed backend ``mpidist`` against gloo: the same PyTorch scripts, in one run.

    python benchmarks/torch_backend.py [--ranks 2,4] [--rounds 3] [--json out.json] [--quick]

The driver launches ``mpiexec -n N`` workers for each (backend, ranks) pair, in rotating order for
``--rounds`` rounds (so slow phases of a shared machine hit both backends alike), and reports medians over
rounds and the ratio mpidist/gloo (below 1: mpidist is faster). Each worker measures, float32, one BLAS
thread per process (``torch.set_num_threads(1)``):

- ddp_mlp:   a DistributedDataParallel SGD step of an MLP 784-1024-1024-10, batch 64 per rank
- ddp_gpt:   a DDP AdamW step of a small GPT (vocab 256, context 64, width 128, 2 layers, 4 heads, batch 4 per rank)
- fsdp_gpt:  the same GPT under FSDP2 fully_shard (per block and at the root)
- allreduce: dist.all_reduce sweep 8 B .. 64 MiB; algbw = bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests)

Step times are the median of per-step times after warm-up; ``*_cpu_ms``: CPU time per step of every thread,
summed over the ranks (a shared machine's load moves wall times, hardly this); each run records the load
average at its end. The worker is this file with ``--worker``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


# -- worker ---------------------------------------------------------------------------------------------
def _worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import mpidist.torch  # noqa: F401 - registers mpidist; gloo meets in the MPI store (no MASTER_ADDR)

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}

    def timed_steps(name, step, warmup, steps):
        for _ in range(warmup):
            step()
        dist.barrier()
        times = []
        cpu = time.process_time()
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        # CPU time of every thread of every rank per step: on a shared machine the load moves wall times,
        # hardly this (spinning waits show up here as CPU spent on communication).
        c = torch.tensor([(time.process_time() - cpu) / steps], dtype=torch.float64)
        dist.all_reduce(c)
        results[name[:-3] + "_cpu_ms"] = 1e3 * c.item()
        # Every rank's step ends at the same gradient exchange; take the slowest rank's median.
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results[name] = 1e3 * t.item()

    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    mlp = DDP(nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def mlp_step():
        opt.zero_grad()
        nn.functional.cross_entropy(mlp(x), y).backward()
        opt.step()
    timed_steps("ddp_mlp_ms", mlp_step, 5, args.steps)

    for name, wrap in (("ddp_gpt_ms", "ddp"), ("fsdp_gpt_ms", "fsdp")):
        torch.manual_seed(0)
        model = _gpt(nn, torch)
        if wrap == "ddp":
            model = DDP(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        gopt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (4, 65))

        def gpt_step(model=model, gopt=gopt):
            gopt.zero_grad()
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
            gopt.step()
        timed_steps(name, gpt_step, 2, max(3, args.steps // 4))

    sweep = []
    size = 8
    while size <= args.max_bytes:
        t = torch.ones(size // 4, dtype=torch.float32)
        iters = max(3, min(200, int(2e8 // max(size, 1) // 10) or 3))
        for _ in range(2):
            dist.all_reduce(t)
        trials = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            trials.append((time.perf_counter() - start) / iters)
        seconds = torch.tensor([statistics.median(trials)], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        algbw = size / seconds.item() / 1e9
        sweep.append({"bytes": size, "us": 1e6 * seconds.item(), "algbw_GBs": algbw, "busbw_GBs": algbw * 2 * (world - 1) / world})
        size *= 8 if size < 65536 else 4
    results["allreduce"] = sweep
    results["load_average"] = os.getloadavg()[0]
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def _gpt(nn, torch, vocab=256, context=64, width=128, layers=2, heads=4):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            h = self.ln1(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(context, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(x)
    return GPT()


# -- driver ---------------------------------------------------------------------------------------------
def _launcher():
    mpiexec = os.environ.get("MPIDIST_MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return [mpiexec] + os.environ.get("MPIEXEC_FLAGS", "").split()


def _run(variant, ranks, args):
    backend, _, progress = variant.partition(":")  # "mpidist:poll": MPIDIST_TORCH_PROGRESS=poll
    cmd = _launcher() + ["-n", str(ranks), sys.executable, HERE, "--worker", "--backend", backend,
                         "--steps", str(args.steps), "--max-bytes", str(args.max_bytes)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if progress:
        env["MPIDIST_TORCH_PROGRESS"] = progress
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{backend} at {ranks} ranks failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _median_runs(runs):
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("_ms")}
    out["allreduce"] = [{"bytes": row["bytes"], **{k: statistics.median(r["allreduce"][i][k] for r in runs)
                                                   for k in ("us", "algbw_GBs", "busbw_GBs")}}
                        for i, row in enumerate(runs[0]["allreduce"])]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per (backend, ranks), in rotating order")
    parser.add_argument("--steps", type=int, default=20, help="measured training steps per run")
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest allreduce (default 64 MiB)")
    parser.add_argument("--backends", default="mpidist,gloo",
                        help="variants to run, gloo last; mpidist:MODE sets MPIDIST_TORCH_PROGRESS=MODE (default mpidist,gloo)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="one round, few steps, up to 1 MiB (a smoke test)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="mpidist", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    if args.quick:
        args.rounds, args.steps, args.max_bytes = 1, 4, 1 << 20
    backends = tuple(args.backends.split(","))
    if backends[-1] != "gloo":
        raise SystemExit(f"--backends: gloo must come last (ratios are against it); got {args.backends}")
    ranks = [int(n) for n in args.ranks.split(",")]
    runs = {(b, n): [] for b in backends for n in ranks}
    for round_ in range(args.rounds):
        shift = round_ % len(backends)  # rotate which variant goes first
        order = [(b, n) for n in ranks for b in backends[shift:] + backends[:shift]]
        for b, n in order:
            runs[b, n].append(_run(b, n, args))
            print(f"round {round_ + 1}/{args.rounds}: {b} at {n} ranks done", file=sys.stderr, flush=True)
    table = {f"{b}-{n}": _median_runs(runs[b, n]) for b in backends for n in ranks}
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "rounds": args.rounds,
              "steps": args.steps, "results": table, "raw": {f"{b}-{n}": runs[b, n] for b, n in runs},
              "ratios": {}}
    for n in ranks:
        gloo = table[f"gloo-{n}"]
        for variant in backends[:-1]:
            mine = table[f"{variant}-{n}"]
            ratios = {k: mine[k] / gloo[k] for k in mine if k.endswith("_ms")}
            ratios["allreduce_busbw"] = {row["bytes"]: row["busbw_GBs"] / other["busbw_GBs"]
                                         for row, other in zip(mine["allreduce"], gloo["allreduce"])}
            report["ratios"][f"{variant}-{n}"] = ratios
            print(f"\n{n} ranks, {variant} vs gloo: step times, median of {args.rounds} runs (ms)   {variant:>12}     gloo   ratio")
            for k in ("ddp_mlp_ms", "ddp_gpt_ms", "fsdp_gpt_ms", "ddp_mlp_cpu_ms", "ddp_gpt_cpu_ms", "fsdp_gpt_cpu_ms"):
                if k in mine:
                    print(f"  {k[:-3]:<58}{mine[k]:>10.2f} {gloo[k]:>8.2f} {ratios[k]:>7.2f}")
            loads = [r["load_average"] for b in (variant, "gloo") for r in runs[b, n] if "load_average" in r]
            if loads:
                print(f"  load average at the end of these runs: {min(loads):.1f}-{max(loads):.1f}")
            print(f"  allreduce float32  {'bytes':>10}  {'us':>10} {'busbw GB/s':>10}  {'gloo us':>9} {'busbw GB/s':>10}  busbw ratio")
            for row, other in zip(mine["allreduce"], gloo["allreduce"]):
                print(f"  {'':<19}{row['bytes']:>10}  {row['us']:>10.1f} {row['busbw_GBs']:>10.3f}  {other['us']:>9.1f} "
                      f"{other['busbw_GBs']:>10.3f}  {row['busbw_GBs'] / other['busbw_GBs']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
