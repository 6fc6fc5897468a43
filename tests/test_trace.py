"""mpidist.trace: Chrome trace files per rank and merged, events of known programs, the summary's numbers.

References: the program's own structure (a DDP's buckets: one allreduce each, of the bucket's bytes),
the pipeline bubble formula (p-1)/(m+p-1) for a stage of known, fixed cost, and interval arithmetic done
by hand on a synthetic trace.
"""

import io
import json
import os
import time
from contextlib import redirect_stdout

import numpy as np
import pytest

from mpidist import cli, collectives, trace
from mpidist.nn import GELU, Linear, Module, MSELoss, Sequential
from mpidist.nn.autograd import make_result
from mpidist.optim import SGD
from mpidist.parallel import DDP, Pipeline
from mpidist.trace import recorder as trace_recorder


def _shared_dir(comm, tmp_path):
    """One directory every rank writes into (rank 0's tmp_path: the ranks of these tests share a host)."""
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


def _model(widths, seed=0):
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [Linear(a, b, rng=np.random.default_rng(seed + i)), GELU()]
    return Sequential(*layers[:-1])


def _x_events(content):
    return [e for e in content["traceEvents"] if e.get("ph") == "X"]


def test_trace_files_are_chrome_json_with_a_row_per_rank(comm, tmp_path):
    directory = _shared_dir(comm, tmp_path)
    rank, size = comm.Get_rank(), comm.Get_size()
    model = DDP(_model([8, 16, 4]), comm)
    opt = SGD(model.parameters(), lr=0.1)
    trace.start(directory, comm, depth=1, run="test")
    assert trace.enabled()
    x = np.random.default_rng(rank).normal(size=(4, 8)).astype(np.float32)
    loss = MSELoss()(model(x), np.zeros((4, 4), np.float32))
    loss.backward()
    opt.step()
    merged = trace.stop()
    assert (merged is not None) == (rank == 0)
    with open(os.path.join(directory, f"rank{rank:05d}.json")) as f:
        own = json.load(f)
    assert own["otherData"]["rank"] == rank and own["otherData"]["size"] == size
    assert own["otherData"]["run"] == "test" and own["otherData"]["dropped"] == 0
    assert abs(own["otherData"]["clock_offset_s"]) < 0.05  # ranks of one host share a clock: offset ~0
    if rank != 0:
        return
    with open(merged) as f:
        content = json.load(f)
    events = _x_events(content)
    assert {e["pid"] for e in events} == set(range(size))
    names = {e["pid"]: e["args"]["name"] for e in content["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(size)}
    for e in events:
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
        assert e["tid"] in (trace.COMPUTE, trace.COMM, trace.IN_FLIGHT)
    assert min(e["ts"] for e in events) == 0
    for r in range(size):
        mine = {(e["cat"], e["name"]) for e in events if e["pid"] == r}
        # Forward and backward of the model (depth 0) and its layers (depth 1), the loss, the step.
        assert {("forward", "Sequential"), ("forward", "0"), ("forward", "1"), ("forward", "2"),
                ("backward", "Sequential"), ("backward", "0"), ("backward", "2"), ("forward", "MSELoss"),
                ("optimizer", "SGD.step")} <= mine
    for r in range(size):  # a rank's forward precedes its backward, which precedes its step
        first = {cat: min(e["ts"] for e in events if e["pid"] == r and e["cat"] == cat)
                 for cat in ("forward", "backward", "optimizer")}
        assert first["forward"] < first["backward"] < first["optimizer"]


def test_tracing_off_records_nothing(comm, tmp_path):
    # After stop the hooks are gone: a later step adds no event anywhere.
    directory = _shared_dir(comm, tmp_path)
    model = _model([4, 4])
    trace.start(directory, comm)
    trace.stop()
    comm.Barrier()
    assert not trace.enabled() and not trace_recorder._handles
    model(np.ones((2, 4), np.float32)).sum().backward()
    collectives.allreduce(np.ones(3), comm)
    assert trace_recorder._recorders == {}


@pytest.mark.world_sizes(2, 4)
def test_ddp_step_has_one_allreduce_per_bucket_with_its_bytes(comm, tmp_path):
    directory = _shared_dir(comm, tmp_path)
    rank = comm.Get_rank()
    inner = _model([32, 64, 64, 8])
    # Caps below every parameter's size: one bucket per parameter, launched in reverse parameter order.
    model = DDP(inner, comm, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    params = list(inner.parameters())
    assert len(model.buckets) == len(params)
    expected = [b.nbytes for b in model.buckets]
    stamp = expected[-1] - params[0].data.nbytes  # the last bucket carries the step check's slots too
    assert expected[:-1] == [p.data.nbytes for p in reversed(params)][:-1] and 0 < stamp <= 128
    steps = 2
    trace.start(directory, comm)
    for step in range(steps):
        x = np.random.default_rng(10 * step + rank).normal(size=(4, 32)).astype(np.float32)
        MSELoss()(model(x), np.zeros((4, 8), np.float32)).backward()
        model.zero_grad()
    merged = trace.stop()
    if rank != 0:
        return
    with open(merged) as f:
        events = _x_events(json.load(f))
    for r in range(comm.Get_size()):
        reduces = sorted((e for e in events if e["pid"] == r and e["cat"] == "comm" and "allreduce" in e["name"]),
                         key=lambda e: e["ts"])
        assert len(reduces) == steps * len(expected)
        assert [e["args"]["bytes"] for e in reduces] == expected * steps  # launched in bucket order
        assert all(e["tid"] == trace.IN_FLIGHT and 0 <= e["args"]["posted_us"] <= e["dur"] for e in reduces)


def _sleepy_linear(x, weight, f):
    """x @ W.T whose backward sleeps 2f: a stage of known cost (F = f, B = 2f), as in benchmarks/pipeline.py."""
    def backward_fn(g, needs):
        time.sleep(2 * f)
        return (g @ weight.data if needs[0] else None, g.T @ x.data if needs[1] else None)
    return make_result("SleepyLinear", x.data @ weight.data.T, (x, weight), backward_fn)


class _SleepStage(Module):
    def __init__(self, f, seed):
        super().__init__()
        self.f = f
        self.lin = Linear(4, 4, bias=False, rng=np.random.default_rng(seed), dtype=np.float64)

    def forward(self, x):
        time.sleep(self.f)
        return _sleepy_linear(x, self.lin.weight, self.f)


@pytest.mark.slow
@pytest.mark.world_sizes(2, 4)
def test_pipeline_bubble_from_the_trace_matches_the_formula(comm, tmp_path):
    directory = _shared_dir(comm, tmp_path)
    p, rank = comm.Get_size(), comm.Get_rank()
    # Every boundary crossing on the critical path (about 2m of them) adds the machine's scheduling latency L
    # (ms when loaded) to the idle time: a relative error of about 2mL / ((p-1) 3f), 3% at m = p = 4, f = 80 ms.
    m, f = p, 0.08
    pipe = Pipeline(_SleepStage(f, rank), comm, m, schedule="1f1b", loss_fn=MSELoss())
    x, y = np.ones((m, 4)), np.zeros((m, 4))
    trace.start(directory, comm)
    for _ in range(3):
        collectives.barrier(comm)
        pipe.step(x, y)
    merged = trace.stop()
    if rank != 0:
        return
    from mpidist.trace.analysis import analyze
    with open(merged) as f_:
        steps = analyze(json.load(f_))["pipeline"]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["ranks"] == p for s in steps)
    formula = (p - 1) / (m + p - 1)
    assert steps[0]["formula"] == pytest.approx(formula)
    measured = float(np.median([s["measured"] for s in steps]))
    assert abs(measured - formula) <= 0.1 * formula, (measured, formula)


@pytest.mark.world_sizes(2)
def test_a_nonblocking_collective_records_its_post_its_wait_and_its_end(comm, tmp_path):
    """start <= posted <= wait() called <= end; the caller computed (slept) 20 ms between posting and waiting."""
    directory = _shared_dir(comm, tmp_path)
    trace.start(directory, comm)
    x = np.full(1000, comm.Get_rank() + 1.0)
    handle = collectives.iallreduce(x, comm)
    time.sleep(0.02)
    handle.wait()
    merged = trace.stop()
    np.testing.assert_array_equal(x, np.full(1000, 3.0))
    if comm.Get_rank() != 0:
        return
    with open(merged) as f:
        events = [e for e in _x_events(json.load(f)) if e["cat"] == "comm" and "allreduce" in e["name"]]
    assert sorted(e["pid"] for e in events) == [0, 1]
    for e in events:
        args = e["args"]
        assert e["tid"] == trace.IN_FLIGHT and args["bytes"] == 8000
        assert 0 <= args["posted_us"] and args["posted_us"] + 20_000 <= args["wait_us"] <= e["dur"] + 1, args


def test_a_wait_inside_a_forward_counts_as_exposed_communication_not_compute():
    """FSDP waits for its prefetched gather inside a module's forward: that wait is not compute."""
    from mpidist.trace.analysis import analyze
    # forward 0-10 ms; an allgather posted at 2 ms (posting 0.5 ms), waited for from 6 ms, done at 9 ms.
    events = [{"ph": "X", "pid": 0, "tid": 0, "cat": "forward", "name": "block", "ts": 0, "dur": 10_000,
               "args": {"depth": 0}},
              {"ph": "X", "pid": 0, "tid": 2, "cat": "comm", "name": "iallgather", "ts": 2_000, "dur": 7_000,
               "args": {"comm": "world", "bytes": 8, "peer": -1, "seq": 0, "posted_us": 500, "wait_us": 4_000}}]
    numbers = analyze({"traceEvents": events})["ranks"][0]
    # compute = 10 - 0.5 (posting) - 3 (waiting) ms; communication 7 ms of which 3.5 ms exposed.
    assert numbers["compute"] == pytest.approx(6.5e-3) and numbers["communication"] == pytest.approx(7e-3)
    assert numbers["exposed"] == pytest.approx(3.5e-3) and numbers["overlap"] == pytest.approx(0.5)


def _synthetic_trace():
    """Two ranks with hand-made timings (microseconds) whose summary numbers are known."""
    def x(pid, tid, cat, name, ts, dur, **args):
        return {"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}
    events = [
        # rank 0: backward 0-10 ms; a nonblocking allreduce 4-14 ms whose posting took 1 ms.
        # compute = [0,4] + [5,10] = 9 ms (and 4 ms of pipeline actions below: 13 ms); communication = [4,14]
        # = 10 ms; exposed = [4,5] + [10,14] = 5 ms; overlap = 50%; span 0-31 ms (its step's end).
        x(0, 0, "backward", "model", 0, 10_000, depth=0),
        x(0, 2, "comm", "iallreduce", 4_000, 10_000, comm="world", bytes=4096, peer=-1, seq=0, posted_us=1_000),
        # rank 1: forward 0-6 ms, then a blocking allreduce 6-9 ms: compute 6 (+ 6 below: 12), comm 3,
        # exposed 3, overlap 0%; span 0-30.5 ms.
        x(1, 0, "forward", "model", 0, 6_000, depth=0),
        x(1, 1, "comm", "allreduce", 6_000, 3_000, comm="world", bytes=1 << 20, peer=-1, seq=0),
        # a pipeline step on both ranks: rank 0 busy 4 ms, rank 1 busy 6 ms over a 10 ms makespan
        # (first action at 20 ms, last end at 30 ms): bubble = mean(1 - 0.4, 1 - 0.6) = 0.5.
        x(0, 0, "pipeline step", "1f1b step 1", 19_000, 12_000, step=1, schedule="1f1b", p=2, m=2, v=1,
          bubble_formula=1 / 3),
        x(1, 0, "pipeline step", "1f1b step 1", 19_500, 11_000, step=1, schedule="1f1b", p=2, m=2, v=1,
          bubble_formula=1 / 3),
        x(0, 0, "pipeline", "0F0", 20_000, 1_000, kind="F", stage=0, microbatch=0, step=1),
        x(0, 0, "pipeline", "0B0", 27_000, 3_000, kind="B", stage=0, microbatch=0, step=1),
        x(1, 0, "pipeline", "1F0", 21_000, 2_000, kind="F", stage=1, microbatch=0, step=1),
        x(1, 0, "pipeline", "1B0", 23_000, 4_000, kind="B", stage=1, microbatch=0, step=1),
    ]
    return {"traceEvents": events, "otherData": {"ranks": [{"rank": 0, "dropped": 0}, {"rank": 1, "dropped": 7}]}}


def test_trace_summary_prints_the_known_numbers_of_a_synthetic_trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_synthetic_trace()))
    text = trace.summary(str(path), top=2)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["trace", "summary", str(path), "--top", "2"]) == 0
    assert out.getvalue() == (text + "\n" if cli._is_printer() else "")  # under mpiexec rank 0 prints
    lines = text.splitlines()
    rank0 = next(line.split() for line in lines if line.split()[:1] == ["0"])
    rank1 = next(line.split() for line in lines if line.split()[:1] == ["1"])
    # span, compute, comm, exposed (each "N ms"), overlap, dropped
    assert rank0[1:10:2] == ["31.000", "13.000", "10.000", "5.000", "50.0%"]
    assert rank1[1:10:2] == ["30.500", "12.000", "3.000", "3.000", "0.0%"]
    assert rank1[10] == "7"
    assert "bubble 0.500 measured (median of 1 steps), 0.333 by the schedule's formula" in text
    slowest = text[text.index("slowest communication"):].splitlines()
    assert "iallreduce 4.0 KiB on world 10.000 ms" in slowest[1] and "allreduce 1.0 MiB" in slowest[2]


def test_trace_summary_refuses_what_is_not_a_trace(tmp_path):
    (tmp_path / "rank00000.json").write_text("{\"not\": 1}")
    with pytest.raises(ValueError, match="rank00000.json is not a Chrome trace"):
        trace.summary(str(tmp_path))
    assert cli.main(["trace", "summary", str(tmp_path)]) == 1


def test_start_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="depth must be an int >= 0"):
        trace.start(str(tmp_path), depth=-1)
    with pytest.raises(ValueError, match=r"limit must be an int >= 1 \(got 0\)"):
        trace.start(str(tmp_path), limit=0)
    with pytest.raises(RuntimeError, match="not started"):
        trace.stop()


def test_the_ring_keeps_the_last_events_and_counts_the_dropped(comm, tmp_path):
    directory = _shared_dir(comm, tmp_path)
    rank = comm.Get_rank()
    trace.start(directory, comm, limit=16)
    for i in range(40):
        with trace.span(f"work {i}"):
            pass
    trace.stop()
    with open(os.path.join(directory, f"rank{rank:05d}.json")) as f:
        content = json.load(f)
    names = [e["name"] for e in _x_events(content)]
    assert names == [f"work {i}" for i in range(24, 40)]
    assert content["otherData"]["events"] == 16 and content["otherData"]["dropped"] == 24


def test_a_reused_input_keeps_no_hooks_and_each_backward_is_one_event(tmp_path):
    # A leaf input that requires grad keeps hooks across backwards: tracing must remove its own once used.
    from mpi4py import MPI
    from mpidist.nn.autograd import Tensor
    model = _model([4, 4, 4])
    x = Tensor(np.ones((2, 4), np.float32), requires_grad=True)
    trace.start(str(tmp_path), MPI.COMM_SELF, depth=1)  # this process alone, under mpiexec too
    for _ in range(3):
        model(x).sum().backward()
    assert not x._hooks
    merged = trace.stop()
    with open(merged) as f:
        events = _x_events(json.load(f))
    backward = [e["name"] for e in events if e["cat"] == "backward"]
    assert sorted(backward) == sorted(["Sequential", "0", "1", "2"] * 3)


def test_plot_draws_a_png_of_the_synthetic_trace(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_synthetic_trace()))
    png = tmp_path / "timeline.png"
    with redirect_stdout(io.StringIO()):
        assert cli.main(["trace", "summary", str(path), "--plot", str(png)]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.world_sizes(2, 4)
def test_clock_offset_is_measured_within_half_a_round_trip(comm):
    from mpidist.trace.clock import measure_offset
    rank = comm.Get_rank()
    skew = 3.0 * rank  # this rank's clock runs 3 s per rank ahead of rank 0's

    def skewed():
        return time.monotonic() + skew
    offset, round_trip = measure_offset(comm, rounds=8, clock=skewed)
    if rank == 0:
        assert (offset, round_trip) == (0.0, 0.0)
    else:
        assert 0 < round_trip < 1.0
        assert abs(offset - (-skew)) <= round_trip / 2 + 1e-6


def test_checkpoint_save_and_load_are_io_events_around_their_writes(comm, tmp_path):
    """Checkpoint I/O shows as one 'io' event per rank and call (not counted as compute by the summary)."""
    from mpidist import checkpoint
    directory = _shared_dir(comm, tmp_path)
    root = os.path.join(directory, "ckpt")
    model = DDP(_model([4, 8, 2]), comm)
    trace.start(os.path.join(directory, "trace"), comm)
    checkpoint.save(root, {"model": model}, comm, step=3)
    checkpoint.load(root, {"model": model}, comm, log=None)
    merged = trace.stop()
    if comm.Get_rank() != 0:
        return
    with open(merged) as f:
        events = _x_events(json.load(f))
    for r in range(comm.Get_size()):
        io = sorted((e for e in events if e["pid"] == r and e["cat"] == "io"), key=lambda e: e["ts"])
        assert [(e["name"], e["args"]["step"]) for e in io] == [("checkpoint save", 3), ("checkpoint load", None)]
        save, load = io
        assert save["dur"] > 0 and save["ts"] + save["dur"] <= load["ts"]
