"""The ``mpidist`` command: argument parsing, info/check/bench on one process and under mpiexec.

Bandwidths are checked against nccl-tests' formulas written out here, not against mpidist.bench's
own table. Tests that start processes (``python -m mpidist``, ``mpiexec -n 2 ...``) are ``mpi_skip``:
under ``mpiexec pytest --with-mpi`` every rank would start them again.
"""

import csv
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

import launcher
from mpidist import bench, simulate, xp
from mpidist.cli import UsageError, build_parser, main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# Bus factors from nccl-tests' doc/PERFORMANCE.md, written out independently of mpidist.bench.
NCCL_BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
                   "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n, "bcast": lambda n: 1,
                   "sendrecv": lambda n: 1}  # nccl-tests doc/PERFORMANCE.md
ROW_KEYS = {"op", "bytes", "count", "type", "ranks", "iters", "mpidist_us", "mpidist_algbw", "mpidist_busbw",
            "raw_us", "raw_algbw", "raw_busbw", "ratio"}


def run_cli(*args, ranks=None, timeout=120):
    """Run ``python -m mpidist ARGS`` (under ``mpiexec -n ranks`` if given); return the CompletedProcess."""
    cmd = [sys.executable, "-m", "mpidist", *args]
    if ranks is not None:
        cmd = launcher.mpiexec(ranks, *cmd)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launcher.env(OMP_NUM_THREADS="1"))


def assert_row_matches_formula(row, ranks):
    """Check one bench row's algbw/busbw against size / time and the nccl-tests bus factor."""
    assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
    assert int(row["ranks"]) == ranks and int(row["bytes"]) == int(row["count"]) * np.dtype(row["type"]).itemsize
    for impl in ("mpidist", "raw"):
        seconds = float(row[f"{impl}_us"]) * 1e-6
        algbw = int(row["bytes"]) / seconds / 1e9
        assert float(row[f"{impl}_algbw"]) == pytest.approx(algbw, rel=1e-6)
        assert float(row[f"{impl}_busbw"]) == pytest.approx(algbw * NCCL_BUS_FACTOR[row["op"]](ranks), rel=1e-6)
    assert float(row["ratio"]) == pytest.approx(float(row["raw_us"]) / float(row["mpidist_us"]), rel=1e-6)


# -- parsing ------------------------------------------------------------------------------------------
def test_bench_arguments_parse():
    args = build_parser().parse_args(["bench", "allreduce", "bcast", "--sizes", "8,1K", "--iters", "3",
                                      "--device", "cpu", "--json", "a.json", "--csv", "a.csv", "--plot", "a.png"])
    assert (args.command, args.ops, args.sizes, args.iters, args.device) == ("bench", ["allreduce", "bcast"], "8,1K", 3, "cpu")
    assert (args.json, args.csv, args.plot) == ("a.json", "a.csv", "a.png")


@pytest.mark.parametrize("argv", [
    ["bench", "allreduce", "--threds", "3"],   # unknown option
    ["bench", "allreduce", "--siz", "8"],      # abbreviations are not accepted
    ["bench", "alltoallv"],                    # unknown op
    ["bench", "allreduce", "--device", "tpu"],
    ["bench", "allreduce", "all"],             # no op is "all"; "all" is not an op
    ["infos"],                                 # unknown command
    ["info", "--verbose"],
])
def test_bad_arguments_fail_loudly(argv):
    with pytest.raises(UsageError):
        build_parser().parse_args(argv)


def test_bench_without_ops_sweeps_every_op():
    args = build_parser().parse_args(["bench"])
    assert sorted(args.ops) == sorted(NCCL_BUS_FACTOR) and args.sizes == "8:64M"


@pytest.mark.mpi_skip
def test_usage_error_is_reported_with_exit_status_2(capsys):
    assert main(["bench", "allreduce", "--threds", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("unrecognized arguments: --threds 3") == 1


@pytest.mark.parametrize("spec, sizes", [
    ("8:64M", [8 << i for i in range(24)]),
    ("1K:4K", [1024, 2048, 4096]),
    ("1K:64K:4", [1024, 4096, 16384, 65536]),
    ("8,1K,2MiB, 3", [8, 1024, 2 << 20, 3]),
    ("1G", [1 << 30]),
])
def test_parse_sizes(spec, sizes):
    assert bench.parse_sizes(spec) == sizes


@pytest.mark.parametrize("spec", ["8x", "64M:8", "8:64M:1", "1:2:3:4", "", "0", "-8"])
def test_parse_sizes_rejects(spec):
    with pytest.raises(bench.BenchError, match="--sizes"):
        bench.parse_sizes(spec)


# -- the measurement and its formulas -----------------------------------------------------------------
def test_bus_bandwidth_formulas():
    # 1 MB in 1 ms on 4 ranks: algbw 1 GB/s; allreduce moves 2(n-1)/n of it over each link.
    for op, busbw in (("allreduce", 1.5), ("allgather", 0.75), ("reduce_scatter", 0.75), ("bcast", 1.0), ("sendrecv", 1.0)):
        row = bench.Result(op, 10**6, 250000, "float32", 4, 10, mpidist_s=1e-3, raw_s=0.5e-3).row()
        assert row["mpidist_us"] == pytest.approx(1000.0) and row["mpidist_algbw"] == pytest.approx(1.0)
        assert row["mpidist_busbw"] == pytest.approx(busbw) and row["raw_busbw"] == pytest.approx(2 * busbw)
        assert row["ratio"] == pytest.approx(0.5)


@pytest.mark.parametrize("ranks", [2, 3])
def test_bench_rows_on_simulated_ranks(ranks):
    sizes = [8, 1000]
    results = simulate(ranks, lambda comm: [r.row() for r in bench.run(bench.OPS, sizes, comm, iters=2, reps=1, warmup=1)])
    rows = results[0]
    assert all(r == rows for r in results)  # max over ranks: every rank reports the same times
    assert [(r["op"], r["count"]) for r in rows] == [
        (op, count) for op in bench.OPS for count in
        ((2, 250) if op not in ("allgather", "reduce_scatter", "alltoall") else (ranks, 250 // ranks * ranks))]
    for row in rows:
        assert_row_matches_formula(row, ranks)


def test_bench_rejects_bad_requests():
    with pytest.raises(bench.BenchError, match="unknown op"):
        simulate(1, lambda comm: bench.run(["alltoallv"], [8], comm))
    with pytest.raises(bench.BenchError, match="--iters"):
        simulate(1, lambda comm: bench.run(["allreduce"], [8], comm, iters=0))


def test_gpu_device_without_gpu_fails_cleanly():
    from mpidist import xp
    if xp.gpu_count() > 0:
        pytest.skip("this machine has a GPU")
    with pytest.raises(bench.BenchError, match="--device gpu: cupy"):
        bench.device_module()


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(bench.BenchError, match=r"pip install 'mpidist\[plot\]'"):
        bench.require_matplotlib()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the plot extra)")
def test_plot_writes_png(tmp_path):
    results = simulate(2, lambda comm: bench.run(["allreduce", "bcast"], [8, 64, 512], comm, iters=2, reps=1))[0]
    path = tmp_path / "bench.png"
    bench.plot(str(path), results, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# -- whole commands in fresh processes ----------------------------------------------------------------
@pytest.mark.mpi_skip
def test_info_single_process():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in result.stdout.splitlines())
    assert (fields["ranks"], fields["nodes"].split()[0], fields["launcher"]) == ("1", "1", "none")
    assert fields["numpy"] == np.__version__
    if xp.get_cupy() is None:
        assert fields["GPU path"].startswith("none (cupy is not installed")
    # The MPICH wheel is not CUDA-aware, and its probe symbol says so.
    assert fields["MPI CUDA"].endswith("says no")
    assert {"mpidist", "mpi4py", "cupy", "MPI library", "ranks/node", "GPUs"} <= set(fields)


@pytest.mark.mpi_skip
def test_info_under_mpiexec_prints_once():
    result = run_cli("info", ranks=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("mpidist      ") == 1
    assert "ranks        2" in result.stdout and "launcher     mpiexec" in result.stdout
    assert "ranks/node   2" in result.stdout and result.stdout.count("GPU path     ") == 1


@pytest.mark.mpi_skip
@pytest.mark.parametrize("ranks", [None, 2])
def test_check_passes(ranks):
    result = run_cli("check", ranks=ranks)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout and "0 failed" in result.stdout
    assert result.stdout.count("  ok    allreduce") == 1  # printed once, by rank 0


@pytest.mark.mpi_skip
def test_check_failing_on_some_ranks_fails_on_every_rank_naming_them(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(
        "import sys\nimport mpidist.cli as cli\n\n"
        "def broken_on_1_and_2(comm):\n"
        "    if comm.Get_rank() in (1, 2):\n        raise ValueError('broken')\n    return 'fine'\n\n"
        "cli._CHECKS = (('ranks', cli._check_ranks), ('broken', broken_on_1_and_2))\n"
        "sys.exit(cli.main(['check']))\n")
    result = subprocess.run([sys.executable, "-m", "mpidist", "sim", "-n", "3", str(script)], capture_output=True,
                            text=True, timeout=120, env=launcher.env(OMP_NUM_THREADS="1"))
    assert result.returncode == 1, result.stdout + result.stderr
    # under the simulator every rank prints: each says the same, naming the two ranks once
    assert result.stdout.count("  FAIL  broken          ranks 1,2: ValueError: broken\n") == 3, result.stdout
    assert result.stdout.count("1 ok, 1 failed, 0 skipped") == 3, result.stdout


@pytest.mark.mpi_skip
def test_bench_under_mpiexec_writes_json_and_csv(tmp_path):
    json_path, csv_path = tmp_path / "b.json", tmp_path / "b.csv"
    result = run_cli("bench", "allreduce", "reduce_scatter", "sendrecv", "--sizes", "8,4K", "--iters", "3", "--reps", "1",
                     "--json", str(json_path), "--csv", str(csv_path), ranks=2)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("# allreduce on 2 ranks") == 1
    rows = json.loads(json_path.read_text())["rows"]
    with open(csv_path) as f:
        csv_rows = list(csv.DictReader(f))
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for op in ("allreduce", "reduce_scatter", "sendrecv") for b in (8, 4096)]
    assert [(r["op"], int(r["bytes"])) for r in csv_rows] == [(r["op"], r["bytes"]) for r in rows]
    for row in rows + csv_rows:
        assert_row_matches_formula(row, 2)


@pytest.mark.mpi_skip
def test_bench_without_ops_runs_the_default_sweep(tmp_path):
    json_path = tmp_path / "b.json"
    result = run_cli("bench", "--sizes", "8,4K", "--iters", "2", "--reps", "1", "--json", str(json_path))
    assert result.returncode == 0, result.stderr
    rows = json.loads(json_path.read_text())["rows"]
    assert sorted((r["op"], r["bytes"]) for r in rows) == sorted((op, b) for op in NCCL_BUS_FACTOR for b in (8, 4096))
    for row in rows:
        assert_row_matches_formula(row, 1)
        assert result.stdout.count(f"# {row['op']} on 1 ranks") == 1


@pytest.mark.mpi_skip
def test_launches_use_the_configured_launcher_and_flags(tmp_path, monkeypatch):
    """MPIDIST_MPIEXEC and MPIEXEC_FLAGS (what `make` exports) decide how tests start ranks."""
    real = launcher.mpiexec(2, "true")  # [launcher, *flags, "-n", "2", "true"] of this session (skips if none)
    real_launcher, real_flags = real[0], real[1:-3]
    log, wrapper = tmp_path / "argv", tmp_path / "my-mpiexec"
    # Records its arguments one per line, drops the two made-up ones and starts the ranks with the real launcher.
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}"\nshift 2\nexec "{real_launcher}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("MPIDIST_MPIEXEC", str(wrapper))
    monkeypatch.setenv("MPIEXEC_FLAGS", "--made-up 'two words' " + shlex.join(real_flags))
    result = run_cli("info", ranks=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ranks        2" in result.stdout
    assert log.read_text().splitlines() == ["--made-up", "two words", *real_flags,
                                            "-n", "2", sys.executable, "-m", "mpidist", "info"]


@pytest.mark.mpi_skip
def test_the_fsdp_memory_benchmark_starts_its_ranks_with_the_configured_launcher(tmp_path, monkeypatch):
    real = launcher.mpiexec(1, "true")  # skips if there is no launcher at all
    real_launcher, real_flags = real[0], real[1:-3]
    log, wrapper = tmp_path / "argv", tmp_path / "my-mpiexec"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{log}"\nshift\nexec "{real_launcher}" "$@"\n')
    wrapper.chmod(0o755)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "fsdp_memory.py")
    env = launcher.env(MPIDIST_MPIEXEC=str(wrapper), MPIEXEC_FLAGS="--made-up " + shlex.join(real_flags),
                       OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, script, "--ranks", "1", "--width", "8", "--layers", "2", "--steps", "1",
                             "--warmup", "0", "--strategies", "ddp"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| ddp | 1 |" in result.stdout, result.stdout
    assert log.read_text().splitlines()[:len(real_flags) + 3] == ["--made-up", *real_flags, "-n", "1"]


@pytest.mark.mpi_skip
def test_launched_jobs_get_the_environment_python_started_with():
    # What Open MPI 4's singleton init does with PMIX_* (os.putenv writes the C environment, not os.environ):
    # a child that inherits it takes itself for part of this process's MPI job.
    os.putenv("MPIDIST_TEST_LEAKED", "1")
    try:
        show = [sys.executable, "-c", "import os; print(os.environ.get('MPIDIST_TEST_LEAKED'))"]
        assert subprocess.run(show, capture_output=True, text=True).stdout.split() == ["1"]
        assert subprocess.run(show, capture_output=True, text=True, env=launcher.env()).stdout.split() == ["None"]
        assert launcher.env(A="b") == dict(os.environ, A="b")
    finally:
        os.unsetenv("MPIDIST_TEST_LEAKED")


@pytest.mark.mpi_skip
def test_a_configured_launcher_that_is_missing_fails_instead_of_skipping(monkeypatch):
    monkeypatch.setenv("MPIDIST_MPIEXEC", "/nonexistent/mpiexec")
    with pytest.raises(pytest.fail.Exception, match=r"MPIDIST_MPIEXEC='/nonexistent/mpiexec': no such launcher"):
        launcher.mpiexec(2, "true")
    monkeypatch.delenv("MPIDIST_MPIEXEC")
    monkeypatch.setattr(launcher, "_BESIDE_PYTHON", "/nonexistent/mpiexec")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(pytest.skip.Exception, match="no mpiexec"):
        launcher.mpiexec(2, "true")


@pytest.mark.mpi_skip
def test_errors_under_mpiexec_are_printed_once():
    result = run_cli("bench", "allreduce", "--threds", "3", ranks=2)
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count("unrecognized arguments: --threds 3") == 1
    result = run_cli("bench", "allreduce", "--sizes", "8x", ranks=2)
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count("cannot read '8x' as a size") == 1


@pytest.mark.mpi_skip
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed (the plot extra)")
def test_bench_plot_flag_writes_png(tmp_path):
    path = tmp_path / "out.png"
    result = run_cli("bench", "allreduce", "--sizes", "8:64", "--iters", "2", "--reps", "1", "--plot", str(path))
    assert result.returncode == 0, result.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.mpi_skip
@launcher.needed
def test_bench_refuses_paths_it_cannot_write_before_measuring(tmp_path):
    missing = tmp_path / "no-such-dir" / "b.json"
    result = run_cli("bench", "allreduce", "--sizes", "8", "--iters", "2", "--reps", "1", "--json", str(missing),
                     "--csv", str(tmp_path), ranks=2)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(f"mpidist bench: BenchError: rank 0: --json {str(missing)!r}: cannot "
                               f"write it (No such file or directory)") == 1, result.stderr
    assert "# allreduce on" not in result.stdout  # nothing was measured
    result = run_cli("bench", "allreduce", "--sizes", "8", "--iters", "2", "--reps", "1", "--csv", str(tmp_path))
    assert result.returncode == 2 and f"--csv {str(tmp_path)!r}: is a directory" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []  # the check wrote nothing
