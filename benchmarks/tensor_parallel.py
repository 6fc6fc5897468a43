"""Tensor parallelism on the CPU: bytes sent per rank next to the Megatron formula, step time tp=2 vs dp=2,
per-rank memory at tp = 1/2/4 with and without sequence parallelism.

Run from the repo root (the driver starts ``mpiexec -n N`` for each N in --ranks, one worker per rank):

    .venv/bin/python benchmarks/tensor_parallel.py --json docs/tensor_parallel_bench.json

or one job by hand (prints its rows): ``.venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/tensor_parallel.py
--worker``.
The launcher is chosen as benchmarks/gpt.py chooses it (``MPIDIST_MPIEXEC``, ``MPIEXEC_FLAGS``); every process
runs one BLAS thread. Jobs with more ranks than cores set ``MPIR_CVAR_POLLS_BEFORE_YIELD=1`` (as gpt.py does).

Model: ``GPT(GPTConfig())``: vocabulary 256, context 128, width 256, 4 layers, 4 heads, tied head, float32;
global batch 16 sequences of 128 random tokens, AdamW. A step is zero_grad, forward, loss (``model.loss``: the
vocab-parallel cross-entropy after ``tensor_parallel``), backward, optimizer step. Tensor-parallel ranks all
take the whole global batch; data-parallel ranks take 8 sequences each.

Bytes (rows ``kind="bytes"``). Inside the worker, ``mpidist.collectives``' functions (allreduce, allgather,
reduce_scatter, their nonblocking forms, broadcast, alltoall) are wrapped for ``--count-steps`` steps after a
warm-up step: every call the step issues (the TP ops, the loss's reductions, DDP's bucket allreduces) is counted
with its **payload**, the bytes of the array handed to the collective on this rank (allreduce: the buffer;
allgather: this rank's piece; reduce_scatter: the full input). What goes on the wire is MPICH's choice of
algorithm and is not observed; ``ring_bytes`` converts each counted call to the bytes a rank *sends* under the
bandwidth-optimal ring (or reduce-scatter + allgather) algorithm: allreduce of N bytes 2(t-1)/t N, allgather of
a piece n (t-1) n, reduce_scatter of N (t-1)/t N. ``formula_*`` is the same sum computed from the model's shape
alone (``formula_terms``): Megatron's 4 allreduces of b*s*h per layer (plain TP) or 4 allgathers + 4
reduce-scatters of the same total bytes (sequence parallel), plus the embedding, head, loss and (SP only) the
column-parallel inputs gathered again in backward (Megatron's too: backward keeps only the shards) and the
gradients of the replicated parameters used on sequence shards. ``megatron_layer_ring_bytes`` is the
per-layer term alone, 4 L 2(t-1)/t b s h x 4 bytes. Not counted: the 144-byte (18 int64) shape header each
``allgather`` without ``out=`` exchanges first (``allgather_calls_with_header`` counts those calls).

Step time (rows ``kind="time"``, the 2-rank job): ``tp2`` and ``tp2_sp`` (tensor_parallel over both ranks,
batch 16 on each), ``dp2`` (DDP over both ranks, 8 sequences each: the same global batch) and ``local`` (the
plain model on 8 sequences on both ranks at once, no communication: dp2's floor), timed interleaved in blocks
with ``matmuls`` (the float32 products of a local 8-sequence step alone: ``matmul_gflops``); medians over steps
of the slowest rank. The 1-rank job times ``single`` (the whole batch on one rank). ``comm_ms`` is the time spent
inside the counted collectives during the byte-counting steps (median per step; it includes waiting for the
other rank).

Memory (rows ``kind="memory"``), per rank: ``param_bytes`` from this rank's parameters (shards plus replicated
norms, biases and position table; the tied weight once), ``replicated_param_bytes`` the replicated part;
``state_bytes`` = parameters + gradients + AdamW's two moments after a step. Activations as in
benchmarks/gpt.py: ``activation_held_bytes`` is what tracemalloc (numpy reports its buffers to it) sees still
allocated after forward and loss beyond what was allocated before, i.e. the arrays autograd keeps for backward
plus the logits and loss; ``activation_peak_bytes`` the peak over forward + backward beyond the same start
(it also holds the gradients, allocated during backward: ``grad_bytes``).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import tracemalloc

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # one BLAS thread per process, as the other benchmarks

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import MatmulsOnly, launch_command, load_average, optimizer_state_bytes  # noqa: E402
from train_step import time_steps  # noqa: E402  (interleaved blocks, slowest rank, medians)

GLOBAL_BATCH = 16
COUNTED = ("allreduce", "iallreduce", "allgather", "iallgather", "reduce_scatter", "broadcast", "ibroadcast",
           "alltoall")
BLOCKING_FORM = {"iallreduce": "allreduce", "iallgather": "allgather", "ibroadcast": "broadcast"}


def build(seed=0):
    from mpidist.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(), rng=np.random.default_rng(seed))


def global_batch(config):
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, (GLOBAL_BATCH, config.block_size + 1))
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


class Trainer:
    """One AdamW setup: ``step()`` runs zero_grad, forward, ``model.loss``, backward and the update."""

    def __init__(self, model, x, y, wrap=None):
        from mpidist.optim import AdamW
        self.module = model
        self.model = wrap(model) if wrap else model
        self.opt = AdamW(list(model.parameters()), lr=3e-4)
        self.x, self.y = x, y

    def loss(self):
        return self.module.loss(self.model(self.x), self.y)

    def step(self):
        self.opt.zero_grad()
        self.loss().backward()
        self.opt.step()


# -- bytes ------------------------------------------------------------------------------------------------------

def ring_bytes(op, payload, size):
    """Bytes one rank sends for a collective of ``payload`` bytes over ``size`` ranks, ring algorithms."""
    if size == 1:
        return 0.0
    if op == "allreduce":
        return 2 * (size - 1) / size * payload
    if op == "allgather":
        return (size - 1) * payload       # payload is this rank's piece; it sends the size - 1 others on
    if op in ("reduce_scatter", "alltoall", "broadcast"):
        return (size - 1) / size * payload  # broadcast: scatter + allgather, per non-root rank
    raise ValueError(f"ring_bytes: unknown collective {op!r}")


class CollectiveCounter:
    """While entered, count every call of ``mpidist.collectives``' collectives: calls, payload bytes, time.

    The wrappers replace the module attributes, which is what the TP ops, the loss and DDP call through
    (``collectives.allreduce(...)``), and are removed on exit.
    """

    def __init__(self):
        self.calls, self.payload, self.ring = {}, {}, {}
        self.seconds = 0.0
        self.allgather_calls_with_header = 0

    def __enter__(self):
        from mpidist import collectives
        self._module = collectives
        self._saved = {name: getattr(collectives, name) for name in COUNTED}
        for name, fn in self._saved.items():
            setattr(collectives, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self._module, name, fn)

    def _wrap(self, name, fn):
        def counted(x, comm, *args, **kwargs):
            op = BLOCKING_FORM.get(name, name)
            nbytes = int(getattr(x, "nbytes", 0))
            self.calls[op] = self.calls.get(op, 0) + 1
            self.payload[op] = self.payload.get(op, 0) + nbytes
            self.ring[op] = self.ring.get(op, 0.0) + ring_bytes(op, nbytes, comm.Get_size())
            if op == "allgather" and kwargs.get("out") is None and not args:
                self.allgather_calls_with_header += 1
            start = time.perf_counter()
            try:
                return fn(x, comm, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return counted


def formula_terms(config, batch, tp, sequence_parallel):
    """The collectives one TP training step issues per rank, from the model's shape alone.

    Returns [(op, elements handed to the collective, calls, what)]; allgather elements are one rank's piece.
    """
    b, s, h, layers = batch, config.block_size, config.n_embd, config.n_layer
    bsh, tokens = b * s * h, b * s
    if not sequence_parallel:
        terms = [("allreduce", bsh, 2 * layers, "blocks forward: attention and MLP outputs (row-parallel sums)"),
                 ("allreduce", bsh, 2 * layers, "blocks backward: attention and MLP input gradients"),
                 ("allreduce", bsh, 1, "token embedding output (forward)"),
                 ("allreduce", bsh, 1, "head input gradient (backward)")]
    else:
        replicated_per_layer = 2 * (1 + config.bias) + 2 * config.bias  # ln1, ln2 (gain, shift), 2 row biases
        terms = [("allgather", bsh // tp, 2 * layers, "blocks forward: attention and MLP inputs"),
                 ("reduce_scatter", bsh, 2 * layers, "blocks forward: attention and MLP outputs"),
                 ("reduce_scatter", bsh, 2 * layers, "blocks backward: attention and MLP input gradients"),
                 ("allgather", bsh // tp, 2 * layers, "blocks backward: attention and MLP output gradients"),
                 ("allgather", bsh // tp, 2 * layers,
                  "blocks backward: attention and MLP inputs gathered again for the qkv and fc weight gradients"),
                 ("reduce_scatter", bsh, 1, "token embedding output (forward)"),
                 ("allgather", bsh // tp, 1, "token embedding output gradient (backward)"),
                 ("allgather", bsh // tp, 1, "head input (forward)"),
                 ("reduce_scatter", bsh, 1, "head input gradient (backward)"),
                 ("allgather", bsh // tp, 1, "head input gathered again for its weight gradient (backward)"),
                 ("allreduce", h, replicated_per_layer * layers + 1 + config.bias,
                  "gradients of norm gains/shifts and row-parallel biases seen on sequence shards (backward)"),
                 ("allreduce", config.block_size * h, 1, "position table gradient (backward)")]
    terms += [("allreduce", tokens, 1, "loss: row max of the logits (forward)"),
              ("allreduce", 2 * tokens, 1, "loss: sum of exponentials and target logit (forward)")]
    return terms


def formula_totals(config, batch, tp, sequence_parallel, itemsize):
    terms = formula_terms(config, batch, tp, sequence_parallel)
    calls, payload, ring = {}, {}, 0.0
    for op, elements, n, _ in terms:
        calls[op] = calls.get(op, 0) + n
        payload[op] = payload.get(op, 0) + n * elements * itemsize
        ring += n * ring_bytes(op, elements * itemsize, tp)
    megatron = 4 * config.n_layer * ring_bytes("allreduce", batch * config.block_size * config.n_embd * itemsize, tp)
    return calls, payload, ring, megatron


def count_step(trainer, steps):
    """Run one warm-up step, then count ``steps`` steps; return per-step calls, payload, ring bytes, comm ms."""
    trainer.step()
    per_step_seconds = []
    with CollectiveCounter() as counter:
        for _ in range(steps):
            before = counter.seconds
            trainer.step()
            per_step_seconds.append(counter.seconds - before)
    return ({k: v // steps for k, v in counter.calls.items()}, {k: v // steps for k, v in counter.payload.items()},
            sum(counter.ring.values()) / steps, float(np.median(per_step_seconds)) * 1e3,
            counter.allgather_calls_with_header // steps)


# -- memory -----------------------------------------------------------------------------------------------------

def activation_bytes(trainer):
    """Return (bytes still held after forward + loss, peak bytes over forward + backward), beyond the start."""
    trainer.step()  # warm: optimizer state and scratch exist before counting
    trainer.opt.zero_grad()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        loss = trainer.loss()
        held = tracemalloc.get_traced_memory()[0] - start
        loss.backward()
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    trainer.opt.step()
    return held, peak


def memory(trainer):
    from mpidist.nn.placement import Replicate, placement_of
    params = list(trainer.module.parameters())
    held, peak = activation_bytes(trainer)
    param_bytes = sum(int(p.data.nbytes) for p in params)
    grad_bytes = sum(int(p.grad.nbytes) for p in params if p.grad is not None)
    return {"param_bytes": param_bytes, "param_count": sum(int(p.data.size) for p in params),
            "replicated_param_bytes": sum(int(p.data.nbytes) for p in params
                                          if isinstance(placement_of(p), Replicate)),
            "grad_bytes": grad_bytes,
            "state_bytes": param_bytes + grad_bytes + optimizer_state_bytes(trainer.opt),
            "activation_held_bytes": held, "activation_peak_bytes": peak}


# -- the jobs ---------------------------------------------------------------------------------------------------

def run_worker(args):
    from mpi4py import MPI

    from mpidist import DDP, mesh
    from mpidist.models import tensor_parallel

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    config = build().config
    itemsize = np.dtype(config.dtype).itemsize
    x, y = global_batch(config)
    tokens = GLOBAL_BATCH * config.block_size
    flops_per_step = build().flops_per_token() * tokens
    common = {"ranks": size, "global_batch": GLOBAL_BATCH, "seq_len": config.block_size, "width": config.n_embd,
              "layers": config.n_layer, "heads": config.n_head, "vocab": config.vocab_size,
              "params": build().num_parameters(), "cores": os.cpu_count(),
              "load_avg_1m_at_start": comm.allreduce(load_average() or 0.0, op=MPI.MAX)}
    rows = []

    def largest(d):  # per-rank values are equal up to padding: report the largest
        return {k: comm.allreduce(v, op=MPI.MAX) for k, v in d.items()}

    def tp_model(sequence_parallel):
        return tensor_parallel(build(), mesh(comm, tp=size).tp_comm, sequence_parallel=sequence_parallel)

    if size == 1:
        rows.append({"kind": "memory", "layout": "tp1", "tp": 1, "sequence_parallel": False,
                     **memory(Trainer(build(), x, y)), **common})
        times = time_steps({"single": Trainer(build(), x, y)}, args.steps, warmup=1, block=2)
        rows.append({"kind": "time", "layout": "single", "step_ms": times["single"] * 1e3,
                     "tokens_per_s": tokens / times["single"], **common})
    else:
        for sp in (False, True):
            trainer = Trainer(tp_model(sp), x, y)
            calls, payload, ring, comm_ms, headers = count_step(trainer, args.count_steps)
            f_calls, f_payload, f_ring, megatron = formula_totals(config, GLOBAL_BATCH, size, sp, itemsize)
            rows.append({"kind": "bytes", "layout": f"tp{size}" + ("_sp" if sp else ""), "tp": size,
                         "sequence_parallel": sp, "calls": calls, "payload_bytes": payload,
                         "payload_total_bytes": sum(payload.values()), "ring_bytes": ring,
                         "formula_calls": f_calls, "formula_payload_bytes": f_payload,
                         "formula_payload_total_bytes": sum(f_payload.values()), "formula_ring_bytes": f_ring,
                         "megatron_layer_ring_bytes": megatron, "allgather_calls_with_header": headers,
                         "comm_ms": comm.allreduce(comm_ms, op=MPI.MAX), **common})
            rows.append({"kind": "memory", "layout": f"tp{size}" + ("_sp" if sp else ""), "tp": size,
                         "sequence_parallel": sp, **largest(memory(trainer)), **common})
            del trainer
        if size == 2:
            half = GLOBAL_BATCH // size
            mine = slice(rank * half, (rank + 1) * half)
            dp_comm = mesh(comm, dp=size).dp_comm
            ddp = Trainer(build(), x[mine], y[mine], wrap=lambda m: DDP(m, dp_comm))
            calls, payload, ring, _, headers = count_step(ddp, args.count_steps)
            psi = build().num_parameters()
            rows.append({"kind": "bytes", "layout": "dp2", "tp": 1, "dp": size, "sequence_parallel": False,
                         "calls": calls, "payload_bytes": payload, "payload_total_bytes": sum(payload.values()),
                         "ring_bytes": ring, "formula_payload_total_bytes": psi * itemsize,
                         "formula_ring_bytes": ring_bytes("allreduce", psi * itemsize, size),
                         "allgather_calls_with_header": headers, **common})
            trainers = {"matmuls": MatmulsOnly(config, batch_size=half), "local": Trainer(build(), x[mine], y[mine]),
                        "dp2": ddp, "tp2": Trainer(tp_model(False), x, y), "tp2_sp": Trainer(tp_model(True), x, y)}
            times = time_steps(trainers, args.steps, comm, warmup=1, block=2)
            gflops = comm.allreduce(trainers["matmuls"].flops / times["matmuls"] / 1e9, op=MPI.MIN)
            for layout in ("local", "dp2", "tp2", "tp2_sp"):
                step_s = times[layout]
                r = {"kind": "time", "layout": layout, "step_ms": step_s * 1e3, "matmul_gflops": gflops,
                     "matmul_ms": times["matmuls"] * 1e3}
                if layout != "local":  # the job's FLOPs split over the ranks; local runs half the batch per rank
                    r.update(tokens_per_s=tokens / step_s, mfu=flops_per_step / size / step_s / 1e9 / gflops,
                             over_dp2=step_s / times["dp2"])
                rows.append({**r, **common})
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


# -- the driver -------------------------------------------------------------------------------------------------

def run_driver(args):
    here = os.path.abspath(__file__)
    rows, started = [], time.perf_counter()
    load_before = os.getloadavg()
    for n in args.ranks:
        cmd = [*launch_command(n), sys.executable, here, "--worker", "--steps", str(args.steps),
               "--count-steps", str(args.count_steps)]
        env = dict(os.environ)
        if n > os.cpu_count():
            env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")  # spinning receivers yield the core
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"tensor_parallel: {shlex.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        rows += json.loads(next(line[5:] for line in proc.stdout.splitlines() if line.startswith("ROWS ")))
        print(f"[{n} rank(s): {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(here)).stdout.strip() or None
    run = {"kind": "run", "commit": commit, "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg()),
           "seconds": time.perf_counter() - started, "command": shlex.join([os.path.relpath(sys.executable),
                                                                             os.path.relpath(here), *sys.argv[1:]])}
    rows.append(run)
    print(tables(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _mib(v):
    return "-" if v is None else f"{v / 2 ** 20:.2f}"


def tables(rows):
    out = ["| layout | calls per step (measured = formula) | payload MiB measured | payload MiB formula | "
           "ring MiB sent measured | ring MiB formula | Megatron per-layer term MiB | comm ms |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "bytes":
            continue
        calls = ", ".join(f"{op} {n}" for op, n in sorted(r["calls"].items()))
        same = "" if r.get("formula_calls") in (None, r["calls"]) else f" (formula {r['formula_calls']})"
        comm_ms = f"{r['comm_ms']:.0f}" if "comm_ms" in r else "-"
        out.append(f"| {r['layout']} | {calls}{same} | {_mib(r['payload_total_bytes'])} | "
                   f"{_mib(r['formula_payload_total_bytes'])} | {_mib(r['ring_bytes'])} | "
                   f"{_mib(r['formula_ring_bytes'])} | {_mib(r.get('megatron_layer_ring_bytes'))} | {comm_ms} |")
    out += ["", "| layout | step ms (median) | vs dp2 | tokens/s | MFU | matmul GFLOP/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "time":
            fmt = lambda k, spec: "-" if r.get(k) is None else format(r[k], spec)  # noqa: E731
            out.append(f"| {r['layout']} ({r['ranks']} rank{'s' if r['ranks'] > 1 else ''}) | {r['step_ms']:.0f} | "
                       f"{fmt('over_dp2', '.2f')} | {fmt('tokens_per_s', '.0f')} | {fmt('mfu', '.3f')} | "
                       f"{fmt('matmul_gflops', '.1f')} |")
    out += ["", "| layout | params per rank | param MiB | of which replicated MiB | params+grads+AdamW MiB | "
            "activations held MiB | peak fwd+bwd MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "memory":
            out.append(f"| {r['layout']} | {r['param_count']:,} | {_mib(r['param_bytes'])} | "
                       f"{_mib(r['replicated_param_bytes'])} | {_mib(r['state_bytes'])} | "
                       f"{_mib(r['activation_held_bytes'])} | {_mib(r['activation_peak_bytes'])} |")
    run = next((r for r in rows if r["kind"] == "run"), None)
    if run:
        out.append(f"\nload average before {run['load_avg_before']}, after {run['load_avg_after']}; "
                   f"{run['seconds']:.0f} s; {os.cpu_count()} cores")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4],
                        help="jobs to run: 1 (tp=1 memory, single-rank step), 2 (tp=2 bytes and memory, "
                             "tp2 vs dp2 step time), 4 (tp=4 bytes and memory)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setup (after one warm-up)")
    parser.add_argument("--count-steps", type=int, default=2, help="steps whose collectives are counted")
    parser.add_argument("--worker", action="store_true", help="run one job's measurements (under mpiexec)")
    args = parser.parse_args(argv)
    (run_worker if args.worker else run_driver)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
