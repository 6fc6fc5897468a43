"""mpidist.metrics.Logger: rows agreed over ranks against numpy on every rank's inputs, and rank 0's files."""

import csv
import io
import json
import os
import time

import numpy as np
import pytest

from mpidist import collectives
from mpidist.metrics import Logger, measure_matmul_peak


def _shared_dir(comm, tmp_path):
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


def test_rows_agree_with_every_ranks_inputs(comm, tmp_path):
    directory = _shared_dir(comm, tmp_path)
    rank, size = comm.Get_rank(), comm.Get_size()
    stream = io.StringIO()
    logger = Logger(comm, directory, flops_per_sample=1e6, peak_flops=1e9, memory=lambda: 1000 * (rank + 1),
                    stream=stream)
    x = np.ones(256, np.float32)
    rows = []
    for step in range(1, 4):
        for _ in range(step):  # step k: k allreduces of 1 KiB on every rank
            collectives.allreduce(x, comm)
        time.sleep(0.01)
        rows.append(logger.log(step, loss=float(rank + step), samples=8 * (rank + 1), lr=0.5))
    logger.close()
    losses = np.array([[r + s for r in range(size)] for s in range(1, 4)], dtype=float)
    samples = sum(8 * (r + 1) for r in range(size))
    for step, row in enumerate(rows, start=1):
        assert row["step"] == step and row["lr"] == 0.5
        assert row["loss"] == pytest.approx(losses[step - 1].mean())
        assert row["comm_bytes"] == size * step * x.nbytes  # the logger's own allgather is not counted
        assert 0 < row["comm_share"] < 1
        assert [row[f"memory_bytes_rank{r}"] for r in range(size)] == [1000 * (r + 1) for r in range(size)]
        # MFU = model flops per second over the summed peak of the ranks
        assert row["mfu"] == pytest.approx(row["samples_per_s"] * 1e6 / (size * 1e9))
        assert row["samples_per_s"] == pytest.approx(samples / row["interval_s"])
        assert 0.01 <= row["interval_s"] <= rows[-1]["time_s"]  # it holds the sleep
    if rank != 0:
        assert stream.getvalue() == ""  # only rank 0 prints
        return
    # Rank 0 wrote every row to JSONL and CSV, and printed plain lines (the stream is not a terminal).
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == rows
    with open(os.path.join(directory, "metrics.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in table] == [r["loss"] for r in rows]
    assert [int(r["comm_bytes"]) for r in table] == [r["comm_bytes"] for r in rows]
    assert stream.getvalue().splitlines() == [Logger.format(r) for r in rows]
    assert stream.getvalue().splitlines()[0].startswith(f"step 1 | loss {losses[0].mean():.4f} |")


def test_ranks_without_a_loss_are_left_out_of_the_mean(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    logger = Logger(comm, peak_flops=1.0, progress=False)
    row = logger.log(1, loss=2.0 if rank == size - 1 else None)  # a pipeline: only the last stage has one
    assert row["loss"] == 2.0 and "samples_per_s" not in row and "mfu" not in row


def test_logger_refuses_bad_arguments(comm):
    with pytest.raises(ValueError, match="flops_per_sample or flops_per_token, not both"):
        Logger(comm, flops_per_sample=1, flops_per_token=1, peak_flops=1)
    with pytest.raises(ValueError, match=r"peak_flops must be a positive number \(got -1\)"):
        Logger(comm, peak_flops=-1)
    with pytest.raises(TypeError, match="memory must be a callable"):
        Logger(comm, peak_flops=1, memory=5)


def test_matmul_peak_is_the_best_of_the_timed_products(monkeypatch):
    """The rate is 2 n^3 over the fastest of ``repeats`` timed products (a fake clock: no timing in a unit test)."""
    import types
    from mpidist import metrics
    durations = iter([0.5, 0.2, 0.3])
    ticks = []

    def perf_counter():  # start, end pairs: each end is its start plus the next duration
        ticks.append(ticks[-1] + next(durations) if len(ticks) % 2 else float(len(ticks)))
        return ticks[-1]

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=perf_counter))
    n = 64
    assert measure_matmul_peak(n, repeats=3) == pytest.approx(2 * n ** 3 / 0.2)
    assert len(ticks) == 6


def test_memory_from_a_wrapper_with_memory_stats(comm):
    """A wrapper that is callable (FSDP is, like the model) gives its accounted peak, never a forward call."""
    from mpidist.nn import Linear, Sequential
    from mpidist.parallel import FSDP
    fsdp = FSDP(Sequential(Linear(4, 8, rng=np.random.default_rng(0)), Linear(8, 2, rng=np.random.default_rng(1))),
                comm)
    fsdp(np.ones((2, 4), np.float32)).sum().backward()
    logger = Logger(comm, peak_flops=1e9, memory=fsdp, progress=False, stream=io.StringIO())
    row = logger.log(1, loss=1.0, samples=1)
    logger.close()
    peaks = comm.allgather(fsdp.memory_stats()["peak_bytes"])
    assert [row[f"memory_bytes_rank{r}"] for r in range(comm.Get_size())] == peaks
