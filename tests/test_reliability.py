"""Failure behaviour of whole jobs under a real mpiexec: abort on error, kill -9 and resume, preemption.

These tests launch `mpiexec -n 4` themselves, so they run once in the single-process session
(``mpi_skip``) rather than on every rank of an MPI session.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "examples", "resumable.py")

pytestmark = [pytest.mark.mpi_skip, launcher.needed]


def run(args, timeout=120, **kwargs):
    return subprocess.run(launcher.mpiexec(4, sys.executable, *args), capture_output=True, text=True,
                          timeout=timeout, env=launcher.env(), **kwargs)


def test_uncaught_exception_on_one_rank_ends_the_job_with_its_traceback():
    start = time.monotonic()
    proc = run([os.path.join(ROOT, "tests", "jobs", "raise_on_one_rank.py")], timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, f"job took {elapsed:.1f} s to end"
    assert "[rank 2] Traceback" in proc.stderr and "[rank 2] ValueError: rank two broke on purpose" in proc.stderr, proc.stderr[-2000:]
    assert "aborting all 4 ranks" in proc.stderr


def final_params(out):
    with np.load(os.path.join(out, "final.npz")) as data:
        return {k: data[k].copy() for k in data.files}


def assert_bit_identical(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype and (a[k] == b[k]).all(), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Final parameters of uninterrupted 10-step runs, per strategy (computed once)."""
    cache = {}

    def get(strategy):
        if strategy not in cache:
            base = tmp_path_factory.mktemp(f"ref-{strategy}")
            proc = run([JOB, "--strategy", strategy, "--ckpt", str(base / "ckpt"), "--out", str(base / "out")])
            assert proc.returncode == 0, proc.stdout + proc.stderr
            cache[strategy] = final_params(base / "out")
        return cache[strategy]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_kill_9_during_step_7_then_resume_is_bit_identical(strategy, tmp_path, uninterrupted):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    start = time.monotonic()
    killed = run([JOB, "--strategy", strategy, "--ckpt", ckpt, "--out", out, "--kill-rank", "2", "--kill-step", "7"])
    assert killed.returncode != 0 and time.monotonic() - start < 60
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000004", "step_00000006"]
    resumed = run([JOB, "--strategy", strategy, "--ckpt", ckpt, "--out", out])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step 6" in resumed.stdout
    assert_bit_identical(final_params(out), uninterrupted(strategy))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_preemption_signal_on_one_rank_saves_everywhere_at_one_step(strategy, tmp_path, uninterrupted):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    proc = subprocess.Popen(launcher.mpiexec(4, sys.executable, JOB, "--strategy", strategy, "--ckpt", ckpt,
                                             "--out", out, "--step-seconds", "0.25"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=launcher.env())
    progress = os.path.join(out, "progress")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(progress) and open(progress).read().strip() not in ("", "0", "1", "2") and os.path.exists(os.path.join(out, "pid.1")):
            break
        time.sleep(0.05)
    os.kill(int(open(os.path.join(out, "pid.1")).read()), signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 99, stdout + stderr
    # mpiexec forwards each rank's output as it comes: lines of different ranks may run together.
    saved = re.findall(r"rank (\d+): preempted \(([^)]*)\), saved step (\d+)", stdout)
    assert sorted(int(r) for r, _, _ in saved) == [0, 1, 2, 3], stdout
    steps = {s for _, _, s in saved}
    assert len(steps) == 1, saved  # every rank stopped after the same step
    assert ("1", "SIGUSR1") in [(r, why) for r, why, _ in saved]
    resumed = run([JOB, "--strategy", strategy, "--ckpt", ckpt, "--out", out])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from step {steps.pop()}" in resumed.stdout
    assert_bit_identical(final_params(out), uninterrupted(strategy))
