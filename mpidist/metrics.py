"""Training metrics: one row per logged step, agreed by every rank, written by rank 0.

``Logger(comm, directory, flops_per_sample=...)``; then ``logger.log(step, loss, samples=...)`` on every rank
(it is collective: one small allgather). Rank 0 appends the row to ``DIR/metrics.jsonl`` and ``DIR/metrics.csv``,
to TensorBoard event files when ``tensorboardX`` is installed, and prints a progress line (a tqdm bar when
tqdm is installed and stdout is a terminal).

Columns:
- step, time_s (since the logger was made), interval_s (since the previous row was agreed), loss (mean over
  the ranks that have one), samples_per_s and tokens_per_s (all ranks' samples or tokens over interval_s);
- mfu: model flops per second over the ranks' summed matmul peak, ``flops_per_sample`` (or per token) being the
  model's training flops (e.g. ``6 * parameters`` per token; ``GPT.flops_per_token``), the peak measured on each
  rank at start as the best rate of a float32 matmul (``peak_flops=`` overrides);
- comm_share: share of the interval this rank spent with a collective or point-to-point call in progress,
  averaged over ranks; comm_bytes: the payload bytes of those calls, summed over ranks. Both are read from
  the flight recorder (``guard.record``): they cover its last ``flight_size`` calls (MPIDIST_FLIGHT_SIZE);
- memory_bytes_rank{r}: each rank's bytes by the wrapper's own accounting (``memory=``: a callable returning
  bytes, or a parallel wrapper (``mpidist.parallel.interface.Wrapper``: DDP, FSDP, Pipeline), whose
  ``memory_stats()["peak_bytes"]`` is used), when given.
"""

import csv
import json
import os
import sys
import time

import numpy as np

from . import collectives
from .comm import is_simulated
from .guard import record as _record
from .parallel.interface import Wrapper

__all__ = ["Logger", "measure_matmul_peak"]


def measure_matmul_peak(n=512, repeats=5):
    """Return this process's best float32 matmul rate in flop/s over ``repeats`` products of n x n matrices."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)
    np.matmul(a, b, out=out)  # warm-up: first-call allocations and thread start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def _positive(name, value):
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"metrics.Logger: {name} must be a positive number (got {value!r})")


class Logger:
    """Per-step metrics agreed over ``comm`` and written by its rank 0 (see the module's columns)."""

    _FIELDS = ("loss", "samples", "tokens", "comm_s", "comm_bytes", "memory", "peak", "has_memory")

    def __init__(self, comm, directory=None, *, flops_per_sample=None, flops_per_token=None, peak_flops=None,
                 memory=None, comms=None, tensorboard=True, progress=True, total_steps=None, stream=None):
        if flops_per_sample is not None and flops_per_token is not None:
            raise ValueError("metrics.Logger: give flops_per_sample or flops_per_token, not both")
        for name, value in (("flops_per_sample", flops_per_sample), ("flops_per_token", flops_per_token),
                            ("peak_flops", peak_flops)):
            _positive(name, value)
        if memory is not None and not callable(memory) and not isinstance(memory, Wrapper):
            raise TypeError(f"metrics.Logger: memory must be a callable returning bytes or a parallel wrapper "
                            f"(got {type(memory).__name__})")
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.directory = directory
        self.flops_per_sample, self.flops_per_token = flops_per_sample, flops_per_token
        self.peak = float(peak_flops) if peak_flops is not None else measure_matmul_peak()
        self._memory = memory
        # Whose calls count as this rank's: under MPI every call this process made; simulated ranks share a
        # process (and its flight recorder), so there only calls on these communicators count.
        self._comms = None if comms is None and not is_simulated(comm) else list(comms or [comm])
        self._started = self._last = time.monotonic()
        self._stream = stream if stream is not None else sys.stdout
        self.rows = []
        self._jsonl = self._csv = self._csv_writer = self._tensorboard = self._bar = None
        if self.rank != 0:
            return
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._jsonl = open(os.path.join(directory, "metrics.jsonl"), "a")
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter
                except ImportError:
                    pass  # optional (pip install mpidist[metrics]): JSONL and CSV carry the same rows
                else:
                    self._tensorboard = SummaryWriter(os.path.join(directory, "tensorboard"))
        if progress and total_steps is not None and getattr(self._stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total_steps, file=self._stream, dynamic_ncols=True)
        self._progress = progress

    # -- this rank's share of the interval --------------------------------------------------------------
    def _communication(self, since, now):
        """Return (seconds with a call in progress, payload bytes) of this rank's calls in (since, now]."""
        intervals, nbytes = [], 0
        for rec in _record.snapshot():
            end = rec[_record.END]
            if end is None or end <= since:
                continue
            if self._comms is not None and not any(rec[_record.COMM].owner() is c for c in self._comms):
                continue
            intervals.append((max(rec[_record.START], since), min(end, now)))
            nbytes += max(rec[_record.BYTES], 0)
        covered, reach = 0.0, since
        for start, end in sorted(intervals):
            start = max(start, reach)
            if end > start:
                covered += end - start
                reach = end
        return covered, nbytes

    def _memory_bytes(self):
        if self._memory is None:
            return None
        if isinstance(self._memory, Wrapper):  # first: a wrapper (FSDP) is callable too, as the model
            return float(self._memory.memory_stats()["peak_bytes"])
        return float(self._memory())

    def log(self, step, loss, samples=None, tokens=None, **extra):
        """Agree on one row over every rank and write it (collective); return the row (a dict) on every rank.

        ``loss``: this rank's loss (a number; None where a rank holds none, e.g. pipeline stages before the
        last); ``samples``/``tokens``: processed by this rank since the previous row. ``extra``: numbers rank
        0 adds to its row as they are (learning rate, gradient norm).
        """
        now = time.monotonic()
        comm_s, comm_bytes = self._communication(self._last, now)
        memory = self._memory_bytes()
        mine = np.array([[np.nan if loss is None else float(loss), samples or 0, tokens or 0, comm_s, comm_bytes,
                          np.nan if memory is None else memory, self.peak, memory is not None]], dtype=np.float64)
        table = collectives.allgather(mine, self.comm, out=np.empty((self.size, len(self._FIELDS))))
        column = dict(zip(self._FIELDS, table.T))
        elapsed = max(now - self._last, 1e-12)
        self._last = time.monotonic()  # after the allgather: the next row does not count the logger's own call
        losses = column["loss"][~np.isnan(column["loss"])]
        row = {"step": int(step), "time_s": round(now - self._started, 6), "interval_s": elapsed,
               "loss": float(losses.mean()) if losses.size else None}
        samples_total, tokens_total = float(column["samples"].sum()), float(column["tokens"].sum())
        if samples_total:
            row["samples_per_s"] = samples_total / elapsed
        if tokens_total:
            row["tokens_per_s"] = tokens_total / elapsed
        flops = (self.flops_per_sample * samples_total if self.flops_per_sample is not None else
                 self.flops_per_token * tokens_total if self.flops_per_token is not None else None)
        if flops:
            row["mfu"] = flops / elapsed / float(column["peak"].sum())
        row["comm_share"] = float(np.mean(column["comm_s"])) / elapsed
        row["comm_bytes"] = int(column["comm_bytes"].sum())
        if column["has_memory"].all():
            row.update({f"memory_bytes_rank{r}": int(b) for r, b in enumerate(column["memory"])})
        row.update(extra)
        self.rows.append(row)
        if self.rank == 0:
            self._write(row)
        return row

    # -- rank 0's outputs ----------------------------------------------------------------------------------
    def _write(self, row):
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
            if self._csv_writer is None or set(row) - set(self._csv_writer.fieldnames):
                self._open_csv(row)
            self._csv_writer.writerow(row)
            self._csv.flush()
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key, value, row["step"])
        if not self._progress:
            return
        text = self.format(row)
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(row["step"] - self._bar.n)
        else:
            print(text, file=self._stream, flush=True)

    def _open_csv(self, row):
        # A row with a new column (memory appears, an extra) rewrites the header: CSV readers need one.
        fields = list(row) if self._csv_writer is None else \
            list(self._csv_writer.fieldnames) + [k for k in row if k not in self._csv_writer.fieldnames]
        if self._csv is not None:
            self._csv.close()
        rows = self.rows[:-1]
        self._csv = open(os.path.join(self.directory, "metrics.csv"), "w", newline="")
        self._csv_writer = csv.DictWriter(self._csv, fieldnames=fields, restval="")
        self._csv_writer.writeheader()
        self._csv_writer.writerows(rows)

    @staticmethod
    def format(row):
        """Return the progress line of ``row``: step, loss, throughput, MFU, communication share."""
        parts = [f"step {row['step']}"]
        if row.get("loss") is not None:
            parts.append(f"loss {row['loss']:.4f}")
        if "tokens_per_s" in row:
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        elif "samples_per_s" in row:
            parts.append(f"{row['samples_per_s']:,.1f} samples/s")
        if "mfu" in row:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        parts.append(f"comm {100 * row['comm_share']:.1f}%")
        return " | ".join(parts)

    def close(self):
        """Close rank 0's files, TensorBoard writer and progress bar."""
        for handle in (self._jsonl, self._csv, self._tensorboard, self._bar):
            if handle is not None:
                handle.close()
        self._jsonl = self._csv = self._csv_writer = self._tensorboard = self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
