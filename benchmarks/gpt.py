"""GPT training speed and memory on the CPU: tokens/s and MFU, DDP and FSDP, checkpointing, the 1F1B bubble.

Run from the repo root (the driver starts ``mpiexec -n N`` for each N in --ranks, one worker per rank):

    .venv/bin/python benchmarks/gpt.py --json docs/gpt_bench.json
    .venv/bin/python benchmarks/gpt.py --ranks 1 --width 512 --json docs/gpt_bench_512.json   # issue 32's width 512

or one job by hand (prints its rows; what it measures depends on N, see below):

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/gpt.py --worker

The launcher is chosen as benchmarks/fsdp_memory.py and the tests choose it: ``MPIDIST_MPIEXEC`` (default: the
mpiexec next to this Python, else the one on PATH) with ``MPIEXEC_FLAGS``. Every process runs one BLAS thread.

Model: ``GPT(GPTConfig())``: vocabulary 256, context 128, width 256 (``--width``), 4 layers, 4 heads, tied head,
float32, 3,257,856 parameters; batch 16 sequences of 128 random tokens per rank, AdamW. A step is zero_grad,
forward, cross-entropy, backward, optimizer step. Times are medians over steps (of the slowest rank), the setups
of one job timed interleaved in blocks so that load from elsewhere hits them alike. Every worker first calls
``mpidist.nn.allocator.retain_freed_memory()`` (glibc keeps freed arrays' pages for the next step instead of
faulting them in again; ``--no-retain-memory`` leaves malloc alone); it is process-wide, so the PyTorch peer
gets it too.

What each job measures (rows, ``strategy`` and ``ranks``):
- 1 rank: ``single`` (the plain model) and ``checkpointed`` (``checkpoint_blocks()``): tokens/s, MFU, the
  activation bytes each keeps (below); ``ddp`` and ``fsdp`` memory at one rank. ``single`` also holds: the time
  outside the matmuls (``outside_matmul_ms``: the step's time less the same run's time for its products alone,
  and ``outside_matmul_share`` of the step), that time by op family (``outside_matmul_ms_by_op``: every op of
  mpidist.nn.functional and its backward timed in an instrumented step, linear's and attention's own products
  subtracted), and, when torch is installed, the same GPT in PyTorch eager with the same weights, timed
  interleaved with it in the same process (``TorchTrainer``; ``torch_tokens_per_s``, ``tokens_per_s_over_torch``,
  ``torch_mfu`` against the same matmul rate; ``--no-torch`` leaves it out).
- 2 ranks: ``local`` (the plain step on both ranks at once, no communication), ``ddp`` and ``fsdp``
  (``units=model.fsdp_units()``, full_shard): tokens/s per rank, MFU, memory.
- 4 ranks (or any N >= 3): ``ddp`` and ``fsdp`` memory (one step each; 4 ranks on 2 cores are not timed), and
  ``pipeline_1f1b``: ``pipeline_stages(4)`` with the tied head's gradient summed with the embedding's
  (``tied_parameters=``), m = 8 micro-batches, bubble measured from ``Pipeline.stats`` next to (p-1)/(m+p-1).

MFU is the model's training FLOPs (``flops_per_token()`` x tokens: the matmuls, forward + backward) per second
over ``matmul_gflops``: the rate at which this process's BLAS runs the same products alone (every matmul of a
step, linears as 2-D (B*T, in) x (in, out) products, attention as numpy's batched (B, H, T, .) products), timed
interleaved with the steps. So MFU is the share of the step's time that is matmul work at the rate BLAS gives
those shapes. ``mfu_vs_peak`` is against ``peak_gflops``, the best float32 2048^3 product.

Memory is counted from the arrays each wrapper owns, per rank: FSDP from ``memory_stats(optimizer)``; DDP as the
module's parameters + its flat gradient buckets + AdamW's exp_avg and exp_avg_sq. ``zero_formula_bytes`` is
16 Psi (4 params + 4 grads + 8 Adam) for DDP and 16 Psi / N for FSDP full_shard (without the shards' padding).
Activations: ``activation_held_bytes`` is what tracemalloc (numpy reports its buffers to it) sees still allocated
after forward and loss, beyond what was allocated before: the tensors autograd keeps for backward, plus the
logits and loss; ``activation_peak_bytes`` is the peak over forward + backward beyond the same start (it also
holds the gradients, the same in both variants).
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tracemalloc

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")  # one BLAS thread per process: what the targets are stated for

import numpy as np  # noqa: E402

BATCH = 16
MICROBATCHES = 8
TARGETS = {"single_mfu": 0.80, "ddp_over_one_rank": 0.9, "fsdp_over_one_rank": 0.8, "outside_matmul_share": 0.15,
           "over_torch": {256: 1.1, 512: 1.0}}
WIDTH = 256  # --width: the model's n_embd (heads stay 4)


def build(seed=0):
    from mpidist.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(n_embd=WIDTH), rng=np.random.default_rng(seed))


def batch(rank, config):
    tokens = np.random.default_rng([7, rank]).integers(0, config.vocab_size, (BATCH, config.block_size + 1))
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


class Trainer:
    """One AdamW training setup: ``step()`` runs zero_grad, forward, loss, backward and the update."""

    def __init__(self, model, x, y, wrap=None):
        from mpidist.optim import AdamW
        self.module = model
        self.model = wrap(model) if wrap else model
        self.opt = AdamW(list(self.model.parameters()), lr=3e-4)
        self.x, self.y = x, y

    def step(self):
        from mpidist.models.gpt import lm_loss
        self.opt.zero_grad()
        lm_loss(self.model(self.x), self.y).backward()
        self.opt.step()


class MatmulsOnly:
    """The float32 products of one GPT training step, with the step's shapes, and nothing else."""

    def __init__(self, config, batch_size=BATCH, clock=time.perf_counter):
        self.clock = clock
        rng = np.random.default_rng(1)
        b, t, d, h, v = batch_size, config.block_size, config.n_embd, config.n_head, config.vocab_size
        n, hd = b * t, d // h

        def r(*shape):
            return rng.standard_normal(shape, dtype=np.float32)

        shapes = [(d, 3 * d), (d, d), (d, config.mlp_ratio * d), (config.mlp_ratio * d, d)] * config.n_layer
        shapes.append((d, v))  # the head
        # (input, weight (out, in), output gradient) per linear: forward x @ W.T, backward g @ W and g.T @ x.
        self.linears = [(r(n, a), r(c, a), r(n, c)) for a, c in shapes]
        self.attention = [(r(b, h, t, hd), r(b, h, t, hd), r(b, h, t, hd), r(b, h, t, t), r(b, h, t, hd))
                          for _ in range(config.n_layer)]
        self.flops = (sum(6 * n * a * c for a, c in shapes) + config.n_layer * 6 * 2 * b * h * t * t * hd)
        self.linear_s, self.attention_s = [], []

    def step(self):
        t0 = self.clock()
        for x, w, g in self.linears:
            x @ w.T
            g @ w
            g.T @ x
        t1 = self.clock()
        for q, k, v, p, g in self.attention:
            q @ k.swapaxes(-1, -2)             # scores
            p @ v                              # weighted sum
            p.swapaxes(-1, -2) @ g             # value gradient
            g @ v.swapaxes(-1, -2)             # probability gradient
            p @ k                              # query gradient (ds @ K)
            p.swapaxes(-1, -2) @ q             # key gradient (ds^T @ Q)
        t2 = self.clock()
        self.linear_s.append(t1 - t0)
        self.attention_s.append(t2 - t1)


# -- the PyTorch peer -----------------------------------------------------------------------------------------

class TorchTrainer:
    """The same GPT in PyTorch eager, as one writes it there (nanoGPT's layout: ``F.scaled_dot_product_attention``,
    ``nn.LayerNorm``, GELU tanh, tied head), holding a copy of ``model``'s weights; AdamW with the same settings.

    One intra-op thread (``torch.set_num_threads(1)``), as the mpidist side runs one BLAS thread.
    """

    def __init__(self, model, x, y):
        import torch
        from torch import nn
        from torch.nn import functional as F
        torch.set_num_threads(1)
        c = model.config

        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv, self.proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)

            def forward(self, x):
                b, t, d = x.shape
                q, k, v = self.qkv(x).view(b, t, 3, c.n_head, d // c.n_head).permute(2, 0, 3, 1, 4)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.proj(y.transpose(1, 2).reshape(b, t, d))

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(c.n_embd, c.mlp_ratio * c.n_embd)
                self.proj = nn.Linear(c.mlp_ratio * c.n_embd, c.n_embd)

            def forward(self, x):
                return self.proj(F.gelu(self.fc(x), approximate="tanh"))

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.attn = nn.LayerNorm(c.n_embd), Attention()
                self.ln2, self.mlp = nn.LayerNorm(c.n_embd), MLP()

            def forward(self, x):
                x = x + self.attn(self.ln1(x))
                return x + self.mlp(self.ln2(x))

        class GPT(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Module()
                self.embed.wte = nn.Embedding(c.vocab_size, c.n_embd)
                self.embed.wpe = nn.Embedding(c.block_size, c.n_embd)
                self.blocks = nn.ModuleList(Block() for _ in range(c.n_layer))
                self.head = nn.Module()
                self.head.ln_f = nn.LayerNorm(c.n_embd)

            def forward(self, idx):
                x = self.embed.wte(idx) + self.embed.wpe(torch.arange(idx.shape[1]))
                for block in self.blocks:
                    x = block(x)
                return F.linear(self.head.ln_f(x), self.embed.wte.weight)  # tied head

        self.F = F
        self.model = GPT()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                params[name].copy_(torch.from_numpy(p.data))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=1e-2)
        self.x, self.y, self.vocab = torch.from_numpy(x), torch.from_numpy(y), c.vocab_size

    def loss(self):
        return self.F.cross_entropy(self.model(self.x).reshape(-1, self.vocab), self.y.reshape(-1))

    def step(self):
        self.opt.zero_grad()
        self.loss().backward()
        self.opt.step()


def torch_peer(model, x, y):
    """Return a TorchTrainer for ``model``, or None when torch is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return TorchTrainer(model, x, y)


# -- memory -----------------------------------------------------------------------------------------------------

def optimizer_state_bytes(opt):
    return sum(int(v.nbytes) for s in opt.state.values() for v in s.values() if hasattr(v, "nbytes"))


def ddp_memory(trainer):
    params = sum(int(p.data.nbytes) for p in trainer.module.parameters())
    grads = sum(int(b.flat.nbytes) for b in trainer.model.buckets)
    state = optimizer_state_bytes(trainer.opt)
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_state_bytes": state,
            "persistent_bytes": params + grads + state, "peak_bytes": params + grads + state}


def fsdp_memory(trainer):
    s = trainer.model.memory_stats(trainer.opt)
    return {"param_bytes": s["param_shard_bytes"], "grad_bytes": s["grad_shard_bytes"],
            "optimizer_state_bytes": s["optimizer_state_bytes"], "persistent_bytes": s["persistent_bytes"],
            "peak_bytes": s["peak_bytes"], "peak_gathered_bytes": s["peak_gathered_bytes"]}


def zero_formula_bytes(strategy, psi, ranks):
    return 16 * psi // (ranks if strategy == "fsdp" else 1)


def activation_bytes(trainer):
    """Return (bytes still held after forward + loss, peak bytes over forward + backward), beyond the start."""
    from mpidist.models.gpt import lm_loss
    trainer.step()  # warm: optimizer state and scratch exist before counting
    trainer.opt.zero_grad()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        loss = lm_loss(trainer.model(trainer.x), trainer.y)
        held = tracemalloc.get_traced_memory()[0] - start
        loss.backward()
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    trainer.opt.step()
    return held, peak


# The op families outside the matmuls, by the names of mpidist.nn.functional's ops (forward) and of their graph
# nodes (backward). Linear and attention also run the step's matmuls: their family is charged their time minus
# the same run's time for those products alone (``MatmulsOnly``). MatmulsOnly times attention's full (T, T)
# products, as MFU counts every key; causal attention computes about 3/4 of them (row blocks), so attention's
# row is its softmax time less the products it skips.
FAMILIES = {
    "gelu": ("gelu", "Gelu"),
    "layer_norm": ("layer_norm", "LayerNorm"),
    "attention (softmax, mask, scale)": ("multi_head_attention", "MultiHeadAttention", "scaled_dot_product_attention",
                                         "Attention"),
    "linear (bias, reshapes)": ("linear", "Linear"),
    "residual adds": ("add", "Add"),
    "reshapes/permutes/splits": ("reshape", "Reshape", "permute", "Permute", "split", "Split", "transpose",
                                 "swapaxes", "Swapaxes", "getitem", "Index", "cat", "Cat"),
    "embedding": ("embedding", "Embedding"),
    "cross_entropy": ("cross_entropy", "CrossEntropy"),
    "dropout": ("dropout", "Dropout"),
}


def op_times(trainer, matmuls, steps=4, clock=time.perf_counter):
    """Return {family: ms per step outside the matmuls} of ``trainer``'s step, timed op by op.

    Every public op of mpidist.nn.functional is wrapped (forward: the outermost op call only, so a composite op
    is not counted twice), and every backward closure it records; ``optimizer`` is AdamW.step, ``autograd engine
    and Python`` the rest of the step. ``step`` is the instrumented step (a little slower than the timed one).
    Linear's and attention's own products (``matmuls``, a MatmulsOnly) are timed alternately with the
    instrumented steps, so that both see the same load.
    """
    from mpidist.nn import functional as F
    spent, depth = {}, [0]
    originals = {name: getattr(F, name) for name in F.__all__}
    make_result, make_results = F.make_result, F.make_results

    def timed(name, fn):
        def run(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + clock() - start
                depth[0] -= 1
        return run

    def timed_backward(name, backward):
        def run(g, needs):
            start = clock()
            try:
                return backward(g, needs)
            finally:
                spent[name] = spent.get(name, 0.0) + clock() - start
        return run

    opt_step = trainer.opt.step
    try:
        for name, fn in originals.items():
            setattr(F, name, timed(name, fn))
        F.make_result = lambda name, out, inputs, bw: make_result(name, out, inputs, timed_backward(name, bw))
        F.make_results = lambda name, outs, inputs, bw: make_results(name, outs, inputs, timed_backward(name, bw))
        trainer.opt.step = timed("optimizer", opt_step)
        trainer.step()
        spent.clear()
        total = linear_s = attention_s = 0.0
        for _ in range(steps):
            matmuls.step()
            linear_s, attention_s = linear_s + matmuls.linear_s[-1], attention_s + matmuls.attention_s[-1]
            start = clock()
            trainer.step()
            total += clock() - start
        total, matmul_linear_ms, matmul_attention_ms = (v / steps * 1e3 for v in (total, linear_s, attention_s))
    finally:
        for name, fn in originals.items():
            setattr(F, name, fn)
        F.make_result, F.make_results = make_result, make_results
        del trainer.opt.step
    ms = {name: v / steps * 1e3 for name, v in spent.items()}
    out = {family: sum(ms.pop(n, 0.0) for n in names) for family, names in FAMILIES.items()}
    out["linear (bias, reshapes)"] -= matmul_linear_ms
    out["attention (softmax, mask, scale)"] -= matmul_attention_ms
    out["optimizer"] = ms.pop("optimizer", 0.0)
    out["other ops"] = sum(ms.values())
    out["autograd engine and Python"] = total - matmul_linear_ms - matmul_attention_ms - sum(out.values())
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["step"] = total
    return out


# -- the jobs ---------------------------------------------------------------------------------------------------

def load_average():
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_worker(args):
    from mpi4py import MPI

    from mpidist import DDP, FSDP
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_step import matmul_gflops, time_steps  # the same peak and interleaved timing as that benchmark

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    global WIDTH
    WIDTH = args.width
    args.retained = False
    if not args.no_retain_memory:
        from mpidist.nn.allocator import retain_freed_memory
        args.retained = retain_freed_memory()  # process-wide: the PyTorch peer in this process gets it too
    model = build()
    config = model.config
    psi = model.num_parameters()
    flops_per_token = model.flops_per_token()
    tokens = BATCH * config.block_size
    x, y = batch(rank, config)
    common = {"batch_per_rank": BATCH, "seq_len": config.block_size, "params": psi,
              "flops_per_token": flops_per_token, "cores": os.cpu_count(),
              "load_avg_1m_at_start": comm.allreduce(load_average() or 0.0, op=MPI.MAX)}
    rows = []

    def row(strategy, step_s=None, gflops=None, peak=None, **extra):
        r = {"strategy": strategy, "ranks": size, "tokens_per_s": None, "mfu": None, "matmul_gflops": gflops,
             "step_ms": None}
        if step_s is not None:
            achieved = tokens * flops_per_token / step_s / 1e9
            r.update(tokens_per_s=tokens / step_s, step_ms=step_s * 1e3,
                     mfu=None if gflops is None else achieved / gflops,
                     mfu_vs_peak=None if peak is None else achieved / peak, peak_gflops=peak)
        r.update(extra)
        r.update(common)
        rows.append(r)

    def memory_row(strategy, trainer, step_s=None, gflops=None, peak=None):
        mem = (ddp_memory if strategy == "ddp" else fsdp_memory)(trainer)
        mem = {k: comm.allreduce(v, op=MPI.MAX) for k, v in mem.items()}  # equal up to padding: the largest
        row(strategy, step_s, gflops, peak, **mem, zero_formula_bytes=zero_formula_bytes(strategy, psi, size))

    ddp = lambda m: DDP(m, comm)  # noqa: E731
    fsdp = lambda m: FSDP(m, comm, units=m.fsdp_units())  # noqa: E731
    if size == 1:
        peak = matmul_gflops(repeats=3)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        matmuls = MatmulsOnly(config, clock=clock)
        assert matmuls.flops == tokens * flops_per_token, (matmuls.flops, tokens * flops_per_token)
        plain = Trainer(model, x, y)
        ckpt = Trainer(build().checkpoint_blocks(), x, y)
        peer = None if args.no_torch else torch_peer(model, x, y)
        setups = {"matmuls": matmuls, "single": plain, "checkpointed": ckpt}
        if peer is not None:
            import torch
            with torch.no_grad():  # the same model: the largest logit difference (float32 rounding only)
                logits_diff = float(np.abs(peer.model(peer.x).numpy() - model(x).data).max())
            setups["torch"] = peer
        times = time_steps(setups, args.steps, warmup=1, block=2, clock=clock)
        gflops = matmuls.flops / times["matmuls"] / 1e9
        linear_flops = matmuls.flops - config.n_layer * 12 * BATCH * config.block_size ** 2 * config.n_embd
        linear_ms, attention_ms = np.median(matmuls.linear_s) * 1e3, np.median(matmuls.attention_s) * 1e3
        split = {"matmul_gflops_linears": linear_flops / linear_ms / 1e6,
                 "matmul_gflops_attention": (matmuls.flops - linear_flops) / attention_ms / 1e6,
                 "matmul_ms": times["matmuls"] * 1e3}
        outside = times["single"] * 1e3 - split["matmul_ms"]
        versus = {}
        if peer is not None:
            versus = {"torch_tokens_per_s": tokens / times["torch"], "torch_step_ms": times["torch"] * 1e3,
                      "torch_mfu": tokens * flops_per_token / times["torch"] / 1e9 / gflops,
                      "tokens_per_s_over_torch": times["torch"] / times["single"],
                      "torch_logits_max_abs_diff": logits_diff, "torch_version": sys.modules["torch"].__version__}
        held, peak_act = activation_bytes(plain)
        held_c, peak_c = activation_bytes(ckpt)
        row("single", times["single"], gflops, peak, **split, **versus, activation_held_bytes=held,
            activation_peak_bytes=peak_act, outside_matmul_ms=outside,
            outside_matmul_share=outside / (times["single"] * 1e3), width=config.n_embd,
            malloc_retained=args.retained, clock=args.clock,
            outside_matmul_ms_by_op=op_times(plain, matmuls, clock=clock))
        row("checkpointed", times["checkpointed"], gflops, peak, time_over_single=times["checkpointed"] /
            times["single"], activation_held_bytes=held_c, activation_peak_bytes=peak_c,
            held_saving=1 - held_c / held, peak_saving=1 - peak_c / peak_act)
        del plain, ckpt
        for strategy, wrap in (("ddp", ddp), ("fsdp", fsdp)):
            trainer = Trainer(build(), x, y, wrap)
            trainer.step()
            trainer.step()
            memory_row(strategy, trainer)
    elif size == 2:
        peak = comm.allreduce(matmul_gflops(repeats=3), op=MPI.MIN)
        trainers = {"matmuls": MatmulsOnly(config), "local": Trainer(model, x, y),
                    "ddp": Trainer(build(), x, y, ddp), "fsdp": Trainer(build(), x, y, fsdp)}
        times = time_steps(trainers, args.steps, comm, warmup=1, block=2)
        gflops = trainers["matmuls"].flops / times["matmuls"] / 1e9
        row("local", times["local"], gflops, peak)
        for strategy in ("ddp", "fsdp"):
            memory_row(strategy, trainers[strategy], times[strategy], gflops, peak)
            rows[-1]["over_local"] = times["local"] / times[strategy]
    else:
        for strategy, wrap in (("ddp", ddp), ("fsdp", fsdp)):
            trainer = Trainer(build(), x, y, wrap)
            trainer.step()
            memory_row(strategy, trainer)
            del trainer
        rows.append(pipeline_row(comm, args, common, tokens))
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def pipeline_row(comm, args, common, tokens):
    """1F1B over all ranks of ``comm``: the measured bubble (median over steps) next to (p-1)/(m+p-1)."""
    from mpi4py import MPI

    from mpidist import Pipeline
    from mpidist.models.gpt import lm_loss, split_layers
    from mpidist.optim import AdamW

    p, rank, m = comm.Get_size(), comm.Get_rank(), MICROBATCHES
    model = build()
    stage = model.pipeline_stages(p)[rank]
    pipe = Pipeline(stage, comm, m, schedule="1f1b", loss_fn=lm_loss, tied_parameters=stage.tied)
    opt = AdamW(list(stage.parameters()), lr=3e-4)
    x, y = batch(0, model.config)
    bubbles, walls, computes = [], [], []
    for step in range(args.pipeline_steps + 1):
        opt.zero_grad()
        comm.Barrier()
        pipe.step(x, y)
        s = pipe.stats
        stats = np.array(comm.allgather((s.compute_s, s.wall_s)))
        opt.step()
        if step > 0:  # the first step warms up allocations and MPI connections
            makespan = stats[:, 1].max()
            bubbles.append(float(np.mean(1 - stats[:, 0] / makespan)))
            walls.append(makespan)
            computes.append(stats[:, 0])
    step_s = float(np.median(walls))
    return {"strategy": "pipeline_1f1b", "ranks": p, "tokens_per_s": tokens / step_s / p, "mfu": None,
            "matmul_gflops": None, "step_ms": step_s * 1e3, "p": p, "m": m, "microbatch": BATCH // m,
            "bubble_measured": float(np.median(bubbles)), "bubble_formula": (p - 1) / (m + p - 1),
            "stage_compute_ms": [float(c) * 1e3 for c in np.median(computes, axis=0)],
            "blocks_per_stage": split_layers(model.config.n_layer, p),
            **common, "batch_per_rank": None, "global_batch": BATCH,
            "load_avg_1m_at_start": comm.allreduce(load_average() or 0.0, op=MPI.MAX)}


# -- the driver -------------------------------------------------------------------------------------------------

def launch_command(n):
    """Return the launcher and its flags for ``n`` ranks, chosen as tests/launcher.py chooses them."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = os.environ.get("MPIDIST_MPIEXEC") or (beside if os.path.exists(beside) else shutil.which("mpiexec"))
    if not mpiexec or not (os.path.isfile(mpiexec) or shutil.which(mpiexec)):
        sys.exit(f"gpt: no launcher (MPIDIST_MPIEXEC={os.environ.get('MPIDIST_MPIEXEC', '')!r}, "
                 f"no mpiexec next to {sys.executable} or on PATH): set MPIDIST_MPIEXEC")
    return [mpiexec, *shlex.split(os.environ.get("MPIEXEC_FLAGS", "")), "-n", str(n)]


def run_driver(args):
    here = os.path.abspath(__file__)
    rows = []
    for n in args.ranks:
        cmd = [*launch_command(n), sys.executable, here, "--worker", "--steps", str(args.steps),
               "--pipeline-steps", str(args.pipeline_steps), "--width", str(args.width)]
        cmd += ["--no-torch"] * args.no_torch + ["--no-retain-memory"] * args.no_retain_memory + ["--clock", args.clock]
        env = dict(os.environ)
        if n > os.cpu_count():
            # More ranks than cores: MPICH busy-polls in blocking receives, and a spinning rank takes the core
            # from one that computes. Yield on every poll (as benchmarks/pipeline.py does).
            env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"gpt: {shlex.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        rows += json.loads(next(line[5:] for line in proc.stdout.splitlines() if line.startswith("ROWS ")))
        print(f"[{n} rank(s): {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    single = next((r for r in rows if r["strategy"] == "single"), None)
    for r in rows:
        if single is not None and r["tokens_per_s"] is not None and r["strategy"] in ("ddp", "fsdp", "local"):
            r["over_one_rank"] = r["tokens_per_s"] / single["tokens_per_s"]
    print(table(rows))
    print(targets(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows):
    mib = 1024 * 1024
    lines = ["| strategy | ranks | tokens/s per rank | MFU | matmul GFLOP/s | step ms | vs 1 rank | params MiB | "
             "grads MiB | Adam MiB | total MiB | ZeRO formula MiB | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["strategy"] == "pipeline_1f1b":
            continue
        mem = [_fmt(r.get(k) and r[k] / mib, ".2f") for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes",
                                                             "persistent_bytes", "zero_formula_bytes", "peak_bytes")]
        lines.append(f"| {r['strategy']} | {r['ranks']} | {_fmt(r['tokens_per_s'], '.0f')} | {_fmt(r['mfu'], '.3f')} | "
                     f"{_fmt(r['matmul_gflops'], '.1f')} | {_fmt(r['step_ms'], '.0f')} | "
                     f"{_fmt(r.get('over_one_rank'), '.2f')} | " + " | ".join(mem) + " |")
    out = ["\n".join(lines)]
    for r in rows:
        if r["strategy"] in ("single", "checkpointed"):
            out.append(f"{r['strategy']}: activations held after forward {r['activation_held_bytes'] / mib:.1f} MiB, "
                       f"peak over forward+backward {r['activation_peak_bytes'] / mib:.1f} MiB"
                       + (f", step time x{r['time_over_single']:.2f} of single" if "time_over_single" in r else ""))
        if r["strategy"] == "single":
            out.append(f"single: peak 2048^3 {r['peak_gflops']:.1f} GFLOP/s, MFU vs peak {r['mfu_vs_peak']:.3f}; "
                       f"linears {r['matmul_gflops_linears']:.1f}, attention {r['matmul_gflops_attention']:.1f} "
                       f"GFLOP/s")
            if "torch_tokens_per_s" in r:
                out.append(f"single vs PyTorch {r['torch_version']} eager (same run, same weights; logits differ by "
                           f"{r['torch_logits_max_abs_diff']:.1e}): {r['tokens_per_s']:.0f} against "
                           f"{r['torch_tokens_per_s']:.0f} tokens/s = {r['tokens_per_s_over_torch']:.2f}x; "
                           f"torch MFU {r['torch_mfu']:.3f}")
            by_op = r["outside_matmul_ms_by_op"]
            out.append(f"single: outside the matmuls {r['outside_matmul_ms']:.0f} of {r['step_ms']:.0f} ms = "
                       f"{r['outside_matmul_share']:.1%} of the step ({r['clock']} clock; malloc retained: "
                       f"{r['malloc_retained']}); "
                       f"by op family (instrumented step {by_op['step']:.0f} ms):")
            out.extend(f"  {k:34s} {v:7.1f} ms  {v / by_op['step']:6.1%}" for k, v in by_op.items() if k != "step")
        if r["strategy"] == "pipeline_1f1b":
            out.append(f"1F1B p={r['p']} m={r['m']}: bubble measured {r['bubble_measured']:.3f}, formula "
                       f"{r['bubble_formula']:.3f}; step {r['step_ms']:.0f} ms; stage compute ms "
                       f"{[round(c) for c in r['stage_compute_ms']]}")
    return "\n".join(out)


def targets(rows):
    out = []
    by = {(r["strategy"], r["ranks"]): r for r in rows}
    if ("single", 1) in by:
        single = by[("single", 1)]
        mfu, goal = single["mfu"], TARGETS["single_mfu"]
        out.append(f"single MFU >= {goal}: {mfu:.3f} ({'met' if mfu >= goal else 'MISSED'})")
        share, goal = single["outside_matmul_share"], TARGETS["outside_matmul_share"]
        out.append(f"outside matmuls <= {goal:.0%} of the step: {share:.1%} ({'met' if share <= goal else 'MISSED'})")
        goal = TARGETS["over_torch"].get(single["width"])
        if goal is not None and "tokens_per_s_over_torch" in single:
            ratio = single["tokens_per_s_over_torch"]
            out.append(f"tokens/s >= {goal}x PyTorch eager at width {single['width']}: {ratio:.2f}x "
                       f"({'met' if ratio >= goal else 'MISSED'})")
    for s in ("ddp", "fsdp"):
        r = by.get((s, 2))
        if r and "over_one_rank" in r:
            goal = TARGETS[f"{s}_over_one_rank"]
            out.append(f"{s} at 2 ranks >= {goal}x one rank: {r['over_one_rank']:.2f}x "
                       f"({'met' if r['over_one_rank'] >= goal else 'MISSED'}; {r['over_local']:.2f}x of the "
                       f"local step run by the same 2 processes)")
    return "targets: " + "; ".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], choices=[1, 2, 4],
                        help="jobs to run (what a job measures depends on its size)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setup (after one warm-up)")
    parser.add_argument("--pipeline-steps", type=int, default=4, help="timed 1F1B steps (after one warm-up)")
    parser.add_argument("--worker", action="store_true", help="run one job's measurements (under mpiexec)")
    parser.add_argument("--width", type=int, default=256, help="the GPT's n_embd (4 heads; issue 32: 256 and 512)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the PyTorch eager peer of the 1-rank job")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="the 1-rank job's clock: wall time, or this process's CPU time (time.process_time: "
                             "steadier when other jobs share the cores; tokens/s are then per CPU second)")
    parser.add_argument("--no-retain-memory", action="store_true",
                        help="leave glibc's malloc thresholds alone (mpidist.nn.allocator.retain_freed_memory)")
    args = parser.parse_args(argv)
    (run_worker if args.worker else run_driver)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
