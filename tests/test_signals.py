"""Ctrl-C (SIGINT) on whole jobs under a real mpiexec: an agreed stop with a checkpoint, or one line and an abort.

MPICH's mpiexec (Hydra) forwards a Ctrl-C to every rank; Open MPI's mpirun does not (it ends the job
itself), so there the tests deliver the SIGINT to every rank the way Hydra would. With ``mpidist.preemption.Preemption`` installed it is a stop like
SIGTERM: every rank stops after the same step, saves, and the job exits 99; a second SIGINT ends it at once.
Without it, the abort-on-error hook of ``mpidist.init()`` ends the job with one line instead of a traceback
per rank. These tests launch jobs themselves, so they run once in the single-process session (``mpi_skip``).
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
NP = 4

pytestmark = [pytest.mark.mpi_skip, launcher.needed]


def start(args):
    return subprocess.Popen(launcher.mpiexec(NP, sys.executable, *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=launcher.env())


def wait_for(predicate, timeout=60, what="the job to get going"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def progress(out):
    try:
        return int(open(os.path.join(out, "progress")).read().strip() or 0)
    except (OSError, ValueError):
        return 0


def pids(out):
    return [int(open(os.path.join(out, f"pid.{r}")).read()) for r in range(NP)]


def all_pids_written(out):
    return all(os.path.exists(os.path.join(out, f"pid.{r}")) for r in range(NP))


def final_params(out):
    with np.load(os.path.join(out, "final.npz")) as data:
        return {k: data[k].copy() for k in data.files}


def our_lines(stderr):
    """The lines of stderr that come from the job, not from the launcher's own notices and banners."""
    return [line for line in stderr.splitlines()
            if line.startswith(("[rank ", "mpidist")) or "Traceback" in line or "KeyboardInterrupt" in line]


def launcher_forwards_ctrl_c():
    """Return whether mpiexec passes a SIGINT on to the ranks (MPICH's Hydra does; Open MPI's mpirun ends the job)."""
    version = subprocess.run([launcher.launcher(), "--version"], capture_output=True, text=True, timeout=60)
    return "HYDRA" in (version.stdout + version.stderr).upper()


def ctrl_c(job, rank_pids):
    """Do what a Ctrl-C in the terminal does to the ranks: through mpiexec where it forwards it, else rank by rank."""
    if launcher_forwards_ctrl_c():
        job.send_signal(signal.SIGINT)
    else:
        for pid in rank_pids:
            os.kill(pid, signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_after_one_step_saves_and_exits_99(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    job = start([JOB, "--strategy", "ddp", "--ckpt", ckpt, "--out", out, "--step-seconds", "0.25"])
    wait_for(lambda: progress(out) >= 3 and all_pids_written(out))
    ctrl_c(job, pids(out))
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == 99, stdout + stderr
    saved = re.findall(r"rank (\d+): preempted \(([^)]*)\), saved step (\d+)", stdout)
    assert sorted(int(r) for r, _, _ in saved) == list(range(NP)), stdout
    assert {why for _, why, _ in saved} == {"SIGINT"} and len({s for _, _, s in saved}) == 1, saved
    step = int(saved[0][2])
    assert 3 <= step < 10
    # One line for the job, not a traceback per rank.
    assert our_lines(stderr) == ["mpidist: SIGINT received: stopping after the current step on every rank to save a "
                                 "checkpoint (exit 99); Ctrl-C again aborts at once without saving"], stderr
    assert f"step_{step:08d}" in os.listdir(ckpt)

    # The reference: the same job never interrupted. Resumed, the stopped one ends bit for bit the same.
    resumed = subprocess.run(launcher.mpiexec(NP, sys.executable, JOB, "--strategy", "ddp", "--ckpt", ckpt,
                                              "--out", out), capture_output=True, text=True, timeout=120,
                             env=launcher.env())
    assert resumed.returncode == 0 and f"resumed from step {step}" in resumed.stdout, resumed.stdout + resumed.stderr
    ref_out = str(tmp_path / "ref")
    reference = subprocess.run(launcher.mpiexec(NP, sys.executable, JOB, "--strategy", "ddp", "--ckpt",
                                                str(tmp_path / "ref-ckpt"), "--out", ref_out),
                               capture_output=True, text=True, timeout=120, env=launcher.env())
    assert reference.returncode == 0, reference.stdout + reference.stderr
    got, want = final_params(out), final_params(ref_out)
    assert got.keys() == want.keys() and got
    for k in want:
        assert got[k].dtype == want[k].dtype and (got[k] == want[k]).all(), k


def test_a_second_ctrl_c_aborts_at_once_without_waiting_for_the_step(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    # Each step sleeps 60 s: the agreed stop would come only after it, so a quick end proves the abort.
    job = start([JOB, "--strategy", "ddp", "--ckpt", ckpt, "--out", out, "--step-seconds", "60"])
    wait_for(lambda: progress(out) >= 1 and all_pids_written(out))
    ctrl_c(job, pids(out))
    time.sleep(1.0)
    assert job.poll() is None, "the first Ctrl-C must not end the job (it waits for the step, then saves)"
    os.kill(pids(out)[1], signal.SIGINT)  # the second, on one rank
    t0 = time.monotonic()
    stdout, stderr = job.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, f"the job took {time.monotonic() - t0:.1f} s to end after the second Ctrl-C"
    assert job.returncode not in (0, 99), stdout + stderr
    assert "Traceback" not in stderr and "preempted" not in stdout, stdout + stderr
    assert not os.path.exists(ckpt) or os.listdir(ckpt) == []  # nothing saved: step 1 was never finished


@pytest.mark.parametrize("who", ["every rank", "rank 2"])
def test_ctrl_c_without_preemption_ends_the_job_with_one_line(tmp_path, who):
    job = start([os.path.join(ROOT, "tests", "jobs", "interrupted.py"), str(tmp_path)])
    wait_for(lambda: os.path.exists(tmp_path / "ready"))
    if who == "every rank":
        ctrl_c(job, [int((tmp_path / f"pid.{r}").read_text()) for r in range(NP)])
    else:
        os.kill(int((tmp_path / "pid.2").read_text()), signal.SIGINT)
    t0 = time.monotonic()
    stdout, stderr = job.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert job.returncode != 0
    rank = 0 if who == "every rank" else 2
    assert our_lines(stderr) == [f"[rank {rank}] mpidist: interrupted (KeyboardInterrupt), aborting all {NP} ranks "
                                 f"without saving"], stderr
