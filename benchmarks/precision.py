"""Mixed precision: training quality of bf16/fp16 next to fp32, and gradient bytes and step time of DDP's
communication hooks and FSDP's reduce_dtype.

Run from the repo root:

    .venv/bin/python benchmarks/precision.py quality [--steps 80] [--json PATH]
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/precision.py comm [--steps 12] [--json PATH]

Results and the commands that made them: docs/precision.md (docs/precision_*.json).

quality (one process): a small GPT (vocabulary 256, context 64, width 96, 2 layers, 4 heads, tied head) on the
Python standard library's source (``mpidist.data.stdlib_corpus``), batch 8, AdamW lr 3e-3, seed 0 for the model
and the batches, trained ``--steps`` steps in: float32; ``Policy("bf16", "fp32")`` (bfloat16 parameters, float32
activations); ``Policy("bf16")`` (bfloat16 activations too); ``Policy("fp16", "fp32")`` with ``GradScaler``
(float16 activations are left out: numpy has no float16 BLAS, a step took 12 s against 0.14 s in float32).
Reports the validation loss (16 fixed batches), its ratio to float32's, the parameter bytes and the median step
time.

comm (N ranks): the same GPT under DDP with no hook (float32 MPI allreduce), ``bf16_compress_hook``,
``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, plain for the first 2 synchronizations), and under FSDP
(full_shard, one unit per block) with ``param_dtype="bf16"`` and ``reduce_dtype`` float32 vs bfloat16. Bytes are
what each rank sends per step by the algorithm's count: a ring allreduce of B bytes sends 2 (N-1)/N B (MPI's large-
message allreduce, and our 16-bit ring exactly), a reduce-scatter or allgather (N-1)/N B; PowerSGD sends its P and
Q factors (float32) and the uncompressed tensors. Step times are medians of the slowest rank (one BLAS thread per
rank); on one node the link is shared memory, so they show the compute cost of compression more than its gain.
"""

import argparse
import json
import os
import sys
import time

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mpidist import files, nn, optim  # noqa: E402
from mpidist.amp import GradScaler  # noqa: E402
from mpidist.data import TokenDataset, stdlib_corpus  # noqa: E402
from mpidist.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from mpidist.nn.precision import Policy, apply_policy  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=96)
BATCH = 8


def datasets():
    train = TokenDataset(stdlib_corpus("train", max_bytes=2_000_000), CONFIG.block_size)
    val = TokenDataset(stdlib_corpus("val", max_bytes=2_000_000), CONFIG.block_size)
    return train, val


def batch(dataset, step, seed, n=BATCH):
    rng = np.random.default_rng([seed, step])
    return dataset.batch(rng.integers(0, len(dataset), n))


def val_loss(model, val):
    with nn.no_grad():
        return float(np.mean([float(lm_loss(model(x), y).data) for x, y in (batch(val, k, 99) for k in range(16))]))


def quality(steps):
    train, val = datasets()
    rows = []
    for name, policy, scaled in (("fp32", None, False), ("bf16 params, fp32 compute", Policy("bf16", "fp32"), False),
                                 ("bf16", Policy("bf16"), False),
                                 ("fp16 params, fp32 compute + GradScaler", Policy("fp16", "fp32"), True)):
        model = GPT(CONFIG, rng=np.random.default_rng(0))
        if policy is not None:
            apply_policy(model, policy)
        opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=50, enabled=scaled)
        times = []
        with np.errstate(over="ignore", invalid="ignore"):
            for step in range(steps):
                x, y = batch(train, step, 0)
                start = time.perf_counter()
                opt.zero_grad()
                scaler.scale(lm_loss(model(x), y)).backward()
                scaler.step(opt)
                scaler.update()
                times.append(time.perf_counter() - start)
        rows.append({"run": name, "val_loss": val_loss(model, val), "step_ms": 1e3 * float(np.median(times)),
                     "param_bytes": int(sum(p.data.nbytes for p in model.parameters())),
                     "skipped_steps": list(scaler.skipped_steps)})
    for r in rows:
        r["val_loss_vs_fp32"] = r["val_loss"] / rows[0]["val_loss"]
    return {"config": {"model": repr(CONFIG), "batch": BATCH, "steps": steps, "optimizer": "AdamW lr 3e-3",
                       "seed": 0}, "rows": rows}


def _ring(nbytes, n, factor=2):
    return int(factor * (n - 1) / n * nbytes)


def comm_bench(steps, comm):
    from mpidist.parallel import comm_hooks
    from mpidist.parallel.ddp import DDP
    from mpidist.parallel.fsdp import FSDP
    size, rank = comm.Get_size(), comm.Get_rank()
    train, _ = datasets()

    def run(make, hook=None, state=None):
        model = GPT(CONFIG, rng=np.random.default_rng(0))
        wrapper = make(model)
        if hook is not None:
            wrapper.register_comm_hook(state, hook)
        opt = optim.AdamW(wrapper.parameters(), lr=3e-3, weight_decay=0.0)
        times, losses = [], []
        for step in range(steps):
            x, y = batch(train, step * size + rank, 0)
            comm.Barrier()
            start = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(wrapper(x), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.data))
        slowest = np.max(comm.allgather(times), axis=0)
        mean_losses = np.mean(comm.allgather(losses), axis=0)
        return wrapper, 1e3 * float(np.median(slowest[2:])), float(np.mean(mean_losses[-4:]))

    numel = sum(p.data.size for p in GPT(CONFIG, rng=np.random.default_rng(0)).parameters())
    rows = []
    for name, hook, elem_bytes in (("ddp fp32 allreduce", None, 4), ("ddp bf16_compress_hook", comm_hooks.bf16_compress_hook, 2),
                                   ("ddp fp16_compress_hook", comm_hooks.fp16_compress_hook, 2)):
        _, ms, loss = run(lambda m: DDP(m, comm), hook)
        rows.append({"setup": name, "grad_bytes_sent_per_rank": _ring(elem_bytes * numel, size), "step_ms": ms,
                     "loss_last4": loss})
    state = comm_hooks.PowerSGDState(matrix_approximation_rank=4, start_powerSGD_iter=2)
    ddp, ms, loss = run(lambda m: DDP(m, comm), comm_hooks.powerSGD_hook, state)
    compressed = plain = 0
    for bucket in ddp.buckets:
        for view in bucket.views:
            rows_, cols = view.shape[0], view.size // max(view.shape[0], 1)
            r = min(4, rows_, cols)
            if view.ndim >= 2 and rows_ * cols >= 2.0 * (rows_ + cols) * r:
                compressed += (rows_ + cols) * r
            else:
                plain += view.size
    rows.append({"setup": "ddp powerSGD_hook rank 4", "grad_bytes_sent_per_rank": _ring(4 * (compressed + plain), size),
                 "step_ms": ms, "loss_last4": loss})
    for name, reduce_dtype, elem_bytes in (("fsdp param bf16, reduce fp32", None, 4),
                                           ("fsdp param bf16, reduce bf16", "bf16", 2)):
        try:
            _, ms, loss = run(lambda m: FSDP(m, comm, units=m.fsdp_units(), param_dtype="bf16",
                                             reduce_dtype=reduce_dtype))
        except Exception as e:  # noqa: BLE001 - report what failed instead of dropping the other rows
            rows.append({"setup": name, "error": f"{type(e).__name__}: {e}"})
            continue
        # gathers: the bf16 parameters (forward and backward), reduce-scatter: the gradients
        rows.append({"setup": name, "grad_bytes_sent_per_rank": _ring(elem_bytes * numel, size, 1),
                     "param_bytes_gathered_per_rank": 2 * _ring(2 * numel, size, 1), "step_ms": ms, "loss_last4": loss})
    return {"config": {"model": repr(CONFIG), "batch_per_rank": BATCH, "steps": steps, "ranks": size,
                       "parameters": int(numel)}, "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["quality", "comm"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.what == "quality":
        result, rank = quality(args.steps or 80), 0
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        result, rank = comm_bench(args.steps or 12, comm), comm.Get_rank()
    if rank == 0:
        text = json.dumps(result, indent=1)
        print(text)
        if args.json:
            files.write_text_atomic(args.json, text + "\n")


if __name__ == "__main__":
    main()
