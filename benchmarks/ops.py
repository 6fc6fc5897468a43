"""Time the fused ops' forward + backward (GELU, SwiGLU, LayerNorm, RMSNorm, rotary, attention) by dtype: medians
of ``--repeats`` runs.

    .venv/bin/python benchmarks/ops.py --json docs/ops_bench.json

Run alone on the machine (numbers from a shared machine are noise). The 16-bit rows show the ops computing in
float32 inside and keeping 16-bit arrays (docs/nn.md, "What is saved")."""
import argparse
import json
import statistics
import time

import numpy as np

from mpidist import nn
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16

DTYPES = {"float32": np.float32, "bfloat16": bfloat16, "float16": np.float16}


def cases():
    """Yield (name, op, input shapes): GPT-sized activations (batch 8 x seq 256, width 256, ffn 1024)."""
    yield "gelu", lambda x: F.gelu(x), [(2048, 1024)]
    yield "swiglu", lambda x: F.swiglu(x), [(2048, 2 * 1024)]   # the same 1024 units: gate and up in
    yield "layer_norm", lambda x, w, b: F.layer_norm(x, w, b), [(8, 256, 256), (256,), (256,)]
    yield "rms_norm", lambda x, w: F.rms_norm(x, w), [(8, 256, 256), (256,)]
    yield "rotary", lambda qkv: F.rotary(qkv, 4), [(8, 256, 768)]
    yield "attention", lambda qkv: F.multi_head_attention(qkv, 4, is_causal=True), [(8, 256, 768)]


def time_case(op, shapes, dtype, repeats, rng):
    """Return the median seconds of one forward + backward of ``op`` on random ``dtype`` inputs."""
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    seconds = []
    for _ in range(repeats + 1):   # the first run warms caches and allocators: not counted
        inputs = [nn.Tensor(a, requires_grad=True) for a in arrays]
        start = time.perf_counter()
        out = op(*inputs)
        out.backward(np.ones(out.shape, dtype=out.data.dtype))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for name, op, shapes in cases():
        for dtype_name, dtype in DTYPES.items():
            ms = time_case(op, shapes, dtype, args.repeats, rng) * 1e3
            rows.append({"op": name, "dtype": dtype_name, "shapes": shapes, "median_ms": ms})
            print(f"{name:<11} {dtype_name:<9} {ms:8.2f} ms (forward + backward, median of {args.repeats})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
