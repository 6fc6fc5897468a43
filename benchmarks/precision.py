"""Mixed precision: training quality of bf16/fp16 next to fp32, and gradient bytes and step time of DDP's
communication hooks and FSDP's reduce_dtype.

Run from the repo root:

    .venv/bin/python benchmarks/precision.py quality [--steps 80] [--json PATH]
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/precision.py comm [--steps 12] [--json PATH]
    .venv/bin/python benchmarks/precision.py cluster [--rate 100mbit] [--steps 40] [--setups NAME ...] [--json PATH]

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

cluster (root; brings up tests/cluster/vcluster.py's virtual cluster, 2 nodes x 2 ranks in block placement, each
node's link shaped to ``--rate`` by tc's tbf, and always tears it down): the same GPT under DDP, batch 2 per rank
(the global batch of 8 the quality runs use), buckets of 0.25 MB (5 buckets), AdamW lr 3e-3, seed 0, ``--steps``
steps each with the float32 MPI allreduce (no hook, ``fp32``), ``bf16_compress_hook`` over the flat 16-bit ring
(``bf16-flat``) and node-aware (``bf16-node``: ``CompressHookState(algorithm="hierarchical")``, what "auto" takes
here), and ``powerSGD_hook`` (rank 4, plain for the first 2 synchronizations, ``powersgd``), the flat ring and
PowerSGD also with ``DDP(overlap=False)`` (``bf16-flat-nooverlap``, ``powersgd-nooverlap``: every bucket launched
after backward: what the hooks' overlap with backward saves); ``--setups`` picks some (default: all), and they
take their steps in turn. Reports the median of the
slowest rank's step (steps 3 on), gradient bytes per rank by the algorithm's count, the bytes each node's link
carried per step (its tx counter: everything, the 16-bit ring's and MPI's messages and the step's barriers), the
mean training loss of the last 4 steps and the validation loss after ``--steps`` steps.
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


def _powersgd_bytes(ddp, r, size):
    """Bytes each rank sends per step under PowerSGD rank ``r`` (float32 P and Q, plus the uncompressed rest)."""
    compressed = plain = 0
    for bucket in ddp.buckets:
        for view in bucket.views:
            rows_, cols = view.shape[0], view.size // max(view.shape[0], 1)
            rank = min(r, rows_, cols)
            if view.ndim >= 2 and rows_ * cols >= 2.0 * (rows_ + cols) * rank:
                compressed += (rows_ + cols) * rank
            else:
                plain += view.size
    return _ring(4 * (compressed + plain), size)


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
    rows.append({"setup": "ddp powerSGD_hook rank 4", "grad_bytes_sent_per_rank": _powersgd_bytes(ddp, 4, size),
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


CLUSTER_SETUPS = ("fp32", "bf16-flat", "bf16-flat-nooverlap", "bf16-node", "powersgd", "powersgd-nooverlap")
CLUSTER_BATCH = 2  # per rank: 4 ranks x 2 = the quality runs' batch of 8
CLUSTER_BUCKET_MB = 0.25  # 1 MB of gradients in 5 buckets: DDP's defaults (1 MB first, 25 MB) would make one


def _link_tx():
    """Return the bytes this node's link has sent (inside a virtual-cluster node: its eth0), or None elsewhere."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _cluster_setups():
    """Return {name: (row label, hook, make the hook's state, overlap)} of the cluster benchmark."""
    from mpidist.parallel import comm_hooks

    def powersgd():
        return comm_hooks.PowerSGDState(matrix_approximation_rank=4, start_powerSGD_iter=2)

    def compress(algorithm):
        return lambda: comm_hooks.CompressHookState(algorithm=algorithm)

    bf16 = comm_hooks.bf16_compress_hook
    return {"fp32": ("ddp fp32 allreduce", None, None, True),
            "bf16-flat": ("ddp bf16_compress_hook, flat ring", bf16, compress("flat"), True),
            "bf16-flat-nooverlap": ("ddp bf16_compress_hook, flat ring, overlap=False", bf16, compress("flat"), False),
            "bf16-node": ("ddp bf16_compress_hook, node-aware", bf16, compress("hierarchical"), True),
            "powersgd": ("ddp powerSGD_hook rank 4", comm_hooks.powerSGD_hook, powersgd, True),
            "powersgd-nooverlap": ("ddp powerSGD_hook rank 4, overlap=False", comm_hooks.powerSGD_hook, powersgd,
                                   False)}


def cluster_worker(steps, comm, names):
    """Inside the job: DDP GPT training with each gradient communication; rows of timings, bytes and losses.

    The setups take their steps in turn (step k of each, then step k + 1), so a change in the machine's load
    during the run falls on all of them alike; each trains its own model on the same batches."""
    from mpi4py import MPI
    from mpidist.parallel import comm_hooks
    from mpidist.parallel.ddp import DDP
    size, rank = comm.Get_size(), comm.Get_rank()
    hosts = comm.allgather(MPI.Get_processor_name())
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    reads_link = node.Get_rank() == 0  # one rank per node reads its node's counter
    train, val = datasets()

    table = _cluster_setups()
    setups = []
    for key in names:
        name, hook, make_state, overlap = table[key]
        model = GPT(CONFIG, rng=np.random.default_rng(0))
        ddp = DDP(model, comm, overlap=overlap, bucket_cap_mb=CLUSTER_BUCKET_MB, first_bucket_mb=CLUSTER_BUCKET_MB)
        if hook is not None:
            ddp.register_comm_hook(make_state() if make_state else None, hook)
        setups.append({"name": name, "key": key, "hook": hook, "model": model, "ddp": ddp, "times": [], "waits": [],
                       "losses": [], "link": 0,
                       "opt": optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.0)})
    for step in range(steps):
        x, y = batch(train, step * size + rank, 0, CLUSTER_BATCH)
        for s in setups:
            ddp, opt = s["ddp"], s["opt"]
            comm.Barrier()
            tx = _link_tx() if reads_link else None
            start = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(ddp(x), y)
            before = ddp.stats["sync_wait_s"]
            loss.backward()
            s["waits"].append(ddp.stats["sync_wait_s"] - before)
            opt.step()
            s["times"].append(time.perf_counter() - start)
            s["losses"].append(float(loss.data))
            comm.Barrier()  # every message of the step sent: the counter holds them
            if tx is not None:
                s["link"] += _link_tx() - tx
    numel = sum(p.data.size for p in setups[0]["model"].parameters())
    rows = []
    for s in setups:
        per_node = [v / steps for v in comm.allgather(s["link"] if reads_link else None) if v is not None]
        slowest = np.max(comm.allgather(s["times"]), axis=0)
        exposed = np.max(comm.allgather(s["waits"]), axis=0)
        mean_losses = np.mean(comm.allgather(s["losses"]), axis=0)
        counted_link = None  # by the algorithm's count, each node's link, where known
        if s["hook"] is None:
            grad_bytes = _ring(4 * numel, size)  # by a ring's count; MPI's allreduce may send less over the link
        elif s["key"] == "bf16-node":
            grad_bytes = counted_link = _ring(2 * numel, len(per_node))  # the leaders' ring; in-node sends aside
        elif s["hook"] is comm_hooks.bf16_compress_hook:
            grad_bytes = counted_link = _ring(2 * numel, size)  # block placement: one rank's ring per node's link
        else:
            grad_bytes = _powersgd_bytes(s["ddp"], 4, size)
        rows.append({"setup": s["name"], "key": s["key"], "step_ms": 1e3 * float(np.median(slowest[3:])),
                     "exposed_sync_ms": 1e3 * float(np.median(exposed[3:])),
                     "grad_bytes_sent_per_rank": grad_bytes, "link_bytes_by_count_per_node": counted_link,
                     "link_bytes_per_step_per_node": [float(v) for v in per_node],
                     "loss_last4": float(np.mean(mean_losses[-4:])), "val_loss": val_loss(s["model"], val),
                     "slowest_step_ms": [1e3 * float(t) for t in slowest]})
    node.Free()
    return {"config": {"model": repr(CONFIG), "batch_per_rank": CLUSTER_BATCH, "steps": steps, "ranks": size,
                       "hosts": hosts, "parameters": int(numel), "optimizer": "AdamW lr 3e-3", "seed": 0,
                       "order": "interleaved: step k of every setup, then step k + 1"},
            "rows": rows}


def cluster_driver(args):
    """Bring up 2 nodes x 2 ranks with shaped links, run ``cluster_worker`` there, tear down; return its JSON."""
    import subprocess
    import tempfile
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tests", "cluster"))
    import vcluster
    why = vcluster.unavailable()
    if why:
        raise SystemExit(why)
    with vcluster.VirtualCluster(nodes=2, rate=args.rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cluster.json")
        argv = cluster.mpiexec([sys.executable, os.path.abspath(__file__), "cluster", "--worker", "--out", out,
                                "--steps", str(args.steps or 40), "--setups", *args.setups], ppn=2, placement="block")
        env = dict(os.environ, OMP_NUM_THREADS="1", MPIDIST_COLLECTIVE_TIMEOUT="600")
        subprocess.run(argv, check=True, env=env, timeout=600, cwd=tmp)
        with open(out) as f:
            result = json.load(f)
    result["rate"] = args.rate
    result["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["quality", "comm", "cluster"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rate", default="100mbit", help="cluster: each node's link rate, tc syntax")
    parser.add_argument("--setups", nargs="+", default=list(CLUSTER_SETUPS), choices=CLUSTER_SETUPS,
                        help="cluster: which setups to run (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what == "cluster" and args.worker:
        from mpi4py import MPI
        result = cluster_worker(args.steps or 40, MPI.COMM_WORLD, args.setups)
        if MPI.COMM_WORLD.Get_rank() == 0:
            files.write_text_atomic(args.out, json.dumps(result))
        return
    if args.what == "quality":
        result, rank = quality(args.steps or 80), 0
    elif args.what == "cluster":
        result, rank = cluster_driver(args), 0
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
