"""Collective benchmarks: mpidist next to raw mpi4py, in the same run, reported like nccl-tests.

Glossary (nccl-tests' definitions, so numbers compare with theirs):
- size: bytes of the operation's full buffer: the reduced array (allreduce, bcast), the gathered
  output (allgather), the input before scattering (reduce_scatter), the message (sendrecv).
- time: seconds per call, OSU style: warm-up calls, a barrier, many timed calls, the median over
  repetitions on each rank, then the maximum over ranks (the slowest rank is the collective's time).
- algbw: size / time. busbw: algbw times the op's bus factor (``BUS_FACTOR``), which makes the
  number comparable to the link bandwidth whatever the rank count.

mpidist and raw mpi4py run interleaved (alternating which goes first in each repetition), so both
see the same machine state; the ratio mpidist busbw / raw busbw is mpidist's overhead.
"""

import csv
import dataclasses
import io
import re
import statistics
import time

import numpy as np
from mpi4py import MPI

from . import collectives
from . import xp as _xp
from .files import write_text_atomic

__all__ = ["OPS", "BUS_FACTOR", "BenchError", "Result", "parse_sizes", "format_size", "run", "table",
           "write_json", "write_csv", "plot", "device_module", "FIELDS"]

OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast", "sendrecv")
# nccl-tests' bus factors for n ranks (their doc/PERFORMANCE.md).
BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "bcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
FIELDS = ("op", "bytes", "count", "type", "ranks", "iters", "mpidist_us", "mpidist_algbw", "mpidist_busbw",
          "raw_us", "raw_algbw", "raw_busbw", "ratio")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


class BenchError(ValueError):
    """A benchmark request that cannot run (bad sizes, no GPU, missing matplotlib)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """One op at one size: times in seconds, bandwidths in GB/s (1e9 bytes/s)."""

    op: str
    bytes: int
    count: int
    type: str
    ranks: int
    iters: int
    mpidist_s: float
    raw_s: float

    def row(self):
        """Return the result as a flat dict with the nccl-tests columns for both implementations."""
        factor = BUS_FACTOR[self.op](self.ranks)
        row = {"op": self.op, "bytes": self.bytes, "count": self.count, "type": self.type, "ranks": self.ranks,
               "iters": self.iters}
        for name, seconds in (("mpidist", self.mpidist_s), ("raw", self.raw_s)):
            algbw = self.bytes / seconds / 1e9
            row.update({f"{name}_us": seconds * 1e6, f"{name}_algbw": algbw, f"{name}_busbw": algbw * factor})
        row["ratio"] = self.raw_s / self.mpidist_s  # = mpidist busbw / raw busbw
        return row


def _parse_size(text):
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise BenchError(f"--sizes: cannot read {text!r} as a size (examples: 8, 64K, 1M, 2GiB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(spec):
    """Return byte sizes from ``START:STOP`` (doubling), ``START:STOP:FACTOR`` or a list ``8,1K,1M``."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise BenchError(f"--sizes: expected START:STOP or START:STOP:FACTOR (got {spec!r})")
        start, stop = _parse_size(parts[0]), _parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].strip().isdigit() else (2 if len(parts) == 2 else 0)
        if start < 1 or stop < start or factor < 2:
            raise BenchError(f"--sizes: need 1 <= START <= STOP and an integer FACTOR >= 2 (got {spec!r})")
        sizes = []
        while start <= stop:
            sizes.append(start)
            start *= factor
        return sizes
    sizes = [_parse_size(s) for s in spec.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        raise BenchError(f"--sizes: need at least one size >= 1 byte (got {spec!r})")
    return sizes


def format_size(nbytes):
    """Return ``nbytes`` as 8, 64K, 16M (powers of 1024)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def device_module():
    """Return cupy when a CUDA GPU is usable, else raise ``BenchError`` saying what is missing."""
    cupy = _xp.get_cupy()
    if cupy is None:
        raise BenchError("--device gpu: cupy is not installed (pip install 'mpidist[gpu]')")
    if _xp.gpu_count() == 0:
        raise BenchError("--device gpu: cupy is installed but sees no usable CUDA GPU")
    return cupy


def default_iters(nbytes):
    """Return OSU-like iterations per repetition: many for small messages, a few for 64 MiB."""
    return int(min(1000, max(5, (64 << 20) // max(nbytes, 1))))


# -- one op at one size: the two implementations as zero-argument callables ------------------------
def _element_count(op, nbytes, itemsize, n):
    count = max(1, nbytes // itemsize)
    if op in ("allgather", "reduce_scatter", "alltoall"):
        count = max(n, count // n * n)  # every rank's share must be whole elements
    return count


def _setup(op, count, dtype, comm, xp):
    """Return (mpidist call, raw mpi4py call, sync) for ``op`` on ``count`` elements of ``dtype``."""
    n, rank = comm.Get_size(), comm.Get_rank()
    # Zeros: sums stay finite however many times the same buffer is reduced.
    x = xp.zeros(count, dtype=dtype)
    if xp is np:
        stage, unstage, sync = (lambda a: a), (lambda host, a: None), (lambda: None)
    else:
        # The raw baseline stages through host memory by hand: neither PyPI MPI is CUDA-aware.
        def stage(a):
            return a.get()

        def unstage(host, a):
            a.set(host)

        def sync():
            xp.cuda.get_current_stream().synchronize()

    if op == "allreduce":
        def raw():
            h = stage(x)
            comm.Allreduce(MPI.IN_PLACE, h, op=MPI.SUM)
            unstage(h, x)
        return (lambda: collectives.allreduce(x, comm)), raw, sync
    if op == "bcast":
        def raw():
            h = stage(x)
            comm.Bcast(h, root=0)
            unstage(h, x)
        return (lambda: collectives.broadcast(x, comm)), raw, sync
    if op == "allgather":
        part, out = x[: count // n], xp.empty(count, dtype=dtype)
        host_out = np.empty(count, dtype=dtype)

        def raw():
            comm.Allgather(stage(part), host_out)
            unstage(host_out, out)
        return (lambda: collectives.allgather(part, comm, out=out)), raw, sync
    if op == "reduce_scatter":
        host_out = np.empty(count // n, dtype=dtype)
        out = xp.empty(count // n, dtype=dtype)

        def raw():
            comm.Reduce_scatter_block(stage(x), host_out, op=MPI.SUM)
            unstage(host_out, out)
        return (lambda: collectives.reduce_scatter(x, comm)), raw, sync
    if op == "alltoall":
        # nccl-tests' alltoall: every rank sends count / n elements to each rank.
        host_out = np.empty(count, dtype=dtype)
        out = host_out.copy() if xp is np else None

        def raw():
            comm.Alltoall(stage(x), host_out)
            unstage(host_out, x)
        return (lambda: collectives.alltoall(x, comm, out=out)), raw, sync
    if op == "sendrecv":
        # nccl-tests' sendrecv: every rank sends to the next and receives from the previous (a ring).
        dest, source = (rank + 1) % n, (rank - 1) % n
        host_in = np.empty(count, dtype=dtype)
        y = xp.empty(count, dtype=dtype)

        def with_mpidist():
            handle = collectives.isend(x, dest, comm)
            collectives.recv(source, comm, out=y)
            handle.wait()

        def raw():
            comm.Sendrecv(stage(x), dest, recvbuf=host_in, source=source)
            unstage(host_in, y)
        return with_mpidist, raw, sync
    raise BenchError(f"unknown op {op!r} (expected one of {', '.join(OPS)})")


def _time_pair(calls, comm, iters, warmup, reps, sync):
    """Return the per-call seconds of each callable: median over reps per rank, max over ranks."""
    for call in calls:
        for _ in range(warmup):
            call()
        sync()
    samples = [[] for _ in calls]
    for rep in range(reps):
        # Alternate which implementation goes first, so neither always runs on a warmer machine.
        order = range(len(calls)) if rep % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                calls[i]()
            sync()
            samples[i].append((time.perf_counter() - t0) / iters)
    local = np.array([statistics.median(s) for s in samples])
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    return [float(t) for t in slowest]


def run(ops, sizes, comm, *, dtype="float32", device="cpu", iters=None, warmup=None, reps=5, progress=None):
    """Measure each op at each size (bytes) with mpidist and raw mpi4py; return ``Result``s in order.

    ``iters=None`` picks ``default_iters(size)``. ``progress(result)`` is called after each size.
    """
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise BenchError(f"unknown op {unknown[0]!r} (expected one of {', '.join(OPS)})")
    if device not in ("cpu", "gpu"):
        raise BenchError(f"--device: expected cpu or gpu (got {device!r})")
    if reps < 1 or (iters is not None and iters < 1):
        raise BenchError(f"--iters and --reps must be >= 1 (got iters {iters}, reps {reps})")
    xp = device_module() if device == "gpu" else np
    dtype = np.dtype(dtype)
    n = comm.Get_size()
    results = []
    for op in ops:
        for nbytes in sizes:
            count = _element_count(op, nbytes, dtype.itemsize, n)
            k = iters or default_iters(count * dtype.itemsize)
            w = warmup if warmup is not None else max(2, k // 10)
            with_mpidist, raw, sync = _setup(op, count, dtype, comm, xp)
            t_mpidist, t_raw = _time_pair([with_mpidist, raw], comm, k, w, reps, sync)
            result = Result(op, count * dtype.itemsize, count, dtype.name, n, k, t_mpidist, t_raw)
            results.append(result)
            if progress is not None:
                progress(result)
    return results


# -- reporting --------------------------------------------------------------------------------------
_HEADER = (f"{'size':>10} {'count':>10} {'type':>8} | {'time(us)':>10} {'algbw':>7} {'busbw':>7} |"
           f" {'time(us)':>10} {'algbw':>7} {'busbw':>7} | {'ratio':>5}")


def table_header(op, ranks):
    """Return the header lines printed above one op's rows."""
    title = f"# {op} on {ranks} ranks; bandwidths in GB/s; ratio = mpidist busbw / raw mpi4py busbw"
    groups = f"{'':>31} | {'mpidist':^26} | {'raw mpi4py':^26} |"
    return "\n".join([title, groups, _HEADER])


def table_row(result):
    """Return one nccl-tests style line for ``result``."""
    r = result.row()
    return (f"{r['bytes']:>10} {r['count']:>10} {r['type']:>8} | {r['mpidist_us']:>10.2f} {r['mpidist_algbw']:>7.3f}"
            f" {r['mpidist_busbw']:>7.3f} | {r['raw_us']:>10.2f} {r['raw_algbw']:>7.3f} {r['raw_busbw']:>7.3f} |"
            f" {r['ratio']:>5.2f}")


def table(results):
    """Return the whole nccl-tests style table, one block per op."""
    lines, op = [], None
    for result in results:
        if result.op != op:
            op = result.op
            lines.append(table_header(op, result.ranks))
        lines.append(table_row(result))
    return "\n".join(lines)


def write_json(path, results, meta=None):
    """Write ``{"meta": ..., "rows": [...]}`` with one row per (op, size)."""
    import json
    write_text_atomic(path, json.dumps({"meta": meta or {}, "rows": [r.row() for r in results]}, indent=1))


def write_csv(path, results):
    """Write one CSV row per (op, size) with the columns in ``FIELDS``."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=FIELDS)
    writer.writeheader()
    for r in results:
        writer.writerow(r.row())
    write_text_atomic(path, text.getvalue())


def require_matplotlib():
    """Import and return matplotlib.pyplot (Agg backend), or raise ``BenchError`` saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot: matplotlib is not installed (pip install 'mpidist[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(path, results, title=""):
    """Draw busbw against message size, mpidist next to raw mpi4py, one panel per op; save to ``path``."""
    plt = require_matplotlib()
    ops = list(dict.fromkeys(r.op for r in results))
    cols = min(len(ops), 3)
    rows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        mine = [r for r in results if r.op == op]
        x = [r.bytes for r in mine]
        ax.plot(x, [r.row()["raw_busbw"] for r in mine], "o-", color="0.55", label="raw mpi4py", markersize=3)
        ax.plot(x, [r.row()["mpidist_busbw"] for r in mine], "s--", color="tab:blue", label="mpidist", markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op} ({mine[0].ranks} ranks, {mine[0].type})", fontsize=10)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: format_size(int(v)) if v >= 1 else ""))
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
