"""The GPT on one GPU: float64 parity of training steps on CuPy against numpy, then float32 tokens/s and MFU.

Run on a GPU machine (one process; docs/gpu.md):

    python benchmarks/gpt_gpu.py --json gpt_gpu.json

Parity: a small GPT (context 32, width 64, 2 layers, float64) built twice from one seed, one copy moved to the
GPU, ``--parity-steps`` AdamW steps on the same batches; every parameter is compared with the numpy run
(max |difference| must stay below 1e-9).
Speed: ``GPTConfig(n_layer, n_embd, n_head, block_size)`` from the flags in float32, batch ``--batch``, AdamW;
the median step time over ``--steps`` timed steps (after two warm-ups, the device synchronized around each step),
tokens/s, and MFU: the model's matmul FLOPs per token (``GPT.flops_per_token``) x tokens/s over the float32
matmul rate this GPU gives a 4096^3 product in the same run (CuPy's default math mode; TF32 is not enabled).
Without cupy or a GPU it says so and exits with status 0.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

from mpidist.models.gpt import GPT, GPTConfig, lm_loss
from mpidist.optim import AdamW
from mpidist.xp import get_cupy, gpu_count


def to_device(module, cupy):
    """Move every parameter and buffer of ``module`` to the current GPU (same values, tied weights stay tied)."""
    moved = {}
    for p in module.parameters():
        if id(p) not in moved:
            p.data = cupy.asarray(p.data)
            moved[id(p)] = p
    for m in module.modules():
        for name, b in list(m.named_buffers()):
            if "." not in name:
                setattr(m, name, cupy.asarray(b))
    return module


def batches(config, batch_size, steps, seed=7):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, config.vocab_size, (batch_size, config.block_size + 1))
        yield tokens[:, :-1].copy(), tokens[:, 1:].copy()


def parity(cupy, steps):
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64, dtype="float64")
    cpu = GPT(config, rng=np.random.default_rng(0))
    dev = to_device(GPT(config, rng=np.random.default_rng(0)), cupy)
    opts = [AdamW(list(m.parameters()), lr=1e-3) for m in (cpu, dev)]
    losses = []
    for x, y in batches(config, 4, steps):
        pair = []
        for model, opt, put in ((cpu, opts[0], np.asarray), (dev, opts[1], cupy.asarray)):
            opt.zero_grad()
            loss = lm_loss(model(put(x)), put(y))
            loss.backward()
            opt.step()
            pair.append(float(loss))
        losses.append(pair)
    worst = max(float(np.max(np.abs(cupy.asnumpy(b.data) - a.data)))
                for a, b in zip(cpu.parameters(), dev.parameters()))
    return {"parity_steps": steps, "parity_max_abs_diff": worst, "parity_losses": losses,
            "parity_ok": bool(worst < 1e-9)}


def matmul_tflops(cupy, n=4096, reps=10):
    a = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    a @ b
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        cupy.cuda.Device().synchronize()
        samples.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(samples) / 1e12


def speed(cupy, args):
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = to_device(GPT(config, rng=np.random.default_rng(0)), cupy)
    opt = AdamW(list(model.parameters()), lr=3e-4)
    x, y = next(batches(config, args.batch, 1))
    x, y = cupy.asarray(x), cupy.asarray(y)
    sync = cupy.cuda.Device().synchronize
    times = []
    for i in range(args.steps + 2):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = args.batch * config.block_size
    tflops = matmul_tflops(cupy)
    model_tflops = model.flops_per_token() * tokens / step_s / 1e12
    return {"config": config.to_dict(), "batch": args.batch, "parameters": model.num_parameters(),
            "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s, "model_tflops": model_tflops,
            "matmul_tflops_fp32": tflops, "mfu": model_tflops / tflops, "final_loss": float(loss)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as one JSON object")
    ap.add_argument("--parity-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (after two warm-ups)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    args = ap.parse_args(argv)
    cupy = get_cupy()
    if cupy is None or gpu_count() == 0:
        print("gpt_gpu: " + ("cupy is not installed" if cupy is None else "cupy sees no usable CUDA GPU")
              + "; nothing to measure (run on a GPU machine, see docs/gpu.md)")
        return 0
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    result = {"device": name.decode() if isinstance(name, bytes) else str(name), "cupy": cupy.__version__}
    result.update(parity(cupy, args.parity_steps))
    print(f"parity: {args.parity_steps} AdamW steps float64, max |w_gpu - w_cpu| = {result['parity_max_abs_diff']:.3g}"
          f" -> {'OK' if result['parity_ok'] else 'FAIL'}", flush=True)
    result.update(speed(cupy, args))
    print(f"speed on {result['device']}: {result['parameters']:,} parameters, batch {args.batch} x {args.block_size}: "
          f"{result['step_ms']:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s, "
          f"{result['model_tflops']:.2f} TFLOP/s of matmuls, fp32 matmul rate {result['matmul_tflops_fp32']:.1f} "
          f"TFLOP/s, MFU {result['mfu']:.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["parity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
