"""What tracing costs a GPT training step: off next to on, and a bound on what the off path adds.

Run: .venv/bin/python benchmarks/trace_cost.py --json trace_cost.json

One process, one BLAS thread. Model and step as benchmarks/gpt.py's ``single`` row: ``GPT(GPTConfig())``
(vocabulary 256, context 128, width 256, 4 layers, 4 heads), batch 16 sequences of 128 random tokens, AdamW;
a step is zero_grad, forward, cross-entropy, backward, optimizer step.

- on / off: the step's median time with ``mpidist.trace`` recording (module depth ``--depth``) and without
  it, timed interleaved in blocks (off, on, on, off, ...) so that load from elsewhere hits both alike; each
  block of "on" is one ``trace.start``/``trace.stop`` whose file writing is outside the timed steps. On a
  shared machine the median of each block pair's on/off ratio is steadier than the ratio of medians.
- per module call: a chain of 20 tiny Linears, forward and backward, with tracing on and off (the same
  interleaving): what recording adds per traced module call (both hooks, both events). Times the module calls
  of one GPT step, it is what tracing should add to the step, free of the step's own noise.
- off path: with tracing off nothing is registered; what remains is a check per module call (two global hook
  dicts), per optimizer step, per collective (``record.on_hold``/``on_leave``) and per pipeline action. The
  benchmark counts the module calls of one step and times those checks alone: calls x check time bounds what
  the off path can add to the step.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import timeit

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # before numpy loads its BLAS

import numpy as np  # noqa: E402

from mpidist import trace  # noqa: E402
from mpidist.models import GPT, GPTConfig  # noqa: E402
from mpidist.nn import module as nn_module  # noqa: E402
from mpidist.optim import AdamW  # noqa: E402


def build(seed=0, batch=16):
    config = GPTConfig()
    model = GPT(config, rng=np.random.default_rng(seed))
    opt = AdamW(list(model.parameters()), lr=3e-4)
    rng = np.random.default_rng(seed + 1)
    idx = rng.integers(0, config.vocab_size, size=(batch, config.block_size))
    targets = rng.integers(0, config.vocab_size, size=(batch, config.block_size))

    def step():
        opt.zero_grad()
        loss = model.loss(model(idx), targets)
        loss.backward()
        opt.step()
        return float(loss)
    return model, step


def module_calls_per_step(step):
    """Count the module calls of one step through a global forward hook."""
    calls = [0]

    def count(module, args):
        calls[0] += 1
    handle = nn_module.register_module_forward_pre_hook(count)
    try:
        step()
    finally:
        handle.remove()
    return calls[0]


def check_cost_ns(number=2_000_000):
    """Nanoseconds the off path's added condition costs per module call (two empty global dicts)."""
    setup = "a = {}; b = {}; c = {}; flag = False; g = nn_module"
    with_globals = timeit.timeit("a or b or flag or g._global_forward_pre_hooks or g._global_forward_hooks",
                                 setup=setup, globals={"nn_module": nn_module}, number=number)
    without = timeit.timeit("a or b or flag", setup=setup, globals={"nn_module": nn_module}, number=number)
    return max(with_globals - without, 0.0) / number * 1e9


def per_call_cost_us(repeats=30, number=50):
    """Microseconds tracing adds per module call (forward and backward, depth >= 1), best of ``repeats``."""
    from mpidist.nn import Linear, Sequential
    from mpidist.nn.autograd import Tensor
    chain = Sequential(*[Linear(4, 4, rng=np.random.default_rng(i)) for i in range(20)])
    x = Tensor(np.ones((2, 4), np.float32), requires_grad=True)

    def run():
        chain(x).sum().backward()
    directory = tempfile.mkdtemp(prefix="mpidist-trace-cost-")
    best = {"off": float("inf"), "on": float("inf")}
    for _ in range(repeats):
        for mode in ("off", "on"):
            if mode == "on":
                trace.start(directory, depth=1, limit=1 << 16)
            best[mode] = min(best[mode], timeit.timeit(run, number=number) / number)
            if mode == "on":
                trace.stop()
    return (best["on"] - best["off"]) / 21 * 1e6  # 20 Linears and the Sequential


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4, help="blocks per mode (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block (default 4)")
    parser.add_argument("--depth", type=int, default=1, help="module depth traced (default 1)")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)

    model, step = build()
    for _ in range(2):
        step()  # warm-up: allocations, the optimizer's packs
    calls = module_calls_per_step(step)
    times = {"off": [], "on": []}
    pairs = []  # (off, on) mean step time of each block: neighbours in time share the machine's load
    events = []
    directory = tempfile.mkdtemp(prefix="mpidist-trace-cost-")
    for block in range(args.blocks):
        means = {}
        for mode in (("off", "on") if block % 2 == 0 else ("on", "off")):
            if mode == "on":
                trace.start(directory, depth=args.depth)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t0)
            means[mode] = float(np.mean(times[mode][-args.steps:]))
            if mode == "on":
                with open(trace.stop()) as f:
                    events.append(sum(1 for e in json.load(f)["traceEvents"] if e.get("ph") == "X") / args.steps)
        pairs.append((means["off"], means["on"]))
    off, on = float(np.median(times["off"])), float(np.median(times["on"]))
    check_ns = check_cost_ns()
    call_us = per_call_cost_us()
    result = {
        "model": "GPT(GPTConfig()) width 256, 4 layers, context 128, batch 16, AdamW, 1 rank, 1 BLAS thread",
        "steps_per_mode": len(times["off"]), "depth": args.depth,
        "off_ms": 1e3 * off, "on_ms": 1e3 * on, "on_over_off": on / off,
        "paired_on_over_off_median": float(np.median([b / a for a, b in pairs])),
        "off_ms_quartiles": [1e3 * float(q) for q in np.percentile(times["off"], [25, 75])],
        "on_ms_quartiles": [1e3 * float(q) for q in np.percentile(times["on"], [25, 75])],
        "events_per_step": float(np.median(events)),
        "module_calls_per_step": calls, "on_us_per_module_call": call_us,
        "on_bound_ms_per_step": calls * call_us / 1e3, "off_check_ns_per_call": check_ns,
        "off_path_bound_us_per_step": calls * check_ns / 1e3,
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    print(f"step off {result['off_ms']:.1f} ms (IQR {result['off_ms_quartiles'][0]:.1f}-"
          f"{result['off_ms_quartiles'][1]:.1f}), on {result['on_ms']:.1f} ms (IQR {result['on_ms_quartiles'][0]:.1f}-"
          f"{result['on_ms_quartiles'][1]:.1f}): on/off {result['on_over_off']:.3f} (median of the blocks' on/off: "
          f"{result['paired_on_over_off_median']:.3f}); "
          f"{result['events_per_step']:.0f} events per step traced")
    print(f"on, per module call: {call_us:.1f} us x {calls} calls = {calls * call_us / 1e3:.3f} ms per step "
          f"({100 * calls * call_us * 1e-6 / off:.3f}% of the off step)")
    print(f"off path: {calls} module calls per step x {check_ns:.1f} ns per check = "
          f"{result['off_path_bound_us_per_step']:.1f} us per step "
          f"({100 * result['off_path_bound_us_per_step'] * 1e-6 / off:.4f}% of the step)")
    print(f"load average {result['load_average']:.1f} on {result['cpus']} cpus")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
