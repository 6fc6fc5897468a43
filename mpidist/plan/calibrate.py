"""``mpidist plan --calibrate``: measure this machine's matmul curve, memory bandwidth and link alpha-beta.

Matmuls and memory bandwidth are timed in this process (one BLAS thread, as ranks run); the intra-node link is
timed by a ping-pong between two ranks started with ``mpiexec -n 2`` (this module run as a program), fitting
time = alpha + bytes / bandwidth over message sizes. The inter-node tier is the intra one unless a measured
link is given (``--inter-latency``/``--inter-bandwidth``, e.g. the virtual cluster's shaped link from
benchmarks/cluster.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

__all__ = ["measure_matmul_curve", "measure_memory_bandwidth", "measure_link", "calibrate"]


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


def _pingpong():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = []
    for size in (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22):
        buf = np.zeros(size, dtype=np.uint8)
        reps = 20 if size < (1 << 20) else 5
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                comm.Send(buf, 1)
                comm.Recv(buf, 1)
            else:
                comm.Recv(buf, 0)
                comm.Send(buf, 0)
        out.append((size, (time.perf_counter() - t0) / (2 * reps)))
    if rank == 0:
        print(json.dumps(out))


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
    measured = _run_measurement([sys.executable, "-m", "mpidist.plan.calibrate", "--steps"])
    data["compute_scale"], data["fit"] = fit_compute_scale(data, measured)
    return data


# The declared calibration subset of compute_scale: one-rank steps of these shapes (no communication).
CALIBRATION_RUNS = [({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 32}, 8),
                    ({"layers": 2, "hidden": 128, "heads": 4, "vocab": 256, "seq": 64}, 8)]


def _steps():
    """Print the median seconds of one-rank training steps of ``CALIBRATION_RUNS`` (real LayoutRuns)."""
    from mpi4py import MPI

    from .execute import LayoutRun
    from .layouts import Layout
    from .model import ModelShape
    out = []
    for dims, batch in CALIBRATION_RUNS:
        run = LayoutRun(ModelShape(**dims), Layout(1, 1, 1, micro_batch=batch), MPI.COMM_SELF)
        run.step()
        out.append(float(np.median([run.step() for _ in range(5)])))
    print(json.dumps(out))


def fit_compute_scale(profile_data, measured):
    """Return (compute_scale, fit record): the geometric mean of measured / modelled step times of the runs."""
    from .estimate import estimate
    from .layouts import Layout
    from .model import ModelShape
    from .profile import Profile
    profile = Profile.from_dict(dict(profile_data, compute_scale=1.0))
    ratios = []
    for (dims, batch), seconds in zip(CALIBRATION_RUNS, measured):
        modelled = estimate(ModelShape(**dims), Layout(1, 1, 1, micro_batch=batch), profile, 1).time["step"]
        ratios.append(seconds / modelled)
    scale = float(np.exp(np.mean(np.log(ratios))))
    return scale, {"compute_scale": {"value": scale, "runs": [dict(d, batch=b) for d, b in CALIBRATION_RUNS],
                                     "measured_s": measured, "ratios": ratios}}


if __name__ == "__main__":
    if sys.argv[1:] == ["--pingpong"]:
        _pingpong()
    elif sys.argv[1:] == ["--compute"]:
        _compute()
    elif sys.argv[1:] == ["--steps"]:
        _steps()
