"""Models larger than one rank: per-rank memory predicted from the layout next to the measured, under a memory cap.

Run from the repo root (spawns ``mpiexec -n N`` per row, one process per rank; launcher as in fsdp_memory.py):

    .venv/bin/python benchmarks/memory_deferred.py                      # FSDP and tp x pp at 1, 2, 4 ranks
    .venv/bin/python benchmarks/memory_deferred.py --fit --ranks 1 4 --cap-mb 1600 --n-layer 67   # the capped run

Every rank builds the GPT inside ``mpidist.nn.deferred()`` (nothing allocated), and the wrapper materializes
only its part: FSDP (full_shard) its shard of each unit; tp x pp (tp = N/2, pp = 2; at N=1 the plain model) its
stage's tensor-parallel slices. Float32 parameters with AdamW: 16 bytes per parameter held (params, grads, two
moments), so the prediction per rank is, from the deferred model alone (``predict``, nothing allocated):
- persistent: 16 x (elements this rank holds): FSDP sum over units of ceil(numel / N) (ZeRO-3: 16 Psi / N);
  tp x pp the stage's local shapes (sharded matrices / tp, replicated norms and positions whole);
- peak: persistent + transient: ``mpidist.optim.AdamW``'s scratch (a few blocks of ``optim._BLOCK`` elements
  whatever the model's size: the update runs block by block in place, see ``ADAM_SCRATCH_BLOCKS``) + FSDP's two
  gathered units and two unsharded unit gradients (prefetch and the reduce-scatter in flight: 4 x the largest
  unit; tp x pp has none) - plus the activations, which the table shows as what the measured peak has beyond
  the prediction.
Measured: ``tracemalloc`` peak of this process's allocations (numpy arrays included) above what it held before
building, during construction and during training; ``memory_stats`` persistent bytes; construction seconds.
Rows give the largest rank.

``--fit``: a model whose parameters + gradients + Adam state (16 Psi) is at least 3x ``--cap-mb`` trains at 4
ranks under ``RLIMIT_DATA`` = cap in each rank (heap and anonymous mappings: numpy's arrays), with FSDP and with
tp x pp, and each rank's parameters after ``--steps`` steps are compared with a one-process run of the same model
without the cap (read box by box from the safetensors file that run writes). ``--whole-too``: the same job
building the model whole; tp x pp hits the cap at construction (MemoryError: the whole model and the slices). FSDP
at 4 ranks does not: a rank's 16 Psi / 4 is the whole model's 4 Psi float32 parameters, so a cap that fits the
sharded training fits the whole construction too; ``--ranks 1`` under the cap shows it binds (the backward fails).
``MALLOC_MMAP_THRESHOLD_`` is fixed for the ranks (see ``launch``) so freed arrays do not fragment the heap.
"""

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

ADAM_BYTES = 16  # float32 parameter, gradient and two moments
# mpidist.optim.AdamW's scratch per parameter pack (one here: float32, one group): the work, denominator and step
# blocks and the blocks that gather small parameters' gradients and values, float32.
ADAM_SCRATCH_BLOCKS = 5
# A float32 gradient near 0 differs between layouts in its last bits (other summation orders); Adam's default
# eps 1e-8 turns that into an update of +-lr either way. eps 1e-3 keeps the update linear in such gradients, so
# the comparison with one process measures the layout, not Adam's sign of noise.
LR, EPS = 1e-3, 1e-3


def gpt_config(args):
    from mpidist.models import GPTConfig
    return GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd, dtype="float32")


def deferred_model(args):
    from mpidist import nn
    from mpidist.models import GPT
    with nn.deferred(seed=args.seed):
        return GPT(gpt_config(args))


def predict(args, layout, size, rank):
    """Return (persistent bytes, transient bytes) of ``rank`` of ``size`` at ``layout``, from deferred shapes."""
    model = deferred_model(args)
    if layout == "fsdp" or size == 1:
        units, seen = [], set()
        for unit in model.fsdp_units():
            numel = 0
            for p in unit.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    numel += p.data.size
            units.append(numel)
        held = sum(-(-n // size) for n in units)
        largest = max(-(-n // size) * size for n in units) * 4
        return ADAM_BYTES * held, adam_scratch_bytes(held) + (4 * largest if size > 1 else 0)
    # tp x pp: the stage's local shapes; tensor_parallel on a deferred model only needs the tp group's size.
    tp, pp = size // 2, 2
    stage_rank, tp_rank = rank // tp, rank % tp
    held = 0
    for name, n in _tp_local_sizes(model, tp, tp_rank).items():
        held += n if _in_stage(model, name, pp, stage_rank) else 0
    if model.config.tie_weights and stage_rank == pp - 1:  # the last stage's own copy of the tied head
        held += _tp_local_sizes(model, tp, tp_rank)["embed.wte.weight"]
    return ADAM_BYTES * held, adam_scratch_bytes(held)


def adam_scratch_bytes(held):
    """Return the bytes of AdamW's scratch for a rank holding ``held`` float32 elements: a few blocks."""
    from mpidist.optim import _BLOCK
    return ADAM_SCRATCH_BLOCKS * min(_BLOCK, held) * 4


def _tp_local_sizes(model, tp, tp_rank):
    """Return {name: local elements} of ``model`` split over ``tp`` ranks as models.tensor_parallel splits it:
    column-parallel rows and row-parallel columns ceil(n / tp) (padding included), everything else whole."""
    out = {}
    for name, p in model.named_parameters():
        shape = p.data.shape
        if tp > 1 and (name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias"))
                       or name in ("embed.wte.weight", "head.weight")):
            out[name] = -(-shape[0] // tp) * math.prod(shape[1:])
        elif tp > 1 and name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            out[name] = shape[0] * -(-shape[1] // tp)
        else:
            out[name] = p.data.size
    return out


def _in_stage(model, name, pp, stage_rank):
    from mpidist.models.gpt import split_layers
    counts = split_layers(model.config.n_layer, pp)
    first = sum(counts[:stage_rank])
    if name.startswith("embed."):
        return stage_rank == 0
    if name.startswith("head."):
        return stage_rank == pp - 1
    block = int(name.split(".")[1])
    return first <= block < first + counts[stage_rank]


def build(args, comm, layout, deferred=True):
    """Build this rank's wrapper at ``layout`` (deferred: only its part; else the whole model first)."""
    from mpidist import nn
    from mpidist.models import GPT, tensor_parallel
    from mpidist.parallel import FSDP, LocalModule, Pipeline, mesh
    if deferred:
        model = deferred_model(args)
    else:
        nn.manual_seed(args.seed)
        model = GPT(gpt_config(args))
    size = comm.Get_size()
    if size == 1:
        return model, LocalModule(nn.materialize(model)), None
    if layout == "fsdp":
        return model, FSDP(model, comm, units=model.fsdp_units()), None
    grid = mesh(comm, dp=1, pp=2, tp=size // 2)
    tensor_parallel(model, grid.tp_comm, sequence_parallel=False)
    stage = model.pipeline_stages(2)[grid.pp_rank]
    return model, Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss, tied_parameters=stage.tied), grid


def batch(args):
    rng = np.random.default_rng(1)
    x = rng.integers(0, args.vocab, (args.batch, args.block))
    return x, np.roll(x, -1, axis=1)


def train(args, model, wrapper, comm, layout, opt):
    x, y = batch(args)
    size, rank = comm.Get_size(), comm.Get_rank()
    if layout == "fsdp" and size > 1:
        n = args.batch // size
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    for _ in range(args.steps):
        opt.zero_grad()
        if hasattr(wrapper, "step"):
            wrapper.step(x, y)
        else:
            model.loss(wrapper.module(x) if hasattr(wrapper, "module") else wrapper(x), y).backward()
        opt.step()


def compare_with_reference(wrapper, path):
    """Return the largest |difference| between this rank's parameters and the reference file's same elements."""
    from safetensors import safe_open
    from mpidist.nn.placement import boxes
    worst, read = 0.0, 0
    with safe_open(path, framework="numpy") as f:
        for placed in wrapper.placed_parameters():
            local = placed.parameter.data
            for box in boxes(placed.placement, local.shape):
                want = f.get_slice(placed.name)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
                read += want.nbytes
                worst = max(worst, float(np.max(np.abs(box.view(local) - want))) if want.size else 0.0)
    return worst, read


def vm_data():
    for line in open("/proc/self/status"):
        if line.startswith("VmData"):
            return int(line.split()[1]) * 1024
    return 0


def run_worker(args):
    from mpi4py import MPI
    from mpidist import optim
    import mpidist.models  # noqa: F401 (imported before the construction is timed)
    import mpidist.parallel  # noqa: F401
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if args.cap_mb:
        cap = args.cap_mb * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    row = {"layout": args.layout, "ranks": comm.Get_size(), "deferred": not args.whole,
           "vm_data_before": vm_data()}
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    try:
        model, wrapper, grid = build(args, comm, args.layout, deferred=not args.whole)
    except MemoryError as exc:
        row["construction_error"] = f"MemoryError {exc}"
        print("ROW " + json.dumps(row), flush=True)
        comm.Abort(3)
        return
    row["construct_s"] = time.perf_counter() - start
    row["construct_peak"] = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.reset_peak()
    opt = optim.AdamW(list(wrapper.parameters()), lr=LR, eps=EPS)
    try:
        train(args, model, wrapper, comm, args.layout, opt)
    except MemoryError as exc:
        row["training_error"] = f"MemoryError {exc}"
        print("ROW " + json.dumps(row), flush=True)
        comm.Abort(3)
        return
    row["train_peak"] = tracemalloc.get_traced_memory()[1] - base
    row["persistent"] = wrapper.memory_stats(opt)["persistent_bytes"]
    row["predicted_persistent"], row["predicted_transient"] = predict(args, args.layout, comm.Get_size(), rank)
    row["vm_data_after"] = vm_data()
    if args.reference:
        row["max_abs_diff"], row["bytes_read"] = compare_with_reference(wrapper, args.reference)
    rows = comm.gather(row)
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)


def run_reference(args):
    """One process, no cap: the same deferred model materialized whole, trained, written as safetensors."""
    import safetensors.numpy
    from mpidist import nn, optim
    model = nn.materialize(deferred_model(args))
    opt = optim.AdamW(list(model.parameters()), lr=LR, eps=EPS)
    x, y = batch(args)
    for _ in range(args.steps):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        opt.step()
    safetensors.numpy.save_file(dict(model.state_dict()), args.reference)


def launch_command(n):
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = os.environ.get("MPIDIST_MPIEXEC") or (beside if os.path.exists(beside) else shutil.which("mpiexec"))
    if not mpiexec:
        sys.exit("memory_deferred: no launcher: set MPIDIST_MPIEXEC")
    return [mpiexec, *shlex.split(os.environ.get("MPIEXEC_FLAGS", "")), "-n", str(n)]


def model_args(args):
    return ["--vocab", str(args.vocab), "--block", str(args.block), "--n-layer", str(args.n_layer), "--n-head",
            str(args.n_head), "--n-embd", str(args.n_embd), "--batch", str(args.batch), "--steps", str(args.steps),
            "--seed", str(args.seed)]


def launch(args, n, layout, extra=()):
    cmd = [*launch_command(n), sys.executable, os.path.abspath(__file__), "--worker", "--layout", layout,
           *model_args(args), *extra]
    # glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which the
    # gathered units and per-step arrays come from the heap and fragment it: under RLIMIT_DATA a 12 MiB unit
    # then fails with 100 MiB free. A fixed threshold keeps large arrays in their own mappings, returned on free.
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), **os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS "):
            return json.loads(line[5:])
        if line.startswith("ROW "):  # a rank's failure (several may print at once: the first is read)
            return [json.JSONDecoder().raw_decode(line[4:])[0]]
    sys.exit(f"memory_deferred: {shlex.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")


def mib(b):
    return f"{b / 2**20:.1f}"


def run_driver(args):
    psi = sum(p.data.size for p in deferred_model(args).parameters())
    print(f"GPT float32: n_layer {args.n_layer}, n_embd {args.n_embd}, vocab {args.vocab}, block {args.block}; "
          f"Psi = {psi / 1e6:.2f}M; 16 Psi = {mib(16 * psi)} MiB; batch {args.batch}, {args.steps} AdamW steps")
    extra = []
    if args.fit:
        reference = os.path.join(tempfile.mkdtemp(), "reference.safetensors")
        args.reference = reference
        run_reference(args)
        extra = ["--cap-mb", str(args.cap_mb), "--reference", reference]
        print(f"cap: RLIMIT_DATA {args.cap_mb} MiB per rank; 16 Psi / cap = {16 * psi / (args.cap_mb * 2**20):.2f}")
    print("| layout | ranks | build | construct s | construct peak MiB | persistent MiB (measured) | "
          "persistent MiB (predicted) | transient MiB (predicted) | train peak MiB | peak - predicted MiB | "
          "max abs diff vs 1 process | MiB read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        for n in args.ranks:
            if layout == "tp_pp" and n not in (1,) and n % 2:
                continue
            rows = launch(args, n, layout, extra)
            worst = max(rows, key=lambda r: r.get("train_peak", 0))
            failed = [r for r in rows if "construction_error" in r or "training_error" in r]
            if failed:
                print(f"| {layout} | {n} | deferred | failed: {failed[0]} |")
                continue
            rest = worst["train_peak"] - worst["predicted_persistent"] - worst["predicted_transient"]
            diff = max(r.get("max_abs_diff", float("nan")) for r in rows)
            read = max(r.get("bytes_read", 0) for r in rows)
            print(f"| {layout} | {n} | deferred | {max(r['construct_s'] for r in rows):.2f} | "
                  f"{mib(worst['construct_peak'])} | {mib(worst['persistent'])} | "
                  f"{mib(worst['predicted_persistent'])} | {mib(worst['predicted_transient'])} | "
                  f"{mib(worst['train_peak'])} | {mib(rest)} | {diff:.2e} | {mib(read)} |")
            if args.fit and args.whole_too and n > 1:
                whole = launch(args, n, layout, [*extra, "--whole"])
                failed = [r for r in whole if "construction_error" in r]
                print(f"| {layout} | {n} | whole | " + (f"failed at construction: {failed[0]['construction_error']}"
                                                       if failed else "did NOT fail at construction") + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "tp_pp"], choices=["fsdp", "tp_pp"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fit", action="store_true", help="the capped run at 4 ranks (see the module docstring)")
    parser.add_argument("--cap-mb", type=int, default=0)
    parser.add_argument("--whole-too", action="store_true", help="--fit: also run each job building the model whole")
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    if args.fit:
        if not args.cap_mb:
            psi = sum(p.data.size for p in deferred_model(args).parameters())
            args.cap_mb = int(16 * psi / 3 / 2**20)
    return run_driver(args)


if __name__ == "__main__":
    main()
