"""``mpidist plan --calibrate``: measure this machine's matmul curve, memory bandwidth and link alpha-beta.

Matmuls and memory bandwidth are timed in this process (one BLAS thread, as ranks run); the intra-node link is
timed by a ping-pong between two ranks started with ``mpiexec -n 2`` (this module run as a program), fitting
time = alpha + bytes / bandwidth over message sizes. Two knobs are then fitted on one-rank training steps of
declared shapes (``CALIBRATION_RUNS``): ``compute_scale`` and ``layer_overhead_s`` (``fit_knobs``); then one-rank
steps of one shape over micro-batch sizes (``MICROBATCH_SWEEP``) give the micro-batch cost curve
(``fit_microbatch_cost``), one tensor-parallel rank of declared shapes stepping alone beside them
(``TP_RANK_RUNS``, its group's collectives local) gives ``tp_replicated_s`` and ``sp_replicated_s``
(``fit_replicated_terms``), and ``2 x cores`` ranks timing a loop of work with and without allreduces of several
sizes, over pairs and over all of them, give the intra link as oversubscribed groups of those sizes see it
(``measure_oversubscribed``). The
inter-node tier is the intra one until measured: run across two nodes, e.g.
``mpiexec -n 2 -hosts a,b python -m mpidist.plan.calibrate --inter BASE.json OUT.json``, the same ping-pong
between ranks 0 and 1 (on different hosts) gives BASE's inter tier, written to OUT (``calibrate_inter``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

__all__ = ["measure_matmul_curve", "measure_memory_bandwidth", "measure_link", "measure_pingpong", "fit_alpha_beta",
           "calibrate", "calibrate_inter", "with_inter_tier", "fit_knobs", "machine_busy_seconds", "quiet_median",
           "fit_microbatch_cost", "microbatch_curve", "measure_oversubscribed", "fit_oversubscribed",
           "oversubscribed_entries",
           "interleaved_medians", "halving_doubling_allreduce", "fit_tp_replicated", "fit_replicated_terms",
           "CALIBRATION_RUNS", "MICROBATCH_SWEEP", "TP_RANK_RUNS"]


def _best(fn, repeat, budget_s=0.3):
    """Return the fastest of at least ``repeat`` runs, running on for ``budget_s`` (others share the cores)."""
    best, began, runs = float("inf"), time.perf_counter(), 0
    while runs < repeat or time.perf_counter() - began < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def measure_matmul_curve(sizes=(32, 64, 128, 256, 512, 1024), dtype="float32"):
    """Return (peak FLOP/s, [[gemm_flops, efficiency], ...]): the best rate of square GEMMs is the peak."""
    rates = []
    for n in sizes:
        a = np.ones((n, n), dtype=dtype)
        b = np.ones((n, n), dtype=dtype)
        seconds = _best(lambda: a @ b, max(3, int(2e8 / n ** 3)))
        rates.append((2.0 * n ** 3, 2.0 * n ** 3 / seconds))
    peak = max(r for _, r in rates)
    return peak, [[f, round(r / peak, 4)] for f, r in rates]


def measure_memory_bandwidth(nbytes=64 << 20):
    """Return bytes/s of a large copy (read + write counted)."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    seconds = _best(lambda: np.copyto(dst, src), 5)
    return 2 * nbytes / seconds


PINGPONG_SIZES = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)


def measure_pingpong(comm, ranks=(0, 1), sizes=PINGPONG_SIZES):
    """Return [[bytes, one-way seconds], ...] of a ping-pong between ``ranks`` of ``comm``, on every rank
    (collective: the other ranks wait at the barriers)."""
    first, second = ranks
    rank = comm.Get_rank()
    out = []
    for size in sizes:
        buf = np.zeros(size, dtype=np.uint8)
        reps = 20 if size < (1 << 20) else 5
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if rank == first:
                comm.Send(buf, second)
                comm.Recv(buf, second)
            elif rank == second:
                comm.Recv(buf, first)
                comm.Send(buf, first)
        out.append([size, (time.perf_counter() - t0) / (2 * reps)])
    return comm.bcast(out, root=first)


def machine_busy_seconds():
    """Return the CPU seconds the whole machine has spent busy (user, nice, system, steal) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system = fields[:3]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + steal) / os.sysconf("SC_CLK_TCK")


def quiet_median(step, steps, tries=8, max_foreign=0.05, wait_s=2.0):
    """Return (median seconds of ``steps`` calls of ``step``, foreign share) of the quietest of up to ``tries``
    attempts: the foreign share is the machine's busy CPU time not spent by this process over the cores' time
    (another job on a shared machine); an attempt at most ``max_foreign`` is taken at once."""
    attempts = []
    for _ in range(tries):
        busy, own, wall = machine_busy_seconds(), time.process_time(), time.perf_counter()
        times = [step() for _ in range(steps)]
        busy, own = machine_busy_seconds() - busy, time.process_time() - own
        foreign = max(0.0, busy - own) / ((time.perf_counter() - wall) * (os.cpu_count() or 1))
        attempts.append((float(np.median(times)), foreign))
        if foreign <= max_foreign:
            break
        time.sleep(wait_s)
    return min(attempts, key=lambda a: a[1])


def _single_thread_env():
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"   # one BLAS thread, as each rank runs: set before numpy loads its BLAS
    return env


def _run_measurement(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_single_thread_env())
    if done.returncode:
        raise RuntimeError(f"plan --calibrate: {' '.join(command[-3:])} failed ({done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compute():
    peak, curve = measure_matmul_curve()
    # Efficiency is kept non-decreasing in size: on a shared machine a dip is another process's work.
    best = 0.0
    for point in curve:
        best = point[1] = max(best, point[1])
    peak64, _ = measure_matmul_curve(sizes=(256,), dtype="float64")
    print(json.dumps({"peak": peak, "curve": curve, "peak64": peak64, "bandwidth": measure_memory_bandwidth()}))


def measure_link(mpiexec=None):
    """Return (alpha seconds, bandwidth bytes/s) between two ranks of this node (``mpiexec -n 2`` ping-pong)."""
    mpiexec = mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    points = _run_measurement([mpiexec, "-n", "2", sys.executable, "-m", "mpidist.plan.calibrate", "--pingpong"])
    return fit_alpha_beta(points)


def fit_alpha_beta(points):
    """Return (alpha, bandwidth) of time = alpha + bytes / bandwidth fitted to [(bytes, seconds), ...]; alpha is at
    least the smallest message's time (noise can put the fitted intercept below it, even under zero)."""
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    slope, alpha = np.polyfit(x, y, 1)
    return max(float(alpha), float(y[0])), 1.0 / max(float(slope), 1e-15)


def calibrate(name="local", memory_bytes=None, inter=None, cores=None) -> dict:
    """Measure this machine and return a profile dict (see ``profile.Profile``)."""
    compute = _run_measurement([sys.executable, "-m", "mpidist.plan.calibrate", "--compute"])
    peak, curve, peak64, bandwidth = compute["peak"], compute["curve"], compute["peak64"], compute["bandwidth"]
    alpha, beta_bw = measure_link()
    if memory_bytes is None:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory_bytes = pages
    intra = {"latency_s": alpha, "bandwidth": beta_bw, "efficiency": 1.0}
    data = {"name": name, "source": f"measured by mpidist plan --calibrate on {os.uname().nodename}, "
                                    f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "peak_flops": {"float32": peak, "float64": peak64}, "matmul_efficiency": curve,
            "memory_bytes": memory_bytes, "memory_bandwidth": bandwidth, "elementwise_factor": 3.0,
            "cores_per_node": cores or os.cpu_count(),
            "tiers": {"intra": intra, "inter": inter or dict(intra)}, "fit": {}}
    steps = _run_measurement([sys.executable, "-m", "mpidist.plan.calibrate", "--steps"])
    measured = [seconds for seconds, _ in steps["runs"]]
    data["compute_scale"], data["layer_overhead_s"], data["fit"]["compute"] = fit_compute(data, measured)
    data["fit"]["compute"]["foreign_cpu_share"] = [foreign for _, foreign in steps["runs"]]
    data["microbatch_cost"], data["fit"]["microbatch"] = microbatch_curve(data, [t for t, _ in steps["sweep"]])
    data["fit"]["microbatch"]["foreign_cpu_share"] = [foreign for _, foreign in steps["sweep"]]
    replicated, data["fit"]["tp_replicated"] = fit_replicated_terms(data, [t for t, _ in steps["tp_rank"]])
    data.update(replicated)
    data["fit"]["tp_replicated"]["foreign_cpu_share"] = [foreign for _, foreign in steps["tp_rank"]]
    if data["cores_per_node"] and data["cores_per_node"] > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        ranks = 2 * data["cores_per_node"]
        points = _run_measurement([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpidist.plan.calibrate",
                                   "--oversubscribed"])
        entries, data["fit"]["oversubscribed"] = oversubscribed_entries(points, ranks)
        data.update(entries)
    return data


# The declared calibration subset of the two knobs (compute_scale, layer_overhead_s): one-rank steps of these
# shapes and micro-batch sizes (no communication). Micro-batch 1 is mostly the fixed per-layer cost, 8 mostly
# the arithmetic, so the two are told apart; none of them is a validated layout.
CALIBRATION_RUNS = [({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32}, 1),
                    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32}, 8),
                    ({"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq": 64}, 1),
                    ({"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq": 64}, 8)]


# The micro-batch cost curve: one-rank steps of this shape at these micro-batch sizes (one micro-batch each; none
# of them a validated layout: those run 2 or 4 ranks).
MICROBATCH_SWEEP = ({"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq": 64}, (1, 2, 4, 8, 16))


# One rank of a tensor-parallel group stepping alone (``OneRankOfMany``: the group's collectives are local), timed
# with the runs above: (shape, tp, micro-batch, sequence parallel). The validated layouts run 4 layers; these run 2.
TP_RANK_RUNS = [(MICROBATCH_SWEEP[0], tp, batch, sp) for sp in (False, True) for tp in (2, 4) for batch in (8, 16)]


def interleaved_medians(steps, rounds=6, per_round=3):
    """Return [[median seconds, largest foreign share], ...] of each callable in ``steps``, timed interleaved:
    ``rounds`` rounds in which each in turn takes one untimed and ``per_round`` timed calls (``quiet_median``),
    so a slow minute of a shared machine falls on all of them alike; the median is over the rounds."""
    times, foreign = [[] for _ in steps], [[] for _ in steps]
    for _ in range(rounds):
        for k, step in enumerate(steps):
            step()
            seconds, share = quiet_median(step, per_round)
            times[k].append(seconds)
            foreign[k].append(share)
    return [[float(np.median(t)), max(f)] for t, f in zip(times, foreign)]


def _without_stand_ins(run, comm):
    """Return a callable stepping ``run`` that returns its seconds less what ``comm``'s stand-in collectives
    (``OneRankOfMany``: copies and sums a real transport does instead, timed by the transport's alpha-beta)
    spent in the step."""
    def step():
        before = comm.local_seconds
        seconds = run.step()
        return seconds - (comm.local_seconds - before)
    return step


def _steps():
    """Print {"runs": [[median seconds, foreign share], ...] of ``CALIBRATION_RUNS``, "sweep": the same of
    ``MICROBATCH_SWEEP``, "tp_rank": the same of ``TP_RANK_RUNS``, less their stand-in collectives' time}:
    training steps of real LayoutRuns, all timed interleaved (``interleaved_medians``)."""
    from mpi4py import MPI

    from .execute import LayoutRun, OneRankOfMany
    from .layouts import Layout
    from .model import ModelShape
    dims, batches = MICROBATCH_SWEEP
    shapes = list(CALIBRATION_RUNS) + [(dims, b) for b in batches]
    steps = [LayoutRun(ModelShape(**d), Layout(1, 1, 1, micro_batch=b), MPI.COMM_SELF).step for d, b in shapes]
    for d, tp, b, sp in TP_RANK_RUNS:
        comm = OneRankOfMany(tp, rank=tp - 1, splits=[1, 1, tp])
        run = LayoutRun(ModelShape(**d), Layout(1, tp, 1, micro_batch=b, sequence_parallel=sp), comm)
        steps.append(_without_stand_ins(run, comm))
    measured = interleaved_medians(steps)
    n, m = len(CALIBRATION_RUNS), len(batches)
    print(json.dumps({"runs": measured[:n], "sweep": measured[n:n + m], "tp_rank": measured[n + m:]}))


def fit_knobs(modelled, layer_passes, measured):
    """Return (compute_scale, layer_overhead_s) minimizing the squared relative error of
    ``compute_scale * modelled + layer_overhead_s * layer_passes`` against ``measured`` (overhead >= 0).

    ``modelled``: each run's step time with both knobs neutral (scale 1, no overhead); ``layer_passes``: its
    layers times micro-batches (what the overhead multiplies)."""
    m, k, y = (np.asarray(v, float) for v in (modelled, layer_passes, measured))
    if not (len(m) == len(k) == len(y) >= 2) or (m <= 0).any() or (y <= 0).any():
        raise ValueError(f"fit_knobs: needs >= 2 runs with positive times (modelled={list(m)}, measured={list(y)})")
    (scale, overhead), *_ = np.linalg.lstsq(np.stack([m / y, k / y], axis=1), np.ones_like(y), rcond=None)
    if overhead < 0 or scale <= 0:   # no fixed cost the data can see: the scale alone
        scale, overhead = float(np.sum(m / y) / np.sum((m / y) ** 2)), 0.0
    return float(scale), float(overhead)


def fit_compute(profile_data, measured):
    """Return (compute_scale, layer_overhead_s, fit record) of ``CALIBRATION_RUNS`` measured in ``measured``."""
    from .estimate import estimate
    from .layouts import Layout
    from .model import ModelShape
    from .profile import Profile
    profile = Profile.from_dict(dict(profile_data, compute_scale=1.0, layer_overhead_s=0.0))
    modelled, passes = [], []
    for dims, batch in CALIBRATION_RUNS:
        layout = Layout(1, 1, 1, micro_batch=batch)
        modelled.append(estimate(ModelShape(**dims), layout, profile, 1).time["step"])
        passes.append((dims["layers"] + 2) * layout.num_micro)   # embedding, blocks, head
    scale, overhead = fit_knobs(modelled, passes, measured)
    fitted = [scale * m + overhead * k for m, k in zip(modelled, passes)]
    return scale, overhead, {"compute_scale": scale, "layer_overhead_s": overhead,
                             "runs": [dict(d, batch=b) for d, b in CALIBRATION_RUNS], "measured_s": measured,
                             "modelled_neutral_s": modelled, "layer_passes": passes,
                             "fit_errors": [f / y - 1 for f, y in zip(fitted, measured)]}


def fit_tp_replicated(modelled, elements, measured):
    """Return the seconds per element ``c >= 0`` minimizing the squared relative error of
    ``modelled + c * elements`` against ``measured``: ``modelled``, each tensor-parallel rank's step as the model
    gives it without the term; ``elements``, its replicated (tokens x hidden x (1 - 1/tp)) elements summed over
    blocks and micro-batches."""
    m, u, y = (np.asarray(v, float) for v in (modelled, elements, measured))
    if not (len(m) == len(u) == len(y) >= 1) or (y <= 0).any() or (u <= 0).any():
        raise ValueError(f"fit_tp_replicated: needs >= 1 run with positive times and elements "
                         f"(elements={u.tolist()}, measured={y.tolist()})")
    return max(0.0, float(np.sum(u / y * (y - m) / y) / np.sum((u / y) ** 2)))


def fit_replicated_terms(profile_data, measured):
    """Return ({"tp_replicated_s": ..., "sp_replicated_s": ...}, fit record) of ``TP_RANK_RUNS`` measured in
    ``measured`` against ``profile_data`` (its fitted knobs and micro-batch curve; one rank alone: no
    oversubscription), each fitted on its runs (without, with sequence parallelism)."""
    from .estimate import estimate
    from .layouts import Layout
    from .model import ModelShape
    from .profile import Profile
    profile = Profile.from_dict(dict(profile_data, tp_replicated_s=0.0, sp_replicated_s=0.0, cores_per_node=None))
    modelled, elements = [], []
    for dims, tp, batch, sp in TP_RANK_RUNS:
        shape, layout = ModelShape(**dims), Layout(1, tp, 1, micro_batch=batch, sequence_parallel=sp)
        timing = estimate(shape, layout, profile, tp).time
        modelled.append(timing["compute"] + timing["optimizer"])   # the collectives are local: no transport
        elements.append(shape.layers * layout.num_micro * batch * shape.seq * shape.hidden * (1 - 1 / tp))
    fitted, errors = {}, [0.0] * len(TP_RANK_RUNS)
    for key, sp in (("tp_replicated_s", False), ("sp_replicated_s", True)):
        mine = [k for k, run in enumerate(TP_RANK_RUNS) if run[3] == sp]
        fitted[key] = fit_tp_replicated(*([v[k] for k in mine] for v in (modelled, elements, measured)))
        for k in mine:
            errors[k] = (modelled[k] + fitted[key] * elements[k]) / measured[k] - 1
    return fitted, dict(fitted, runs=[dict(d, tp=tp, batch=b, sequence_parallel=sp) for d, tp, b, sp in TP_RANK_RUNS],
                        measured_s=measured, modelled_without_s=modelled, elements=elements, fit_errors=errors)


def fit_microbatch_cost(block_bytes, arithmetic, rest, measured, floor=0.05):
    """Return the micro-batch cost curve ``[[block_bytes, factor], ...]`` (increasing sizes) making
    ``factor * arithmetic + rest`` equal ``measured`` per run: ``arithmetic`` is a run's modelled arithmetic and
    memory time with the fitted knobs (what the factor multiplies), ``rest`` the remainder of its modelled step
    (per-layer overhead, optimizer). A factor is at least ``floor`` (a run all overhead says little of it)."""
    x, a, r, y = (np.asarray(v, float) for v in (block_bytes, arithmetic, rest, measured))
    if not (len(x) == len(a) == len(r) == len(y) >= 1) or (a <= 0).any() or (y <= 0).any() or (np.diff(x) <= 0).any():
        raise ValueError(f"fit_microbatch_cost: needs runs of increasing sizes with positive times "
                         f"(block_bytes={list(x)}, arithmetic={list(a)}, measured={list(y)})")
    return [[float(b), float(max(floor, (t - o) / m))] for b, m, o, t in zip(x, a, r, y)]


def microbatch_curve(profile_data, measured):
    """Return (curve, fit record) of ``MICROBATCH_SWEEP`` measured in ``measured`` against ``profile_data``'s
    fitted knobs (``fit_microbatch_cost``)."""
    from .estimate import estimate, touched_bytes
    from .layouts import Layout
    from .model import ModelShape
    from .profile import Profile
    full = Profile.from_dict(dict(profile_data, microbatch_cost=[]))
    arithmetic_only = Profile.from_dict(dict(profile_data, microbatch_cost=[], layer_overhead_s=0.0))
    dims, batches = MICROBATCH_SWEEP
    shape = ModelShape(**dims)
    sizes, arithmetic, rest = [], [], []
    for batch in batches:
        layout = Layout(1, 1, 1, micro_batch=batch)
        sizes.append(touched_bytes(shape, layout, ["blocks.0"]))
        arithmetic.append(estimate(shape, layout, arithmetic_only, 1).time["compute"])
        rest.append(estimate(shape, layout, full, 1).time["step"] - arithmetic[-1])
    curve = fit_microbatch_cost(sizes, arithmetic, rest, measured)
    return curve, {"shape": dims, "micro_batches": list(batches), "block_bytes": sizes, "measured_s": measured,
                   "modelled_arithmetic_s": arithmetic, "modelled_rest_s": rest}


OVERSUBSCRIBED_SIZES = (8, 1 << 16, 1 << 18, 1 << 20)


def measure_oversubscribed(comm, sizes=OVERSUBSCRIBED_SIZES, iterations=100, segment_flops=4e7, groups=None,
                           tries=5, stream_bytes=1 << 21):
    """Return {"<group size>": [[bytes, seconds], ...]} (string keys, as JSON writes them): what one allreduce
    of that many bytes over groups of that size (consecutive ranks, every group at once, as tensor-parallel
    groups are laid out) adds to a loop of work per rank when ``comm``'s ranks outnumber the cores (run it with
    twice the cores): the loop's time per iteration with the allreduce minus without it (the same work, one
    barrier at the end), medians of ``tries`` tries. ``groups``: the sizes (default pairs and the whole of
    ``comm``, each where it divides the ranks; sizes given that do not are an error). The work between calls is
    what a training step's is made of: ``segment_flops`` of matmuls (about half a millisecond of a core) and one
    elementwise pass over ``stream_bytes`` (more than a core's L2), the same on every rank, so no rank waits for
    a slower one.

    Measured on this machine (2026-11-28, 4 ranks on 2 cores, 100 iterations, medians of 5 tries; the runs are
    in docs/plan_validate_s14_oversubscribed_loops.json): a pair's 256 KiB allreduce added 0.16-0.50 ms with
    matmuls alone between the calls and 0.27-0.54 ms with the elementwise pass; 4 ranks' 1 MiB one 0.64-1.93
    and 1.42-2.10 ms. Both still move between runs minutes apart. With the pass the loop comes nearer what a
    tensor-parallel layout's calls cost in real steps (its step minus the same ranks stepping with local
    collectives: 13.7-14.1 ms for 18 calls of 256 KiB, dp2 x tp2, or 512 KiB, tp4, and 2 small ones),
    plausibly because an allreduce's copies then compete with the other ranks' streaming rather than with
    cache-resident matmuls. 25 iterations of 2 ms of matmuls varied by 2x; 30 of half a millisecond, the
    default until 2026-11-28, by up to 2.7x at 1 MiB. The step took 17 s with 4 ranks (was a few seconds)."""
    from mpi4py import MPI
    a = np.ones((128, 128), dtype=np.float32)
    reps = max(1, round(segment_flops / (2 * 128 ** 3)))
    streamed = np.ones(max(1, stream_bytes // 4), dtype=np.float32)
    scratch = np.empty_like(streamed)
    size = comm.Get_size()
    if groups is None:
        groups = [g for g in sorted({2, size}) if 2 <= g <= size and size % g == 0]
    else:
        groups = sorted(set(groups))
        bad = [g for g in groups if not (isinstance(g, int) and 2 <= g <= size and size % g == 0)]
        if bad:
            raise ValueError(f"measure_oversubscribed: group sizes must be integers from 2 to the {size} ranks "
                             f"dividing them (got {bad} of {groups})")

    def work():
        for _ in range(reps):
            a @ a
        np.multiply(streamed, 0.5, out=scratch)   # an elementwise op over activations: evicts L2
        np.add(scratch, streamed, out=scratch)

    def loop(group, token):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            work()
            if token is not None:
                group.Allreduce(MPI.IN_PLACE, token)
        comm.Barrier()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iterations
    out = {}
    for g in groups:
        group = comm.Split(comm.Get_rank() // g, comm.Get_rank())   # consecutive ranks, as tp groups are
        points = []
        for nbytes in sizes:
            token = np.ones(max(1, nbytes // 4), dtype=np.float32)
            loop(group, token)   # warm-up
            plain, synced = [], []
            for _ in range(tries):
                plain.append(loop(group, None))
                synced.append(loop(group, token))
            points.append([nbytes, max(0.0, float(np.median(synced) - np.median(plain)))])
        group.Free()
        out[str(g)] = points
    return out


def oversubscribed_entries(points, ranks):
    """Return (profile entries, fit record) of ``measure_oversubscribed``'s ``points`` over ``ranks`` ranks: the
    series of all the ranks is ``oversubscribed_tier``, each other group size's an ``oversubscribed_groups`` entry
    (``fit_oversubscribed`` at that size)."""
    if str(ranks) not in points:
        raise ValueError(f"oversubscribed_entries: no series over all {ranks} ranks (got group sizes {sorted(points)})")
    fitted = {size: fit_oversubscribed(series, int(size)) for size, series in points.items()}
    alpha, bandwidth = fitted[str(ranks)]
    entries = {"oversubscribed_tier": {"latency_s": alpha, "bandwidth": bandwidth},
               "oversubscribed_groups": {size: {"latency_s": a, "bandwidth": b} for size, (a, b) in fitted.items()
                                         if size != str(ranks)}}
    return entries, {"ranks": ranks, "allreduce_bytes_extra_s": points}


def fit_oversubscribed(points, ranks):
    """Return (alpha, bandwidth) of the ring allreduce time 2 (n - 1) alpha + 2 (n - 1) / n x bytes / bandwidth
    (``estimate.collective_seconds``) fitted to ``points`` [[bytes, seconds], ...] of ``ranks`` ranks."""
    n = ranks
    if n < 2:
        raise ValueError(f"fit_oversubscribed: needs 2 ranks or more (got {n})")
    intercept, bandwidth = fit_alpha_beta([[2 * (n - 1) / n * b, t] for b, t in points])
    return intercept / (2 * (n - 1)), bandwidth


def with_inter_tier(base: dict, points, ranks_per_link: int = 1, hosts=(), name=None) -> dict:
    """Return a copy of profile dict ``base`` whose inter tier is fitted to ping-pong ``points`` between two nodes
    (``fit_alpha_beta``); ``ranks_per_link``: the ranks of a node that share its link."""
    alpha, bandwidth = fit_alpha_beta(points)
    data = json.loads(json.dumps(base))
    data["tiers"]["inter"] = {"latency_s": alpha, "bandwidth": bandwidth, "efficiency": 1.0,
                              "ranks_per_link": ranks_per_link}
    if name:
        data["name"] = name
    between = " and ".join(hosts) if hosts else "two nodes"
    data["source"] = (f"{base.get('source', '')}; inter tier: ping-pong between {between}, "
                      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    data.setdefault("fit", {})["inter"] = {"points": [list(p) for p in points], "hosts": list(hosts)}
    return data


def halving_doubling_allreduce(library_version: str, env=None) -> bool:
    """Return whether an MPI library of ``library_version`` (``MPI.Get_library_version()``) reduces large arrays by
    recursive halving then doubling (``Profile.halving_doubling_allreduce``): MPICH does, unless the environment
    ``env`` (this process's by default) names another algorithm (``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM``)."""
    env = os.environ if env is None else env
    chosen = env.get("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", "auto").strip().lower()
    return "MPICH" in library_version and chosen in ("", "auto", "reduce_scatter_allgather")


def calibrate_inter(base: dict, comm, ranks_per_link: int = 1, name=None, host=None, multi_rail=None) -> dict:
    """Return ``base`` with its inter tier measured by a ping-pong between ranks 0 and 1 of ``comm``, on every
    rank (collective); the two must run on different hosts (``host``: this rank's, the host name by default).
    It also records whether this MPI library's allreduce is recursive halving then doubling
    (``halving_doubling_allreduce``) and ``multi_rail`` as told (the collectives the job will run, NCCL's on GPUs,
    cross a node on every NIC of a group's ranks: a ping-pong between two ranks cannot see that; None keeps the
    base's). A multi-rail job's allreduce is NCCL's, not this MPI library's: then no halving-doubling."""
    hosts = comm.allgather(host or socket.gethostname())
    # every rank sees the same host list, so every rank raises the same error (no rank is left waiting)
    if len(hosts) < 2:
        raise ValueError(f"plan calibrate --inter: needs 2 ranks or more (world size {len(hosts)})")
    if hosts[0] == hosts[1]:
        raise ValueError(f"plan calibrate --inter: ranks 0 and 1 are both on host {hosts[0]!r}: start them on two "
                         f"nodes (e.g. mpiexec -n 2 -hosts a,b)")
    from mpi4py import MPI
    points = measure_pingpong(comm, (0, 1))
    data = with_inter_tier(base, points, ranks_per_link, hosts[:2], name)
    rails = bool(base.get("multi_rail", False)) if multi_rail is None else bool(multi_rail)
    data["multi_rail"] = rails
    data["halving_doubling_allreduce"] = not rails and halving_doubling_allreduce(MPI.Get_library_version())
    return data


def _inter_main(argv):
    """``mpiexec -n 2 -hosts a,b python -m mpidist.plan.calibrate --inter BASE OUT``: rank 0 writes OUT."""
    import argparse

    from mpi4py import MPI

    from .profile import Profile
    parser = argparse.ArgumentParser(prog="python -m mpidist.plan.calibrate --inter",
                                     description="measure the link between the nodes of ranks 0 and 1 into a "
                                                 "profile's inter tier")
    parser.add_argument("base", help="profile JSON measured on one node (mpidist plan --calibrate)")
    parser.add_argument("out", help="write the profile with the measured inter tier here")
    parser.add_argument("--ranks-per-link", type=int, default=1, help="ranks per node sharing its link")
    parser.add_argument("--name", help="the written profile's name (default: the base's)")
    parser.add_argument("--multi-rail", action="store_true", default=None,
                        help="the job's collectives cross a node on all its ranks' NICs (NCCL on GPU nodes; "
                             "default: as in the base profile)")
    args = parser.parse_args(argv)
    with open(args.base) as f:
        base = json.load(f)
    data = calibrate_inter(base, MPI.COMM_WORLD, args.ranks_per_link, args.name, multi_rail=args.multi_rail)
    if MPI.COMM_WORLD.Get_rank() == 0:
        Profile.from_dict(data, where="calibrate --inter")   # what is written loads
        with open(args.out, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        print(f"mpidist plan: wrote {args.out}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--pingpong"]:
        from mpi4py import MPI
        points = measure_pingpong(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(points))
    elif sys.argv[1:] == ["--compute"]:
        _compute()
    elif sys.argv[1:] == ["--steps"]:
        _steps()
    elif sys.argv[1:] == ["--oversubscribed"]:
        from mpi4py import MPI
        result = measure_oversubscribed(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(result))
    elif sys.argv[1:2] == ["--inter"]:
        _inter_main(sys.argv[2:])
    else:
        sys.exit("usage: mpiexec -n 2 -hosts A,B python -m mpidist.plan.calibrate --inter BASE_PROFILE.json OUT.json "
                 "[--ranks-per-link K] [--name NAME] [--multi-rail] (or python -m mpidist plan --calibrate OUT)")
