"""The GPU paths on the CPU: a numpy-backed fake device (tests/fake_device.py), numpy references.

What runs where:
- staged, cuda_aware (fake MPI that takes the fake memory) and nccl (fake NCCL over MPI) run on
  SimComm and under ``mpiexec --with-mpi``;
- ipc and hierarchical run on SimComm only: fake IPC maps a peer's numpy memory through a
  process-global registry, which cannot span the processes of a real MPI job (there, opening a
  peer's handle fails and selection falls back to staged, which is tested too).
Nothing here touches CUDA; docs/gpu.md lists what has run on a real GPU (nothing yet).
"""

import contextlib
import logging

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
import mpidist.xp
from mpidist import gpu
from mpidist.gpu.probe import MPIProbe, find_mpi_library, probe_mpi_cuda_support
from mpidist.gpu.staged import chunk_bounds

from mpidist import nn, optim
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import comm_hooks
from mpidist.parallel.ddp import DDP
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel.full_state import full_state_dict
from mpidist.ring16 import iring_allreduce_16, ring_allreduce_16, ring_reduce_scatter_16

from helpers import ring_reference
from fake_device import FakeCupyArray, FakeDevice, FakeDeviceArray, FakeSegfault, RecordingComm, install_fake_cupy, to_fake_cupy
from test_collectives import valid_ops
from test_collectives import assert_matches, rank_input, reference
from test_collectives import assert_nan_propagated, float16_overflow_case, nan_inputs

YES = MPIProbe("libmpi-fake.so", "MPIX_GPU_query_support", True)
NO = MPIProbe("libmpi-fake.so", "MPIX_GPU_query_support", False)
TINY_CHUNKS = gpu.Settings(chunk_bytes=24)  # 3 float64 per chunk: many chunks from small arrays


@pytest.fixture(autouse=True)
def fake_arrays_are_device_arrays(monkeypatch):
    """Let mpidist.collectives route FakeDeviceArray like a CuPy array (as it would a real one)."""
    real = mpidist.xp.is_device_array
    monkeypatch.setattr(mpidist.xp, "is_device_array", lambda x: isinstance(x, FakeDeviceArray) or real(x))
    monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
    monkeypatch.delenv("MPIDIST_GPU_PATH", raising=False)


def fake_for(comm, share=1, **kw):
    """A fake device for this rank; ``share`` consecutive ranks of a node use the same GPU key."""
    return FakeDevice(f"gpu{comm.Get_rank() // share}", **kw)


# -- the ctypes probe, on this machine's MPI ------------------------------------------------------------
def test_probe_reports_the_mpich_wheel_has_no_cuda():
    probe = probe_mpi_cuda_support()
    assert probe.library.endswith(tuple(f"libmpi.so{s}" for s in ("", ".12", ".40"))) or "libmpi.so" in probe.library
    if "MPICH" in MPI.Get_library_version():
        assert probe.symbol == "MPIX_GPU_query_support"
        assert probe.cuda_support is False
        assert "says no" in str(probe)


def test_probe_without_symbol_or_library_never_crashes(tmp_path):
    libc = next((line.split()[-1] for line in open("/proc/self/maps") if "/libc.so" in line or "/libc-" in line), None)
    if libc is not None:
        probe = probe_mpi_cuda_support(libc)
        assert (probe.symbol, probe.cuda_support) == ("", None)
        assert "has neither" in str(probe)
    missing = probe_mpi_cuda_support(str(tmp_path / "libmpi.so.99"))
    assert (missing.library, missing.cuda_support) == ("", None)
    maps = tmp_path / "maps"
    maps.write_text("7f00 r-xp 0 0:0 1 /opt/mpi/lib/libmpi_cxx.so.40\n7f01 r-xp 0 0:0 1 /opt/mpi/lib/libmpi.so.40.30.0\n")
    assert find_mpi_library(str(maps)) == "/opt/mpi/lib/libmpi.so.40.30.0"


# -- path selection ------------------------------------------------------------------------------------
SELECTION_CASES = [
    # (id, world, ranks_per_node, device kwargs, share, probe, env, expected path, phrase in the reasons)
    ("one-rank", 1, None, {}, 1, NO, {}, "self", "one rank"),
    ("cuda-aware", 4, None, {"cuda_aware": True, "nccl": True}, 1, YES, {}, "cuda_aware", "self-test passed"),
    ("lying-mpi", 4, None, {"lying": True, "nccl": True}, 1, YES, {}, "nccl", "self-test failed"),
    ("env-0-wins", 4, None, {"cuda_aware": True}, 1, YES, {"MPIDIST_CUDA_AWARE": "0"}, "ipc", "MPIDIST_CUDA_AWARE=0"),
    ("env-1-wins", 4, None, {"cuda_aware": True}, 1, NO, {"MPIDIST_CUDA_AWARE": "1"}, "cuda_aware", "MPIDIST_CUDA_AWARE=1"),
    ("nccl-unique-gpus", 4, None, {"nccl": True}, 1, NO, {}, "nccl", "one GPU per rank"),
    ("shared-gpu-ipc", 4, None, {"nccl": True}, 2, NO, {}, "ipc", "share GPU gpu0"),
    ("two-nodes-shared", 4, 2, {"nccl": True}, 2, NO, {}, "hierarchical", "2 nodes x 2 ranks"),
    ("one-rank-per-node", 4, 1, {}, 1, NO, {}, "staged", "one rank per node"),
    ("uneven-nodes", 3, 2, {}, 1, NO, {}, "staged", "different rank counts"),
    ("ipc-broken", 4, None, {"ipc": False}, 1, NO, {}, "staged", "CUDA IPC failed"),
    ("forced-staged", 4, None, {"nccl": True}, 1, NO, {"MPIDIST_GPU_PATH": "staged"}, "staged", "pinned host staging"),
]


@pytest.mark.mpi_skip
@pytest.mark.parametrize("case", SELECTION_CASES, ids=[c[0] for c in SELECTION_CASES])
def test_path_selection(case, monkeypatch, caplog):
    name, world, per_node, kw, share, probe, env, want, phrase = case
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def body(comm):
        device = fake_for(comm, share, **kw)
        choice = gpu.attach(comm, device, probe=probe)
        assert gpu.describe(comm) is choice
        if not (kw.get("cuda_aware") or kw.get("lying")):
            assert ("mpi_buffer",) not in device.log  # never a device buffer to an MPI that said no
        gpu.release(comm)
        return choice

    with caplog.at_level(logging.INFO, logger="mpidist.gpu"):
        choices = mpidist.simulate(world, body, ranks_per_node=per_node)
    assert {c.path for c in choices} == {want}, [str(c) for c in choices]
    assert phrase in str(choices[0]), str(choices[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "mpidist.gpu"]
    assert len(lines) == world and all(f"use path {want} (" in line for line in lines), lines


@pytest.mark.mpi_skip
def test_selection_refuses_impossible_or_unsafe_requests(monkeypatch):
    def forced_nccl_on_shared_gpu(comm):
        gpu.attach(comm, fake_for(comm, 2, nccl=True), path="nccl", probe=NO)

    with pytest.raises(RuntimeError, match="path 'nccl' is not possible.*share GPU"):
        mpidist.simulate(2, forced_nccl_on_shared_gpu)

    def forced_cuda_aware_on_non_cuda_mpi(comm):
        gpu.attach(comm, fake_for(comm), path="cuda_aware", probe=NO)  # FakeSegfault if it tried

    with pytest.raises(RuntimeError, match="path 'cuda_aware' is not possible.*not CUDA-aware"):
        mpidist.simulate(2, forced_cuda_aware_on_non_cuda_mpi)

    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    with pytest.raises(RuntimeError, match="MPIDIST_CUDA_AWARE=1 but a device-buffer allreduce gave wrong values"):
        mpidist.simulate(2, lambda comm: gpu.attach(comm, fake_for(comm, lying=True), probe=NO))
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "maybe")  # the booleans of mpidist.config: 1/0, true/false, yes/no, on/off
    with pytest.raises(ValueError, match="MPIDIST_CUDA_AWARE: expected 1/0, true/false, yes/no or on/off \\(got 'maybe'\\)"):
        mpidist.simulate(2, lambda comm: gpu.attach(comm, fake_for(comm), probe=NO))
    with pytest.raises(ValueError, match="unknown path 'fast'"):
        gpu.attach(None, FakeDevice(), path="fast")


@pytest.mark.mpi_skip
def test_a_failed_self_test_names_what_every_rank_got():
    """The lying MPI hands each rank its own input back: rank r gets arange(7) + r, not the sum."""
    def body(comm):
        choice = gpu.attach(comm, fake_for(comm, lying=True, nccl=True), probe=YES)
        gpu.release(comm)
        return str(choice)

    text = mpidist.simulate(4, body)[0]
    assert f"self-test failed (expected {(np.arange(7.0) * 4 + 6).tolist()}; " in text, text
    for rank in range(4):
        assert f"rank {rank}: got {(np.arange(7.0) + rank).tolist()}" in text, text


def test_selection_under_any_comm(comm):
    """cuda-aware yes/lying and NCCL also choose right under real MPI (no IPC across processes)."""
    rank = comm.Get_rank()
    cases = [({"cuda_aware": True}, YES, "cuda_aware"), ({"lying": True, "ipc": False}, YES, "staged"),
             ({"nccl": True}, NO, "nccl"), ({"ipc": False}, NO, "staged")]
    for kw, probe, want in cases:
        choice = gpu.attach(comm, FakeDevice(f"gpu{rank}", **kw), probe=probe)
        assert choice.path == (want if comm.Get_size() > 1 else "self"), str(choice)
        gpu.release(comm)


def test_describe_without_cupy_needs_no_communication():
    if mpidist.xp.get_cupy() is not None:
        pytest.skip("cupy is installed here")
    choice = gpu.describe(MPI.COMM_SELF)
    assert choice.path == "none" and "cupy is not installed" in str(choice)


# -- every collective on every path against numpy --------------------------------------------------------
DTYPES = ("float64", "float32", "float16", "int32", "int16", "uint8", "bool", "complex64")


def run_all_collectives(comm, device):
    """Every public collective on fake device arrays vs numpy references; 13 elements (uneven splits)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    for i, dtype in enumerate(DTYPES):
        for op in valid_ops(dtype):
            x = device.asarray(rank_input(rank, (13,), dtype, seed=i))
            got = mpidist.allreduce(x, comm, op=op)
            assert got is x
            assert_matches(device.to_numpy(x), reference(op, [rank_input(r, (13,), dtype, seed=i) for r in range(size)]), op)
    # nonblocking, non-contiguous, 2-d
    base = [rank_input(r, (5, 6), np.float64, seed=99) for r in range(size)]
    x = device.asarray(base[rank])
    handle = mpidist.iallreduce(x[:, ::2], comm, op="mean")
    assert handle.test()
    want = base[rank].copy()
    want[:, ::2] = reference("mean", [b[:, ::2] for b in base])
    assert handle.wait() is not None
    assert_matches(device.to_numpy(x), want, "mean")
    # broadcast from the last rank
    y = device.asarray(rank_input(rank, (4, 3), np.int64, seed=5))
    mpidist.ibroadcast(y, comm, root=size - 1).wait()
    np.testing.assert_array_equal(device.to_numpy(y), rank_input(size - 1, (4, 3), np.int64, seed=5))
    # allgather with uneven rows, and with out
    rows = [r % 3 + 1 for r in range(size)]
    parts = [rank_input(r, (rows[r], 2), np.float32, seed=7) for r in range(size)]
    gathered = mpidist.allgather(device.asarray(parts[rank]), comm)
    assert device.is_device_array(gathered)
    np.testing.assert_array_equal(device.to_numpy(gathered), np.concatenate(parts))
    out = device.asarray(np.zeros((2 * size, 3), np.int32))
    same = [rank_input(r, (2, 3), np.int32, seed=8) for r in range(size)]
    assert mpidist.iallgather(device.asarray(same[rank]), comm, out=out).wait() is out
    np.testing.assert_array_equal(device.to_numpy(out), np.concatenate(same))
    # reduce_scatter: 7 rows do not divide by 2, 3 or 4
    for op, dtype in (("sum", "float64"), ("mean", "float32"), ("max", "int16"), ("sum", "bool")):
        full = [rank_input(r, (7, 2), dtype, seed=11) for r in range(size)]
        got = mpidist.reduce_scatter(device.asarray(full[rank]), comm, op=op)
        lo = sum(mpidist.collectives.split_sizes(7, size)[:rank])
        want = reference(op, full)[lo: lo + got.shape[0]]
        assert_matches(device.to_numpy(got), want, op)
    # send/recv around a ring (the receiver gets a host array)
    msg = rank_input(rank, (3, 2), np.float64, seed=13)
    handle = mpidist.isend(device.asarray(msg), (rank + 1) % size, comm, tag=3)
    got = mpidist.recv((rank - 1) % size, comm, tag=3)
    handle.wait()
    np.testing.assert_array_equal(got, rank_input((rank - 1) % size, (3, 2), np.float64, seed=13))
    # an empty device array is one message (header only); the next message must still pair up
    handles = [mpidist.isend(device.asarray(np.zeros((0, 4), np.float32)), (rank + 1) % size, comm, tag=4),
               mpidist.isend(device.asarray(msg), (rank + 1) % size, comm, tag=4)]
    empty, after = mpidist.recv((rank - 1) % size, comm, tag=4), mpidist.recv((rank - 1) % size, comm, tag=4)
    for h in handles:
        h.wait()
    assert empty.shape == (0, 4) and empty.dtype == np.float32
    np.testing.assert_array_equal(after, rank_input((rank - 1) % size, (3, 2), np.float64, seed=13))


ANY_COMM_PATHS = [("staged", {}), ("cuda_aware", {"cuda_aware": True}), ("nccl", {"nccl": True})]


@pytest.mark.parametrize("path,kw", ANY_COMM_PATHS, ids=[p for p, _ in ANY_COMM_PATHS])
def test_collectives_on_path(comm, path, kw):
    device = FakeDevice(f"gpu{comm.Get_rank()}", **kw)
    choice = gpu.attach(comm, device, path=None if comm.Get_size() == 1 else path, probe=YES if kw.get("cuda_aware") else NO,
                        settings=TINY_CHUNKS)
    assert choice.path == (path if comm.Get_size() > 1 else "self")
    try:
        run_all_collectives(comm, device)
    finally:
        gpu.release(comm)


@pytest.mark.world_sizes(2, 3, 4)
def test_float16_on_an_mpi_without_float16(comm, monkeypatch):
    """MPI 3.1 (Open MPI 4) has no float16 datatype: mpi4py raises ``KeyError: 'e'`` on such a buffer. Emulated on
    any MPI: every path carries float16 copies as uint16 and reduces float16 in float32 or as int16 order keys."""
    monkeypatch.delitem(MPI._typedict, "e", raising=False)  # real mpi4py and the simulator both look types up here
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_input(r, (7, 2), "float16", seed=21) for r in range(size)]
    lo = sum(mpidist.collectives.split_sizes(7, size)[:rank])
    # Copies must be bit-exact whatever the bits: NaN payloads, infinities, subnormals, signed zeros.
    bits = [((np.arange(9) * 977 + r * 31) % 65536).astype(np.uint16).view(np.float16) for r in range(size)]
    for path, kw in ANY_COMM_PATHS:
        device = FakeDevice(f"gpu{rank}", **kw)
        gpu.attach(comm, device, path=path, probe=YES if kw.get("cuda_aware") else NO, settings=TINY_CHUNKS)
        try:
            for op in valid_ops("float16"):
                x = device.asarray(inputs[rank])
                assert mpidist.allreduce(x, comm, op=op) is x
                assert_matches(device.to_numpy(x), reference(op, inputs), op)
                got = mpidist.reduce_scatter(device.asarray(inputs[rank]), comm, op=op)
                assert_matches(device.to_numpy(got), reference(op, inputs)[lo: lo + got.shape[0]], op)
            y = device.asarray(bits[rank])
            mpidist.broadcast(y, comm, root=size - 1)
            np.testing.assert_array_equal(device.to_numpy(y).view(np.uint16), bits[size - 1].view(np.uint16))
            gathered = mpidist.allgather(device.asarray(bits[rank][: rank + 1]), comm)  # uneven: Allgatherv
            want = np.concatenate([b[: r + 1] for r, b in enumerate(bits)])
            np.testing.assert_array_equal(device.to_numpy(gathered).view(np.uint16), want.view(np.uint16))
            handle = mpidist.isend(device.asarray(bits[rank]), (rank + 1) % size, comm, tag=5)
            got = mpidist.recv((rank - 1) % size, comm, tag=5)
            handle.wait()
            np.testing.assert_array_equal(got.view(np.uint16), bits[(rank - 1) % size].view(np.uint16))
        finally:
            gpu.release(comm)


IPC_WORLDS = [("ipc", 2, None), ("ipc", 3, None), ("ipc", 4, None), ("hierarchical", 4, 2), ("hierarchical", 6, 3)]


@pytest.mark.mpi_skip
@pytest.mark.parametrize("path,n_ranks,per_node", IPC_WORLDS, ids=[f"{p}-{w}" for p, w, _ in IPC_WORLDS])
def test_collectives_on_ipc_paths(path, n_ranks, per_node):
    def body(comm):
        device = fake_for(comm, 2)
        assert gpu.attach(comm, device, probe=NO, settings=TINY_CHUNKS).path == path
        run_all_collectives(comm, device)
        gpu.release(comm)

    mpidist.simulate(n_ranks, body, ranks_per_node=per_node)


def check_reduction_rules(comm, device):
    """NaN wins max/min whichever rank holds it, and float16 sums, means and products accumulate in float32 and
    round once (mpidist.wire), on device arrays, against numpy on every rank's input."""
    size, rank = comm.Get_size(), comm.Get_rank()
    sizes = mpidist.collectives.split_sizes(6, size)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for dtype in ("float16", "float32", "float64"):
        for nan_rank in range(size):
            xs = nan_inputs(size, dtype, nan_rank)
            for op, ufunc in (("max", np.maximum), ("min", np.minimum)):
                want = ufunc.reduce(np.stack(xs))
                x = device.asarray(xs[rank])
                mpidist.allreduce(x, comm, op=op)
                assert_nan_propagated(device.to_numpy(x), want)
                source = device.asarray(xs[rank])
                got = mpidist.reduce_scatter(source, comm, op=op)
                assert_nan_propagated(device.to_numpy(got), want[lo:hi])
                np.testing.assert_array_equal(device.to_numpy(source), xs[rank])  # the input is left as it was
    for op in ("sum", "mean", "prod"):
        xs, want = float16_overflow_case(size, op)
        x = device.asarray(xs[rank])
        mpidist.allreduce(x[:, ::2], comm, op=op)  # a strided view: flattened, widened, rounded, written back
        expected = xs[rank].copy()
        expected[:, ::2] = want[:, ::2]
        np.testing.assert_array_equal(device.to_numpy(x), expected)
        got = mpidist.reduce_scatter(device.asarray(xs[rank]), comm, op=op)
        assert got.dtype == np.float16
        first = sum(mpidist.collectives.split_sizes(5, size)[:rank])
        np.testing.assert_array_equal(device.to_numpy(got), want[first: first + got.shape[0]])


@contextlib.contextmanager
def device_on_path(comm, path, kw):
    """Attach a fake device with ``kw`` to ``comm`` on ``path`` (any path on one rank), in tiny chunks; release it."""
    device = FakeDevice(f"gpu{comm.Get_rank()}", **kw)
    gpu.attach(comm, device, path=None if comm.Get_size() == 1 else path, probe=YES if kw.get("cuda_aware") else NO,
               settings=TINY_CHUNKS)
    try:
        yield device
    finally:
        gpu.release(comm)


@pytest.mark.parametrize("path,kw", ANY_COMM_PATHS, ids=[p for p, _ in ANY_COMM_PATHS])
def test_nan_and_float16_rules_on_path(comm, path, kw):
    with device_on_path(comm, path, kw) as device:
        check_reduction_rules(comm, device)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("path,n_ranks,per_node", IPC_WORLDS, ids=[f"{p}-{w}" for p, w, _ in IPC_WORLDS])
def test_nan_and_float16_rules_on_ipc_paths(path, n_ranks, per_node):
    def body(comm):
        device = fake_for(comm, 2)
        assert gpu.attach(comm, device, probe=NO, settings=TINY_CHUNKS).path == path
        try:
            check_reduction_rules(comm, device)
        finally:
            gpu.release(comm)

    mpidist.simulate(n_ranks, body, ranks_per_node=per_node)


# -- synchronization and pipelining ---------------------------------------------------------------------
def _pending_producer(device, x, values):
    """Queue a write of ``values`` into ``x`` on the current stream: a kernel that has not run yet."""
    a = x.a
    device.current.enqueue(lambda: a.__setitem__(Ellipsis, values))


PRODUCER_PATHS = [("staged", {}, None), ("cuda_aware", {"cuda_aware": True}, None), ("nccl", {"nccl": True}, None),
                  ("ipc", {}, None), ("hierarchical", {}, 2)]


@pytest.mark.mpi_skip
@pytest.mark.parametrize("path,kw,per_node", PRODUCER_PATHS, ids=[p[0] for p in PRODUCER_PATHS])
def test_every_path_waits_for_the_producing_stream(path, kw, per_node):
    def body(comm):
        rank = comm.Get_rank()
        device = fake_for(comm, 1 if path == "nccl" else 2, **kw)
        gpu.attach(comm, device, path=path, probe=YES if kw else NO, settings=TINY_CHUNKS)
        x = device.asarray(np.zeros(10))
        _pending_producer(device, x, np.arange(10.0) * (rank + 1))  # not run until someone syncs
        mpidist.allreduce(x, comm)
        np.testing.assert_array_equal(device.to_numpy(x), np.arange(10.0) * sum(range(1, 5)))
        if path in ("staged", "cuda_aware"):
            mpi = [i for i, e in enumerate(device.log) if e[0] in ("mpi_buffer", "event_sync")]
            assert mpi and ("sync", "current") in device.log[: mpi[0]]
        gpu.release(comm)

    mpidist.simulate(4, body, ranks_per_node=per_node)


def test_staged_pipeline_order(comm):
    """D2H k+1 is issued before MPI works on chunk k; H2D k-1 is in flight during MPI on chunk k.

    The staged path is forced on one rank too (it would pick "self" there): its chunks still go through MPI.
    """
    device = FakeDevice(f"gpu{comm.Get_rank()}")
    rec = RecordingComm(comm, device.log)
    assert gpu.attach(rec, device, path="staged", probe=NO, settings=TINY_CHUNKS).path == "staged"
    x = device.asarray(np.arange(14.0))  # 5 chunks of 3, 3, 3, 3, 2 elements
    start = len(device.log)
    mpidist.allreduce(x, rec)
    log = device.log[start:]
    np.testing.assert_array_equal(device.to_numpy(x), np.arange(14.0) * comm.Get_size())
    chunks = chunk_bounds(14, 8, 24)
    assert len(chunks) == 5
    mpi = [i for i, e in enumerate(log) if e == ("mpi", "Allreduce")]
    d2h = [i for i, e in enumerate(log) if e[0] == "d2h"]
    h2d = [i for i, e in enumerate(log) if e[0] == "h2d"]
    assert len(mpi) == len(d2h) == len(h2d) == 5
    assert [log[i][1] // 24 for i in d2h] == [0, 1, 2, 3, 4] == [log[i][1] // 24 for i in h2d]
    assert log.index(("sync", "current")) < d2h[0]  # the producer is done before the first copy
    for k in range(5):
        if k + 1 < 5:
            assert d2h[k + 1] < mpi[k], "D2H of chunk k+1 must be issued before MPI works on chunk k"
        assert log[mpi[k] - 1][0] == "event_sync", "MPI must wait for its chunk's D2H copy"
        assert mpi[k] < h2d[k] and (k + 1 == 5 or h2d[k] < mpi[k + 1]), "H2D k overlaps MPI on k+1"
    streams = {log[i][3] for i in d2h}, {log[i][3] for i in h2d}
    assert len(streams[0]) == 1 and len(streams[1]) == 1 and streams[0] != streams[1] and "current" not in streams[0] | streams[1]
    assert log[-1][:3] == ("wait_event", "current", log[h2d[0]][3])  # results ready on the current stream
    gpu.release(rec)


def test_the_self_path_moves_nothing():
    """One rank picks "self": no copies and no MPI call (COMM_SELF: real MPI in every run, one rank always)."""
    device = FakeDevice("gpu0")
    rec = RecordingComm(MPI.COMM_SELF, device.log)
    assert gpu.attach(rec, device, probe=NO, settings=TINY_CHUNKS).path == "self"
    try:
        x = device.asarray(np.arange(14.0))
        start = len(device.log)
        for op in ("sum", "mean", "max"):
            mpidist.allreduce(x, rec, op=op)
        np.testing.assert_array_equal(device.to_numpy(x), np.arange(14.0))
        moved = [e for e in device.log[start:] if e[0] in ("d2h", "h2d", "mpi", "pinned_alloc")]
        assert moved == [], moved
    finally:
        gpu.release(rec)


def test_staging_buffers_are_reused_and_only_grow(comm):
    device = FakeDevice(f"gpu{comm.Get_rank()}")
    # Forced on one rank too, where "self" would be chosen.
    assert gpu.attach(comm, device, path="staged", probe=NO, settings=TINY_CHUNKS).path == "staged"
    size = comm.Get_size()
    allocs = []
    for n in (10, 10, 4, 16, 16, 8):
        x = device.asarray(np.ones(n))
        mpidist.allreduce(x, comm)  # no host sync between calls: the last H2D is still queued
        x2 = device.asarray(np.full(n, 2.0))
        mpidist.allreduce(x2, comm)
        np.testing.assert_array_equal(device.to_numpy(x), np.full(n, float(size)))
        np.testing.assert_array_equal(device.to_numpy(x2), np.full(n, 2.0 * size))
        allocs.append([e[1] for e in device.log if e[0] == "pinned_alloc"])
    assert allocs[-1] == [80, 128], allocs  # float64: grew once to 10, once to 16, never shrank
    gpu.release(comm)


@pytest.mark.mpi_skip
def test_ipc_handles_are_exchanged_once_per_buffer():
    def body(comm):
        device = fake_for(comm, 4)
        gpu.attach(comm, device, probe=NO)
        path = gpu.engine(comm)
        after_selftest = path.exchanges  # the self-test's float64 arena of 7 elements
        for n in (100, 100, 50, 100):
            x = device.asarray(np.ones(n))
            mpidist.allreduce(x, comm)
            np.testing.assert_array_equal(device.to_numpy(x), np.full(n, 4.0))
        assert path.exchanges - after_selftest == 1
        mpidist.allreduce(device.asarray(np.ones(200)), comm)  # grows: one more exchange
        mpidist.allreduce(device.asarray(np.ones(200, np.float32)), comm)  # another dtype, its own arena
        assert path.exchanges - after_selftest == 3
        handles = sum(1 for e in device.log if e[0] == "ipc_handle")
        opens = sum(1 for e in device.log if e[0] == "ipc_open")
        assert (handles, opens) == (path.exchanges, 3 * path.exchanges)
        gpu.release(comm)
        assert sum(1 for e in device.log if e[0] == "ipc_close") == opens

    mpidist.simulate(4, body)


@pytest.mark.mpi_skip
def test_hierarchical_split_sends_only_slices_between_nodes():
    def body(comm):
        rank = comm.Get_rank()
        device = fake_for(comm, 2)
        assert gpu.attach(comm, device, probe=NO).path == "hierarchical"
        path = gpu.engine(comm)
        # MPI between nodes only among ranks with the same local rank; IPC only within a node
        assert path.cross.allgather(rank) == [rank % 2, rank % 2 + 2]
        assert path.local.allgather(rank) == [rank - rank % 2, rank - rank % 2 + 1]
        staged_allocs = len(path.cross_path.pool.buffers)
        x = device.asarray(np.arange(9.0) + rank)
        mpidist.allreduce(x, comm, op="mean")
        np.testing.assert_array_equal(device.to_numpy(x), np.arange(9.0) + 1.5)
        # 9 elements over 2 local ranks: slices of 5 and 4 elements cross the nodes, never all 9
        host = path.cross_path.pool.buffers[(np.dtype(np.float64).str, 0)]
        assert host.size == 5 - rank % 2 and staged_allocs <= 1
        gpu.release(comm)

    mpidist.simulate(4, body, ranks_per_node=2)


def test_device_arrays_never_reach_a_non_cuda_mpi(comm):
    """Every collective on the staged path: MPI only ever sees host memory (FakeSegfault otherwise)."""
    device = FakeDevice(f"gpu{comm.Get_rank()}")
    gpu.attach(comm, device, path="staged" if comm.Get_size() > 1 else None, probe=NO)
    run_all_collectives(comm, device)
    assert ("mpi_buffer",) not in device.log
    with pytest.raises(FakeSegfault):
        device.mpi_buffer(device.asarray(np.ones(1)))
    gpu.release(comm)


# -- device selection in init() --------------------------------------------------------------------------
class _StubCupy:
    """Just what ``select_device`` uses: ``cuda.Device(i).use()`` and the PCI bus id of a device."""

    def __init__(self, count):
        stub = self

        class Device:
            def __init__(self, index):
                assert 0 <= index < count, (index, count)
                self.index = index

            def use(self):
                stub.used.append(self.index)

        class Runtime:
            @staticmethod
            def deviceGetPCIBusId(index):
                return f"0000:{index + 1:02x}:00.0"

        self.used = []
        self.cuda = type("cuda", (), {"Device": Device, "runtime": Runtime})


@pytest.mark.parametrize("gpus,per_node,shared", [(4, 4, False), (2, 4, True), (1, 2, True), (2, 2, False)])
def test_init_selects_local_rank_modulo_gpus(monkeypatch, gpus, per_node, shared):
    import warnings

    stub = _StubCupy(gpus)
    monkeypatch.setattr(mpidist.xp, "gpu_count", lambda: gpus)
    monkeypatch.setattr(mpidist.xp, "get_cupy", lambda: stub)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = mpidist.simulate(4, lambda comm: mpidist.init(comm, abort_on_error=False)[1], ranks_per_node=per_node)
    assert [i.device for i in infos] == [i.local_rank % gpus for i in infos]
    assert sorted(stub.used) == sorted(i.local_rank % gpus for i in infos)
    messages = [str(w.message) for w in caught if "share GPU" in str(w.message)]
    assert bool(messages) == shared, messages
    if shared:
        assert "NCCL cannot be used" in messages[0] and "nvidia-cuda-mps-control -d" in messages[0]
    assert str(infos[0]).endswith(f" gpu {infos[0].device}")


def test_init_without_gpu_selects_nothing(monkeypatch):
    monkeypatch.setattr(mpidist.xp, "gpu_count", lambda: 0)
    infos = mpidist.simulate(2, lambda comm: mpidist.init(comm, abort_on_error=False)[1])
    assert [i.device for i in infos] == [None, None] and "gpu" not in str(infos[0])


class _StubRuntime:
    """cupy.cuda.runtime's IPC calls, counting what CUDA would map (it refuses one handle twice per process)."""

    def __init__(self):
        self.mapped, self.opens, self.closes = {}, 0, 0

    def ipcOpenMemHandle(self, handle):  # noqa: N802 - CUDA's name
        if handle in self.mapped.values():
            raise RuntimeError("cudaErrorAlreadyMapped: resource already mapped")
        self.opens += 1
        pointer = 0x1000 * self.opens
        self.mapped[pointer] = handle
        return pointer

    def ipcCloseMemHandle(self, pointer):  # noqa: N802
        self.closes += 1
        del self.mapped[pointer]


def test_ipc_mappings_open_a_handle_once_per_process_and_close_on_the_last_release():
    from mpidist.gpu.device import _IpcMappings

    rt, maps = _StubRuntime(), _IpcMappings()
    a, b = maps.open(rt, b"peer-arena"), maps.open(rt, b"peer-arena")  # two communicators, one peer arena
    other = maps.open(rt, b"other-arena")
    assert a == b != other and rt.opens == 2
    maps.close(rt, a)
    assert rt.closes == 0 and a in rt.mapped  # still used by the second path
    maps.close(rt, b)
    maps.close(rt, other)
    assert rt.closes == 2 and rt.mapped == {}
    with pytest.raises(ValueError, match="not an open IPC mapping"):
        maps.close(rt, a)
    assert maps.open(rt, b"peer-arena") != 0 and rt.opens == 3  # a closed handle can be opened again


def test_ipc_arenas_are_whole_granules():
    """Arenas never share a 2 MiB granule (CUDA maps IPC memory per granule; a shared one failed on an H100)."""
    from mpidist.gpu import device as device_module

    allocated = []

    class StubCupy:
        class cuda:
            runtime = None

            class Memory:
                def __init__(self, nbytes):
                    allocated.append(nbytes)

            @staticmethod
            def MemoryPointer(mem, offset):  # noqa: N802
                return (mem, offset)

        @staticmethod
        def ndarray(shape, dtype, memptr):
            return (shape, np.dtype(dtype))

    dev = object.__new__(device_module.CupyDevice)
    dev.cp, dev.rt = StubCupy, None
    granule = device_module.IPC_GRANULE_BYTES
    assert granule == 2 << 20
    for n, dtype in ((1, np.float32), (granule // 8, np.float64), (granule // 8 + 1, np.float64), (0, np.int8)):
        assert dev.ipc_alloc(n, dtype) == ((max(n, 0),), np.dtype(dtype))
        expected = -(-max(1, n) * np.dtype(dtype).itemsize // granule) * granule
        assert allocated[-1] == expected


@pytest.mark.mpi_skip
def test_ipc_failing_on_some_ranks_raises_on_every_rank_naming_each_failure():
    from mpidist.gpu.base import Op
    from mpidist.gpu.ipc import IpcPath, IpcUnavailable

    def body(comm):
        rank = comm.Get_rank()
        device = FakeDevice(f"gpu{rank}", ipc=rank not in (1, 3))  # ranks 1 and 3 cannot map peer memory
        path = IpcPath(comm, device)
        with pytest.raises(IpcUnavailable) as caught:
            path.allreduce(device.asarray(np.ones(8)), Op(MPI.SUM, "SUM"))
        # what a rank mapped before the failure is unmapped: the working ranks mapped their 3 peers
        assert sum(1 for e in device.log if e[0] == "ipc_close") == (0 if rank in (1, 3) else 3)
        return str(caught.value)

    messages = mpidist.simulate(4, body)
    assert len(set(messages)) == 1, messages  # every rank, the same message
    assert "CUDA IPC unavailable: ranks 1,3: cannot open the handle of local rank 0" in messages[0], messages[0]


# -- 16-bit floats on device arrays (issue 30) -------------------------------------------------------------------
# float16 and bfloat16 device arrays reduce by mpidist.wire's rule on every path: sums in float32, rounded once;
# copies as 2-byte words. nn, DDP and FSDP on "CuPy" run on FakeCupy (tests/fake_device.py): numpy's arithmetic
# behind CuPy's interface, so each result must equal the numpy run's bits.
SIXTEEN = [("float16", np.float16), ("bfloat16", bfloat16)]


def sixteen_bit_inputs(size, dtype, seed):
    """Every rank's (7, 2) input of 16-bit ``dtype``: multiples of 1/8 below 64 (rounded to ``dtype``), so their
    float32 sums are exact in any order (a GPU path may add in another order than MPI)."""
    return [(np.round(np.random.default_rng([seed, r]).standard_normal((7, 2)) * 96) / 8).clip(-63, 63).astype(dtype)
            for r in range(size)]


def sum_rounded_once(xs, dtype, mean=False):
    """The float32 sum (or mean) of ``xs``, rounded once to ``dtype``: mpidist.wire's rule for 16-bit floats."""
    total = np.sum([x.astype(np.float32) for x in xs], axis=0, dtype=np.float32)
    return (total / np.float32(len(xs)) if mean else total).astype(dtype)


def bits(a):
    return np.asarray(a).view(np.uint16)


def check_sixteen_bit_collectives(comm, device, dtypes=SIXTEEN):
    """allreduce (sum, mean, max), reduce_scatter, allgather (uneven) and broadcast of float16 and bfloat16 device
    arrays: the numpy path's bits, and the float32 sum rounded once; copies carry arbitrary bit patterns."""
    size, rank = comm.Get_size(), comm.Get_rank()
    lo = sum(mpidist.collectives.split_sizes(7, size)[:rank])
    for i, (name, dtype) in enumerate(dtypes):
        xs = sixteen_bit_inputs(size, dtype, seed=40 + i)
        for op in ("sum", "mean", "max"):
            x = device.asarray(xs[rank])
            mpidist.allreduce(x, comm, op=op)
            host = mpidist.allreduce(xs[rank].copy(), comm, op=op)
            np.testing.assert_array_equal(bits(device.to_numpy(x)), bits(host), err_msg=f"{name} {op}")
            got = mpidist.reduce_scatter(device.asarray(xs[rank]), comm, op=op)
            assert got.dtype == dtype
            np.testing.assert_array_equal(bits(device.to_numpy(got)), bits(host[lo: lo + got.shape[0]]))
        np.testing.assert_array_equal(bits(host), bits(np.maximum.reduce(np.stack(xs))))
        x = device.asarray(xs[rank])
        mpidist.allreduce(x, comm, op="sum")
        np.testing.assert_array_equal(bits(device.to_numpy(x)), bits(sum_rounded_once(xs, dtype)), err_msg=name)
        patterns = [((np.arange(9) * 977 + r * 31) % 65536).astype(np.uint16).view(dtype) for r in range(size)]
        gathered = mpidist.allgather(device.asarray(patterns[rank][: rank + 1]), comm)
        assert gathered.dtype == dtype
        np.testing.assert_array_equal(bits(device.to_numpy(gathered)),
                                      bits(np.concatenate([p[: r + 1] for r, p in enumerate(patterns)])))
        y = device.asarray(patterns[rank])
        mpidist.broadcast(y, comm, root=size - 1)
        np.testing.assert_array_equal(bits(device.to_numpy(y)), bits(patterns[size - 1]))


@pytest.mark.parametrize("path,kw", ANY_COMM_PATHS, ids=[p for p, _ in ANY_COMM_PATHS])
def test_sixteen_bit_collectives_on_path_equal_the_numpy_path(comm, path, kw):
    with device_on_path(comm, path, kw) as device:
        check_sixteen_bit_collectives(comm, device)


@pytest.mark.mpi_skip
@pytest.mark.parametrize("path,n_ranks,per_node", IPC_WORLDS[::2], ids=[f"{p}-{w}" for p, w, _ in IPC_WORLDS[::2]])
def test_sixteen_bit_collectives_on_ipc_paths_equal_the_numpy_path(path, n_ranks, per_node):
    def body(comm):
        device = fake_for(comm, 2)
        assert gpu.attach(comm, device, probe=NO, settings=TINY_CHUNKS).path == path
        try:
            check_sixteen_bit_collectives(comm, device)
        finally:
            gpu.release(comm)

    mpidist.simulate(n_ranks, body, ranks_per_node=per_node)


def check_ring16_on_device(comm, to_device, dtypes=SIXTEEN):
    """ring16's 16-bit ring on device arrays (``to_device(numpy array)``, a copy): the numpy emulation of the ring on
    every rank's input (helpers.ring_reference) bitwise, results on the device (``out`` written in place)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    for i, (name, dtype) in enumerate(dtypes):
        xs = [np.random.default_rng([50 + i, r]).standard_normal(11).astype(dtype) for r in range(size)]
        want = ring_reference(xs, dtype)
        got = ring_allreduce_16(to_device(xs[rank]), comm)
        assert mpidist.xp.is_device_array(got) and got.dtype == dtype
        np.testing.assert_array_equal(bits(mpidist.xp.to_numpy(got)), bits(want), err_msg=name)
        x = to_device(xs[rank])
        assert iring_allreduce_16(x, comm, out=x).wait() is x  # out may be the input: copied at the start
        np.testing.assert_array_equal(bits(mpidist.xp.to_numpy(x)), bits(want), err_msg=name)
        chunk = -(-11 // size)
        mean = ring_reference(xs, dtype, mean=True)[rank * chunk: (rank + 1) * chunk]
        got = ring_reduce_scatter_16(to_device(xs[rank]), comm, mean=True)
        assert mpidist.xp.is_device_array(got) and got.dtype == dtype
        np.testing.assert_array_equal(bits(mpidist.xp.to_numpy(got)), bits(mean), err_msg=name)


def test_ring16_on_fake_cupy_is_the_numpy_ring(comm, fake_cupy):
    check_ring16_on_device(comm, lambda a: FakeCupyArray(a.copy()))  # a copy, as CuPy's asarray


@pytest.fixture
def fake_cupy(monkeypatch):
    """FakeCupy as ``cupy`` (CuPy 14: with bfloat16) for one test; every comm's device path on a fake device."""
    return install_fake_cupy(monkeypatch)


def tiny_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(6, 10, rng=rng), nn.Tanh(), nn.LayerNorm(10), nn.Linear(10, 4, rng=rng))


def tiny_batch(step, n):
    rng = np.random.default_rng([29, step])
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 4, size=n)


def host_values(module):
    """``module``'s parameters as numpy arrays (copied from the device where they live there)."""
    return [mpidist.xp.to_numpy(p.data) for _, p in module.named_parameters()]


def assert_same_bits(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(f"u{g.dtype.itemsize}"), w.view(f"u{w.dtype.itemsize}"))


FAKE_CUPY = (to_fake_cupy, FakeCupyArray)  # (move a module's arrays, an input array) to the device


def train_tiny(comm, wrap, device=None, steps=2, per_rank=3, policy=None, make_opt=None):
    """Train ``tiny_model`` for ``steps`` on this rank's slice of the global batches: wrapped by ``wrap(model)``,
    on the device if ``device`` (a pair like FAKE_CUPY); return (the wrapper, the optimizer)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    model = device[0](tiny_model()) if device else tiny_model()
    if policy is not None:
        apply_policy(model, policy)  # on the device's arrays
    wrapped = wrap(model)
    opt = (make_opt or (lambda ps: optim.Adam(ps, lr=0.01)))(list(wrapped.parameters()))
    for step in range(steps):
        x, y = tiny_batch(step, per_rank * size)
        part = slice(rank * per_rank, (rank + 1) * per_rank)
        x, y = x[part], y[part]
        if device:
            x, y = device[1](x), device[1](y)
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
    return wrapped, opt


@pytest.mark.mpi_skip
@pytest.mark.parametrize("param,compute", [("fp16", None), ("fp16", "fp32"), ("bf16", None)])
def test_policy_on_fake_cupy_trains_as_on_numpy(fake_cupy, param, compute):
    """Policy on CuPy arrays: 16-bit parameters and activations (the root's CuPy input cast too), float32 masters
    in the optimizer; three Adam steps equal numpy's bitwise (parameters and masters)."""
    policy = Policy(param, compute)
    results = []
    for on_device in (False, True):
        model, opt = train_tiny(MPI.COMM_SELF, lambda m: m, FAKE_CUPY if on_device else None, steps=3, policy=policy)
        assert all(mpidist.xp.is_device_array(p.data) == on_device for p in model.parameters())
        masters = [opt.state[i]["master_param"] for i in range(len(opt.param_groups[0]["params"]))]
        assert all(m.dtype == np.float32 and mpidist.xp.is_device_array(m) == on_device for m in masters)
        results.append((host_values(model), [mpidist.xp.to_numpy(m) for m in masters]))
    assert all(v.dtype == policy.param_dtype for v in results[1][0])
    assert_same_bits(results[1][0], results[0][0])
    assert_same_bits(results[1][1], results[0][1])


@pytest.mark.mpi_skip
def test_grouped_query_attention_on_fake_cupy_equals_numpy(fake_cupy):
    """Grouped-query attention (F.repeat_kv before the fused attention) on CuPy arrays: the output, the input's and
    every parameter's gradient equal numpy's bitwise; and F.repeat_kv's 16-bit group sums on the device too."""
    results = []
    for on_device in (False, True):
        attn = nn.MultiheadAttention(8, 4, causal=True, rng=np.random.default_rng(0), num_kv_heads=2)
        if on_device:
            attn = to_fake_cupy(attn)
        x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
        x = nn.Tensor(FakeCupyArray(x) if on_device else x, requires_grad=True)
        y = attn(x)
        y.backward(nn.Tensor(mpidist.xp.asarray_like(np.ones(y.data.shape, np.float32), y.data)))
        assert mpidist.xp.is_device_array(y.data) == on_device
        results.append([mpidist.xp.to_numpy(a) for a in [y.data, x.grad] + [p.grad for p in attn.parameters()]])
    assert_same_bits(results[1], results[0])
    qkv = np.random.default_rng(2).standard_normal((1, 3, 32)).astype(bfloat16)   # 4 heads, 2 k/v heads of 4
    grads = []
    for on_device in (False, True):
        t = nn.Tensor(FakeCupyArray(qkv) if on_device else qkv, requires_grad=True)
        out = nn.functional.repeat_kv(t, 4, 2)
        out.backward(nn.Tensor(out.data * 3))
        grads.append([mpidist.xp.to_numpy(out.data), mpidist.xp.to_numpy(t.grad)])
    assert_same_bits(grads[1], grads[0])


DDP_16_BIT = ["fp16_compress_hook", "bf16_compress_hook", "bf16_params"]


def ddp_16_bit_run(comm, kind, device, state=None):
    """Two Adam steps of DDP (several buckets) with ``kind``: a 16-bit compression hook (with ``state``), or
    Policy("bf16") parameters (bfloat16 buckets, summed in float32); return the module's parameters on the host."""
    def wrap(model):
        ddp = DDP(model, comm, bucket_cap_mb=0.0002, first_bucket_mb=0.0002)  # several buckets, several rings
        if kind != "bf16_params":
            ddp.register_comm_hook(state, getattr(comm_hooks, kind))
        return ddp

    ddp = train_tiny(comm, wrap, device, policy=Policy("bf16") if kind == "bf16_params" else None)[0]
    assert all(mpidist.xp.is_device_array(p.data) == bool(device) for p in ddp.parameters())
    return host_values(ddp.module)


def fsdp_float16_run(comm, reduce_dtype, device):
    """Two SGD steps of FSDP(param_dtype=float16, reduce_dtype); return the full state on the host."""
    fsdp = train_tiny(comm, lambda m: FSDP(m, comm, param_dtype="fp16", reduce_dtype=reduce_dtype), device,
                      make_opt=lambda ps: optim.SGD(ps, lr=0.5))[0]
    assert all(mpidist.xp.is_device_array(p.data) == bool(device) for p in fsdp.parameters())
    return [mpidist.xp.to_numpy(v) for v in full_state_dict(fsdp, all_ranks=True).values()]


@pytest.mark.parametrize("kind", DDP_16_BIT)
def test_ddp_16_bit_step_on_fake_cupy_equals_numpy(comm, fake_cupy, kind):
    """DDP on CuPy arrays with the 16-bit compression hooks (the ring staged through the host) and with bfloat16
    parameters (bfloat16 buckets summed in float32 on the device path): the numpy run's bits on every rank."""
    assert_same_bits(ddp_16_bit_run(comm, kind, FAKE_CUPY), ddp_16_bit_run(comm, kind, None))


@pytest.mark.mpi_skip
@pytest.mark.parametrize("kind", DDP_16_BIT[:2])
def test_ddp_node_aware_16_bit_hooks_on_fake_cupy_equal_numpy(monkeypatch, kind):
    """The node-aware 16-bit sum (collectives_hier, 2 simulated nodes x 2 ranks) on CuPy buckets: summed on a host
    copy, the result copied up; the numpy run's bits."""
    install_fake_cupy(monkeypatch)
    state = comm_hooks.CompressHookState(algorithm="hierarchical")

    def body(comm):
        return ddp_16_bit_run(comm, kind, FAKE_CUPY, state), ddp_16_bit_run(comm, kind, None, state)

    for got, want in mpidist.simulate(4, body, ranks_per_node=2):
        assert_same_bits(got, want)


@pytest.mark.parametrize("reduce_dtype", [None, "fp16"], ids=["reduce_fp32", "reduce_fp16"])
def test_fsdp_float16_step_on_fake_cupy_equals_numpy(comm, fake_cupy, reduce_dtype):
    """FSDP(param_dtype=float16) on CuPy arrays: gathered in float16 on the device path, float32 shards;
    with reduce_dtype float16 the ring's reduce-scatter staged through the host: the numpy run's bits."""
    assert_same_bits(fsdp_float16_run(comm, reduce_dtype, FAKE_CUPY), fsdp_float16_run(comm, reduce_dtype, None))


def test_bfloat16_on_a_cupy_without_it_raises_naming_the_version(comm, monkeypatch):
    """CuPy before 14 has no bfloat16: Policy("bf16") on its arrays raises on every rank, naming the dtype and
    CuPy's version; float16 works there."""
    install_fake_cupy(monkeypatch, version="13.6.0", bfloat16=False)
    model = to_fake_cupy(tiny_model())
    with pytest.raises(TypeError, match=r"apply_policy: CuPy 13\.6\.0 has no bfloat16 arrays \(TypeError: .*"
                                        r"Unsupported dtype bfloat16\); bfloat16 on CuPy needs CuPy >= 14"):
        apply_policy(model, Policy("bf16"))
    with pytest.raises(TypeError, match=r"CuPy 13\.6\.0 has no bfloat16"):
        apply_policy(model, Policy("fp32", "bf16"))
    assert all(p.dtype == np.float32 for p in model.parameters())  # nothing half done
    apply_policy(model, Policy("fp16"))
    assert all(p.dtype == np.float16 and mpidist.xp.is_device_array(p.data) for p in model.parameters())
    assert mpidist.xp.bfloat16_problem(np) is None


def test_bfloat16_wrappers_on_a_cupy_without_it_raise_naming_the_version(comm, monkeypatch):
    """FSDP's bfloat16 param/reduce dtype and DDP's bf16_compress_hook on CuPy 13's arrays raise on every rank,
    naming the dtype and the version (FSDP at construction, before its first collective; the hook at the first
    bucket); float16 works there."""
    install_fake_cupy(monkeypatch, version="13.6.0", bfloat16=False)
    for what in ("param_dtype", "reduce_dtype"):
        with pytest.raises(TypeError, match=rf"FSDP: {what}: CuPy 13\.6\.0 has no bfloat16 arrays"):
            FSDP(to_fake_cupy(tiny_model()), comm, **{what: "bf16"})
    with pytest.raises(TypeError, match=r"bf16_compress_hook: CuPy 13\.6\.0 has no bfloat16 arrays"):
        ddp_16_bit_run(comm, "bf16_compress_hook", FAKE_CUPY)
    fp16 = "fp16_compress_hook"
    assert_same_bits(ddp_16_bit_run(comm, fp16, FAKE_CUPY), ddp_16_bit_run(comm, fp16, None))


def device_op_is_numpys(op, x, g):
    """Run ``op`` forward and backward on numpy ``x`` (gradient ``g``) and on the fake device's copies: assert the
    device run gives device arrays and the numpy run's bits; return its traced (forward, backward) peak bytes."""
    import tracemalloc
    want = nn.Tensor(x.copy(), requires_grad=True)
    want_out = op(want)
    want_out.backward(g)
    got = nn.Tensor(FakeCupyArray(x.copy()), requires_grad=True)
    device_g = FakeCupyArray(g.copy())
    tracemalloc.start()
    try:
        out = op(got)
        forward_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        out.backward(device_g)
        backward_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert mpidist.xp.is_device_array(out.data) and mpidist.xp.is_device_array(got.grad)
    assert_same_bits([mpidist.xp.to_numpy(out.data), mpidist.xp.to_numpy(got.grad)], [want_out.data, want.grad])
    return forward_peak, backward_peak


@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["float32", "bfloat16"])
def test_rotary_on_fake_cupy_is_numpys(fake_cupy, dtype):
    """Rotary positions on CuPy arrays (its angle table moved to the device): output and gradient are the numpy
    path's bits."""
    rng = np.random.default_rng(33)
    x = rng.standard_normal((2, 5, 8 * 4)).astype(dtype)
    g = rng.standard_normal((2, 5, 8 * 4)).astype(dtype)
    device_op_is_numpys(lambda a: nn.functional.rotary(a, 4, 2), x, g)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16], ids=["float32", "float16", "bfloat16"])
def test_swiglu_on_fake_cupy_is_numpys_in_row_blocks_of_the_device_chunk(fake_cupy, monkeypatch, dtype):
    """SwiGLU on CuPy arrays: one block of rows (float32), or for a 16-bit input blocks of ``_DEVICE_CHUNK``
    elements with float32 scratch of a block, not of the whole input: output and gradient are the numpy path's
    bits, and the traced peaks stay within 1.5x (forward) and 3.5x (backward) the input's bytes (measured 0.8x
    and 2.8x for float16; float32 scratch of the whole input would add 3x and 5x)."""
    monkeypatch.setattr(nn.functional, "_DEVICE_CHUNK", 4 * 96)
    rng = np.random.default_rng(32)
    x = rng.uniform(-6, 6, (2048, 2 * 96)).astype(dtype)
    g = rng.uniform(-2, 2, (2048, 96)).astype(dtype)
    forward_peak, backward_peak = device_op_is_numpys(nn.functional.swiglu, x, g)
    if dtype is not np.float32:
        assert forward_peak < 1.5 * x.nbytes and backward_peak < 3.5 * x.nbytes, (forward_peak, backward_peak, x.nbytes)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["float16", "bfloat16"])
def test_16_bit_gelu_on_fake_cupy_is_numpys_with_float32_scratch_of_a_slice(fake_cupy, monkeypatch, dtype):
    """A 16-bit GELU on CuPy arrays computes in float32 slices of ``_DEVICE_CHUNK`` elements (one kernel per pass
    and slice), not in float32 copies of the whole input: output and gradient are the numpy path's bits, and the
    traced peak stays within 2.5x (forward) and 6x (backward) the input's bytes: its 16-bit output, gradient and
    the fake device's temporaries. Float32 scratch of the whole input measured 5x and 12x."""
    chunk = 1024
    monkeypatch.setattr(nn.functional, "_DEVICE_CHUNK", chunk)
    rng = np.random.default_rng(31)
    x, g = (rng.uniform(-6, 6, 64 * chunk).astype(dtype) for _ in range(2))
    forward_peak, backward_peak = device_op_is_numpys(nn.functional.gelu, x, g)
    assert forward_peak < 2.5 * x.nbytes and backward_peak < 6 * x.nbytes, (forward_peak, backward_peak, x.nbytes)


@pytest.mark.parametrize("policy", [None, "bf16"])
def test_zero_redundancy_optimizer_on_fake_cupy_steps_as_the_plain_one(comm, fake_cupy, policy):
    """ZeroRedundancyOptimizer over DDP on CuPy arrays (its pieces' views, the allgather's device buffers, its
    status element read back to the host): the plain AdamW's bits on the same device arrays, on every rank, the
    parameters staying on the device. (The device's allreduce sums in another order than the host's at 3 ranks
    and more, so the reference is the plain optimizer on the device, not numpy.)"""
    from mpidist.parallel import ZeroRedundancyOptimizer
    runs = []
    for sharded in (True, False):
        make = ((lambda ps: ZeroRedundancyOptimizer(ps, optim.AdamW, comm, chunk_bytes=64, lr=0.01)) if sharded
                else (lambda ps: optim.AdamW(ps, lr=0.01)))
        ddp = train_tiny(comm, lambda m: DDP(m, comm), FAKE_CUPY, steps=3, policy=Policy(policy) if policy else None,
                         make_opt=make)[0]
        assert all(mpidist.xp.is_device_array(p.data) for p in ddp.parameters())
        runs.append(host_values(ddp.module))
    assert_same_bits(runs[0], runs[1])
