"""DDP step time: local (no communication) vs bucketed+overlapped DDP vs per-tensor blocking allreduce.

Run:  OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/ddp_step.py [--json PATH] [--steps N]

Models: an MLP 784-1024-1024-10 (1,863,690 parameters, float32, batch 64 per rank, SGD) for step
times, and a narrow 120-layer MLP of width 32 (240 parameter tensors) for the exposed synchronization
time: the time a step spends waiting for gradients after backward's own compute has finished.
Modes are interleaved in blocks so that machine noise hits all of them alike; times are medians
over steps of the slowest rank.
"""

import argparse
import json
import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # one BLAS thread per rank: ranks share the machine's cores

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402
from mpidist import nn, optim  # noqa: E402


def mlp(widths, seed=0):
    rng = np.random.default_rng(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b, rng=rng, dtype=np.float32))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _NoStepStamp:
    """Stands in for DDP's step stamp (mpidist.parallel.agreement) to measure what the check costs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


# What each DDP mode adds to the setup's own DDP options (bucket sizes): the modes compared in one run.
DDP_MODES = {"ddp": {}, "ddp_no_overlap": {"overlap": False}, "ddp_4mb": {"bucket_cap_mb": 4}, "ddp_unchecked": {},
             "ddp_poll": {"progress_poll_s": 0.002}}


class Runner:
    """One training setup in one mode: local, a DDP mode (``DDP_MODES``), or per_tensor."""

    def __init__(self, mode, widths, comm, batch, ddp_options=None):
        self.mode, self.comm = mode, comm
        module = mlp(widths)
        self.model = module
        if mode in DDP_MODES:
            self.model = mpidist.DDP(module, comm, **{**(ddp_options or {}), **DDP_MODES[mode]})
        if mode == "ddp_unchecked":
            self.model._stamp = _NoStepStamp()  # the step-agreement check off: its cost is ddp - ddp_unchecked
        self.params = list(module.parameters())
        self.opt = optim.SGD(self.params, lr=1e-3)
        self.crit = nn.CrossEntropyLoss()
        rng = np.random.default_rng(comm.Get_rank())
        self.x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        self.y = rng.integers(0, widths[-1], size=batch)

    def step(self):
        """Run one step; return (step seconds, exposed sync seconds)."""
        start = time.perf_counter()
        self.opt.zero_grad()
        loss = self.crit(self.model(self.x), self.y)
        if self.mode.startswith("ddp"):
            before = self.model.stats["sync_wait_s"]
            loss.backward()  # DDP's hooks launch the buckets; its end-of-backward callback waits for them
            sync = self.model.stats["sync_wait_s"] - before
        else:
            loss.backward()
            sync_start = time.perf_counter()
            if self.mode == "per_tensor":  # the old approach: one blocking allreduce per tensor
                for p in self.params:
                    mpidist.allreduce(p.grad, self.comm, op="mean")
            sync = time.perf_counter() - sync_start
        self.opt.step()
        return time.perf_counter() - start, sync


def measure(runners, comm, steps, block=5, warmup=3):
    times = {name: ([], []) for name in runners}
    for runner in runners.values():
        for _ in range(warmup):
            runner.step()
    for _ in range(max(1, steps // block)):
        for name, runner in runners.items():
            for _ in range(block):
                comm.Barrier()
                t, s = runner.step()
                t, s = comm.allreduce(t, op=MPI.MAX), comm.allreduce(s, op=MPI.MAX)
                times[name][0].append(t)
                times[name][1].append(s)
    return {name: (float(np.median(t)) * 1e3, float(np.median(s)) * 1e3) for name, (t, s) in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per mode")
    args = parser.parse_args(argv)
    comm, info = mpidist.init()
    rank, size = comm.Get_rank(), comm.Get_size()

    wide = [784, 1024, 1024, 10]
    big = measure({m: Runner(m, wide, comm, 64) for m in ("local", "ddp", "ddp_unchecked", "ddp_no_overlap", "ddp_4mb",
                                                             "per_tensor")},
                  comm, args.steps)
    narrow_widths = [32] * 121
    narrow = measure({m: Runner(m, narrow_widths, comm, 64) for m in ("ddp", "ddp_unchecked", "per_tensor")},
                     comm, args.steps)

    result = {
        "ranks": size, "params": sum(p.data.size for p in mlp(wide).parameters()),
        "local_ms": big["local"][0], "ddp_ms": big["ddp"][0], "per_tensor_ms": big["per_tensor"][0],
        "ddp_sync_ms": big["ddp"][1], "per_tensor_sync_ms": big["per_tensor"][1],
        "ddp_no_overlap_ms": big["ddp_no_overlap"][0], "ddp_no_overlap_sync_ms": big["ddp_no_overlap"][1],
        "ddp_4mb_ms": big["ddp_4mb"][0], "ddp_4mb_sync_ms": big["ddp_4mb"][1],
        "narrow_tensors": 2 * (len(narrow_widths) - 1),
        "narrow_ddp_sync_ms": narrow["ddp"][1], "narrow_per_tensor_sync_ms": narrow["per_tensor"][1],
        "ddp_unchecked_ms": big["ddp_unchecked"][0], "narrow_ddp_ms": narrow["ddp"][0],
        "narrow_ddp_unchecked_ms": narrow["ddp_unchecked"][0],
    }
    # The rank-agreement step check (issue 11): target under 2% of a DDP step.
    result["step_check_cost"] = result["ddp_ms"] / result["ddp_unchecked_ms"] - 1
    result["narrow_step_check_cost"] = result["narrow_ddp_ms"] / result["narrow_ddp_unchecked_ms"] - 1
    result["ddp_over_local"] = result["ddp_ms"] / result["local_ms"]
    result["narrow_sync_ratio"] = result["narrow_per_tensor_sync_ms"] / max(result["narrow_ddp_sync_ms"], 1e-9)
    if rank == 0:
        print(f"DDP step benchmark, {size} ranks ({info.mpi_library}), MLP 784-1024-1024-10 = {result['params']:,} params, batch 64/rank")
        print(f"{'mode':<28}{'step ms':>10}{'exposed sync ms':>18}")
        print(f"{'local (no communication)':<28}{result['local_ms']:>10.2f}{0:>18.2f}")
        print(f"{'DDP bucketed + overlapped':<28}{result['ddp_ms']:>10.2f}{result['ddp_sync_ms']:>18.2f}")
        print(f"{'DDP without step check':<28}{result['ddp_unchecked_ms']:>10.2f}{big['ddp_unchecked'][1]:>18.2f}")
        print(f"{'DDP, overlap=False':<28}{result['ddp_no_overlap_ms']:>10.2f}{result['ddp_no_overlap_sync_ms']:>18.2f}")
        print(f"{'DDP, 4 MB buckets':<28}{result['ddp_4mb_ms']:>10.2f}{result['ddp_4mb_sync_ms']:>18.2f}")
        print(f"{'per-tensor blocking':<28}{result['per_tensor_ms']:>10.2f}{result['per_tensor_sync_ms']:>18.2f}")
        print(f"narrow MLP (120 layers x 32, {result['narrow_tensors']} tensors): exposed sync DDP "
              f"{result['narrow_ddp_sync_ms']:.3f} ms vs per-tensor {result['narrow_per_tensor_sync_ms']:.3f} ms")
        print(f"targets: ddp_ms <= 1.25 * local_ms -> {result['ddp_over_local']:.2f}x "
              f"({'met' if result['ddp_over_local'] <= 1.25 else 'MISSED'}); "
              f"narrow per-tensor >= 2x DDP -> {result['narrow_sync_ratio']:.1f}x "
              f"({'met' if result['narrow_sync_ratio'] >= 2 else 'MISSED'})")
        print(f"step check (rank agreement): {100 * result['step_check_cost']:+.2f}% of a DDP step (wide MLP), "
              f"{100 * result['narrow_step_check_cost']:+.2f}% (narrow MLP, {result['narrow_ddp_ms']:.2f} ms steps); "
              f"target < 2%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
